//! `airlock`: the command-line front of airlock: the server, template builds, and a client
//! of the HTTP API for sandboxes, commands and operations.

mod admin;
mod client;
mod daemons;
mod events;
mod templates;

use airlock_runtime::datadir::DEFAULT_DATA_DIR;
use airlock_runtime::template::{BuildOptions, TemplateStore, SEED};
use airlock_runtime::{datadir::DataDir, Runtime, RuntimeOptions};
use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use serde_json::json;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "airlock", version, about = "Self-hosted microVM sandboxes for AI agents")]
struct Cli {
    /// Where templates, sandboxes, the store and the credentials live.
    #[arg(long, global = true, env = "AIRLOCK_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

// `Serve` carries every server flag; the command line is parsed once, so its size costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run the API server (builds `seed` first if it is missing, unless its node is remote).
    Serve(daemons::ServeArgs),
    /// Run this host's node for API replicas on other hosts (`serve --node`): its VMs,
    /// networks and egress, served over HTTP/2 to callers with tokens of the cluster secret.
    Node(daemons::NodeArgs),
    /// Build and list templates.
    Template {
        #[command(subcommand)]
        command: TemplateCommand,
    },
    /// Create, list, inspect and delete sandboxes (through the server).
    Sandbox {
        #[command(subcommand)]
        command: SandboxCommand,
    },
    /// Run a command in a sandbox, stream its output, exit with its exit code.
    Exec {
        id: String,
        #[command(flatten)]
        opts: ExecOpts,
        #[arg(last = true, required = true)]
        argv: Vec<String>,
    },
    /// Create a sandbox, run one command in it, stream the output, delete the sandbox.
    Run {
        #[arg(long, default_value = SEED)]
        template: String,
        #[command(flatten)]
        opts: ExecOpts,
        #[arg(last = true, required = true)]
        argv: Vec<String>,
    },
    /// Create, list, inspect, grow and delete volumes: disks that outlive sandboxes
    /// (`sandbox create --volume NAME:/path`).
    Volume {
        #[command(subcommand)]
        command: VolumeCommand,
    },
    /// The tenant's sandbox lifecycle events (created, paused, killed, ...), newest first, or
    /// followed as they happen (`-f`).
    Events(events::EventsArgs),
    /// Register, list and remove webhooks: lifecycle events POSTed to a URL, signed.
    Webhook {
        #[command(subcommand)]
        command: events::WebhookCommand,
    },
    /// Inspect operations.
    Ops {
        #[command(subcommand)]
        command: OpsCommand,
    },
    /// Sign in as the platform account (root@local) for the admin commands (`tenant`, `key`, `pool`):
    /// the password from AIRLOCK_CONSOLE_PASSWORD, else the first line of stdin. The admin
    /// token (valid for an hour) goes to <data-dir>/admin-token.
    Login,
    /// Manage a tenant's API keys (admin; through the API).
    Key {
        #[command(subcommand)]
        command: admin::KeyCommand,
    },
    /// Mint, list and revoke the tokens Prometheus presents to read `GET /metrics` (admin;
    /// through the API).
    ScrapeToken {
        #[command(subcommand)]
        command: admin::ScrapeTokenCommand,
    },
    /// Manage tenants, their quotas and egress policies (admin; through the API).
    Tenant {
        #[command(subcommand)]
        command: TenantCommand,
    },
    /// Size and list warm pools: VMs kept ready per template and shape for creates to claim
    /// (admin; through the API).
    Pool {
        #[command(subcommand)]
        command: PoolCommand,
    },
    /// The nodes as the server sees them: each one's state (ready, draining, refusing with its
    /// reason, unreachable), machine and capacity (admin; through the API; JSON).
    Nodes,
    /// Check the host and report what sandboxes would run with (QEMU, accelerator, isolation,
    /// templates).
    Doctor,
}

/// `TEMPLATE=COUNT` of `--warm-pool`.

#[derive(clap::Args)]
struct ExecOpts {
    /// User to run as (default `user`).
    #[arg(long)]
    user: Option<String>,
    #[arg(long)]
    cwd: Option<String>,
    /// KEY=VALUE, repeatable.
    #[arg(long = "env")]
    env: Vec<String>,
    /// Kill the command after this long, e.g. 30s.
    #[arg(long)]
    timeout: Option<String>,
}

