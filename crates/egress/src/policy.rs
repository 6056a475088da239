//! The one policy engine both doors and both paths (DNS, TCP) ask.
//!
//! Order: platform denies (always) > tenant denies > tenant base allows + the sandbox's profiles.
//! Domains are exact names (no wildcards, no suffix matching); IPs and CIDRs match addresses.
//! Every answer is a [`Decision`]: the verdict and the rule that decided it. Rule strings never
//! contain the destination asked about (that is logged beside them), so counting by rule stays
//! bounded by the configuration's size.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::ConfigError;

/// The environment variable profiles are read from at startup.
pub const PROFILES_ENV: &str = "AIRLOCK_EGRESS_PROFILES";

/// Ranges no rule can open: (CIDR, why). IPv6 translation ranges (IPv4-mapped, NAT64, 6to4,
/// Teredo) embed IPv4 addresses that could be private, so they are refused whole.
pub const PLATFORM_DENIED: &[(&str, &str)] = &[
    ("0.0.0.0/8", "unspecified"),
    ("10.0.0.0/8", "private"),
    ("100.64.0.0/10", "cgnat"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local/metadata"),
    ("172.16.0.0/12", "private"),
    ("192.0.0.0/24", "ietf-protocol"),
    ("192.168.0.0/16", "private"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved/broadcast"),
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::/96", "ipv4-compatible"),
    ("::ffff:0:0/96", "ipv4-mapped"),
    ("64:ff9b::/96", "nat64"),
    ("64:ff9b:1::/48", "nat64"),
    ("2001::/32", "teredo"),
    ("2002::/16", "6to4"),
    ("fc00::/7", "unique-local"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local"),
    ("ff00::/8", "multicast"),
];

/// A verdict and the rule that reached it, e.g. `profile pypi domain pypi.org`,
/// `platform deny 127.0.0.0/8 (loopback)`, `tenant deny cidr 203.0.113.0/24`, `default deny`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Decision {
    pub allowed: bool,
    pub rule: String,
}

impl Decision {
    pub(crate) fn allow(rule: impl Into<String>) -> Self {
        Decision {
            allowed: true,
            rule: rule.into(),
        }
    }
    pub(crate) fn deny(rule: impl Into<String>) -> Self {
        Decision {
            allowed: false,
            rule: rule.into(),
        }
    }
}

/// The always-denied ranges plus the host's own addresses (given at construction, since only the
/// caller knows which addresses this machine answers on).
#[derive(Debug, Clone)]
pub struct PlatformDenies {
    ranges: Vec<(IpNet, &'static str)>,
    host_addrs: BTreeSet<IpAddr>,
}

impl PlatformDenies {
    pub fn new(host_addrs: impl IntoIterator<Item = IpAddr>) -> Self {
        let ranges = PLATFORM_DENIED
            .iter()
            .map(|(net, why)| (net.parse().expect("built-in range parses"), *why))
            .collect();
        PlatformDenies {
            ranges,
            host_addrs: host_addrs.into_iter().collect(),
        }
    }

    /// The denying rule for `ip`, if any.
    pub fn check(&self, ip: IpAddr) -> Option<Decision> {
        if self.host_addrs.contains(&ip) {
            return Some(Decision::deny("platform deny host address"));
        }
        self.ranges
            .iter()
            .find(|(net, _)| net.contains(&ip))
            .map(|(net, why)| Decision::deny(format!("platform deny {net} ({why})")))
    }

    pub fn host_addrs(&self) -> impl Iterator<Item = &IpAddr> {
        self.host_addrs.iter()
    }

    /// Every denied network, the host's addresses as single-address ones: for a check made
    /// outside this crate (an image pull's dials).
    pub fn networks(&self) -> Vec<IpNet> {
        let mut nets: Vec<IpNet> = self.ranges.iter().map(|(n, _)| *n).collect();
        nets.extend(self.host_addrs.iter().map(|a| IpNet::from(*a)));
        nets
    }
}

/// A validated set of rules: exact lowercase domains, addresses, networks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RuleSet {
    pub domains: BTreeSet<String>,
    pub ips: BTreeSet<IpAddr>,
    pub cidrs: BTreeSet<IpNet>,
}

/// Rules as written in JSON (profiles, a tenant's policy): lists of strings.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawRules {
    #[serde(default)]
    pub domains: Vec<String>,
    #[serde(default)]
    pub ips: Vec<String>,
    #[serde(default)]
    pub cidrs: Vec<String>,
}

impl RuleSet {
    /// Validates every entry; `place` names where the entries came from in errors
    /// (`profile "pypi"`, `tenant allow`).
    pub fn parse(raw: &RawRules, place: &str) -> Result<Self, ConfigError> {
        let mut set = RuleSet::default();
        for d in &raw.domains {
            set.domains
                .insert(normalize_domain(d).map_err(|reason| error_for(place, "domains", d, reason))?);
        }
        for ip in &raw.ips {
            let parsed: IpAddr = ip
                .trim()
                .parse()
                .map_err(|_| error_for(place, "ips", ip, "not an IP address".into()))?;
            set.ips.insert(parsed);
        }
        for c in &raw.cidrs {
            let net: IpNet = c
                .trim()
                .parse()
                .map_err(|_| error_for(place, "cidrs", c, "not a CIDR (address/prefix)".into()))?;
            if net.trunc() != net {
                return Err(error_for(
                    place,
                    "cidrs",
                    c,
                    format!("host bits set (did you mean {}?)", net.trunc()),
                ));
            }
            set.cidrs.insert(net);
        }
        Ok(set)
    }

    pub fn is_empty(&self) -> bool {
        self.domains.is_empty() && self.ips.is_empty() && self.cidrs.is_empty()
    }

    /// The rule (`domain x`, `ip x`, `cidr x`) matching an address, if any.
    fn match_ip(&self, ip: IpAddr) -> Option<String> {
        if self.ips.contains(&ip) {
            return Some(format!("ip {ip}"));
        }
        self.cidrs.iter().find(|n| n.contains(&ip)).map(|n| format!("cidr {n}"))
    }

    fn match_domain(&self, name: &str) -> Option<String> {
        self.domains.contains(name).then(|| format!("domain {name}"))
    }

    fn raw(&self) -> RawRules {
        RawRules {
            domains: self.domains.iter().cloned().collect(),
            ips: self.ips.iter().map(|i| i.to_string()).collect(),
            cidrs: self.cidrs.iter().map(|c| c.to_string()).collect(),
        }
    }
}

fn error_for(place: &str, list: &str, entry: &str, reason: String) -> ConfigError {
    if reason == WILDCARD {
        ConfigError::Wildcard {
            place: place.to_string(),
            entry: entry.to_string(),
        }
    } else {
        ConfigError::Malformed {
            place: place.to_string(),
            list: list.to_string(),
            entry: entry.to_string(),
            reason,
        }
    }
}

const WILDCARD: &str = "wildcard";

/// Lowercases, drops one trailing dot, and checks an exact host name (letters, digits, hyphens,
/// underscores; labels of 1..=63; at most 253). `*`, or a leading dot, is a wildcard.
pub fn normalize_domain(input: &str) -> Result<String, String> {
    let s = input.trim();
    if s.contains('*') || s.starts_with('.') {
        return Err(WILDCARD.into());
    }
    let s = s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase();
    if s.is_empty() {
        return Err("empty name".into());
    }
    if s.len() > 253 {
        return Err("longer than 253 characters".into());
    }
    if s.parse::<IpAddr>().is_ok() {
        return Err("an IP address (list it under ips)".into());
    }
    for label in s.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err("a label is empty or longer than 63 characters".into());
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err("only letters, digits, '-' and '_' are allowed in a name".into());
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err("a label starts or ends with '-'".into());
        }
    }
    Ok(s)
}

