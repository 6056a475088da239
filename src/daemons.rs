//! The two long-running commands: `serve` (the API, with this host's node in its process or a
//! node on another host) and `node` (this host's node alone, for API replicas elsewhere).

use airlock_runtime::datadir::DataDir;
use airlock_runtime::objects::{Objects, ObjectsError, S3};
use airlock_runtime::template::{BuildOptions, TemplateStore, SEED};
use clap::Args;
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct ServeArgs {
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
    /// Also serve `GET /metrics` (Prometheus' text format) here, without a credential: an
    /// address only the operator's Prometheus reaches (on the main listener `/metrics` asks
    /// for a scrape token, `airlock admin scrape-token create`, or the admin's token).
    #[arg(long, env = "AIRLOCK_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Let tenants' webhooks point at loopback, private, link-local, metadata and
    /// documentation addresses and this host's own (refused by default: a webhook is the
    /// server's own request).
    #[arg(long, env = "AIRLOCK_WEBHOOK_ALLOW_PRIVATE")]
    webhook_allow_private: bool,
    /// A web console session ends after this long without a request (`30m`, `20s`).
    #[arg(long, env = "AIRLOCK_CONSOLE_IDLE", default_value = "30m", value_parser = humantime::parse_duration)]
    console_idle: std::time::Duration,
    /// ... and this long after signing in, however busy (`12h`); root@local's also when its
    /// hour-long admin token ends.
    #[arg(long, env = "AIRLOCK_CONSOLE_LIFETIME", default_value = "12h", value_parser = humantime::parse_duration)]
    console_lifetime: std::time::Duration,
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
    /// Accept `Authorization: Bearer <JWT>` from the issuers in this JSON file (issuer,
    /// audience, a JWKS file, the claim naming the tenant, the tenants it may name); such
    /// callers are signed in.
    #[arg(long, env = "AIRLOCK_JWT_ISSUERS")]
    jwt_issuers: Option<PathBuf>,
    /// Pull a registry's images from a mirror instead: `REGISTRY=MIRROR` (`docker.io=
    /// http://127.0.0.1:5000`; `http://` for a mirror without TLS), repeatable or
    /// comma-separated.
    #[arg(long = "registry-mirror", env = "AIRLOCK_REGISTRY_MIRRORS", value_delimiter = ',', value_parser = parse_mirror)]
    registry_mirrors: Vec<(String, String)>,
    /// Registries (`host`, `host:port`, or `*` for any) that image builds may pull from
    /// directly, repeatable or comma-separated [default: none, only the mirrors]. A pull is
    /// the server's own connection: allow only registries a tenant may make it reach.
    #[arg(long = "registry-allow", env = "AIRLOCK_REGISTRY_ALLOW", value_delimiter = ',')]
    registry_allow: Vec<String>,
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
    /// Processes (sessions) one sandbox may run at once (429 `quota_exceeded` past it).
    #[arg(long, env = "AIRLOCK_MAX_SESSIONS", default_value_t = airlock_server::core::DEFAULT_MAX_SESSIONS_PER_SANDBOX)]
    max_sessions: u32,
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
    /// Use the node at this address (`airlock node --listen`) instead of running VMs in this
    /// process; repeatable or comma-separated for many hosts (a sandbox goes to the best node
    /// that admits it); needs --node-secret-file. Each node's address is its name: keep it.
    #[arg(
        long = "node",
        env = "AIRLOCK_NODES",
        value_delimiter = ',',
        requires = "node_secret_file"
    )]
    nodes: Vec<SocketAddr>,
    /// Find nodes by resolving this name every few seconds (`HOST:PORT`, e.g. a Kubernetes
    /// headless Service of the node DaemonSet): each joins under the name it reports (`node
    /// --name`); one no longer listed takes no new sandbox. Needs --node-secret-file.
    #[arg(
        long,
        env = "AIRLOCK_NODES_DNS",
        requires = "node_secret_file",
        conflicts_with = "nodes_kube"
    )]
    nodes_dns: Option<String>,
    /// Find nodes through the Kubernetes API (the pod's service account, or the kubeconfig):
    /// the pods of this namespace that match this label selector and are Ready, at
    /// --nodes-kube-port; one on a cordoned Kubernetes node takes no new sandbox and its
    /// sandboxes are taken off it. Needs --node-secret-file.
    #[arg(long, env = "AIRLOCK_NODES_KUBE", requires = "node_secret_file")]
    nodes_kube: Option<String>,
    /// The port the node pods' faces listen on (`airlock node --listen`), for --nodes-kube.
    #[arg(long, env = "AIRLOCK_NODES_KUBE_PORT", default_value_t = 7701)]
    nodes_kube_port: u16,
    /// The cluster secret node calls are signed with (the node's --secret-file; at least 32
    /// bytes).
    #[arg(long, env = "AIRLOCK_NODE_SECRET_FILE")]
    node_secret_file: Option<PathBuf>,
    /// Mutual TLS to the nodes: this replica's client certificate (PEM chain, leaf first, of
    /// the cluster CA, with `clientAuth`), presented to every node.
    #[arg(long, env = "AIRLOCK_NODES_TLS_CERT", requires_all = ["node_tls_key", "node_tls_ca", "node_secret_file"])]
    node_tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "AIRLOCK_NODES_TLS_KEY", requires = "node_tls_cert")]
    node_tls_key: Option<PathBuf>,
    /// The cluster CA (PEM): a node's certificate must be of it, for the name `airlock-node`.
    #[arg(long, env = "AIRLOCK_NODES_TLS_CA", requires = "node_tls_cert")]
    node_tls_ca: Option<PathBuf>,
    /// Many hosts: a node that no replica has had an answer from for this many seconds is
    /// judged dead; its running and paused sandboxes become `lost` (its suspended ones wait for
    /// it), and if it comes back, its VMs of them are removed.
    #[arg(long, env = "AIRLOCK_NODE_GRACE_SECONDS", default_value_t = airlock_server::engine::NODE_GRACE.as_secs())]
    node_grace_seconds: u64,
    #[command(flatten)]
    host: HostArgs,
    #[command(flatten)]
    conns: ConnectionArgs,
}

