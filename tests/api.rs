//! The native API over HTTP, against a real `airlock serve` process with real VMs.
//!
//! One server (and one read-only sandbox) is shared by the tests: `server()` and `shared()`
//! here, with the data dirs of their own that some tests start servers on, and the custom `main`
//! (libtest-mimic) that lists the tests and cleans up after them. The tests are in `api/` by
//! concern (sessions, lifecycle, snapshots, ports, errors, servers, cli, templates, images, volumes, metrics); the harness (`Server`)
//! is `common/`, shared with `hostile.rs`.

#[path = "api/cli.rs"]
mod cli;
mod common;
#[path = "api/errors.rs"]
mod errors;
#[path = "api/images.rs"]
mod images;
#[path = "api/lifecycle.rs"]
mod lifecycle;
#[path = "api/metrics.rs"]
mod metrics;
#[path = "api/ports.rs"]
mod ports;
#[path = "api/servers.rs"]
mod servers;
#[path = "api/sessions.rs"]
mod sessions;
#[path = "api/snapshots.rs"]
mod snapshots;
#[path = "api/templates.rs"]
mod templates;
#[path = "api/volumes.rs"]
mod volumes;

use base64::Engine as _;
use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

static SERVER: OnceLock<Server> = OnceLock::new();

fn server() -> &'static Server {
    SERVER.get_or_init(|| {
        let data = test_data_dir();
        build_template(&data, "seed");
        Server::start(&data)
    })
}

/// One sandbox the read-only tests share.
fn shared() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| server().create(json!({ "template": "seed", "timeout": "30m", "metadata": { "suite": "api" } })))
}

/// An empty data dir of its own (`<shared>-<suffix>`) with the shared one's templates, as hard
/// links (templates are immutable), so a server on it starts without building `seed`.
fn own_data_dir(suffix: &str) -> PathBuf {
    server(); // the shared data dir has the template built
    data_dir_with_templates(suffix)
}

