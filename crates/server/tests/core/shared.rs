//! What nodes share through object storage (issue 25): a template one node built starts on
//! another, which pulls it (every file checked against its digest) at its first create of it.
//! Snapshots shared so start on any node of their machine: that needs a VM image, so the real-VM
//! drain test (`tests/api`) shows it.

use super::common::*;
use super::runs::vm_request;
use airlock_runtime::datadir::DataDir;
use airlock_runtime::fake;
use airlock_runtime::objects::Objects;
use airlock_runtime::template::TemplateStore;
use airlock_server::core::NodeError;
use airlock_server::nodes::{LocalNode, Nodes, VmRequest};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_lacking_a_template_pulls_it_at_its_first_create() {
    let shared = tempfile::tempdir().unwrap();
    let objects = Objects::local(shared.path()).unwrap();
    // Node A built `extra` and put it in object storage.
    let a = fresh();
    let built = fake::install_template(a.path(), "extra").unwrap();
    let a_templates = TemplateStore::new(DataDir::open(a.path()).unwrap());
    objects
        .push_template(&a_templates.resolve("extra").unwrap())
        .await
        .unwrap();
    assert_eq!(
        objects.template_digest("extra").await.unwrap(),
        Some(built.digest.clone())
    );

    // Node B has only `seed`.
    let b = fresh();
    let runtime = open_runtime(b.path(), false).await;
    let node = LocalNode::new(runtime.clone(), None).with_objects(objects.clone());
    assert!(node.template("extra").is_none());
    let vm = VmRequest {
        template: "extra".into(),
        ..vm_request("shared000001")
    };
    node.create(&vm).await.unwrap();
    assert_eq!(node.template("extra").map(|t| t.digest), Some(built.digest));
    node.delete(&vm.id, None).await.unwrap();

    // A template no node shared is unknown, as before; so is a name that is no reference.
    for missing in ["nope", "Not A Name!"] {
        let vm = VmRequest {
            template: missing.into(),
            ..vm_request("shared000002")
        };
        let refused = node.create(&vm).await;
        assert!(
            matches!(refused, Err(NodeError::UnknownTemplate(_))),
            "{missing}: {refused:?}"
        );
    }
    assert!(fake::live_vms(b.path()).is_empty());
}