/// What a node needs of its host: where egress leaves from, warm pools.
#[derive(Args)]
pub struct HostArgs {
    /// The DNS server sandboxes' allowed names are resolved with (default: the first
    /// `nameserver` of /etc/resolv.conf).
    #[arg(long, env = "AIRLOCK_EGRESS_DNS")]
    egress_dns: Option<SocketAddr>,
    /// Make sandboxes' lookups and connections from this network namespace (a name under
    /// /run/netns) instead of the host's own network: a separate uplink, or a test's
    /// "internet".
    #[arg(long, env = "AIRLOCK_EGRESS_UPLINK_NETNS")]
    egress_uplink_netns: Option<String>,
    /// Keep VMs of a template ready for creates to claim, at the default resources:
    /// `TEMPLATE=COUNT`, repeatable or comma-separated (the admin resizes them with
    /// `PUT /v1/admin/pools`).
    #[arg(long = "warm-pool", env = "AIRLOCK_WARM_POOLS", value_delimiter = ',', value_parser = parse_pool)]
    warm_pools: Vec<(String, usize)>,
}

#[derive(Args)]
pub struct ConnectionArgs {
    /// Open connections per listener; past it new ones wait in the listen backlog.
    #[arg(long, env = "AIRLOCK_MAX_CONNECTIONS", default_value_t = airlock_server::listen::MAX_CONNECTIONS)]
    max_connections: usize,
    /// Open connections per client address (an IPv6 /64) on each listener; past it a new one
    /// is reset at once. Behind a reverse proxy every client is the proxy: raise it there.
    #[arg(long, env = "AIRLOCK_MAX_CONNECTIONS_PER_CLIENT", default_value_t = airlock_server::listen::MAX_CONNECTIONS_PER_CLIENT)]
    max_connections_per_client: usize,
}

