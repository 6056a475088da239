//! The core over a node's HTTP face (`nodes::serve` + `RemoteNode`, issue 25's first piece):
//! the same lifecycle, sessions, files and exits as over the in-process node, every call and
//! every agent call crossing the node's face with its token.

use super::common::*;
use airlock_runtime::fake;
use airlock_server::nodes::{Nodes, RemoteNode};
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

/// A node answers only calls that carry a token of its cluster secret.
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
    assert!(err.to_string().contains("a valid node token is required"), "{err}");
    // An agent call without a token never reaches the agent.
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
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get(format!("http://{addr}{path}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    send.send_request(req).await.unwrap().status().as_u16()
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