impl ExecOpts {
    fn session_body(&self, argv: &[String]) -> anyhow::Result<serde_json::Value> {
        client::session_body(
            argv,
            self.user.as_deref(),
            self.cwd.as_deref(),
            &self.env,
            self.timeout.as_deref(),
        )
    }
}

#[derive(Subcommand)]
enum TemplateCommand {
    /// Build a platform template here (`seed`, `base`, `code-interpreter-v1`; skipped when its
    /// recipe is unchanged), or with `-t name[:tag]` your own from a Dockerfile, on the server in
    /// a microVM: `airlock template build -f Dockerfile -t app:v1 DIR`.
    Build {
        /// The platform template to build, or with `-t` the build context (default `.`).
        target: Option<String>,
        /// Your template's name (`name[:tag]`): build it from a Dockerfile on the server.
        #[arg(short = 't', long = "tag")]
        tag: Option<String>,
        /// The Dockerfile (default: `Dockerfile` in the context).
        #[arg(short = 'f', long = "file")]
        file: Option<PathBuf>,
        /// Run every step again (no cached result).
        #[arg(long)]
        no_cache: bool,
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
    /// List templates with their digests: the server's and yours (the local store when no
    /// server answers).
    Ls,
    /// Delete your template (every tag); sandboxes made from it run on.
    Rm { name: String },
    /// Print a build's log (following it until it ends).
    Logs { build: String },
    /// Cancel a build: it ends with nothing of it left running or saved.
    Cancel { build: String },
}

#[derive(Subcommand)]
enum SandboxCommand {
    /// Create a sandbox and wait until it runs; prints its id.
    Create {
        #[arg(long, default_value = SEED)]
        template: String,
        #[command(flatten)]
        shape: ShapeOpts,
        /// Lifetime, e.g. 10m.
        #[arg(long)]
        timeout: Option<String>,
        /// KEY=VALUE labels, repeatable.
        #[arg(long = "metadata")]
        metadata: Vec<String>,
        /// Return at once with the operation instead of waiting.
        #[arg(long)]
        no_wait: bool,
        /// Mount a volume: VOLUME:/path[:ro], repeatable.
        #[arg(long = "volume")]
        volumes: Vec<String>,
    },
    /// List sandboxes.
    Ls {
        #[arg(long)]
        state: Option<String>,
    },
    /// Show one sandbox.
    Get { id: String },
    /// Delete a sandbox.
    Rm { id: String },
}

#[derive(Subcommand)]
enum VolumeCommand {
    /// Create a volume; prints it with its token (shown this once).
    Create {
        name: String,
        /// Size in MiB (default 1024; the disk is sparse).
        #[arg(long)]
        size_mib: Option<u64>,
    },
    /// List the tenant's volumes.
    Ls,
    /// Show one volume (id or name) and who mounts it.
    Get { volume: String },
    /// Grow a volume to SIZE_MIB.
    Resize { volume: String, size_mib: u64 },
    /// Delete a volume and its data (refused while a sandbox mounts it).
    Rm { volume: String },
}

#[derive(Subcommand)]
enum OpsCommand {
    /// Show one operation.
    Get { id: String },
}

/// A sandbox's shape; what is left out is the server's default.
#[derive(clap::Args)]
struct ShapeOpts {
    #[arg(long)]
    vcpu: Option<u32>,
    #[arg(long)]
    memory_mib: Option<u32>,
    #[arg(long)]
    disk_mib: Option<u32>,
}

impl ShapeOpts {
    fn spec(&self) -> airlock_server::model::ResourcesSpec {
        airlock_server::model::ResourcesSpec {
            vcpu: self.vcpu,
            memory_mib: self.memory_mib,
            disk_mib: self.disk_mib,
        }
    }
}

#[derive(Subcommand)]
enum PoolCommand {
    /// Keep SIZE VMs of TEMPLATE (with this shape) ready; 0 empties the pool.
    Set {
        template: String,
        size: usize,
        #[command(flatten)]
        shape: ShapeOpts,
    },
    /// The pools: size, ready and starting VMs, hits and misses (JSON).
    Ls,
}

#[derive(Subcommand)]
enum TenantCommand {
    /// Create a tenant (then `airlock key create --tenant NAME`).
    Create { name: String },
    /// List tenants.
    Ls,
    /// Show a tenant's limits in force and its usage.
    Get { name: String },
    /// Delete a tenant: its keys are revoked and its sandboxes deleted.
    Rm { name: String },
    /// A tenant's base egress policy: what every sandbox of the tenant may reach (with the
    /// sandbox's profiles), and what none may (over any profile).
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// A tenant's quotas: live sandboxes, their vcpu, memory and disk together, sessions per
    /// sandbox, creates per minute. A limit left unset is the server's default
    /// (`--max-sandboxes`, `--max-sessions`, `--max-creates-per-minute`, and `--tenant-share` of
    /// the node's budgets or `--max-vcpu`, `--max-memory-mib`, `--max-disk-mib`); the node's
    /// budgets always apply.
    Quota {
        #[command(subcommand)]
        command: QuotaCommand,
    },
}

#[derive(Subcommand)]
enum QuotaCommand {
    /// Print the limits set for the tenant (JSON; null: the server's default).
    Show {
        #[arg(long, default_value = "default")]
        tenant: String,
    },
    /// Replace the tenant's limits with exactly those given (none: the server's defaults).
    /// Live sandboxes stay; new creates and sessions are checked against them at once.
    Set {
        #[arg(long, default_value = "default")]
        tenant: String,
        #[arg(long)]
        sandboxes: Option<u32>,
        #[arg(long)]
        vcpu: Option<u64>,
        #[arg(long)]
        memory_mib: Option<u64>,
        #[arg(long)]
        disk_mib: Option<u64>,
        #[arg(long)]
        sessions_per_sandbox: Option<u32>,
        #[arg(long)]
        creates_per_minute: Option<u32>,
        #[arg(long)]
        volume_mib: Option<u64>,
    },
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Print the tenant's base egress policy (JSON).
    Show {
        #[arg(long, default_value = "default")]
        tenant: String,
    },
    /// Replace the tenant's base egress policy with exactly the entries given (none: allow
    /// nothing). Exact domains only (no wildcards). New sandboxes get it; live ones keep theirs.
    Set {
        #[arg(long, default_value = "default")]
        tenant: String,
        /// An exact domain to allow, repeatable.
        #[arg(long = "allow-domain")]
        allow_domain: Vec<String>,
        /// An exact domain to deny (beats any profile), repeatable.
        #[arg(long = "deny-domain")]
        deny_domain: Vec<String>,
        /// An IP address or CIDR to allow, repeatable.
        #[arg(long = "allow-cidr")]
        allow_cidr: Vec<String>,
        /// An IP address or CIDR to deny, repeatable.
        #[arg(long = "deny-cidr")]
        deny_cidr: Vec<String>,
    },
}

fn main() -> ExitCode {
    // The confined image unpacker (`template::confine`): before any thread exists.
    let mut args = std::env::args_os().skip(1);
    if args.next().as_deref() == Some(std::ffi::OsStr::new(airlock_runtime::template::UNPACK_ARG)) {
        let stage = PathBuf::from(args.next().unwrap_or_default());
        return ExitCode::from(airlock_runtime::template::unpack_child_main(&stage) as u8);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AIRLOCK_LOG")
                .unwrap_or_else(|_| "warn,airlock=info,airlock_runtime=info,airlock_server=info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("airlock: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Write `text` to `path`, readable by its owner only.
fn write_private(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

/// Signal number for a name like `SIGKILL` or `SIG40` (for the shell-style 128+n exit code); 0
/// for one that names none. Names come from the server's one signal table.
pub fn signal_number(name: &str) -> i32 {
    airlock_server::signals::number(name).unwrap_or(0)
}

pub(crate) fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> anyhow::Result<T> + Send + 'static) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f).await?
}

pub(crate) fn build_template(
    data_dir: &std::path::Path,
    name: String,
    opts: BuildOptions,
) -> impl std::future::Future<Output = anyhow::Result<()>> {
    let data_dir = data_dir.to_path_buf();
    blocking(move || {
        let store = TemplateStore::new(DataDir::open(&data_dir)?);
        let (t, _) = store.build(&name, &opts)?;
        println!("{} {}", t.manifest.name, t.manifest.digest);
        Ok(())
    })
}

async fn run(cli: Cli) -> anyhow::Result<u8> {
    let data_dir = cli.data_dir.clone();
    let client = || client::Client::from_env(&data_dir);
    match cli.command {
        Command::Serve(args) => args.run(cli.data_dir).await?,
        Command::Node(args) => args.run(cli.data_dir).await?,
        Command::Template {
            command:
                TemplateCommand::Build {
                    target,
                    tag,
                    file,
                    no_cache,
                    mirror,
                    agent,
                    force,
                },
        } => match tag {
            Some(tag) => {
                let dir = PathBuf::from(target.unwrap_or_else(|| ".".into()));
                let dockerfile = file.unwrap_or_else(|| dir.join("Dockerfile"));
                let c = client()?;
                tokio::task::spawn_blocking(move || templates::build(&c, &dockerfile, &dir, &tag, no_cache || force))
                    .await??;
            }
            None => {
                if file.is_some() || no_cache {
                    bail!("-f and --no-cache build your own template: name it with -t name[:tag]");
                }
                let opts = BuildOptions {
                    mirror,
                    agent,
                    progress: std::io::stderr().is_terminal(),
                    force,
                };
                build_template(&cli.data_dir, target.unwrap_or_else(|| SEED.into()), opts).await?;
            }
        },
        Command::Template {
            command: TemplateCommand::Rm { name },
        } => {
            client()?.json("DELETE", &format!("/v1/templates/{name}"), None)?;
            println!("deleted {name}");
        }
        Command::Template {
            command: TemplateCommand::Cancel { build },
        } => {
            let ended = client()?.json("DELETE", &format!("/v1/builds/{build}"), None)?;
            println!("{}", serde_json::to_string_pretty(&ended)?);
        }
        Command::Template {
            command: TemplateCommand::Logs { build },
        } => {
            let c = client()?;
            let end = tokio::task::spawn_blocking(move || templates::follow(&c, &build)).await??;
            println!("{}", serde_json::to_string_pretty(&end)?);
        }
        Command::Template {
            command: TemplateCommand::Ls,
        } => {
            if let Some(listed) = client().ok().map(|c| templates::list(&c)) {
                match listed {
                    Ok(()) => return Ok(0),
                    Err(e) => eprintln!("airlock: {e}; the templates built here:"),
                }
            }
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
        Command::Sandbox { command } => {
            let c = client()?;
            match command {
                SandboxCommand::Create {
                    template,
                    shape,
                    timeout,
                    metadata,
                    no_wait,
                    volumes,
                } => {
                    let mut meta = serde_json::Map::new();
                    for kv in &metadata {
                        let (k, v) = kv
                            .split_once('=')
                            .with_context(|| format!("--metadata takes KEY=VALUE, got {kv:?}"))?;
                        meta.insert(k.into(), json!(v));
                    }
                    let mut body = json!({ "template": template, "metadata": meta, "resources": shape.spec() });
                    if let Some(t) = timeout {
                        body["timeout"] = json!(t);
                    }
                    let mut mounts = Vec::new();
                    for v in &volumes {
                        let mut parts = v.splitn(3, ':');
                        let (Some(volume), Some(path)) = (parts.next(), parts.next()) else {
                            anyhow::bail!("--volume takes VOLUME:/path[:ro], got {v:?}");
                        };
                        let read_only = match parts.next() {
                            None | Some("rw") => false,
                            Some("ro") => true,
                            Some(other) => anyhow::bail!("--volume {v:?}: the mode is ro or rw, not {other:?}"),
                        };
                        mounts.push(json!({"volume": volume, "path": path, "read_only": read_only}));
                    }
                    if !mounts.is_empty() {
                        body["volumes"] = json!(mounts);
                    }
                    let id = blocking(move || c.create_sandbox(body, !no_wait)).await?;
                    println!("{id}");
                }
                SandboxCommand::Ls { state } => {
                    let path = match state {
                        Some(s) => format!("/v1/sandboxes?state={s}"),
                        None => "/v1/sandboxes".into(),
                    };
                    let list = blocking(move || c.json("GET", &path, None)).await?;
                    println!(
                        "{:<22} {:<9} {:<8} {:<5} {:>5} {:>7}  {:<25} EXPIRES",
                        "ID", "STATE", "TEMPLATE", "ACCEL", "VCPU", "MEM", "CREATED"
                    );
                    for s in list["sandboxes"].as_array().into_iter().flatten() {
                        println!(
                            "{:<22} {:<9} {:<8} {:<5} {:>5} {:>6}M  {:<25} {}",
                            s["id"].as_str().unwrap_or(""),
                            s["state"].as_str().unwrap_or(""),
                            s["template"].as_str().unwrap_or(""),
                            s["accel"].as_str().unwrap_or(""),
                            s["resources"]["vcpu"],
                            s["resources"]["memory_mib"],
                            s["created_at"].as_str().unwrap_or(""),
                            s["expires_at"].as_str().unwrap_or("")
                        );
                    }
                }
                SandboxCommand::Get { id } => {
                    print_json(&blocking(move || c.json("GET", &format!("/v1/sandboxes/{id}"), None)).await?)
                }
                SandboxCommand::Rm { id } => {
                    blocking(move || c.delete_sandbox(&id, true)).await?;
                }
            }
        }
        Command::Events(args) => {
            let c = client()?;
            blocking(move || events::events(&c, args)).await?
        }
        Command::Webhook { command } => {
            let c = client()?;
            blocking(move || events::webhooks(&c, command)).await?
        }
        Command::Volume { command } => {
            let c = client()?;
            match command {
                VolumeCommand::Create { name, size_mib } => {
                    let body = json!({"name": name, "size_mib": size_mib});
                    print_json(&blocking(move || c.json("POST", "/v1/volumes", Some(body))).await?)
                }
                VolumeCommand::Ls => {
                    let list = blocking(move || c.json("GET", "/v1/volumes", None)).await?;
                    println!(
                        "{:<22} {:<24} {:>9} {:>10}  {:<25} MOUNTED BY",
                        "ID", "NAME", "SIZE", "USED", "CREATED"
                    );
                    for v in list["volumes"].as_array().into_iter().flatten() {
                        let by: Vec<String> = v["mounted_by"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .map(|h| {
                                let ro = if h["read_only"] == json!(true) { " (ro)" } else { "" };
                                format!("{}{ro}", h["sandbox_id"].as_str().unwrap_or(""))
                            })
                            .collect();
                        println!(
                            "{:<22} {:<24} {:>8}M {:>9}M  {:<25} {}",
                            v["id"].as_str().unwrap_or(""),
                            v["name"].as_str().unwrap_or(""),
                            v["size_mib"],
                            v["used_bytes"]
                                .as_u64()
                                .map_or("-".to_string(), |b| (b >> 20).to_string()),
                            v["created_at"].as_str().unwrap_or(""),
                            by.join(", ")
                        );
                    }
                }
                VolumeCommand::Get { volume } => {
                    print_json(&blocking(move || c.json("GET", &format!("/v1/volumes/{volume}"), None)).await?)
                }
                VolumeCommand::Resize { volume, size_mib } => {
                    let body = json!({"size_mib": size_mib});
                    print_json(&blocking(move || c.json("PATCH", &format!("/v1/volumes/{volume}"), Some(body))).await?)
                }
                VolumeCommand::Rm { volume } => {
                    blocking(move || c.json("DELETE", &format!("/v1/volumes/{volume}"), None)).await?;
                }
            }
        }
        Command::Exec { id, opts, argv } => {
            let c = client()?;
            let body = opts.session_body(&argv)?;
            let code = blocking(move || c.exec(&id, body)).await?;
            return Ok(code.clamp(0, 255) as u8);
        }
        Command::Run { template, opts, argv } => {
            let c = client()?;
            let body = opts.session_body(&argv)?;
            let code = blocking(move || {
                let id = c.create_sandbox(json!({ "template": template }), true)?;
                let result = c.exec(&id, body);
                let deleted = c.delete_sandbox(&id, true);
                let code = result?;
                deleted?;
                Ok(code)
            })
            .await?;
            return Ok(code.clamp(0, 255) as u8);
        }
        Command::Ops {
            command: OpsCommand::Get { id },
        } => {
            let c = client()?;
            print_json(&blocking(move || c.json("GET", &format!("/v1/operations/{id}"), None)).await?);
        }
        Command::Login => {
            let password = match std::env::var(airlock_server::core::accounts::PASSWORD_ENV) {
                Ok(p) if !p.is_empty() => p,
                _ => {
                    if std::io::stdin().is_terminal() {
                        eprint!("password for {}: ", airlock_server::core::accounts::ROOT);
                    }
                    let mut line = String::new();
                    std::io::stdin().read_line(&mut line)?;
                    line.trim_end_matches(['\r', '\n']).to_string()
                }
            };
            let token = client::Client::anonymous(&data_dir).json(
                "POST",
                "/v1/admin/login",
                Some(json!({"username": airlock_server::core::accounts::ROOT, "password": password})),
            )?;
            let path = client::admin_token_path(&data_dir);
            write_private(&path, token["token"].as_str().unwrap_or_default())?;
            eprintln!(
                "signed in as {} until {}",
                airlock_server::core::accounts::ROOT,
                token["expires_at"].as_str().unwrap_or("?")
            );
        }
        Command::Key { command } => admin::keys(&client::Client::admin(&data_dir)?, command)?,
        Command::ScrapeToken { command } => admin::scrape_tokens(&client::Client::admin(&data_dir)?, command)?,
        Command::Tenant { command } => {
            let admin = client::Client::admin(&data_dir)?;
            let out = match command {
                TenantCommand::Create { name } => {
                    admin.json("POST", "/v1/admin/tenants", Some(json!({"name": name})))?
                }
                TenantCommand::Ls => admin.json("GET", "/v1/admin/tenants", None)?,
                TenantCommand::Get { name } => admin.json("GET", &format!("/v1/admin/tenants/{name}"), None)?,
                TenantCommand::Rm { name } => admin.json("DELETE", &format!("/v1/admin/tenants/{name}"), None)?,
                TenantCommand::Policy {
                    command: PolicyCommand::Show { tenant },
                } => admin.json("GET", &format!("/v1/admin/tenants/{tenant}/egress"), None)?,
                TenantCommand::Policy {
                    command:
                        PolicyCommand::Set {
                            tenant,
                            allow_domain,
                            deny_domain,
                            allow_cidr,
                            deny_cidr,
                        },
                } => {
                    let rules = |domains: Vec<String>, nets: Vec<String>| {
                        let (ips, cidrs): (Vec<String>, Vec<String>) = nets
                            .into_iter()
                            .partition(|n| n.trim().parse::<std::net::IpAddr>().is_ok());
                        json!({"domains": domains, "ips": ips, "cidrs": cidrs})
                    };
                    let body = json!({"allow": rules(allow_domain, allow_cidr), "deny": rules(deny_domain, deny_cidr)});
                    admin.json("PUT", &format!("/v1/admin/tenants/{tenant}/egress"), Some(body))?
                }
                TenantCommand::Quota {
                    command: QuotaCommand::Show { tenant },
                } => admin.json("GET", &format!("/v1/admin/tenants/{tenant}/quota"), None)?,
                TenantCommand::Quota {
                    command:
                        QuotaCommand::Set {
                            tenant,
                            sandboxes,
                            vcpu,
                            memory_mib,
                            disk_mib,
                            sessions_per_sandbox,
                            creates_per_minute,
                            volume_mib,
                        },
                } => {
                    let quota = airlock_server::model::Quota {
                        sandboxes,
                        vcpu,
                        memory_mib,
                        disk_mib,
                        sessions_per_sandbox,
                        creates_per_minute,
                        volume_mib,
                    };
                    admin.json(
                        "PUT",
                        &format!("/v1/admin/tenants/{tenant}/quota"),
                        Some(serde_json::to_value(quota)?),
                    )?
                }
            };
            print_json(&out);
        }
        Command::Pool { command } => {
            let admin = client::Client::admin(&data_dir)?;
            let out = match command {
                PoolCommand::Set { template, size, shape } => {
                    let req = airlock_server::model::PoolRequest {
                        template,
                        resources: Some(shape.spec()),
                        size,
                    };
                    admin.json("PUT", "/v1/admin/pools", Some(serde_json::to_value(req)?))?
                }
                PoolCommand::Ls => admin.json("GET", "/v1/admin/pools", None)?,
            };
            print_json(&out);
        }
        Command::Nodes => {
            let admin = client::Client::admin(&data_dir)?;
            print_json(&admin.json("GET", "/v1/admin/nodes", None)?);
        }
        Command::Doctor => {
            let rt = Runtime::open(RuntimeOptions::new(&cli.data_dir)).await?;
            println!("data dir:  {}", rt.data_dir().root().display());
            println!("runtime:   {}", rt.runtime_name());
            println!("accel:     {}", rt.accel().await);
            // The isolation in force.
            println!(
                "seccomp:   QEMU's own filter (-sandbox {})",
                airlock_runtime::qemu::SANDBOX
            );
            match rt.isolation() {
                Some(iso) => {
                    println!("vmm user:  {}", iso.user);
                    println!("vmm files: {}", iso.filesystem);
                    println!("cgroups:   {}", iso.cgroups);
                    println!("vmm ns:    {}", iso.namespaces);
                }
                None => println!("vmm jail:  none ({} driver)", rt.runtime_name()),
            }
            let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(rt.data_dir().root())?.permissions());
            println!("data dir mode: {:04o}", mode & 0o7777);
            for m in rt.templates().list() {
                println!("template:  {} {}", m.name, m.digest);
            }
        }
    }
    Ok(0)
}