#[derive(Args)]
pub struct NodeArgs {
    /// Where the node's face listens (API replicas call it; keep it on the cluster's network).
    #[arg(long, env = "AIRLOCK_NODE_LISTEN")]
    listen: SocketAddr,
    /// The cluster secret callers sign their calls with (at least 32 bytes; the same file
    /// as every replica's --node-secret-file).
    #[arg(long, env = "AIRLOCK_NODE_SECRET_FILE")]
    secret_file: PathBuf,
    /// The node's name in the cluster (what sandbox records keep: keep it across restarts)
    /// [default: the host name].
    #[arg(long, env = "AIRLOCK_NODE_NAME")]
    name: Option<String>,
    /// Serve the face over mutual TLS: this node's certificate (PEM chain, leaf first, of the
    /// cluster CA, naming `airlock-node`, with `serverAuth`).
    #[arg(long, env = "AIRLOCK_NODE_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "AIRLOCK_NODE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The cluster CA (PEM): only callers presenting a certificate of it are served.
    #[arg(long, env = "AIRLOCK_NODE_TLS_CA", requires = "tls_cert")]
    tls_ca: Option<PathBuf>,
    /// Creates this node runs at once; past it, it refuses (`capacity`) and the replica places
    /// the sandbox on another node.
    #[arg(long, env = "AIRLOCK_MAX_STARTS", default_value_t = airlock_server::node_daemon::DEFAULT_MAX_STARTS, value_parser = clap::value_parser!(u64).range(1..))]
    max_starts: u64,
    /// The node's own vCPU budget is its CPUs times this (it refuses creates past it, whatever
    /// a replica's view of it).
    #[arg(long, env = "AIRLOCK_VCPU_OVERCOMMIT", default_value_t = airlock_server::core::DEFAULT_VCPU_OVERCOMMIT, value_parser = parse_overcommit)]
    vcpu_overcommit: f64,
    /// Memory the node keeps for its host; its VMs' memory sums to at most the rest.
    #[arg(long, env = "AIRLOCK_MEMORY_RESERVE_MIB", default_value_t = airlock_server::core::DEFAULT_MEMORY_RESERVE_MIB)]
    memory_reserve_mib: u64,
    /// Object storage the node shares templates and moving sandboxes through: a local dir
    /// (`file:///path`, or just `/path`) or an S3 bucket (`s3://bucket`, its keys in
    /// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY). A node lacking `seed` pulls it from there
    /// (every file checked against its digest) rather than build it; one that builds it puts it
    /// there. A draining node parks its sandboxes there, for other nodes to resume, and
    /// tenants' snapshots go there too; a node pulls a template it lacks from there at its
    /// first create of it.
    #[arg(long, env = "AIRLOCK_OBJECTS")]
    objects: Option<String>,
    /// A template built on this host (`airlock template build NAME`) to put in --objects at
    /// start, unless a template of that name is there already; repeat it for several.
    #[arg(long = "share-template", value_name = "NAME")]
    share_templates: Vec<String>,
    /// An S3-compatible store's endpoint (`http://host:port`) for an `s3://` --objects
    /// [default: AWS, by region].
    #[arg(long, env = "AIRLOCK_S3_ENDPOINT")]
    s3_endpoint: Option<String>,
    #[arg(long, env = "AIRLOCK_S3_REGION", default_value = "us-east-1")]
    s3_region: String,
    /// On SIGTERM the node refuses new sandboxes and the replicas take its own off it (parked
    /// in --objects for another node, else suspended here); after this many seconds it
    /// suspends what still runs itself, then exits 0.
    #[arg(long, env = "AIRLOCK_DRAIN_SECONDS", default_value_t = airlock_server::node_daemon::DRAIN_BUDGET.as_secs())]
    drain_seconds: u64,
    #[command(flatten)]
    host: HostArgs,
    #[command(flatten)]
    conns: ConnectionArgs,
}

impl HostArgs {
    fn node_options(
        self,
        data_dir: PathBuf,
        egress: airlock_server::EgressConfig,
    ) -> airlock_server::node_daemon::NodeOptions {
        airlock_server::node_daemon::NodeOptions {
            data_dir,
            egress,
            egress_uplink: airlock_server::EgressUplink {
                dns: self.egress_dns,
                netns: self.egress_uplink_netns,
            },
            warm_pools: self.warm_pools,
            objects: None,
        }
    }
}

impl ConnectionArgs {
    fn limits(&self) -> airlock_server::listen::Limits {
        airlock_server::listen::Limits {
            max_connections: self.max_connections,
            max_connections_per_client: self.max_connections_per_client,
            ..Default::default()
        }
    }
}

/// Build `seed` into the data dir unless it is there (a node's sandboxes start from it).
async fn ensure_seed(data_dir: &Path) -> anyhow::Result<()> {
    let store = TemplateStore::new(DataDir::open(data_dir)?);
    if !store.exists(SEED) {
        eprintln!("airlock: template `seed` is missing; building it first");
        crate::build_template(
            data_dir,
            SEED.into(),
            BuildOptions {
                progress: std::io::stderr().is_terminal(),
                ..Default::default()
            },
        )
        .await?;
    }
    Ok(())
}

