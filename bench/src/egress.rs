//! The egress proxy next to a direct veth path, in the same run, on the same test "internet".
//!
//! Namespaces (`airlock_testnet`, TEST-NET addresses only): a sandbox namespace whose TCP
//! is DNATed to the proxy in the host namespace (which resolves `allowed.test` through a test DNS
//! server and dials it), and a direct namespace forwarded through the same host namespace to the
//! same web server with no proxy. Samples alternate proxy/direct so drift hits both.
//!
//! - request latency: connect, send `GET /` (Host: allowed.test), read the whole small answer,
//!   on a new connection each time. Through the proxy that includes its Host sniff, its own DNS
//!   lookup, its dial and the splice.
//! - download: `GET /bytes/N` on one connection, MB/s.
//!
//!     cargo run --release -p airlock-bench --bin egress-bench -- --requests 300 --downloads 5

mod machine;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_egress::{
    DnsConfig, DnsServer, EgressConfig, PlatformDenies, Policy, Profiles, Proxy, ProxyConfig, Resolver, SandboxEgress,
    SandboxLimits, TenantPolicy,
};
use airlock_testnet::{Netns, TestDns, TestNet, TestWeb, GATEWAY, PROXY_PORT, UPLINK};
use clap::Parser;

const SITE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const DNS: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 53);

#[derive(Parser)]
struct Args {
    /// New-connection requests per side.
    #[arg(long, default_value_t = 300)]
    requests: usize,
    /// Downloads per side.
    #[arg(long, default_value_t = 5)]
    downloads: usize,
    /// Bytes per download.
    #[arg(long, default_value_t = 256 * 1024 * 1024)]
    download_bytes: usize,
    /// Where to write the raw results (JSON).
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
}

fn stats(v: &[f64], unit: &str) -> serde_json::Value {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| s[((s.len() as f64 - 1.0) * p).round() as usize];
    serde_json::json!({
        "n": s.len(), "unit": unit, "median": pct(0.5), "p95": pct(0.95), "min": s[0], "max": s[s.len() - 1],
        "samples": v,
    })
}

/// One request on a new connection from inside `ns`: ms until the whole answer is read.
fn request(ns: &Netns, path: &'static str) -> (f64, usize) {
    ns.spawn(move || {
        let started = Instant::now();
        let mut s = TcpStream::connect_timeout(&SocketAddr::new(SITE.into(), 80), Duration::from_secs(5)).unwrap();
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: allowed.test\r\n\r\n").unwrap();
        let mut buf = vec![0u8; 256 * 1024];
        let mut total = 0;
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => total += n,
                Err(e) => panic!("read: {e}"),
            }
        }
        assert!(total > 0, "empty answer");
        (started.elapsed().as_secs_f64() * 1000.0, total)
    })
    .join()
    .unwrap()
}

