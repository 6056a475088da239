//! `airlock`: the command-line front of airlock: the server, template builds, and a client
//! of the HTTP API for sandboxes, commands and operations.

mod client;

use airlock_runtime::datadir::DEFAULT_DATA_DIR;
use airlock_runtime::template::{BuildOptions, TemplateStore, SEED};
use airlock_runtime::{datadir::DataDir, Runtime, RuntimeOptions};
use anyhow::Context;
use clap::{Parser, Subcommand};
use serde_json::json;
use std::io::IsTerminal;
use std::net::SocketAddr;
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
    /// Run the API server (builds `seed` first if it is missing).
    Serve {
        #[arg(long, env = "AIRLOCK_LISTEN", default_value = "127.0.0.1:7420")]
        listen: SocketAddr,
        /// The control-plane store: a Postgres database,
        /// `postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE` [default: SQLite in the data dir].
        #[arg(long, env = "AIRLOCK_STORE")]
        store: Option<String>,
        /// Also serve E2B's code-interpreter port here (for `E2B_DEBUG=true` setups, where the
        /// SDK calls `localhost:49999`); requests are routed by `X-Access-Token`.
        #[arg(long, env = "AIRLOCK_E2B_DEBUG_LISTEN")]
        e2b_debug_listen: Option<SocketAddr>,
        /// The E2B domain, for `E2B_DOMAIN=<domain>` setups: the API answers as `api.<domain>`,
        /// sandbox ports as `<port>-<sandbox id>.<domain>` (point wildcard DNS at this host).
        #[arg(long, env = "AIRLOCK_E2B_DOMAIN")]
        e2b_domain: Option<String>,
        /// Also serve HTTPS here (same routes); needs --tls-cert and --tls-key.
        #[arg(long, env = "AIRLOCK_TLS_LISTEN", requires_all = ["tls_cert", "tls_key"])]
        tls_listen: Option<SocketAddr>,
        /// PEM certificate chain for --tls-listen (e.g. for `*.<domain>` and `<domain>`).
        #[arg(long, env = "AIRLOCK_TLS_CERT", requires = "tls_listen")]
        tls_cert: Option<PathBuf>,
        /// PEM private key for --tls-listen.
        #[arg(long, env = "AIRLOCK_TLS_KEY", requires = "tls_listen")]
        tls_key: Option<PathBuf>,
        /// The DNS server sandboxes' allowed names are resolved with (default: the first
        /// `nameserver` of /etc/resolv.conf).
        #[arg(long, env = "AIRLOCK_EGRESS_DNS")]
        egress_dns: Option<SocketAddr>,
        /// Make sandboxes' lookups and connections from this network namespace (a name under
        /// /run/netns) instead of the host's own network: a separate uplink, or a test's
        /// "internet".
        #[arg(long, env = "AIRLOCK_EGRESS_UPLINK_NETNS")]
        egress_uplink_netns: Option<String>,
        /// Accept `Authorization: Bearer <JWT>` from the issuers in this JSON file (issuer,
        /// audience, a JWKS file, the claim naming the tenant, the tenants it may name); such
        /// callers are signed in.
        #[arg(long, env = "AIRLOCK_JWT_ISSUERS")]
        jwt_issuers: Option<PathBuf>,
        /// Live sandboxes one tenant may have at once (429 `quota_exceeded` past it), unless the
        /// admin sets the tenant's own quota.
        #[arg(long, env = "AIRLOCK_MAX_SANDBOXES", default_value_t = 20)]
        max_sandboxes: u32,
        /// vCPUs one tenant's live sandboxes may hold together, unless the admin sets the
        /// tenant's own quota [default: --tenant-share of the node's vCPU budget].
        #[arg(long, env = "AIRLOCK_MAX_VCPU", value_parser = clap::value_parser!(u64).range(1..))]
        max_vcpu: Option<u64>,
        /// Memory (MiB) one tenant's live sandboxes may hold together [default: --tenant-share
        /// of the node's memory budget].
        #[arg(long, env = "AIRLOCK_MAX_MEMORY_MIB", value_parser = clap::value_parser!(u64).range(1..))]
        max_memory_mib: Option<u64>,
        /// Disk (MiB) one tenant's sandboxes, saved memory and snapshots may hold together
        /// [default: --tenant-share of the node's disk budget].
        #[arg(long, env = "AIRLOCK_MAX_DISK_MIB", value_parser = clap::value_parser!(u64).range(1..))]
        max_disk_mib: Option<u64>,
        /// The part of each node budget (vCPUs, memory, disk) a tenant gets where neither its
        /// own quota nor --max-vcpu, --max-memory-mib or --max-disk-mib says otherwise (1: no
        /// limit but the node's budgets, for a single tenant).
        #[arg(long, env = "AIRLOCK_TENANT_SHARE", default_value_t = airlock_server::core::DEFAULT_TENANT_SHARE, value_parser = parse_share)]
        tenant_share: f64,
        /// Creates one tenant may make in any 60 seconds (429 `rate_limited` past it), unless
        /// the admin sets the tenant's own quota.
        #[arg(long, env = "AIRLOCK_MAX_CREATES_PER_MINUTE", default_value_t = airlock_server::core::DEFAULT_MAX_CREATES_PER_MINUTE, value_parser = clap::value_parser!(u32).range(1..))]
        max_creates_per_minute: u32,
        /// Keep VMs of a template ready for creates to claim, at the default resources:
        /// `TEMPLATE=COUNT`, repeatable or comma-separated (the admin resizes them with
        /// `PUT /v1/admin/pools`).
        #[arg(long = "warm-pool", env = "AIRLOCK_WARM_POOLS", value_delimiter = ',', value_parser = parse_pool)]
        warm_pools: Vec<(String, usize)>,
        /// Processes (sessions) one sandbox may run at once (429 `quota_exceeded` past it).
        #[arg(long, env = "AIRLOCK_MAX_SESSIONS", default_value_t = airlock_server::core::DEFAULT_MAX_SESSIONS_PER_SANDBOX)]
        max_sessions: u32,
        /// Open connections per listener; past it new ones wait in the listen backlog.
        #[arg(long, env = "AIRLOCK_MAX_CONNECTIONS", default_value_t = airlock_server::listen::MAX_CONNECTIONS)]
        max_connections: usize,
        /// Open connections per client address (an IPv6 /64) on each listener; past it a new one
        /// is reset at once. Behind a reverse proxy every client is the proxy: raise it there.
        #[arg(long, env = "AIRLOCK_MAX_CONNECTIONS_PER_CLIENT", default_value_t = airlock_server::listen::MAX_CONNECTIONS_PER_CLIENT)]
        max_connections_per_client: usize,
        /// The node's vCPU budget is its CPUs times this; past it creates get 503
        /// `node_budget_exceeded`.
        #[arg(long, env = "AIRLOCK_VCPU_OVERCOMMIT", default_value_t = airlock_server::core::DEFAULT_VCPU_OVERCOMMIT, value_parser = parse_overcommit)]
        vcpu_overcommit: f64,
        /// Memory kept for the host; live sandboxes' memory sums to at most the rest.
        #[arg(long, env = "AIRLOCK_MEMORY_RESERVE_MIB", default_value_t = airlock_server::core::DEFAULT_MEMORY_RESERVE_MIB)]
        memory_reserve_mib: u64,
        /// Disk kept free in the data dir's filesystem; live sandboxes' disks (at full size) sum
        /// to at most the rest, and no create is admitted below it.
        #[arg(long, env = "AIRLOCK_DISK_RESERVE_MIB", default_value_t = airlock_server::core::DEFAULT_DISK_RESERVE_MIB)]
        disk_reserve_mib: u64,
    },
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
        command: KeyCommand,
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
    /// Check the host and report what sandboxes would run with (QEMU, accelerator, isolation,
    /// templates).
    Doctor,
}