/// Object storage at `url` (see `airlock node --objects`).
fn open_objects(url: &str, endpoint: Option<String>, region: &str) -> anyhow::Result<Objects> {
    if let Some(bucket) = url.strip_prefix("s3://") {
        let bucket = bucket.trim_end_matches('/');
        if bucket.is_empty() || bucket.contains('/') {
            anyhow::bail!("{url:?} names no bucket: use s3://BUCKET");
        }
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let key = |name: &str| var(name).ok_or_else(|| anyhow::anyhow!("{url} needs {name} set"));
        return Ok(Objects::s3(&S3 {
            endpoint,
            bucket: bucket.to_string(),
            region: region.to_string(),
            access_key_id: key("AWS_ACCESS_KEY_ID")?,
            secret_access_key: key("AWS_SECRET_ACCESS_KEY")?,
        })?);
    }
    let path = Path::new(url.strip_prefix("file://").unwrap_or(url));
    if !path.is_absolute() {
        anyhow::bail!("{url:?} is neither s3://BUCKET nor an absolute path (file:///path)");
    }
    Ok(Objects::local(path)?)
}

/// Templates `names` (built here) into `objects` where it has no template of the name yet, for
/// the other nodes to pull at their first create of one. A name there already is left as it
/// is: a node's restart must not turn it back to an older build.
async fn share_templates(objects: &Objects, data_dir: &Path, names: &[String]) -> anyhow::Result<()> {
    let store = TemplateStore::new(DataDir::open(data_dir)?);
    for name in names {
        let template = store.resolve(name).map_err(|e| {
            anyhow::anyhow!("--share-template {name}: {e}; build it first (`airlock template build {name}`)")
        })?;
        let there = objects
            .template_digest(name)
            .await
            .map_err(|e| anyhow::anyhow!("--share-template {name}: {e}"))?;
        if let Some(digest) = there {
            eprintln!("airlock: template `{name}` is in object storage already ({digest}); left as it is");
            continue;
        }
        let pushed = objects
            .push_template(&template)
            .await
            .map_err(|e| anyhow::anyhow!("--share-template {name}: {e}"))?;
        eprintln!(
            "airlock: template `{name}` {} put in object storage ({} bytes uploaded)",
            pushed.digest, pushed.uploaded_bytes
        );
    }
    Ok(())
}

/// `seed` in the data dir from `objects` if it has one (only the files the data dir lacks are
/// fetched, each checked); else built here and put there for the other nodes.
async fn seed_through(objects: &Objects, data_dir: &Path) -> anyhow::Result<()> {
    let store = TemplateStore::new(DataDir::open(data_dir)?);
    match objects.pull_template(SEED, &store).await {
        Ok(pulled) => {
            eprintln!(
                "airlock: template `seed` {} from object storage ({} bytes fetched)",
                pulled.template.manifest.digest, pulled.fetched_bytes
            );
            return Ok(());
        }
        Err(ObjectsError::NotFound(_)) => {}
        Err(e) => anyhow::bail!("template `seed` from object storage: {e}"),
    }
    ensure_seed(data_dir).await?;
    let seed = store.resolve(SEED)?;
    let pushed = objects
        .push_template(&seed)
        .await
        .map_err(|e| anyhow::anyhow!("template `seed` into object storage: {e}"))?;
    eprintln!(
        "airlock: template `seed` {} put in object storage ({} bytes uploaded)",
        pushed.digest, pushed.uploaded_bytes
    );
    Ok(())
}

