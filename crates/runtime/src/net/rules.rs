//! The two nftables tables of a sandbox, as text for `nft -f` (see the module doc of `net`).

use super::*;
use airlock_proto::net as guest;
use std::net::Ipv4Addr;

/// The sandbox namespace's table (see the module doc).
pub fn netns_ruleset(link: &SandboxLink) -> String {
    let gw = Ipv4Addr::from(guest::GATEWAY);
    let guest_addr = Ipv4Addr::from(guest::GUEST_ADDR);
    let (h, n) = (link.host_addr, link.peer_addr);
    let dns_to_gateway = format!("iifname \"{TAP}\" ip daddr {gw} meta l4proto {{ tcp, udp }} th dport {DNS_PORT}");
    let mut dnat = String::new();
    let mut input = String::new();
    let mut forward = String::new();
    match link.ports.dns {
        Some(port) => {
            dnat.push_str(&format!("\t\t{dns_to_gateway} dnat ip to {h}:{port}\n"));
            forward.push_str(&format!(
                "\t\tiifname \"{TAP}\" oifname \"{UPLINK}\" ct status dnat ip daddr {h} meta l4proto {{ tcp, udp }} th dport {port} counter name \"dns_queries\" accept\n"
            ));
        }
        // Unwired: the query reaches the namespace, where nothing listens (no answer).
        None => input.push_str(&format!("\t\t{dns_to_gateway} counter name \"dns_queries\" accept\n")),
    }
    if link.ports.proxy.is_some() {
        forward.push_str(&format!(
            "\t\tiifname \"{TAP}\" oifname \"{UPLINK}\" meta l4proto tcp counter name \"tcp_out\" accept\n"
        ));
    }
    format!(
        "table inet {NETNS_TABLE}
delete table inet {NETNS_TABLE}
table inet {NETNS_TABLE} {{
	counter spoofed {{ }}
	counter ipv6_dropped {{ }}
	counter dns_queries {{ }}
	counter tcp_out {{ }}
	counter udp_dropped {{ }}
	counter dropped {{ }}

	chain guard {{
		type filter hook prerouting priority raw; policy accept;
		iifname \"{TAP}\" meta nfproto ipv6 counter name \"ipv6_dropped\" drop
		iifname \"{TAP}\" ip saddr != {guest_addr} counter name \"spoofed\" drop
		iifname \"{TAP}\" ether saddr != {guest_mac} counter name \"spoofed\" drop
		iifname != \"{TAP}\" meta nfproto ipv6 counter name \"ipv6_dropped\" drop
	}}

	chain nat_pre {{
		type nat hook prerouting priority dstnat; policy accept;
{dnat}	}}

	chain input {{
		type filter hook input priority filter; policy drop;
		iifname \"lo\" accept
{input}		meta l4proto udp counter name \"udp_dropped\" drop
		counter name \"dropped\" drop
	}}

	chain forward {{
		type filter hook forward priority filter; policy drop;
		ct state established,related accept
{forward}		meta l4proto udp counter name \"udp_dropped\" drop
		counter name \"dropped\" drop
	}}

	chain nat_post {{
		type nat hook postrouting priority srcnat; policy accept;
		oifname \"{UPLINK}\" ip saddr {guest_addr} snat ip to {n}
	}}
}}
",
        guest_mac = guest::GUEST_MAC,
    )
}

