//! Discovery on Kubernetes (`serve --nodes-kube`, `nodes/kube.rs`) against a mocked API server
//! on loopback (no cluster can run here): the kube-rs client lists the node DaemonSet's pods by
//! label selector and reads their nodes, exactly as it would from a kube-apiserver.

use super::cluster::{node_of, replica_config, FITS_FOUR};
use super::common::cluster::{node_link, ClusterNode};
use super::common::*;
use airlock_server::nodes::discovery::{Discovery, Listed, Source};
use airlock_server::nodes::kube::KubeNodes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const NAMESPACE: &str = "airlock";
const SELECTOR: &str = "app.kubernetes.io/component=node";

/// The API's state: the pods listed, and the Kubernetes nodes that are cordoned.
#[derive(Default)]
struct Api {
    pods: Vec<Value>,
    cordoned: Vec<String>,
}

type Shared = Arc<Mutex<Api>>;

fn pod(name: &str, ip: &str, host: &str, ready: bool, deleting: bool) -> Value {
    let mut metadata =
        json!({ "name": name, "namespace": NAMESPACE, "labels": { "app.kubernetes.io/component": "node" } });
    if deleting {
        metadata["deletionTimestamp"] = json!("2026-12-04T07:00:00Z");
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": { "nodeName": host, "containers": [{ "name": "node", "image": "airlock" }] },
        "status": {
            "podIP": ip,
            "conditions": [{ "type": "Ready", "status": if ready { "True" } else { "False" } }]
        }
    })
}

async fn list_pods(
    State(api): State<Shared>,
    Path(namespace): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> axum::response::Response {
    if namespace != NAMESPACE || q.get("labelSelector").map(String::as_str) != Some(SELECTOR) {
        return (StatusCode::BAD_REQUEST, "wrong namespace or selector").into_response();
    }
    let items = api.lock().unwrap().pods.clone();
    Json(json!({ "apiVersion": "v1", "kind": "PodList", "metadata": { "resourceVersion": "1" }, "items": items }))
        .into_response()
}

async fn get_node(State(api): State<Shared>, Path(name): Path<String>) -> axum::response::Response {
    let cordoned = api.lock().unwrap().cordoned.contains(&name);
    Json(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": name },
        "spec": { "unschedulable": cordoned }
    }))
    .into_response()
}

/// The mocked API on a free loopback port, and a kube-rs client of it in [`NAMESPACE`].
async fn mock_api() -> (Shared, kube::Client) {
    let api: Shared = Default::default();
    let app = axum::Router::new()
        .route("/api/v1/namespaces/{namespace}/pods", axum::routing::get(list_pods))
        .route("/api/v1/nodes/{name}", axum::routing::get(get_node))
        .with_state(api.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let mut config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    config.default_namespace = NAMESPACE.into();
    (api, kube::Client::try_from(config).unwrap())
}

#[tokio::test]
async fn ready_node_pods_are_listed_with_their_hosts_cordon() {
    let (api, client) = mock_api().await;
    {
        let mut a = api.lock().unwrap();
        a.pods = vec![
            pod("airlock-node-a1b2c", "10.0.0.1", "k1", true, false),
            pod("airlock-node-d3e4f", "10.0.0.2", "k2", true, false),
            pod("airlock-node-g5h6i", "10.0.0.3", "k3", false, false),
            pod("airlock-node-j7k8l", "10.0.0.4", "k4", true, true),
        ];
        a.cordoned = vec!["k2".into()];
    }
    let kube = KubeNodes::new(client.clone(), NAMESPACE, SELECTOR, 7701);
    let listed = kube.list().await.unwrap();
    assert_eq!(
        listed,
        vec![
            Listed {
                addr: "10.0.0.1:7701".parse().unwrap(),
                cordoned: false
            },
            Listed {
                addr: "10.0.0.2:7701".parse().unwrap(),
                cordoned: true
            },
        ],
        "not Ready and being deleted are left out"
    );
    // A selector the API refuses is an error, never an empty cluster.
    let wrong = KubeNodes::new(client, NAMESPACE, "app=other", 7701);
    assert!(wrong.list().await.is_err());
}

/// A node pod found through the API joins under its reported name and takes sandboxes; once
/// its host is cordoned it takes none and is draining (its sandboxes are to be taken off it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_on_a_cordoned_host_takes_no_sandbox_and_drains() {
    let (store_dir, dir) = (fresh(), fresh());
    let node = ClusterNode::start_named(dir.path(), FITS_FOUR, 0, "airlock-node-a1b2c").await;
    let (api, client) = mock_api().await;
    api.lock().unwrap().pods = vec![pod("airlock-node-a1b2c", "127.0.0.1", "k1", true, false)];
    let source = Source::Kube(Box::new(KubeNodes::new(client, NAMESPACE, SELECTOR, node.addr.port())));
    let replica = Server::start_replica(store_dir.path(), &[], None, replica_config()).await;
    let cluster = replica.cluster.clone().unwrap();
    let mut discovery = Discovery::default();
    discovery
        .round(&cluster, source.list().await.unwrap(), &node_link())
        .await;
    let id = replica.running_sandbox().await;
    assert_eq!(node_of(&replica, &id).await, "airlock-node-a1b2c");

    api.lock().unwrap().cordoned = vec!["k1".into()];
    discovery
        .round(&cluster, source.list().await.unwrap(), &node_link())
        .await;
    let m = replica.core().nodes().members().into_iter().next().unwrap();
    assert!(m.draining, "{m:?}");
    assert_eq!(m.refuses.as_deref(), Some("cordoned: its host is being drained"));
    let (status, body) = replica
        .v1(
            axum::http::Method::POST,
            "/sandboxes",
            Some(json!({ "template": "seed" })),
        )
        .await;
    assert_eq!(status, 503, "{body}");
    assert!(body["message"].as_str().unwrap().contains("cordoned"), "{body}");
    replica.assert_answers(&id).await;
    replica.stop().await;
}