impl ServeArgs {
    pub async fn run(self, data_dir: PathBuf) -> anyhow::Result<()> {
        // First: a bad AIRLOCK_EGRESS_PROFILES, --store or secret stops the server before
        // anything is built (checked here, not by clap, which would echo the URL's password).
        let egress = airlock_server::egress_config_from_env()?;
        if let Some(url) = &self.store {
            airlock_server::store::PgStore::parse_url(url).map_err(|e| anyhow::anyhow!("--store: {e}"))?;
        }
        let node_secret = match &self.node_secret_file {
            Some(path) => airlock_server::node_daemon::read_cluster_secret(path)?,
            None => Vec::new(),
        };
        let remote = !self.nodes.is_empty() || self.nodes_dns.is_some() || self.nodes_kube.is_some();
        if self.node_secret_file.is_some() && !remote {
            anyhow::bail!("--node-secret-file is for remote nodes: name them with --node, --nodes-dns or --nodes-kube");
        }
        if !remote {
            ensure_seed(&data_dir).await?;
        }
        let limits = self.conns.limits();
        let node = self.host.node_options(data_dir.clone(), egress.clone());
        airlock_server::serve(airlock_server::ServeOptions {
            warm_pools: node.warm_pools,
            listen: self.listen,
            store: self.store,
            data_dir,
            max_sandboxes_per_tenant: self.max_sandboxes,
            max_vcpu_per_tenant: self.max_vcpu,
            max_memory_mib_per_tenant: self.max_memory_mib,
            max_disk_mib_per_tenant: self.max_disk_mib,
            tenant_share: self.tenant_share,
            max_creates_per_minute: self.max_creates_per_minute,
            max_sessions_per_sandbox: self.max_sessions,
            vcpu_overcommit: self.vcpu_overcommit,
            memory_reserve_mib: self.memory_reserve_mib,
            disk_reserve_mib: self.disk_reserve_mib,
            e2b_debug_listen: self.e2b_debug_listen,
            metrics_listen: self.metrics_listen,
            webhook_allow_private: self.webhook_allow_private,
            console: airlock_server::console::ConsoleSettings {
                idle: self.console_idle,
                lifetime: self.console_lifetime,
            },
            e2b_domain: self.e2b_domain,
            tls: match (self.tls_listen, self.tls_cert, self.tls_key) {
                (Some(listen), Some(cert), Some(key)) => Some(airlock_server::TlsOptions { listen, cert, key }),
                _ => None,
            },
            limits,
            egress,
            egress_uplink: node.egress_uplink,
            jwt_issuers: self.jwt_issuers,
            registries: airlock_runtime::template::Registries {
                mirrors: self.registry_mirrors.into_iter().collect(),
                allow: self.registry_allow,
                // Each node fills in its own platform denies when it pulls.
                denied: Vec::new(),
            },
            remote_nodes: self.nodes,
            nodes_dns: self.nodes_dns,
            nodes_kube: self.nodes_kube.map(|selector| (selector, self.nodes_kube_port)),
            node_secret,
            node_tls: match (self.node_tls_cert, self.node_tls_key, self.node_tls_ca) {
                (Some(cert), Some(key), Some(ca)) => Some(airlock_server::nodes::tls::TlsFiles { cert, key, ca }),
                _ => None,
            },
            node_grace: std::time::Duration::from_secs(self.node_grace_seconds.max(1)),
        })
        .await
    }
}

impl NodeArgs {
    pub async fn run(self, data_dir: PathBuf) -> anyhow::Result<()> {
        let egress = airlock_server::egress_config_from_env()?;
        let secret = airlock_server::node_daemon::read_cluster_secret(&self.secret_file)?;
        let objects = match &self.objects {
            Some(url) => {
                let objects = open_objects(url, self.s3_endpoint.clone(), &self.s3_region)
                    .map_err(|e| anyhow::anyhow!("--objects: {e}"))?;
                seed_through(&objects, &data_dir).await?;
                share_templates(&objects, &data_dir, &self.share_templates).await?;
                Some(objects)
            }
            None => {
                ensure_seed(&data_dir).await?;
                None
            }
        };
        let limits = self.conns.limits();
        let rules = airlock_server::nodes::NodeRules {
            max_starts: self.max_starts as usize,
            vcpu_overcommit: self.vcpu_overcommit,
            memory_reserve_mib: self.memory_reserve_mib,
            expiry_grace: airlock_server::node_daemon::EXPIRY_GRACE,
            deadlines: Some(data_dir.join("deadlines")),
        };
        let node = airlock_server::node_daemon::NodeOptions {
            objects,
            ..self.host.node_options(data_dir, egress)
        };
        let name = self.name.unwrap_or_else(airlock_server::node_daemon::host_name);
        let drain = std::time::Duration::from_secs(self.drain_seconds);
        let tls = match (self.tls_cert, self.tls_key, self.tls_ca) {
            (Some(cert), Some(key), Some(ca)) => Some(airlock_server::nodes::tls::TlsFiles { cert, key, ca }),
            _ => None,
        };
        airlock_server::node_daemon::serve_node(node, name, self.listen, secret, rules, drain, limits, tls).await
    }
}

fn parse_mirror(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((registry, mirror)) if !registry.trim().is_empty() && !mirror.trim().is_empty() => {
            Ok((registry.trim().to_string(), mirror.trim().to_string()))
        }
        _ => Err(format!(
            "{s:?}: expected REGISTRY=MIRROR, e.g. docker.io=http://127.0.0.1:5000"
        )),
    }
}

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
