//! Egress end to end (issue 10): a real `airlock serve` whose sandboxes' lookups and dials leave
//! through a test internet in namespaces (`tests/net/internet.py`: TEST-NET addresses only, an
//! authoritative DNS server, HTTP/HTTPS servers, a package index), probed from inside a real
//! sandbox with the guest's own python, curl and pip (`tests/guest/egress.py`).
//!
//! The tenant's base policy allows allowed.test, pypi.test and rebind.test and denies denied.test;
//! the server's default profile `web` allows profile.test and denied.test; the non-default
//! profile `optin` allows optin.test and is asked for by header on a create that isn't signed in.

mod common;

use common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock, RwLock, RwLockReadGuard};
use std::time::Duration;

const PROBE_PY: &str = include_str!("guest/egress.py");
const PROFILES: &str = r#"{"web": {"domains": ["profile.test", "denied.test"], "default": true},
                           "optin": {"domains": ["optin.test"]}}"#;
const ALLOWED: &str = "203.0.113.10";
const OTHER: &str = "203.0.113.20";

/// The test internet: the helper process (its namespaces go with it) and what it printed.
struct Internet {
    child: Mutex<Child>,
    info: Value,
}

impl Internet {
    fn start(workdir: &std::path::Path) -> Internet {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/net/internet.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(workdir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let info: Value =
            serde_json::from_str(&line).unwrap_or_else(|_| panic!("test internet did not start: {line:?}"));
        Internet {
            child: Mutex::new(child),
            info,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.info["log"].as_str().unwrap()).unwrap()
    }

    fn stop(&self) {
        let mut child = self.child.lock().unwrap();
        drop(child.stdin.take()); // closing stdin ends it; it removes its namespaces
        let _ = child.wait();
    }
}

struct World {
    internet: Internet,
    /// The internet's files (certificate, index, log); removed by `cleanup`.
    workdir: PathBuf,
    /// Replaced by the restart case (which holds it for writing meanwhile).
    server: RwLock<Server>,
    /// What `airlock serve` is started with.
    serve_args: Vec<String>,
    /// A `base` sandbox under the tenant's policy and the default profile.
    id: String,
}

static WORLD: OnceLock<World> = OnceLock::new();

fn world() -> &'static World {
    WORLD.get_or_init(|| {
        let data = test_data_dir();
        build_template(&data, "base");
        let workdir = tempfile::tempdir().unwrap().keep();
        let internet = Internet::start(&workdir);
        // SAFETY: set before any test thread starts (the world is built by the first test, but
        // only this process's own children read it).
        unsafe { std::env::set_var("AIRLOCK_EGRESS_PROFILES", PROFILES) };
        let serve_args: Vec<String> = vec![
            "--egress-uplink-netns".into(),
            internet.info["uplink_netns"].as_str().unwrap().into(),
            "--egress-dns".into(),
            internet.info["dns"].as_str().unwrap().into(),
        ];
        let server = Server::start_with(&data, &serve_args.iter().map(String::as_str).collect::<Vec<_>>());
        server.cli_ok(&[
            "tenant",
            "policy",
            "set",
            "--allow-domain",
            "allowed.test",
            "--allow-domain",
            "pypi.test",
            "--allow-domain",
            "rebind.test",
            "--deny-domain",
            "denied.test",
        ]);
        let (status, r) = server.call_with(
            "POST",
            "/v1/sandboxes",
            Some(json!({ "template": "base", "timeout": "30m", "metadata": { "suite": "egress" } })),
            Some(&server.key),
            &[("X-Airlock-Egress-Profiles", "optin")],
        );
        assert_eq!(status, 202, "{r}");
        let op = server.wait_op(r["operation"]["id"].as_str().unwrap());
        assert_eq!(op["state"], "succeeded", "{op}");
        let id = r["sandbox_id"].as_str().unwrap().to_string();
        put_file(&server, &id, "/tmp/egress.py", PROBE_PY.as_bytes());
        let cert = std::fs::read(internet.info["cert"].as_str().unwrap()).unwrap();
        put_file(&server, &id, "/tmp/test-ca.pem", &cert);
        World {
            internet,
            workdir,
            server: RwLock::new(server),
            serve_args,
            id,
        }
    })
}

fn server() -> RwLockReadGuard<'static, Server> {
    world().server.read().unwrap_or_else(|e| e.into_inner())
}