/// `TEMPLATE=COUNT` of `--warm-pool`.
fn parse_pool(s: &str) -> Result<(String, usize), String> {
    let bad = || format!("{s:?} is not TEMPLATE=COUNT (e.g. seed=2)");
    let (template, count) = s.split_once('=').ok_or_else(bad)?;
    let count: usize = count.trim().parse().map_err(|_| bad())?;
    if template.trim().is_empty() || count > airlock_server::core::accounts::MAX_POOL {
        return Err(bad());
    }
    Ok((template.trim().to_string(), count))
}

fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f.is_finite() && f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!("{s:?} is not a share above 0 and at most 1 (e.g. 0.5)")),
    }
}

fn parse_overcommit(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f.is_finite() && f > 0.0 && f <= 64.0 => Ok(f),
        _ => Err(format!("{s:?} is not a factor between 0 and 64 (e.g. 4 or 1.5)")),
    }
}

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
    /// Build a template (`seed` or `code-interpreter-v1`); skipped when its recipe is unchanged.
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
enum OpsCommand {
    /// Show one operation.
    Get { id: String },
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Mint an API key (usable as E2B_API_KEY too); prints only the key, shown this once.
    Create {
        #[arg(long, default_value = "default")]
        tenant: String,
        /// What the key is for (shown by `key ls`).
        #[arg(long, default_value = "")]
        name: String,
        /// Spell it `e2b_<hex>`, the shape e2b SDKs 2.26 to 2.5x require of E2B_API_KEY.
        #[arg(long)]
        e2b: bool,
    },
    /// List a tenant's keys (never the keys themselves).
    Ls {
        #[arg(long, default_value = "default")]
        tenant: String,
    },
    /// Revoke a key by its id (`key ls`): its next call gets 401.
    Revoke {
        id: String,
        #[arg(long, default_value = "default")]
        tenant: String,
    },
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

fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> anyhow::Result<T> + Send + 'static) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f).await?
}