/// A tenant's base policy: what it allows every sandbox, and what it denies over any profile.
/// Read back (a node is handed a sandbox's) with every entry checked again.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawTenantPolicy")]
pub struct TenantPolicy {
    pub allow: RuleSet,
    pub deny: RuleSet,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenantPolicy {
    #[serde(default)]
    allow: RawRules,
    #[serde(default)]
    deny: RawRules,
}

impl TryFrom<RawTenantPolicy> for TenantPolicy {
    type Error = ConfigError;

    fn try_from(raw: RawTenantPolicy) -> Result<Self, ConfigError> {
        Self::from_raw(&raw.allow, &raw.deny)
    }
}

impl TenantPolicy {
    /// Nothing allowed (a sealed sandbox, or a tenant that has set nothing yet).
    pub fn sealed() -> Self {
        TenantPolicy::default()
    }

    /// `{"allow": {"domains": [], "ips": [], "cidrs": []}, "deny": {...}}`
    pub fn from_json(json: &str) -> Result<Self, ConfigError> {
        let raw: RawTenantPolicy = serde_json::from_str(json).map_err(|e| ConfigError::Json {
            what: "tenant policy".into(),
            reason: e.to_string(),
        })?;
        Self::from_raw(&raw.allow, &raw.deny)
    }