/// Run `argv` in the shared sandbox; (exit code, stdout, stderr).
fn run(argv: &[&str], root: bool) -> (i64, String, String) {
    let w = world();
    let mut body = json!({ "argv": argv, "timeout": "120s" });
    if root {
        body["user"] = "root".into();
    }
    let server = server();
    let sid = server.session(&w.id, body);
    let events = server.events(&w.id, &sid, None, None);
    let code = events.last().unwrap().2["exit_code"].as_i64().unwrap_or(-1);
    (code, decode(&events, "stdout"), decode(&events, "stderr"))
}

/// One probe of `tests/guest/egress.py`, its JSON answer.
fn probe(args: &[&str]) -> Value {
    let mut argv = vec!["python3", "/tmp/egress.py"];
    argv.extend_from_slice(args);
    let (code, out, err) = run(&argv, false);
    assert_eq!(code, 0, "probe {args:?}: {err}");
    serde_json::from_str(out.trim()).unwrap_or_else(|_| panic!("probe {args:?} printed {out:?}"))
}

fn served_by(v: &Value, ip: &str, port: u16) -> bool {
    v["ok"] == true
        && v["body"]
            .as_str()
            .is_some_and(|b| b.starts_with(&format!("served-by {ip}:{port} ")))
}

/// Refused: no connection, a connection closed without an answer (ports other than 80), or the
/// proxy's own answer naming the rule (port 80).
fn denied(v: &Value) -> bool {
    v["ok"] == false
        || v["body"]
            .as_str()
            .is_some_and(|b| b.is_empty() || b.starts_with("airlock egress denied"))
}

fn assert_never_reached(ip: &str) {
    let log = world().internet.log();
    assert!(!log.contains(&format!("tcp {ip}:")), "{ip} was reached:\n{log}");
}

fn allowed_name_works_over_http_and_https() {
    let v = probe(&["http", "allowed.test"]);
    assert!(served_by(&v, ALLOWED, 80), "{v}");
    let v = probe(&["tls", "allowed.test", "--ca", "/tmp/test-ca.pem"]);
    assert!(served_by(&v, ALLOWED, 443), "{v}");
    assert!(v["body"].as_str().unwrap().contains("sni=allowed.test"), "{v}");
    // The guest's curl, verifying the test site's certificate.
    let (code, out, err) = run(
        &["curl", "-sS", "--cacert", "/tmp/test-ca.pem", "https://allowed.test/"],
        false,
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with(&format!("served-by {ALLOWED}:443 host=allowed.test")),
        "{out}"
    );
}

fn pip_installs_from_an_allowed_index() {
    let w = world();
    let package = w.internet.info["package"].as_str().unwrap();
    let (code, out, err) = run(
        &[
            "sh",
            "-c",
            &format!(
                "pip install --user --break-system-packages --disable-pip-version-check \
                 --index-url http://pypi.test/simple --trusted-host pypi.test {package} && \
                 python -c 'import hello_airlock; print(hello_airlock.GREETING)'"
            ),
        ],
        false,
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.trim_end().ends_with(w.internet.info["greeting"].as_str().unwrap()),
        "{out}"
    );
}

fn a_name_not_allowed_does_not_resolve_and_its_ip_is_unreachable() {
    let v = probe(&["dns", "other.test"]);
    assert_eq!(
        (v["rcode"].as_str(), v["addrs"].as_array().map(Vec::len)),
        (Some("REFUSED"), Some(0)),
        "{v}"
    );
    let v = probe(&["http", "other.test"]);
    assert_eq!(v["ok"], false, "{v}");
    // By IP literal (with its name as Host, or an allowed one on a port that isn't 80), on every port: no IP rule allows it.
    for port in ["80", "8080"] {
        let v = probe(&["http", "other.test", "--ip", OTHER, "--port", port]);
        assert!(denied(&v), "{v}");
    }
    let v = probe(&["http", "allowed.test", "--ip", OTHER, "--port", "8080"]);
    assert!(denied(&v), "{v}");
    let v = probe(&["tls", "other.test", "--ip", OTHER]);
    assert_eq!(v["ok"], false, "{v}");
    assert_never_reached(OTHER);
}

fn other_queries_get_nothing_and_never_leave() {
    for name in [
        "secret-4f2a9c.other.test",
        "exfil-data.example.com",
        "c2VjcmV0.allowed.test",
    ] {
        let v = probe(&["dns", name]);
        assert_eq!(v["rcode"], "REFUSED", "{name}: {v}");
    }
    let v = probe(&["dns", "allowed.test", "--type", "AAAA"]);
    assert_eq!(v["addrs"].as_array().map(Vec::len), Some(0), "{v}");
    let log = world().internet.log();
    for leak in ["secret-4f2a9c", "exfil-data", "c2VjcmV0"] {
        assert!(!log.contains(leak), "{leak} reached the upstream:\n{log}");
    }
}

