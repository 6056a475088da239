//! The core over a node's HTTP face (`nodes::serve` + `RemoteNode`, issue 25's first piece):
//! the same lifecycle, sessions, files and exits as over the in-process node, every call and
//! every agent call crossing the node's face signed for it.

use super::common::*;
use airlock_runtime::fake;
use airlock_server::nodes::{Capacity, Nodes, RemoteNode};
use axum::body::Body;
use axum::http::Method;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_lives_on_a_node_reached_over_its_face() {
    let tmp = fresh();
    let server = Server::start_over_node_face(tmp.path()).await;
    let id = server.running_sandbox().await;
    assert_eq!(fake::live_vms(tmp.path()).len(), 1);
    // A session: spawn and its event stream pass through the node's agent route.
    server.assert_answers(&id).await;
    // Files both ways.
    let path = format!("/v1/sandboxes/{id}/files?path=/home/user/over-the-face.txt");
    let auth = format!("Bearer {}", server.key);
    let put = server
        .send(
            Method::PUT,
            &path,
            &[("authorization", &auth)],
            Body::from("remote bytes"),
        )
        .await;
    assert!(put.status < 300, "put: {}", put.status);
    let got = server
        .send(Method::GET, &path, &[("authorization", &auth)], Body::empty())
        .await;
    assert_eq!(got.status, 200);
    assert_eq!(
        &axum::body::to_bytes(got.body, 1 << 20).await.unwrap()[..],
        b"remote bytes"
    );
    // The agent's own error comes back as itself: a missing file is a 404.
    let missing = server
        .send(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=/no/such/file"),
            &[("authorization", &auth)],
            Body::empty(),
        )
        .await;
    assert_eq!(missing.status, 404);
    // Pause and resume are the node's, and its report follows them.
    let (status, body) = server.v1(Method::POST, &format!("/sandboxes/{id}/pause"), None).await;
    assert_eq!(status, 202, "{body}");
    server.await_state(&id, "paused", Duration::from_secs(5)).await;
    let (status, body) = server.v1(Method::POST, &format!("/sandboxes/{id}/resume"), None).await;
    assert_eq!(status, 202, "{body}");
    server.await_state(&id, "running", Duration::from_secs(5)).await;
    server.assert_answers(&id).await;
    server.delete(&id).await;
    assert_no_vms(tmp.path());
    server.stop().await;
}

/// A VM that dies on the node (`kill -9`) reaches the core through the node's exit stream: the
/// sandbox ends as it does in-process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_that_dies_on_the_node_ends_its_sandbox() {
    let tmp = fresh();
    let server = Server::start_over_node_face(tmp.path()).await;
    let id = server.running_sandbox().await;
    let pid = server.vm_pid(&id);
    fake::kill_vm(pid);
    let took = server.await_state(&id, "failed", Duration::from_secs(5)).await;
    eprintln!("kill -9 on the node: failed after {took:?}");
    assert_no_vms(tmp.path());
    server.stop().await;
}

/// A node answers only calls signed with its cluster secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_face_refuses_callers_without_the_cluster_secret() {
    let tmp = fresh();
    let server = Server::start_over_node_face(tmp.path()).await;
    let id = server.running_sandbox().await;
    let face = server.node_face.expect("a node face");
    let err = RemoteNode::connect(face, b"another secret")
        .await
        .err()
        .expect("refused");
    assert!(err.to_string().contains("not of the cluster secret"), "{err}");
    // An agent call without a signature never reaches the agent.
    let plain = reqwest_like_get(face, &format!("/node/v1/vms/{id}/agent/health")).await;
    assert_eq!(plain, 401);
    // With the secret: the node's report names the VM.
    let node = RemoteNode::connect(face, NODE_SECRET).await.unwrap();
    assert!(node.vm_ids().contains(&id));
    server.delete(&id).await;
    server.stop().await;
}

/// One HTTP/2 GET without credentials; its status.
async fn reqwest_like_get(addr: std::net::SocketAddr, path: &str) -> u16 {
    signed_get(addr, path, &[]).await.0
}

type Answer = (u16, hyper::HeaderMap, bytes::Bytes);

