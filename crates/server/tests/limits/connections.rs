//! Connections: slow request heads cut off while others are served, the listener's cap of open
//! connections (new ones wait) and the per-client cap (past it a client is reset, others get in).

use super::*;

/// Raise the soft fd limit to at least `want` (up to the hard limit).
fn raise_fd_limit(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    if lim.rlim_cur < want {
        lim.rlim_cur = (want as libc::rlim_t).min(lim.rlim_max);
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    }
    lim.rlim_cur
}

/// A connection to `addr` from `from` (any of 127/8 is this host's loopback on Linux).
async fn connect_from(from: &str, addr: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(format!("{from}:0").parse().unwrap())?;
    socket.connect(addr).await
}

/// Open `n` connections that each send a partial request head and then nothing, from
/// 127.0.0.10, .11, ... in turns of `per_address` (under the per-client cap: a client alone
/// cannot hold more).
async fn slow_heads(addr: SocketAddr, n: usize) -> Vec<tokio::net::TcpStream> {
    use tokio::io::AsyncWriteExt;
    let per_address = airlock_server::listen::MAX_CONNECTIONS_PER_CLIENT;
    let mut slow = Vec::with_capacity(n);
    for i in 0..n {
        let from = format!("127.0.0.{}", 10 + i / per_address);
        let mut s = connect_from(&from, addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        slow.push(s);
    }
    slow
}

/// When each connection was closed by the server (None: still open after `wait`).
async fn closed_at(slow: Vec<tokio::net::TcpStream>, wait: Duration) -> Vec<Option<Instant>> {
    use tokio::io::AsyncReadExt;
    futures_util::future::join_all(slow.into_iter().map(|mut s| async move {
        let mut buf = [0u8; 256];
        loop {
            match tokio::time::timeout(wait, s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return Some(Instant::now()),
                Ok(Ok(_)) => continue,
                Err(_) => return None,
            }
        }
    }))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_request_heads_are_cut_off_while_others_are_served() {
    const SLOW: usize = 1000;
    let fds = raise_fd_limit(4 * SLOW as u64);
    assert!(fds >= 3 * SLOW as u64, "RLIMIT_NOFILE is {fds}");
    let header_read = Duration::from_secs(2);
    let server = Server::start_fresh(Limits {
        header_read,
        ..Limits::default()
    })
    .await;
    let started = Instant::now();
    let slow = slow_heads(server.addr, SLOW).await;
    let opened = started.elapsed();
    // Normal requests while all of them hang.
    let mut latencies = Vec::new();
    while started.elapsed() < header_read / 2 || latencies.len() < 3 {
        let t = Instant::now();
        let (status, doc) = server.json(Method::GET, "/openapi-m1.json", &[], Body::empty()).await;
        latencies.push(t.elapsed());
        assert_eq!(status, 200, "{doc}");
        assert!(doc["paths"].is_object());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let closed = closed_at(slow, header_read * 3).await;
    let open = closed.iter().filter(|c| c.is_none()).count();
    let last = closed.iter().flatten().max().unwrap().duration_since(started);
    let first = closed.iter().flatten().min().unwrap().duration_since(started);
    let worst = latencies.iter().max().unwrap();
    println!(
        "{SLOW} slow heads opened in {opened:?}; {} normal requests during the attack, worst {worst:?} \
         (all: {latencies:?}); slow ones closed from {first:?} to {last:?} after the attack began \
         (header timeout {header_read:?}), {open} left open",
        latencies.len()
    );
    assert_eq!(open, 0, "every slow connection is closed");
    assert!(
        first >= header_read - Duration::from_millis(100),
        "{first:?}: closed too early"
    );
    assert!(last < opened + header_read + Duration::from_secs(2), "{last:?}");
    assert!(*worst < Duration::from_secs(1), "{worst:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_cap_new_connections_wait_their_turn() {
    let header_read = Duration::from_secs(1);
    let server = Server::start_fresh(Limits {
        header_read,
        max_connections: 4,
        ..Limits::default()
    })
    .await;
    let slow = slow_heads(server.addr, 4).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The fifth connection waits in the backlog until the slow ones are cut off.
    let t = Instant::now();
    let (status, _) = server.json(Method::GET, "/openapi-m1.json", &[], Body::empty()).await;
    let waited = t.elapsed();
    println!("with 4 of 4 connections held by slow heads, a request took {waited:?}");
    assert_eq!(status, 200);
    assert!(waited >= header_read - Duration::from_millis(300), "{waited:?}");
    assert!(waited < header_read + Duration::from_secs(2), "{waited:?}");
    assert!(closed_at(slow, Duration::from_secs(1))
        .await
        .iter()
        .all(Option::is_some));
}

/// One client address holding its cap of open connections gets no more: the next one is reset
/// at once, while other addresses still connect and are served, and a slot it gives back is its
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_at_its_connection_cap_gets_no_more_while_others_get_in() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const CAP: usize = 8;
    let server = Server::start_fresh(Limits {
        max_connections_per_client: CAP,
        ..Limits::default()
    })
    .await;
    // Connections that say nothing are held until the header timeout (10 s).
    let mut held = Vec::new();
    for _ in 0..CAP {
        held.push(connect_from("127.0.0.2", server.addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // One request on a fresh connection: its answer, or None when the server closed it unanswered.
    let request = |from: &'static str| async move {
        let mut s = connect_from(from, server.addr).await.ok()?;
        let t = Instant::now();
        s.write_all(b"GET /openapi-m1.json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got)).await;
        let status = String::from_utf8_lossy(&got)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string();
        println!("from {from}: {status:?} after {:?} ({read:?})", t.elapsed());
        Some(status).filter(|s| !s.is_empty())
    };
    let started = Instant::now();
    assert_eq!(request("127.0.0.2").await, None, "a client past its cap was served");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "refused only after {:?}",
        started.elapsed()
    );
    for other in ["127.0.0.1", "127.0.0.3"] {
        let status = request(other).await;
        assert_eq!(status.as_deref(), Some("HTTP/1.1 200 OK"), "from {other}");
    }
    // A connection it closes frees its place.
    drop(held.pop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(request("127.0.0.2").await.as_deref(), Some("HTTP/1.1 200 OK"));
}