fn build_template(
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
        Command::Serve {
            listen,
            store: store_url,
            max_sandboxes,
            max_vcpu,
            max_memory_mib,
            max_disk_mib,
            tenant_share,
            max_creates_per_minute,
            max_sessions,
            vcpu_overcommit,
            memory_reserve_mib,
            disk_reserve_mib,
            e2b_debug_listen,
            e2b_domain,
            tls_listen,
            tls_cert,
            tls_key,
            max_connections,
            max_connections_per_client,
            egress_dns,
            egress_uplink_netns,
            jwt_issuers,
            warm_pools,
        } => {
            // First: a bad AIRLOCK_EGRESS_PROFILES or --store stops the server before anything
            // is built (checked here, not by clap, which would echo the URL's password).
            let egress = airlock_server::egress_config_from_env()?;
            if let Some(url) = &store_url {
                airlock_server::store::PgStore::parse_url(url).map_err(|e| anyhow::anyhow!("--store: {e}"))?;
            }
            let store = TemplateStore::new(DataDir::open(&cli.data_dir)?);
            if !store.exists(SEED) {
                eprintln!("airlock: template `seed` is missing; building it first");
                build_template(
                    &cli.data_dir,
                    SEED.into(),
                    BuildOptions {
                        progress: std::io::stderr().is_terminal(),
                        ..Default::default()
                    },
                )
                .await?;
            }
            airlock_server::serve(airlock_server::ServeOptions {
                warm_pools,
                listen,
                store: store_url,
                data_dir: cli.data_dir,
                max_sandboxes_per_tenant: max_sandboxes,
                max_vcpu_per_tenant: max_vcpu,
                max_memory_mib_per_tenant: max_memory_mib,
                max_disk_mib_per_tenant: max_disk_mib,
                tenant_share,
                max_creates_per_minute,
                max_sessions_per_sandbox: max_sessions,
                vcpu_overcommit,
                memory_reserve_mib,
                disk_reserve_mib,
                e2b_debug_listen,
                e2b_domain,
                tls: match (tls_listen, tls_cert, tls_key) {
                    (Some(listen), Some(cert), Some(key)) => Some(airlock_server::TlsOptions { listen, cert, key }),
                    _ => None,
                },
                limits: airlock_server::listen::Limits {
                    max_connections,
                    max_connections_per_client,
                    ..Default::default()
                },
                egress,
                egress_uplink: airlock_server::EgressUplink {
                    dns: egress_dns,
                    netns: egress_uplink_netns,
                },
                jwt_issuers,
            })
            .await?;
        }
        Command::Template {
            command:
                TemplateCommand::Build {
                    name,
                    mirror,
                    agent,
                    force,
                },
        } => {
            let opts = BuildOptions {
                mirror,
                agent,
                progress: std::io::stderr().is_terminal(),
                force,
            };
            build_template(&cli.data_dir, name, opts).await?;
        }
        Command::Template {
            command: TemplateCommand::Ls,
        } => {
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
        Command::Key { command } => {
            let admin = client::Client::admin(&data_dir)?;
            match command {
                KeyCommand::Create { tenant, name, e2b } => {
                    let k = admin.json(
                        "POST",
                        &format!("/v1/admin/tenants/{tenant}/keys"),
                        Some(json!({"name": name, "e2b": e2b})),
                    )?;
                    println!("{}", k["key"].as_str().unwrap_or_default());
                }
                KeyCommand::Ls { tenant } => {
                    print_json(&admin.json("GET", &format!("/v1/admin/tenants/{tenant}/keys"), None)?)
                }
                KeyCommand::Revoke { id, tenant } => {
                    admin.json("DELETE", &format!("/v1/admin/tenants/{tenant}/keys/{id}"), None)?;
                    eprintln!("revoked {id}");
                }
            }
        }
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
                        },
                } => {
                    let quota = airlock_server::model::Quota {
                        sandboxes,
                        vcpu,
                        memory_mib,
                        disk_mib,
                        sessions_per_sandbox,
                        creates_per_minute,
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