fn curl_resolve_to_another_ip_reaches_the_allowed_site() {
    let (code, out, err) = run(
        &[
            "curl",
            "-sS",
            "--cacert",
            "/tmp/test-ca.pem",
            "--resolve",
            &format!("allowed.test:443:{OTHER}"),
            "https://allowed.test/",
        ],
        false,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with(&format!("served-by {ALLOWED}:443 ")), "{out}");
    // The same over plain HTTP: the Host header decides, not the address dialled.
    let v = probe(&["http", "allowed.test", "--ip", OTHER]);
    assert!(served_by(&v, ALLOWED, 80), "{v}");
    assert_never_reached(OTHER);
}

fn sni_of_an_allowed_name_with_another_host_reaches_only_the_allowed_site() {
    let v = probe(&[
        "tls",
        "allowed.test",
        "--ip",
        OTHER,
        "--host",
        "other.test",
        "--ca",
        "/tmp/test-ca.pem",
    ]);
    assert!(served_by(&v, ALLOWED, 443), "{v}");
    assert!(v["body"].as_str().unwrap().contains("host=other.test"), "{v}");
    assert_never_reached(OTHER);
}

fn udp_is_dropped_and_ipv6_has_no_route() {
    let v = probe(&["udp", ALLOWED, "9999"]);
    assert_eq!(v["sent"], true, "{v}");
    let v = probe(&["ipv6"]);
    assert_eq!(v["ok"], false, "{v}");
    std::thread::sleep(Duration::from_millis(500));
    let log = world().internet.log();
    assert!(!log.contains("udp "), "a datagram got out:\n{log}");
}

fn rebinding_answers_are_refused() {
    let v = probe(&["dns", "rebind.test"]);
    assert_eq!(v["addrs"].as_array().map(Vec::len), Some(0), "{v}");
    assert_eq!(v["rcode"], "REFUSED", "{v}");
    let v = probe(&["http", "rebind.test", "--ip", ALLOWED]);
    assert!(denied(&v), "the proxy dialled a private address: {v}");
}

fn spoofed_sources_are_dropped() {
    let w = world();
    let (netns, _) = airlock_runtime::net::names(&server().data, &w.id);
    let spoofed = || -> u64 {
        let out = Command::new("ip")
            .args(["netns", "exec", &netns, "nft", "-j", "list", "counter", "inet"])
            .args([airlock_runtime::net::NETNS_TABLE, "spoofed"])
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v["nftables"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|e| e["counter"]["packets"].as_u64())
            .unwrap_or_else(|| panic!("no counter: {}", String::from_utf8_lossy(&out.stderr)))
    };
    let before = spoofed();
    // As root: TCP SYNs and datagrams from addresses not the guest's, to the allowed site.
    let script = format!(
        r#"
import socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
n = 0
for src in ['100.96.0.3', '203.0.113.99']:
    for proto, payload in [(6, struct.pack('!HHIIBBHHH', 40000, 80, 1, 0, 0x50, 0x02, 1024, 0, 0)),
                           (17, struct.pack('!HHHH', 40000, 9999, 12, 0) + b'spof')]:
        ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(payload), 1, 0, 64, proto, 0,
                         socket.inet_aton(src), socket.inet_aton('{ALLOWED}'))
        s.sendto(ip + payload, ('{ALLOWED}', 0))
        n += 1
print(n)
"#
    );
    let (code, out, err) = run(&["python3", "-c", &script], true);
    assert_eq!((code, out.trim()), (0, "4"), "{err}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(spoofed() >= before + 4, "spoofed counter {before} -> {}", spoofed());
    let log = w.internet.log();
    assert!(!log.contains("udp "), "a spoofed datagram got out:\n{log}");
}

fn profiles_open_exactly_their_names_and_a_tenant_deny_wins() {
    let w = world();
    // The default profile's name.
    let v = probe(&["http", "profile.test"]);
    assert!(served_by(&v, "203.0.113.40", 80), "{v}");
    // In the default profile, but denied by the tenant.
    let v = probe(&["dns", "denied.test"]);
    assert_eq!(v["rcode"], "REFUSED", "{v}");
    let v = probe(&["http", "denied.test", "--ip", "203.0.113.60"]);
    assert!(denied(&v), "{v}");
    // Asked for by header on a create with an API key: ignored.
    let v = probe(&["dns", "optin.test"]);
    assert_eq!(v["rcode"], "REFUSED", "{v}");
    let (status, sb) = server().call("GET", &format!("/v1/sandboxes/{}", w.id), None);
    assert_eq!(status, 200, "{sb}");
    assert_eq!(sb["egress"]["profiles"], json!(["web"]), "{sb}");
    assert_never_reached("203.0.113.50");
    assert_never_reached("203.0.113.60");
}