    pub fn from_raw(allow: &RawRules, deny: &RawRules) -> Result<Self, ConfigError> {
        Ok(TenantPolicy {
            allow: RuleSet::parse(allow, "tenant allow")?,
            deny: RuleSet::parse(deny, "tenant deny")?,
        })
    }

    pub fn to_json(&self) -> String {
        serde_json::json!({"allow": self.allow.raw(), "deny": self.deny.raw()}).to_string()
    }
}

/// One named profile from `AIRLOCK_EGRESS_PROFILES`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Profile {
    pub rules: RuleSet,
    pub default: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    #[serde(default)]
    domains: Vec<String>,
    #[serde(default)]
    ips: Vec<String>,
    #[serde(default)]
    cidrs: Vec<String>,
    #[serde(default)]
    default: bool,
}

/// The server's profiles: name -> rules, some marked default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Profiles {
    by_name: BTreeMap<String, Profile>,
}

impl Profiles {
    /// `{"pypi": {"domains": ["pypi.org"], "ips": [], "cidrs": [], "default": true}, ...}`.
    /// A wildcard or malformed entry is an error naming the profile and the entry.
    pub fn from_json(json: &str) -> Result<Self, ConfigError> {
        let raw: BTreeMap<String, RawProfile> = serde_json::from_str(json).map_err(|e| ConfigError::Json {
            what: PROFILES_ENV.into(),
            reason: e.to_string(),
        })?;
        let mut by_name = BTreeMap::new();
        for (name, p) in raw {
            if name.is_empty()
                || name.len() > 64
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
            {
                return Err(ConfigError::ProfileName(name));
            }
            let rules = RuleSet::parse(
                &RawRules {
                    domains: p.domains,
                    ips: p.ips,
                    cidrs: p.cidrs,
                },
                &format!("profile \"{name}\""),
            )?;
            by_name.insert(
                name,
                Profile {
                    rules,
                    default: p.default,
                },
            );
        }
        Ok(Profiles { by_name })
    }

    /// From `AIRLOCK_EGRESS_PROFILES`; unset or blank means no profiles.
    pub fn from_env() -> Result<Self, ConfigError> {
        match std::env::var(PROFILES_ENV) {
            Ok(v) if !v.trim().is_empty() => Self::from_json(&v),
            _ => Ok(Profiles::default()),
        }
    }