/// One HTTP/2 GET with `headers`; its status and headers.
async fn signed_get(addr: std::net::SocketAddr, path: &str, headers: &[(&'static str, String)]) -> Answer {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let mut req = hyper::Request::get(format!("http://{addr}{path}"));
    for (name, value) in headers {
        req = req.header(*name, value);
    }
    let resp = send
        .send_request(req.body(http_body_util::Empty::<bytes::Bytes>::new()).unwrap())
        .await
        .unwrap();
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    (status, headers, body)
}

/// Through the face itself: a signed request passes once, at the node it is signed for, and
/// its reply proves the secret; replayed, re-targeted or moved to another route it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_face_refuses_replayed_and_retargeted_requests() {
    use airlock_server::nodes::wire;
    let tmp = fresh();
    let server = Server::start_over_node_face(tmp.path()).await;
    let id = server.running_sandbox().await;
    let face = server.node_face.expect("a node face");
    let empty = wire::body_digest(b"");
    let egress = format!("/node/v1/vms/{id}/egress");
    let signed = wire::sign_request(NODE_SECRET, "GET", &egress, &empty, "test-node");
    let (status, headers, body) = signed_get(face, &egress, &signed.headers).await;
    assert_eq!(status, 200);
    let digest = wire::body_digest(&body);
    assert_eq!(
        wire::verify_reply(NODE_SECRET, &signed.nonce, 200, &digest, &headers).as_deref(),
        Some("test-node"),
        "the reply is signed over the request's nonce"
    );
    assert_eq!(
        wire::verify_reply(NODE_SECRET, "another nonce", 200, &digest, &headers),
        None
    );
    // The same request again: a replay.
    assert_eq!(signed_get(face, &egress, &signed.headers).await.0, 401);
    // Signed for another node: refused here (and at that node, by its nonce set only if seen).
    let other = wire::sign_request(NODE_SECRET, "GET", &egress, &empty, "other-node");
    assert_eq!(signed_get(face, &egress, &other.headers).await.0, 401);
    // For any node: only a report takes it.
    let any = wire::sign_request(NODE_SECRET, "GET", &egress, &empty, wire::ANY_NODE);
    assert_eq!(signed_get(face, &egress, &any.headers).await.0, 401);
    let report = wire::sign_request(NODE_SECRET, "GET", "/node/v1/report", &empty, wire::ANY_NODE);
    let (status, headers, _) = signed_get(face, "/node/v1/report", &report.headers).await;
    assert_eq!(status, 200);
    assert_eq!(headers.get(wire::NAME_HEADER).unwrap(), "test-node");
    // A signature moved to another route (another VM's egress).
    let fresh_one = wire::sign_request(NODE_SECRET, "GET", &egress, &empty, "test-node");
    assert_eq!(
        signed_get(face, "/node/v1/vms/sb-other/egress", &fresh_one.headers)
            .await
            .0,
        401
    );
    // The agent route: its body unsigned, the rest signed; passes once.
    let health = format!("/node/v1/vms/{id}/agent/health");
    let agent = wire::sign_request(NODE_SECRET, "GET", &health, wire::UNSIGNED, "test-node");
    let (status, headers, _) = signed_get(face, &health, &agent.headers).await;
    assert_eq!(status, 200);
    assert_eq!(
        wire::verify_reply(NODE_SECRET, &agent.nonce, 200, wire::UNSIGNED, &headers).as_deref(),
        Some("test-node")
    );
    assert_eq!(signed_get(face, &health, &agent.headers).await.0, 401);
    // Elsewhere a body cannot be declared unsigned.
    let unsigned = wire::sign_request(NODE_SECRET, "GET", &egress, wire::UNSIGNED, "test-node");
    assert_eq!(signed_get(face, &egress, &unsigned.headers).await.0, 401);
    server.delete(&id).await;
    server.stop().await;
}

/// A node that does not answer is `Unreachable` (503 at the doors), not a failure of the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_does_not_answer_is_unreachable() {
    let gone = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let err = RemoteNode::connect(gone, NODE_SECRET)
        .await
        .err()
        .expect("nothing listens");
    assert!(
        matches!(err, airlock_server::core::NodeError::Unreachable(_)),
        "{err:?}"
    );
    let core = airlock_server::core::CoreError::from(err);
    assert_eq!(core.code().code, "node_unreachable");
    assert_eq!(core.code().status, 503);
}

/// Over mutual TLS: a caller whose certificate is not of the cluster's CA is refused by the
/// node, and a node whose certificate is not is refused by the replica, whatever secret each
/// holds; a plain HTTP caller gets no answer from a TLS face. The cluster's own pair talks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_or_caller_without_the_clusters_certificate_is_refused_both_ways() {
    use super::common::cluster::{node_link, pki, ClusterNode};
    use airlock_server::nodes::{tls, NodeLink};
    let tmp = fresh();
    let pki = pki();
    let node = ClusterNode::start(&tmp.path().join("node"), Capacity::default(), 0).await;
    // The cluster's certificates: the report, and an agent connection.
    let ok = RemoteNode::connect(node.addr, node_link()).await.unwrap();
    assert_eq!(ok.reported_name(), "test-node");
    // A stranger's client certificate, though it trusts the cluster's CA and has the secret.
    let stranger = tls::client_config(&pki.files("stranger", "replica", "cluster")).unwrap();
    let err = RemoteNode::connect(node.addr, NodeLink::new(NODE_SECRET, Some(stranger)))
        .await
        .err()
        .expect("the node refuses a stranger's certificate");
    eprintln!("refused: {err}");
    assert!(
        matches!(err, airlock_server::core::NodeError::Unreachable(_)),
        "{err:?}"
    );
    // The cluster's own replica certificate, but the node's is a stranger's: the replica refuses.
    let impostor = ClusterNode::start_tls(
        &tmp.path().join("impostor"),
        Capacity::default(),
        tls::server_config(&pki.files("stranger", "node", "cluster")).unwrap(),
    )
    .await;
    let err = RemoteNode::connect(impostor.addr, node_link())
        .await
        .err()
        .expect("the replica refuses a node whose certificate is a stranger's");
    eprintln!("refused: {err}");
    assert!(
        matches!(err, airlock_server::core::NodeError::Unreachable(_)),
        "{err:?}"
    );
    // A node's own certificate (serverAuth only) does not make it a caller.
    let as_node = tls::client_config(&pki.files("cluster", "node", "cluster")).unwrap();
    let err = RemoteNode::connect(node.addr, NodeLink::new(NODE_SECRET, Some(as_node)))
        .await
        .err()
        .expect("a node's certificate is no client's");
    eprintln!("refused: {err}");
    assert!(
        matches!(err, airlock_server::core::NodeError::Unreachable(_)),
        "{err:?}"
    );
    // Plain HTTP to the TLS face.
    let err = RemoteNode::connect(node.addr, NODE_SECRET)
        .await
        .err()
        .expect("plain HTTP gets no answer");
    eprintln!("refused: {err}");
    assert!(
        matches!(err, airlock_server::core::NodeError::Unreachable(_)),
        "{err:?}"
    );
}
