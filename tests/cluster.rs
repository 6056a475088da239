//! Many hosts with real processes (issue 25): Postgres, an S3 server, two `airlock serve`
//! replicas over them and three `airlock node`s, each in a network namespace of its own on a
//! fabric bridge, running real QEMU VMs (`cluster/harness.rs`). The checks (`cluster/checks.rs`)
//! share the one cluster and run one at a time, in order: they kill and cut parts of it. The
//! custom `main` ends the cluster when they are done, failed or not.
//!
//! The same behaviours against in-process nodes with the fake VMM (many more cases, in
//! seconds) are `crates/server/tests/core/cluster.rs`.

#[path = "cluster/checks.rs"]
mod checks;
mod common;
#[path = "cluster/harness.rs"]
mod harness;
#[path = "../crates/server/tests/pg_cluster/mod.rs"]
mod pg_cluster;

use common::trial;

fn main() {
    // QEMUs whose node was killed re-parent to this process: it collects them.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let mut args = libtest_mimic::Arguments::from_args();
    args.test_threads = Some(1);
    let t = trial;
    let trials = vec![
        t(
            "1_creates_spread_over_the_nodes_and_the_next_is_refused_with_every_reason",
            checks::creates_spread_over_the_nodes_and_the_next_is_refused_with_every_reason,
        ),
        t(
            "2_a_sandbox_on_the_third_node_answers_alike_through_either_replica",
            checks::a_sandbox_on_the_third_node_answers_alike_through_either_replica,
        ),
        t(
            "3_two_hundred_operations_with_a_replica_killed_mid_burst_each_run_once",
            checks::two_hundred_operations_with_a_replica_killed_mid_burst_each_run_once,
        ),
        t(
            "4_a_killed_node_re_adopts_and_a_cut_off_one_loses_its_sandbox",
            checks::a_killed_node_re_adopts_and_a_cut_off_one_loses_its_sandbox,
        ),
        t(
            "7_a_node_ends_an_expired_sandbox_while_no_replica_runs",
            checks::a_node_ends_an_expired_sandbox_while_no_replica_runs,
        ),
    ];
    let conclusion = libtest_mimic::run(&args, trials);
    harness::stop(!conclusion.has_failed());
    common::reap_orphans();
    conclusion.exit();
}