    pub fn get(&self, name: &str) -> Option<&Profile> {
        self.by_name.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    pub fn defaults(&self) -> Vec<String> {
        self.by_name
            .iter()
            .filter(|(_, p)| p.default)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// The profiles a new sandbox gets: the named ones (each must exist; an unknown name is an
    /// error naming it), or, when none are named, the default profiles (possibly none: base only).
    /// Sorted and deduplicated, ready to record on the sandbox.
    pub fn select<S: AsRef<str>>(&self, requested: &[S]) -> Result<Vec<String>, ConfigError> {
        if requested.is_empty() {
            return Ok(self.defaults());
        }
        let mut out = BTreeSet::new();
        for r in requested {
            let name = r.as_ref().trim();
            if !self.by_name.contains_key(name) {
                return Err(ConfigError::UnknownProfile(name.to_string()));
            }
            out.insert(name.to_string());
        }
        Ok(out.into_iter().collect())
    }

    /// Parses the `X-Airlock-Egress-Profiles: a,b` form, then [`Profiles::select`].
    pub fn select_header(&self, header: &str) -> Result<Vec<String>, ConfigError> {
        let names: Vec<&str> = header.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        self.select(&names)
    }
}

/// The server-wide egress configuration every replica must agree on.
#[derive(Debug, Clone)]
pub struct EgressConfig {
    pub platform: Arc<PlatformDenies>,
    pub profiles: Arc<Profiles>,
}

impl EgressConfig {
    pub fn new(platform: PlatformDenies, profiles: Profiles) -> Self {
        EgressConfig {
            platform: Arc::new(platform),
            profiles: Arc::new(profiles),
        }
    }

    /// sha256 (hex) of a canonical form of the configuration: the always-denied ranges and every
    /// profile (names sorted, entries normalized, sorted, deduplicated). JSON key order, spacing,
    /// case of names and duplicates in the input don't change it; any rule or default flag does.
    /// The host's own addresses and the upstream resolver are per machine, so they are left out.
    pub fn digest(&self) -> String {
        let profiles: BTreeMap<&str, serde_json::Value> = self
            .profiles
            .by_name
            .iter()
            .map(|(n, p)| {
                let raw = p.rules.raw();
                (n.as_str(), serde_json::json!({"domains": raw.domains, "ips": raw.ips, "cidrs": raw.cidrs, "default": p.default}))
            })
            .collect();
        let ranges: Vec<String> = self.platform.ranges.iter().map(|(n, _)| n.to_string()).collect();
        let canonical = serde_json::json!({"v": 1, "platform_deny": ranges, "profiles": profiles});
        hex::encode(Sha256::digest(canonical.to_string().as_bytes()))
    }
}

/// What the tenant's denied names resolve to at a decision: name -> its addresses, or `None` when
/// the lookup failed (then every address counts as possibly its: denies fail closed).
pub type DeniedNameAddrs = BTreeMap<String, Option<Vec<IpAddr>>>;

/// One sandbox's effective policy: fixed for its lifetime.
#[derive(Debug, Clone)]
pub struct Policy {
    platform: Arc<PlatformDenies>,
    tenant: TenantPolicy,
    profiles: Vec<(String, RuleSet)>,
}

/// What `GET /v1/sandboxes/{id}/egress` can show.
#[derive(Debug, Clone, Serialize)]
pub struct EffectivePolicy {
    pub platform_deny: Vec<String>,
    pub tenant: TenantPolicy,
    pub profiles: BTreeMap<String, RuleSet>,
}

impl Policy {
    /// `profile_names` as chosen by [`Profiles::select`] (and recorded on the sandbox).
    pub fn new<S: AsRef<str>>(
        config: &EgressConfig,
        tenant: TenantPolicy,
        profile_names: &[S],
    ) -> Result<Self, ConfigError> {
        let mut profiles = Vec::new();
        for n in profile_names {
            let n = n.as_ref();
            let p = config
                .profiles
                .get(n)
                .ok_or_else(|| ConfigError::UnknownProfile(n.to_string()))?;
            profiles.push((n.to_string(), p.rules.clone()));
        }
        Ok(Policy {
            platform: config.platform.clone(),
            tenant,
            profiles,
        })
    }

    pub fn profile_names(&self) -> Vec<&str> {
        self.profiles.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// May the sandbox reach this address (an IP literal, or a connection without a name)?
    pub fn decide_ip(&self, ip: IpAddr) -> Decision {
        if let Some(d) = self.deny_for_address(ip) {
            return d;
        }
        if let Some(r) = self.tenant.allow.match_ip(ip) {
            return Decision::allow(format!("tenant allow {r}"));
        }
        for (name, rules) in &self.profiles {
            if let Some(r) = rules.match_ip(ip) {
                return Decision::allow(format!("profile {name} {r}"));
            }
        }
        Decision::deny("default deny")
    }

    /// The names the tenant denies: what [`Policy::decide_address`] needs resolved.
    pub fn denied_domains(&self) -> &BTreeSet<String> {
        &self.tenant.deny.domains
    }

    /// May the sandbox reach this address when the connection names nothing a rule decides on
    /// (no Host/SNI, an IP literal, a name no rule mentions)? [`Policy::decide_ip`], and then an
    /// address a denied name resolves to is that name's: denied whatever IP/CIDR rule allows it.
    pub fn decide_address(&self, ip: IpAddr, denied: &DeniedNameAddrs) -> Decision {
        let d = self.decide_ip(ip);
        if !d.allowed {
            return d;
        }
        for (name, addrs) in denied {
            match addrs {
                Some(addrs) if !addrs.contains(&ip) => {}
                Some(_) => return Decision::deny(format!("tenant deny domain {name} (an address it resolves to)")),
                None => return Decision::deny(format!("tenant deny domain {name} (its addresses are unknown)")),
            }
        }
        d
    }

    /// May the sandbox reach this name (DNS, Host, SNI)? An IP literal goes to
    /// [`Policy::decide_ip`]; a malformed or wildcard name is denied.
    pub fn decide_domain(&self, name: &str) -> Decision {
        let trimmed = name.trim().trim_end_matches('.');
        let unbracketed = trimmed
            .strip_prefix('[')
            .and_then(|s| s.strip_suffix(']'))
            .unwrap_or(trimmed);
        if let Ok(ip) = unbracketed.parse::<IpAddr>() {
            return self.decide_ip(ip);
        }
        let Ok(name) = normalize_domain(name) else {
            return Decision::deny("malformed name");
        };
        if let Some(r) = self.tenant.deny.match_domain(&name) {
            return Decision::deny(format!("tenant deny {r}"));
        }
        if let Some(r) = self.tenant.allow.match_domain(&name) {
            return Decision::allow(format!("tenant allow {r}"));
        }
        for (pname, rules) in &self.profiles {
            if let Some(r) = rules.match_domain(&name) {
                return Decision::allow(format!("profile {pname} {r}"));
            }
        }
        Decision::deny("default deny")
    }

    /// For an address a name resolved to: the platform's ranges, the host's addresses and the
    /// tenant's IP/CIDR denies still apply (a deny beats the domain allow that led here).
    pub fn deny_for_address(&self, ip: IpAddr) -> Option<Decision> {
        if let Some(d) = self.platform.check(ip) {
            return Some(d);
        }
        self.tenant
            .deny
            .match_ip(ip)
            .map(|r| Decision::deny(format!("tenant deny {r}")))
    }

    pub fn effective(&self) -> EffectivePolicy {
        let mut platform_deny: Vec<String> = self
            .platform
            .ranges
            .iter()
            .map(|(n, why)| format!("{n} ({why})"))
            .collect();
        // Named, not listed: the host's addresses are the operator's business, not a tenant's.
        if !self.platform.host_addrs.is_empty() {
            platform_deny.push("the host's own addresses".into());
        }
        EffectivePolicy {
            platform_deny,
            tenant: self.tenant.clone(),
            profiles: self.profiles.iter().cloned().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(profiles: &str) -> EgressConfig {
        EgressConfig::new(
            PlatformDenies::new(["198.51.100.1".parse().unwrap()]),
            Profiles::from_json(profiles).unwrap(),
        )
    }

    #[test]
    fn the_effective_policy_names_the_host_addresses_without_listing_them() {
        let p = Policy::new(&config("{}"), TenantPolicy::default(), &[] as &[&str]).unwrap();
        let shown = p.effective().platform_deny;
        assert!(shown.iter().all(|d| !d.contains("198.51.100.1")), "{shown:?}");
        assert!(shown.contains(&"the host's own addresses".to_string()), "{shown:?}");
    }

    #[test]
    fn platform_denies_beat_every_allow() {
        let c = config(r#"{"all": {"cidrs": ["0.0.0.0/0", "::/0"]}}"#);
        let tenant = TenantPolicy::from_json(r#"{"allow": {"ips": ["127.0.0.1", "169.254.169.254"]}}"#).unwrap();
        let p = Policy::new(&c, tenant, &["all"]).unwrap();
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.20.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "169.254.169.254",
            "224.0.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "198.51.100.1",
            "::1",
            "fe80::1",
            "fd00:ec2::254",
            "::ffff:127.0.0.1",
            "ff02::1",
            "::",
        ] {
            let d = p.decide_ip(ip.parse().unwrap());
            assert!(!d.allowed && d.rule.starts_with("platform deny"), "{ip}: {d:?}");
        }
        assert_eq!(
            p.decide_ip("203.0.113.9".parse().unwrap()),
            Decision::allow("profile all cidr 0.0.0.0/0")
        );
        assert_eq!(p.decide_domain("[::1]").rule, "platform deny ::1/128 (loopback)");
    }

    #[test]
    fn order_and_rules() {
        let c = config(
            r#"{"web": {"domains": ["Allowed.Test.", "denied.test"], "default": true}, "x": {"ips": ["203.0.113.7"]}}"#,
        );
        let tenant = TenantPolicy::from_json(
            r#"{"allow": {"domains": ["base.test"]}, "deny": {"domains": ["denied.test"], "cidrs": ["203.0.113.0/28"]}}"#,
        )
        .unwrap();
        let p = Policy::new(&c, tenant, &c.profiles.select::<&str>(&[]).unwrap()).unwrap();
        assert_eq!(
            p.decide_domain("ALLOWED.test."),
            Decision::allow("profile web domain allowed.test")
        );
        assert_eq!(
            p.decide_domain("base.test"),
            Decision::allow("tenant allow domain base.test")
        );
        assert_eq!(
            p.decide_domain("denied.test"),
            Decision::deny("tenant deny domain denied.test")
        );
        assert_eq!(p.decide_domain("sub.allowed.test"), Decision::deny("default deny"));
        assert_eq!(p.decide_domain("*.allowed.test").rule, "malformed name");
        assert_eq!(
            p.decide_ip("203.0.113.7".parse().unwrap()),
            Decision::deny("tenant deny cidr 203.0.113.0/28")
        );
        assert!(p.deny_for_address("203.0.113.7".parse().unwrap()).is_some());
        assert!(p.deny_for_address("203.0.113.70".parse().unwrap()).is_none());
    }

    #[test]
    fn a_denied_names_addresses_are_denied_under_an_ip_allow() {
        let c = config("{}");
        let tenant = TenantPolicy::from_json(
            r#"{"allow": {"cidrs": ["203.0.113.0/24"], "ips": ["192.0.2.9"]}, "deny": {"domains": ["evil.test", "gone.test"]}}"#,
        )
        .unwrap();
        let p = Policy::new::<&str>(&c, tenant, &[]).unwrap();
        assert_eq!(
            p.denied_domains().iter().collect::<Vec<_>>(),
            ["evil.test", "gone.test"]
        );
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut denied = DeniedNameAddrs::new();
        denied.insert("evil.test".into(), Some(vec![ip("203.0.113.30"), ip("192.0.2.9")]));
        denied.insert("gone.test".into(), Some(vec![]));
        for addr in ["203.0.113.30", "192.0.2.9"] {
            assert_eq!(
                p.decide_address(ip(addr), &denied),
                Decision::deny("tenant deny domain evil.test (an address it resolves to)"),
                "{addr}"
            );
            // decide_ip alone (what IP rules say) allows it: the denied name is what wins.
            assert!(p.decide_ip(ip(addr)).allowed);
        }
        assert_eq!(
            p.decide_address(ip("203.0.113.31"), &denied),
            Decision::allow("tenant allow cidr 203.0.113.0/24")
        );
        // Not allowed by address in the first place: the same answer as before.
        assert_eq!(
            p.decide_address(ip("198.51.100.7"), &denied),
            Decision::deny("default deny")
        );
        // A denied name that could not be looked up: nothing is allowed by address.
        denied.insert("gone.test".into(), None);
        assert_eq!(
            p.decide_address(ip("203.0.113.31"), &denied),
            Decision::deny("tenant deny domain gone.test (its addresses are unknown)")
        );
    }

    #[test]
    fn selection() {
        let c = config(r#"{"a": {"default": true}, "b": {}, "c": {"default": true}}"#);
        assert_eq!(c.profiles.select::<&str>(&[]).unwrap(), ["a", "c"]);
        assert_eq!(c.profiles.select_header(" b , a,b").unwrap(), ["a", "b"]);
        assert_eq!(
            c.profiles.select(&["nope"]).unwrap_err(),
            ConfigError::UnknownProfile("nope".into())
        );
        assert!(config(r#"{"b": {}}"#).profiles.select::<&str>(&[]).unwrap().is_empty());
    }

    #[test]
    fn malformed_entries_name_themselves() {
        for (json, needle) in [
            (r#"{"p": {"domains": ["exa mple.com"]}}"#, "exa mple.com"),
            (r#"{"p": {"ips": ["1.2.3"]}}"#, "1.2.3"),
            (r#"{"p": {"cidrs": ["10.0.0.1/8"]}}"#, "10.0.0.1/8"),
            (r#"{"p": {"domains": ["1.2.3.4"]}}"#, "1.2.3.4"),
            (r#"{"p": {"domain": ["a.test"]}}"#, "domain"),
            (r#"{"P Q": {}}"#, "P Q"),
        ] {
            let e = Profiles::from_json(json).unwrap_err().to_string();
            assert!(e.contains(needle), "{json}: {e}");
        }
    }
}