/// The host's table for one sandbox (see the module doc).
pub fn host_ruleset(link: &SandboxLink) -> String {
    let table = &link.netns;
    let (ifname, h, n) = (&link.host_if, link.host_addr, link.peer_addr);
    let mut dnat = String::new();
    let mut input = String::new();
    if let Some(port) = link.ports.dns {
        dnat.push_str(&format!(
            "\t\tiifname \"{ifname}\" ip daddr {h} tcp dport {port} accept\n"
        ));
        input.push_str(&format!(
            "\t\tiifname \"{ifname}\" ip saddr {n} ip daddr {h} meta l4proto {{ tcp, udp }} th dport {port} accept\n"
        ));
    }
    if let Some(port) = link.ports.proxy {
        dnat.push_str(&format!(
            "\t\tiifname \"{ifname}\" meta l4proto tcp dnat ip to {h}:{port}\n"
        ));
        input.push_str(&format!(
            "\t\tiifname \"{ifname}\" ip saddr {n} ip daddr {h} tcp dport {port} accept\n"
        ));
    }
    format!(
        "table inet {table}
delete table inet {table}
table inet {table} {{
	chain nat_pre {{
		type nat hook prerouting priority dstnat; policy accept;
{dnat}	}}

	chain input {{
		type filter hook input priority filter; policy accept;
		iifname \"{ifname}\" ct state established,related accept
{input}		iifname \"{ifname}\" counter drop
	}}

	chain forward {{
		type filter hook forward priority filter; policy accept;
		iifname \"{ifname}\" counter drop
		oifname \"{ifname}\" counter drop
	}}
}}
"
    )
}

#[cfg(test)]
mod tests {
    use super::super::network::host_if_name;
    use super::super::sys::run;
    use super::*;

    fn link(ports: EgressPorts) -> SandboxLink {
        SandboxLink {
            id: "abcdef0123".into(),
            netns: "airlock-1a2b-abcdef0123".into(),
            host_if: host_if_name("1a2b", "abcdef0123"),
            host_addr: Ipv4Addr::new(169, 254, 0, 4),
            peer_addr: Ipv4Addr::new(169, 254, 0, 5),
            index: 2,
            ports,
        }
    }

    #[test]
    fn unwired_sandbox_rules_allow_only_dns_to_the_gateway() {
        let r = netns_ruleset(&link(EgressPorts::default()));
        assert!(!r.contains("dnat ip to"), "{r}");
        assert!(!r.contains("counter name \"tcp_out\" accept"), "{r}");
        assert!(
            r.contains("ip daddr 100.96.0.1 meta l4proto { tcp, udp } th dport 53 counter name \"dns_queries\" accept")
        );
        assert!(r.contains("ip saddr != 100.96.0.2 counter name \"spoofed\" drop"));
        assert!(r.contains("snat ip to 169.254.0.5"));
        let h = host_ruleset(&link(EgressPorts::default()));
        assert!(!h.contains("dnat ip to"), "{h}");
        assert!(h.contains(&format!(
            "iifname \"{}\" counter drop",
            link(EgressPorts::default()).host_if
        )));
    }

    #[test]
    fn wired_sandbox_rules_send_dns_and_tcp_to_the_hooks() {
        let l = link(EgressPorts {
            dns: Some(5353),
            proxy: Some(15001),
        });
        let r = netns_ruleset(&l);
        assert!(r.contains("th dport 53 dnat ip to 169.254.0.4:5353"), "{r}");
        assert!(r.contains("meta l4proto tcp counter name \"tcp_out\" accept"), "{r}");
        let h = host_ruleset(&l);
        assert!(h.contains("meta l4proto tcp dnat ip to 169.254.0.4:15001"), "{h}");
        assert!(h.contains("ip daddr 169.254.0.4 tcp dport 5353 accept"), "{h}");
    }

    /// Both tables, wired and not, as nft itself parses them (`-c`: checked, never loaded).
    #[tokio::test]
    async fn rulesets_pass_nfts_check() {
        if run("nft", &["--version"], None, None).await.is_err() || !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs nft and root");
            return;
        }
        for ports in [
            EgressPorts::default(),
            EgressPorts {
                dns: Some(5353),
                proxy: Some(15001),
            },
        ] {
            for text in [netns_ruleset(&link(ports)), host_ruleset(&link(ports))] {
                if let Err(e) = run("nft", &["-c", "-f", "-"], None, Some(text.clone())).await {
                    panic!("{e}\n{text}");
                }
            }
        }
    }
}
