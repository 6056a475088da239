//! `airlock`: the command-line front of the airlock runtime.

use airlock_runtime::datadir::DEFAULT_DATA_DIR;
use airlock_runtime::template::{BuildOptions, TemplateStore, SEED};
use airlock_runtime::{datadir::DataDir, Runtime, RuntimeOptions};
use clap::{Parser, Subcommand};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "airlock", version, about = "Self-hosted microVM sandboxes for AI agents")]
struct Cli {
    /// Where templates, sandboxes and the store live.
    #[arg(long, global = true, env = "AIRLOCK_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build and list templates.
    Template {
        #[command(subcommand)]
        command: TemplateCommand,
    },
    /// Check the host and report what sandboxes would run with (QEMU, accelerator, templates).
    Doctor,
}

#[derive(Subcommand)]
enum TemplateCommand {
    /// Build a template (only `seed` today); skipped when its recipe is unchanged.
    Build {
        #[arg(default_value = SEED)]
        name: String,
        /// Debian mirror for debootstrap (default: the host's apt sources).
        #[arg(long, env = "AIRLOCK_DEBIAN_MIRROR")]
        mirror: Option<String>,
        /// Statically linked guest agent (default: found next to this binary).
        #[arg(long, env = "AIRLOCK_AGENT_BIN")]
        agent: Option<PathBuf>,
        /// Rebuild even when the recipe is unchanged.
        #[arg(long)]
        force: bool,
    },
    /// List templates with their digests.
    Ls,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AIRLOCK_LOG").unwrap_or_else(|_| "warn,airlock=info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("airlock: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Template { command: TemplateCommand::Build { name, mirror, agent, force } } => {
            if name != SEED {
                anyhow::bail!("only the `seed` template can be built today (got {name:?})");
            }
            let store = TemplateStore::new(DataDir::open(&cli.data_dir)?);
            let opts = BuildOptions { mirror, agent, progress: std::io::stderr().is_terminal(), force };
            let (t, _built) = tokio::task::spawn_blocking(move || store.build_seed(&opts)).await??;
            println!("{} {}", t.manifest.name, t.manifest.digest);
        }
        Command::Template { command: TemplateCommand::Ls } => {
            let store = TemplateStore::new(DataDir::open(&cli.data_dir)?);
            println!("{:<12} {:<73} {:<24} {:>9}  BUILT", "NAME", "DIGEST", "KERNEL", "SIZE");
            for m in store.list() {
                println!(
                    "{:<12} {:<73} {:<24} {:>6}MiB  {}",
                    m.name,
                    m.digest,
                    m.kernel_version,
                    m.size_bytes >> 20,
                    m.built_at
                );
            }
        }
        Command::Doctor => {
            let rt = Runtime::open(RuntimeOptions::new(&cli.data_dir)).await?;
            println!("data dir:  {}", rt.data_dir().root().display());
            println!("runtime:   {}", rt.runtime_name());
            println!("accel:     {}", rt.accel().await);
            for m in rt.templates().list() {
                println!("template:  {} {}", m.name, m.digest);
            }
        }
    }
    Ok(())
}