fn main() {
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let args = libtest_mimic::Arguments::from_args();
    let t = trial;
    let tests = vec![
        t(
            "walkthrough_create_session_stream_delete",
            sessions::walkthrough_create_session_stream_delete,
        ),
        t(
            "failing_command_reports_its_exit_code_and_stderr",
            sessions::failing_command_reports_its_exit_code_and_stderr,
        ),
        t(
            "sse_resumes_with_last_event_id_without_loss_or_duplicates",
            sessions::sse_resumes_with_last_event_id_without_loss_or_duplicates,
        ),
        t("stdin_signal_and_files", sessions::stdin_signal_and_files),
        t(
            "idempotent_create_returns_the_same_operation",
            lifecycle::idempotent_create_returns_the_same_operation,
        ),
        t(
            "pause_freezes_in_memory_and_resume_continues",
            lifecycle::pause_freezes_in_memory_and_resume_continues,
        ),
        t(
            "timeout_suspends_and_a_request_resumes",
            lifecycle::timeout_suspends_and_a_request_resumes,
        ),
        t(
            "warm_pool_claims_are_fresh_and_refilled",
            servers::warm_pool_claims_are_fresh_and_refilled,
        ),
        t(
            "snapshots_and_forks_start_from_a_running_sandbox",
            snapshots::snapshots_and_forks_start_from_a_running_sandbox,
        ),
        t(
            "ports_and_envd_are_reachable_by_host_name",
            ports::ports_and_envd_are_reachable_by_host_name,
        ),
        t(
            "credentials_never_reach_a_sandbox_port",
            ports::credentials_never_reach_a_sandbox_port,
        ),
        t(
            "e2b_unsupported_create_options_are_refused_by_name",
            errors::e2b_unsupported_create_options_are_refused_by_name,
        ),
        t(
            "timeout_expiry_deletes_the_sandbox",
            lifecycle::timeout_expiry_deletes_the_sandbox,
        ),
        t(
            "list_filters_by_state_and_metadata_with_paging",
            lifecycle::list_filters_by_state_and_metadata_with_paging,
        ),
        t(
            "bad_input_gets_clear_4xx_errors",
            errors::bad_input_gets_clear_4xx_errors,
        ),
        t(
            "unknown_ids_are_404_and_keys_are_checked",
            errors::unknown_ids_are_404_and_keys_are_checked,
        ),
        t("cli_run_exec_and_python_example", cli::cli_run_exec_and_python_example),
        t(
            "serve_refuses_unusable_tls_files",
            cli::serve_refuses_unusable_tls_files,
        ),
        t(
            "creates_restore_from_a_base_snapshot_through_the_api",
            snapshots::creates_restore_from_a_base_snapshot_through_the_api,
        ),
        t(
            "server_killed_mid_create_recovers_and_reattaches",
            servers::server_killed_mid_create_recovers_and_reattaches,
        ),
        t(
            "missing_sandbox_has_one_code_on_every_route",
            errors::missing_sandbox_has_one_code_on_every_route,
        ),
        t(
            "env_names_are_refused_alike_by_both_doors",
            errors::env_names_are_refused_alike_by_both_doors,
        ),
        t(
            "a_vm_that_dies_is_failed_and_frees_its_slot",
            lifecycle::a_vm_that_dies_is_failed_and_frees_its_slot,
        ),
        t(
            "a_replica_drives_a_node_in_its_own_process",
            servers::a_replica_drives_a_node_in_its_own_process,
        ),
        t(
            "a_cold_node_pulls_seed_from_object_storage",
            servers::a_cold_node_pulls_seed_from_object_storage,
        ),
        t(
            "a_draining_nodes_sandboxes_move_to_another_node",
            servers::a_draining_nodes_sandboxes_move_to_another_node,
        ),
        t(
            "quota_is_exact_under_concurrent_creates_over_both_doors",
            servers::quota_is_exact_under_concurrent_creates_over_both_doors,
        ),
        t(
            "a_first_start_prints_a_generated_console_password_once",
            cli::a_first_start_prints_a_generated_console_password_once,
        ),
        t(
            "admin_cli_manages_tenants_keys_quotas_and_policies",
            cli::admin_cli_manages_tenants_keys_quotas_and_policies,
        ),
        t(
            "a_dockerfile_builds_a_template_that_starts_restored",
            templates::a_dockerfile_builds_a_template_that_starts_restored,
        ),
        t(
            "a_failing_step_names_itself_and_bad_definitions_are_refused",
            templates::a_failing_step_names_itself_and_bad_definitions_are_refused,
        ),
        t(
            "a_denied_host_is_named_and_a_build_over_quota_is_refused",
            templates::a_denied_host_is_named_and_a_build_over_quota_is_refused,
        ),
        t(
            "a_server_killed_mid_build_leaves_nothing_behind",
            templates::a_server_killed_mid_build_leaves_nothing_behind,
        ),
        t(
            "the_cli_builds_lists_and_removes_a_template",
            templates::the_cli_builds_lists_and_removes_a_template,
        ),
        t(
            "a_changed_copy_reuses_every_step_before_it",
            templates::a_changed_copy_reuses_every_step_before_it,
        ),
        t(
            "a_dockerfile_from_a_local_registry_builds",
            templates::a_dockerfile_from_a_local_registry_builds,
        ),
        t(
            "a_hostile_image_leaves_the_host_untouched",
            images::a_hostile_image_leaves_the_host_untouched,
        ),
        t(
            "a_cancelled_build_leaves_nothing_behind",
            templates::a_cancelled_build_leaves_nothing_behind,
        ),
        t(
            "a_deleted_tenant_leaves_no_build_behind",
            templates::a_deleted_tenant_leaves_no_build_behind,
        ),
        // Late: by then `seed`'s base snapshot is built, which its readers' creates restore.
        t(
            "volumes_keep_a_workspace_across_sandboxes_and_to_their_tenant",
            volumes::volumes_keep_a_workspace_across_sandboxes_and_to_their_tenant,
        ),
        t(
            "a_volume_survives_a_server_killed_mid_write",
            volumes::a_volume_survives_a_server_killed_mid_write,
        ),
        t(
            "prometheus_scrapes_creates_sessions_and_egress_denials",
            metrics::prometheus_scrapes_creates_sessions_and_egress_denials,
        ),
    ];
    let conclusion = libtest_mimic::run(&args, tests);
    cleanup();
    reap_orphans();
    conclusion.exit();
}

/// Delete every sandbox the shared server knows, then stop it: VMs outlive servers by design.
fn cleanup() {
    let Some(s) = SERVER.get() else { return };
    let (_, list) = s.call("GET", "/v1/sandboxes?limit=100", None);
    for sb in list["sandboxes"].as_array().into_iter().flatten() {
        // One already on its way out (a cancelled build's sandbox) may be gone by now.
        let (status, r) = s.call("DELETE", &format!("/v1/sandboxes/{}", sb["id"].as_str().unwrap()), None);
        if status == 202 {
            s.wait_op(r["operation"]["id"].as_str().unwrap());
        } else {
            assert_eq!(status, 404, "{r}");
        }
    }
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    std::thread::sleep(Duration::from_millis(300));
    reap_orphans();
}
