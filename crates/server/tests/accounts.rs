//! The platform account's sign-in under attack (issue 23): a concurrent burst of guesses is
//! throttled per client address before any password is hashed, and no burst from elsewhere
//! locks the owner out of signing in from the server's own host.

mod common;

use axum::body::Body;
use axum::http::{Method, Request};
use common::*;
use serde_json::{json, Value};
use std::net::{IpAddr, SocketAddr};

/// `POST /v1/admin/login` from `from` (a loopback address the test binds its socket to).
async fn login_from(server_addr: SocketAddr, from: IpAddr, username: &str, password: &str) -> (u16, Value) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(from, 0)).unwrap();
    let stream = socket.connect(server_addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::builder()
        .method(Method::POST)
        .uri("/v1/admin/login")
        .header("host", server_addr.to_string())
        .header("content-type", "application/json")
        .body(Body::from(
            json!({"username": username, "password": password}).to_string(),
        ))
        .unwrap();
    let res = sender.send_request(req).await.unwrap();
    let status = res.status().as_u16();
    Resp {
        status,
        headers: res.headers().clone(),
        body: Body::new(res.into_body()),
    }
    .json()
    .await
}

/// Sends `n` wrong sign-ins from `from` at once; how many were evaluated (401) and throttled (429).
async fn burst(server: &Server, from: IpAddr, n: usize) -> (usize, usize) {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let addr = server.addr;
            tokio::spawn(async move { login_from(addr, from, "root@local", &format!("guess-{i}")).await })
        })
        .collect();
    let (mut evaluated, mut throttled) = (0, 0);
    for t in tasks {
        let (status, body) = t.await.unwrap();
        match status {
            401 => evaluated += 1,
            429 => throttled += 1,
            other => panic!("a wrong sign-in got {other}: {body}"),
        }
    }
    (evaluated, throttled)
}

/// A burst of 50 concurrent wrong sign-ins from one address has at most five evaluated (the
/// attempts are reserved before argon2 runs), and the owner's right password from another
/// loopback address still signs in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sign_in_burst_is_throttled_per_address_before_hashing() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    let password = server
        .core()
        .ensure_console_account(None)
        .await
        .unwrap()
        .expect("a generated password");
    let attacker: IpAddr = "127.0.0.2".parse().unwrap();
    let (evaluated, throttled) = burst(&server, attacker, 50).await;
    eprintln!("sign-in attempts evaluated in a burst of 50: {evaluated}");
    assert!(evaluated <= 5, "{evaluated} of 50 concurrent guesses were evaluated");
    assert_eq!(evaluated + throttled, 50);
    // The attacker's address stays throttled, even with the right password...
    let (status, body) = login_from(server.addr, attacker, "root@local", &password).await;
    assert_eq!((status, body["code"].as_str()), (429, Some("rate_limited")), "{body}");
    // ...and the owner, on the server's host, signs in.
    let owner: IpAddr = "127.0.0.1".parse().unwrap();
    let (status, body) = login_from(server.addr, owner, "root@local", &password).await;
    assert_eq!(status, 200, "{body}");

    // A burst from 50 remote addresses (one guess each) meets the ceiling all remote clients
    // share: at most 20 evaluated. Then a remote owner waits, a local one signs in.
    let core = server.core().clone();
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let core = core.clone();
            let from: IpAddr = format!("203.0.113.{i}").parse().unwrap();
            tokio::spawn(async move { core.login("root@local", "a guess", Some(from)).await.map(|_| ()) })
        })
        .collect();
    let mut evaluated = 0;
    for t in tasks {
        match t.await.unwrap() {
            Err(e) if e.code().status == 401 => evaluated += 1,
            Err(e) if e.code().status == 429 => {}
            other => panic!("a wrong sign-in: {other:?}"),
        }
    }
    eprintln!("sign-in attempts evaluated in a burst of 50 from 50 remote addresses: {evaluated}");
    assert!(
        evaluated <= airlock_server::core::sign_in::FAILURES_REMOTE,
        "{evaluated}"
    );
    let remote = core
        .login("root@local", &password, Some("198.51.100.7".parse().unwrap()))
        .await;
    assert_eq!(remote.unwrap_err().code().status, 429);
    let (status, body) = login_from(server.addr, owner, "root@local", &password).await;
    assert_eq!(status, 200, "{body}");
    drop(core);
    server.stop().await;
}

/// A flood of bad credentials writes a bounded number of audit rows: repeats of one refusal
/// within a minute are one row with a count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_bad_keys_writes_a_bounded_number_of_audit_rows() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    let core = server.core().clone();
    let started = std::time::Instant::now();
    let tasks: Vec<_> = (0..4)
        .map(|t| {
            let core = core.clone();
            tokio::spawn(async move {
                for i in 0..2500 {
                    let key = format!("ak_{t}{i:0>60}");
                    assert!(core.tenant(Some(&key), "Authorization").await.is_err());
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    // The same through the door.
    for _ in 0..20 {
        assert_eq!(server.v1_as("ak_wrong", Method::GET, "/tenant", None).await.0, 401);
    }
    let filter = airlock_server::store::AuditFilter {
        action: Some("auth.key".into()),
        ..Default::default()
    };
    let rows = core.store().audit(&filter, 1000).await.unwrap();
    // One row a minute (two if the flood straddled a window).
    let minutes = started.elapsed().as_secs() / 60 + 2;
    eprintln!(
        "audit rows from 10,020 bad keys: {} in {:?}",
        rows.len(),
        started.elapsed()
    );
    assert!(rows.len() as u64 <= minutes, "{} rows", rows.len());
    // Read as the admin reads it, every bad key is counted.
    let admin = airlock_server::core::accounts::Admin {
        account: "root@local".into(),
    };
    let entries = core.audit_log(&admin, &filter, 1000).await.unwrap();
    assert_eq!(entries.iter().map(|e| e.count).sum::<u64>(), 10_020, "{entries:?}");
    drop(core);
    server.stop().await;
}