fn main() {
    let args = Args::parse();
    let net = TestNet::new(true).expect("test namespaces (root, ip, nft)");
    let direct = net.direct.as_ref().unwrap();
    net.add_internet_host(SITE).unwrap();
    net.add_internet_host(DNS).unwrap();
    let zone = HashMap::from([("allowed.test".to_string(), vec![SITE])]);
    let dns = TestDns::start(&net.internet, SocketAddr::new(DNS.into(), 53), zone).unwrap();
    let _web = TestWeb::start(&net.internet, &[80]).unwrap();

    let config = EgressConfig::new(
        PlatformDenies::new([IpAddr::from(GATEWAY), IpAddr::from(UPLINK)]),
        Profiles::from_json(r#"{"bench": {"domains": ["allowed.test"], "default": true}}"#).unwrap(),
    );
    let policy = Policy::new(
        &config,
        TenantPolicy::sealed(),
        &config.profiles.select::<&str>(&[]).unwrap(),
    )
    .unwrap();
    let sandbox = SandboxEgress::new("bench", policy, SandboxLimits::default());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let sb = sandbox.clone();
    let runner = net.host.spawn(move || {
        // Built on a thread inside the host namespace: its workers inherit it.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let resolver = Arc::new(Resolver::new(SocketAddr::new(DNS.into(), 53), Duration::from_secs(2)));
            let dns = DnsServer::new(resolver.clone(), DnsConfig::default());
            let proxy = Proxy::new(resolver, ProxyConfig::default());
            let udp = tokio::net::UdpSocket::bind((GATEWAY, 53)).await.unwrap();
            let tcp = tokio::net::TcpListener::bind((GATEWAY, PROXY_PORT)).await.unwrap();
            ready_tx.send(()).unwrap();
            tokio::select! {
                _ = dns.serve_udp(udp, sb.clone()) => {}
                _ = proxy.serve(tcp, sb) => {}
                _ = stopped => {}
            }
        });
    });
    ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();

    // Warm both paths (ARP, first connections).
    for _ in 0..5 {
        request(&net.sandbox, "/");
        request(direct, "/");
    }
    let (mut via_proxy, mut via_direct) = (Vec::new(), Vec::new());
    for _ in 0..args.requests {
        via_proxy.push(request(&net.sandbox, "/").0);
        via_direct.push(request(direct, "/").0);
    }
    let path: &'static str = Box::leak(format!("/bytes/{}", args.download_bytes).into_boxed_str());
    let (mut dl_proxy, mut dl_direct) = (Vec::new(), Vec::new());
    let mb = |(ms, bytes): (f64, usize)| bytes as f64 / 1e6 / (ms / 1000.0);
    for _ in 0..args.downloads {
        dl_proxy.push(mb(request(&net.sandbox, path)));
        dl_direct.push(mb(request(direct, path)));
    }
    drop(stop);
    runner.join().unwrap();

    let snap = sandbox.snapshot();
    let (p, d) = (stats(&via_proxy, "ms"), stats(&via_direct, "ms"));
    let (tp, td) = (stats(&dl_proxy, "MB/s"), stats(&dl_direct, "MB/s"));
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    let report = serde_json::json!({
        "bench": "egress",
        "when": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        "machine": machine::machine(),
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
        "what": "new connection + GET / (Host: allowed.test) to a TEST-NET web server in a network namespace; \
                 proxy = DNAT to the egress proxy, which sniffs Host, resolves via a test DNS server and dials; \
                 direct = forwarded through the same host namespace, no proxy",
        "request_via_proxy": p,
        "request_direct": d,
        "added_latency_median_ms": f(&p, "median") - f(&d, "median"),
        "added_latency_p95_ms": f(&p, "p95") - f(&d, "p95"),
        "download_bytes": args.download_bytes,
        "download_via_proxy": tp,
        "download_direct": td,
        "download_throughput_ratio_median": f(&tp, "median") / f(&td, "median"),
        "proxy_decisions": snap.counters,
        "upstream_dns_questions": dns.asked().len(),
    });
    println!(
        "{} requests, {} downloads of {} MiB per side",
        args.requests,
        args.downloads,
        args.download_bytes >> 20
    );
    println!("{:<28} {:>10} {:>10}", "", "median", "p95");
    for (name, s) in [
        ("request via proxy (ms)", &p),
        ("request direct (ms)", &d),
        ("download via proxy (MB/s)", &tp),
        ("download direct (MB/s)", &td),
    ] {
        println!("{name:<28} {:>10.3} {:>10.3}", f(s, "median"), f(s, "p95"));
    }
    println!(
        "added latency: median {:.3} ms, p95 {:.3} ms; throughput ratio (median) {:.3}",
        report["added_latency_median_ms"].as_f64().unwrap(),
        report["added_latency_p95_ms"].as_f64().unwrap(),
        report["download_throughput_ratio_median"].as_f64().unwrap()
    );
    std::fs::create_dir_all(&args.out).unwrap();
    let date = report["when"].as_str().unwrap().replace([':', '-'], "");
    let out = args.out.join(format!("egress-{}.json", &date[..15]));
    std::fs::write(&out, serde_json::to_vec_pretty(&report).unwrap()).unwrap();
    println!("raw results: {}", out.display());
}
