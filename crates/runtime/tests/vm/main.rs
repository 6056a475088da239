//! Real-VM tests of the runtime: every test here boots or uses a QEMU microVM (TCG on hosts
//! without usable KVM) and talks to the guest agent over the real channel.
//!
//! A custom main (libtest-mimic, same CLI and output as libtest) so the sandboxes the tests
//! share are deleted when the run ends: VMs outlive the process that started them by design.
//!
//! One binary, split by concern (`processes`, `files`, `jail`, `lifecycle`, `snapshots`), so the
//! booted sandbox they share (`common::shared`) boots once per run.

#[path = "../common.rs"]
mod common;
mod files;
mod jail;
mod lifecycle;
mod processes;
mod snapshots;
mod volumes;

use common::*;
use libtest_mimic::Trial;

fn catch(f: fn()) -> Result<(), libtest_mimic::Failed> {
    f();
    Ok(())
}

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let tests = vec![
        Trial::test("echo_prints_and_exits_zero", || {
            catch(processes::echo_prints_and_exits_zero)
        }),
        Trial::test(
            "creates_restore_from_a_base_snapshot_with_an_identity_of_their_own",
            || catch(snapshots::creates_restore_from_a_base_snapshot_with_an_identity_of_their_own),
        ),
        Trial::test("nonzero_exit_codes_are_reported", || {
            catch(processes::nonzero_exit_codes_are_reported)
        }),
        Trial::test("stderr_is_separate_from_stdout", || {
            catch(processes::stderr_is_separate_from_stdout)
        }),
        Trial::test("five_mib_of_stdout_arrives_complete_and_in_order", || {
            catch(processes::five_mib_of_stdout_arrives_complete_and_in_order)
        }),
        Trial::test("stdin_round_trips_through_cat", || {
            catch(processes::stdin_round_trips_through_cat)
        }),
        Trial::test("timeout_kills_the_process_and_says_so", || {
            catch(processes::timeout_kills_the_process_and_says_so)
        }),
        Trial::test("sigterm_and_sigkill_reach_the_process", || {
            catch(processes::sigterm_and_sigkill_reach_the_process)
        }),
        Trial::test("cwd_env_and_user_are_honoured", || {
            catch(processes::cwd_env_and_user_are_honoured)
        }),
        Trial::test("host_written_binary_file_reads_back_exactly", || {
            catch(files::host_written_binary_file_reads_back_exactly)
        }),
        Trial::test("guest_written_file_is_read_by_the_host", || {
            catch(files::guest_written_file_is_read_by_the_host)
        }),
        Trial::test("file_operations_stat_list_mkdir_rename_remove", || {
            catch(files::file_operations_stat_list_mkdir_rename_remove)
        }),
        Trial::test("watch_reports_create_write_rename_remove_recursively", || {
            catch(files::watch_reports_create_write_rename_remove_recursively)
        }),
        Trial::test("pty_runs_a_shell_and_resizes", || {
            catch(processes::pty_runs_a_shell_and_resizes)
        }),
        Trial::test("processes_can_be_listed_and_reconnected_by_id", || {
            catch(processes::processes_can_be_listed_and_reconnected_by_id)
        }),
        Trial::test("qemu_runs_jailed", || catch(jail::qemu_runs_jailed)),
        Trial::test("a_volume_outlives_its_sandboxes_and_keeps_to_itself", || {
            catch(volumes::a_volume_outlives_its_sandboxes_and_keeps_to_itself)
        }),
        Trial::test("qemu_has_an_empty_network_namespace_of_its_own", || {
            catch(jail::qemu_has_an_empty_network_namespace_of_its_own)
        }),
        Trial::test("metrics_and_health_report_the_guest", || {
            catch(lifecycle::metrics_and_health_report_the_guest)
        }),
        Trial::test("sandboxes_from_one_template_are_isolated", || {
            catch(lifecycle::sandboxes_from_one_template_are_isolated)
        }),
        Trial::test("delete_leaves_nothing_behind", || {
            catch(lifecycle::delete_leaves_nothing_behind)
        }),
        Trial::test(
            "sandboxes_from_a_saved_image_have_its_processes_and_files_and_lives_of_their_own",
            || catch(snapshots::sandboxes_from_a_saved_image_have_its_processes_and_files_and_lives_of_their_own),
        ),
        Trial::test("killed_vmm_is_cleaned_up", || {
            catch(lifecycle::killed_vmm_is_cleaned_up)
        }),
        Trial::test("resources_are_honoured_and_validated", || {
            catch(lifecycle::resources_are_honoured_and_validated)
        }),
    ];
    let booting = !args.list
        && tests
            .iter()
            .any(|t| args.skip.iter().all(|s| !t.name().contains(s.as_str())));
    if booting {
        // Sandboxes a crashed earlier run left behind are adopted by the runtime: remove them.
        remove_all_sandboxes();
    }
    let conclusion = libtest_mimic::run(&args, tests);
    if booting {
        remove_all_sandboxes();
    }
    conclusion.exit();
}

fn remove_all_sandboxes() {
    let rt = runtime();
    for sb in rt.list() {
        let _ = block_on(rt.delete(sb.id()));
    }
    // A base snapshot build still running would leave its network behind with the process.
    block_on(rt.stop_base_snapshot_builds());
}