fn the_egress_report_shows_decisions_and_recent_denials() {
    let w = world();
    probe(&["http", "other.test", "--ip", OTHER]);
    let (status, r) = server().call("GET", &format!("/v1/sandboxes/{}/egress", w.id), None);
    assert_eq!(status, 200, "{r}");
    assert!(r["counters"]["tcp_denied"].as_u64().unwrap() >= 1, "{r}");
    assert!(r["counters"]["dns_denied"].as_u64().unwrap() >= 1, "{r}");
    let denials = r["recent_denials"].as_array().unwrap();
    assert!(
        denials
            .iter()
            .any(|d| d["destination"] == "other.test:80" && d["path"] == "tcp" && d["rule"] == "default deny"),
        "{r}"
    );
    assert!(r["policy"]["tenant_allow"]["domains"]
        .as_array()
        .unwrap()
        .contains(&json!("allowed.test")));
}

/// `kill -9` of the server; the next one re-attaches the VM and serves its egress again, on the
/// ports its rules were loaded with, under the policy recorded at create.
fn egress_is_served_again_after_a_server_crash() {
    let w = world();
    {
        let mut s = w.server.write().unwrap_or_else(|e| e.into_inner());
        s.kill9();
        let args: Vec<&str> = w.serve_args.iter().map(String::as_str).collect();
        let data = s.data.clone();
        *s = Server::start_with(&data, &args);
    }
    let v = probe(&["http", "allowed.test"]);
    assert!(served_by(&v, ALLOWED, 80), "{v}");
    let v = probe(&["dns", "other.test"]);
    assert_eq!(v["rcode"], "REFUSED", "{v}");
    let v = probe(&["http", "profile.test"]);
    assert!(served_by(&v, "203.0.113.40", 80), "{v}");
}

fn main() {
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let args = libtest_mimic::Arguments::from_args();
    let t = trial;
    let tests = vec![
        t(
            "allowed_name_works_over_http_and_https",
            allowed_name_works_over_http_and_https,
        ),
        t("pip_installs_from_an_allowed_index", pip_installs_from_an_allowed_index),
        t(
            "a_name_not_allowed_does_not_resolve_and_its_ip_is_unreachable",
            a_name_not_allowed_does_not_resolve_and_its_ip_is_unreachable,
        ),
        t(
            "other_queries_get_nothing_and_never_leave",
            other_queries_get_nothing_and_never_leave,
        ),
        t(
            "curl_resolve_to_another_ip_reaches_the_allowed_site",
            curl_resolve_to_another_ip_reaches_the_allowed_site,
        ),
        t(
            "sni_of_an_allowed_name_with_another_host_reaches_only_the_allowed_site",
            sni_of_an_allowed_name_with_another_host_reaches_only_the_allowed_site,
        ),
        t(
            "udp_is_dropped_and_ipv6_has_no_route",
            udp_is_dropped_and_ipv6_has_no_route,
        ),
        t("rebinding_answers_are_refused", rebinding_answers_are_refused),
        t("spoofed_sources_are_dropped", spoofed_sources_are_dropped),
        t(
            "profiles_open_exactly_their_names_and_a_tenant_deny_wins",
            profiles_open_exactly_their_names_and_a_tenant_deny_wins,
        ),
        t(
            "the_egress_report_shows_decisions_and_recent_denials",
            the_egress_report_shows_decisions_and_recent_denials,
        ),
        t(
            "egress_is_served_again_after_a_server_crash",
            egress_is_served_again_after_a_server_crash,
        ),
    ];
    let conclusion = libtest_mimic::run(&args, tests);
    cleanup();
    reap_orphans();
    conclusion.exit();
}

/// Delete the sandbox, stop the server, then the internet; put the tenant's policy back.
fn cleanup() {
    let Some(w) = WORLD.get() else { return };
    let server = server();
    server.delete(&w.id);
    let _ = server.cli(&["tenant", "policy", "set"]);
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    std::thread::sleep(Duration::from_millis(300));
    w.internet.stop();
    let _ = std::fs::remove_dir_all(&w.workdir);
}
