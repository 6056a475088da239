//! Assembling a node: this host's runtime with its sandbox networks and egress, as `LocalNode`.
//! Used by `serve` in single-host mode (the node in the server's process) and by `airlock node`
//! ([`serve_node`]: the node's HTTP face, for API replicas on other hosts).

use crate::nodes::{self, LocalNode, NodeEgress, Nodes};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where sandbox egress leaves the host.
#[derive(Debug, Clone, Default)]
pub struct EgressUplink {
    /// The resolver allowed names are looked up with (default: /etc/resolv.conf's first).
    pub dns: Option<SocketAddr>,
    /// A network namespace (under /run/netns) to make lookups and dials in, instead of the
    /// process's own.
    pub netns: Option<String>,
}

/// What a node is opened with.
pub struct NodeOptions {
    pub data_dir: PathBuf,
    /// Egress profiles and the always-denied ranges (`egress_config_from_env`); the host's
    /// addresses join the denies when the node opens.
    pub egress: airlock_egress::EgressConfig,
    /// Where sandboxes' lookups and connections leave from.
    pub egress_uplink: EgressUplink,
    /// Warm pools to keep from the start: (template, VMs) at the default resources.
    pub warm_pools: Vec<(String, usize)>,
    /// Object storage to park VMs in for other nodes, and to start theirs from (`--objects`).
    pub objects: Option<airlock_runtime::objects::Objects>,
}

/// This host's name, the default name of its node.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// Creates a node runs at once by default (`airlock node --max-starts`): each boot is CPU-bound
/// for seconds, and more at once only slows all of them.
pub const DEFAULT_MAX_STARTS: u64 = 4;

/// How long after a sandbox's timeout a node ends it itself: a live replica acts first.
pub const EXPIRY_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// The shortest cluster secret a node or a replica accepts.
pub const MIN_SECRET_BYTES: usize = 32;

/// The cluster secret in `path` (surrounding whitespace ignored): node calls and replies are signed with it.
pub fn read_cluster_secret(path: &Path) -> anyhow::Result<Vec<u8>> {
    let bytes = std::fs::read(path).map_err(|e| anyhow::anyhow!("the cluster secret {}: {e}", path.display()))?;
    let secret = bytes.trim_ascii().to_vec();
    if secret.len() < MIN_SECRET_BYTES {
        anyhow::bail!(
            "the cluster secret {} holds {} bytes; it needs at least {MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > {}`)",
            path.display(),
            secret.len(),
            path.display()
        );
    }
    Ok(secret)
}

/// This host's node: the runtime (re-attaching the VMs of the last run in the background), its
/// networks served by a `NodeEgress`, the warm pools. Returns the egress configuration completed
/// with the host's addresses. Its owner says what a stop does ([`exit_on_stop`]).
pub async fn open_local_node(opts: NodeOptions) -> anyhow::Result<(Arc<LocalNode>, airlock_egress::EgressConfig)> {
    let mut egress = opts.egress;
    let mut runtime_opts = airlock_runtime::RuntimeOptions {
        reconcile_in_background: true,
        ..airlock_runtime::RuntimeOptions::new(&opts.data_dir)
    };
    // Without sandbox networks (`AIRLOCK_SANDBOX_NETWORK=off`) there is nothing to serve.
    let hook = match runtime_opts.network.as_mut() {
        Some(network) => {
            let hook = node_egress(&opts.egress_uplink, &mut egress, &opts.data_dir)?;
            network.egress = Some(hook.clone());
            Some(hook)
        }
        None => None,
    };
    let runtime = airlock_runtime::Runtime::open(runtime_opts).await?;
    let accel = runtime.accel().await;
    tracing::info!("runtime {} with accel {accel}", runtime.runtime_name());
    let mut node = LocalNode::new(runtime, hook);
    if let Some(objects) = opts.objects {
        node = node.with_objects(objects);
    }
    let node = Arc::new(node);
    set_pools(&*node, &opts.warm_pools).await?;
    Ok((node, egress))
}

/// On SIGTERM or SIGINT: `first` (a node's drain), then base snapshot builds and pool VMs are
/// stopped (a builder must not outlive the process: a restart would only remove it) and the
/// process exits 0. Sandboxes' VMs outlive the process by design.
pub fn exit_on_stop<F>(node: Arc<LocalNode>, first: impl FnOnce() -> F + Send + 'static)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        first().await;
        node.runtime().stop_base_snapshot_builds().await;
        node.runtime().drain_pools().await;
        std::process::exit(0);
    });
}

/// How long a stopping node waits for the replicas to take its sandboxes off it before it
/// suspends the rest to its own disk (`airlock node --drain-seconds`); the chart's termination
/// grace is longer.
pub const DRAIN_BUDGET: std::time::Duration = std::time::Duration::from_secs(300);

/// A node's drain: `face` refuses every start and reports `draining`, so the replicas place
/// nothing here and suspend what runs here; after `budget`, what still runs is suspended by the
/// node itself. Returns once no VM of `node` runs.
pub async fn drain(face: &nodes::serve::NodeFace, node: &dyn Nodes, budget: std::time::Duration) {
    face.drain();
    tracing::info!(
        "stopping: draining (starts refused; the replicas take the sandboxes off this node, for at most {budget:?})"
    );
    let deadline = tokio::time::Instant::now() + budget;
    loop {
        let live: Vec<String> = node
            .vm_ids()
            .into_iter()
            .filter(|id| matches!(node.vm_state(id), nodes::VmState::Running | nodes::VmState::Paused))
            .collect();
        // A replica's park or suspend is answered before the exit: the replica records it
        // by that answer.
        if live.is_empty() && face.changes_under_way() == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            tracing::info!("drained: no sandbox runs on this node");
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(
                "{} sandboxes still run after the drain budget; suspending them here",
                live.len()
            );
            for id in live {
                match node.suspend(&id).await {
                    Ok(ms) => tracing::info!(vm = %id, "suspended to this node's disk in {ms} ms"),
                    Err(e) => tracing::warn!(vm = %id, "cannot suspend it: {e}"),
                }
            }
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// Keep `pools` (template, size) at the resources a create naming none gets, on `node`.
pub async fn set_pools(node: &dyn Nodes, pools: &[(String, usize)]) -> anyhow::Result<()> {
    for (template, size) in pools {
        let defaults = node
            .template(template)
            .map_or_else(Default::default, |t| airlock_runtime::Resources::for_template(&t));
        node.set_pool(template, &defaults, *size)
            .await
            .map_err(|e| anyhow::anyhow!("--warm-pool {template}={size}: {e}"))?;
        tracing::info!("warm pool: {size} VMs of {template}");
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
/// `airlock node`: this host's node, its face served on `listen` to callers signing with
/// `secret`, until the process is stopped.
pub async fn serve_node(
    opts: NodeOptions,
    name: String,
    listen: SocketAddr,
    secret: Vec<u8>,
    rules: nodes::NodeRules,
    drain_budget: std::time::Duration,
    limits: crate::listen::Limits,
    tls: Option<nodes::tls::TlsFiles>,
) -> anyhow::Result<()> {
    let tls = match &tls {
        Some(files) => Some(nodes::tls::server_config(files)?),
        None => {
            tracing::warn!(
                "the node face is plain HTTP (calls signed, but env and registry credentials cross in clear): \
                 give --tls-cert, --tls-key and --tls-ca"
            );
            None
        }
    };
    // Bound before the runtime opens, so a taken address fails at once.
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("listen on {listen}: {e}"))?;
    let (node, egress) = open_local_node(opts).await?;
    tracing::info!(
        "node {name}: serving on {listen} (HTTP/2{}, signed calls); egress digest {}",
        if tls.is_some() { " over mutual TLS" } else { "" },
        egress.digest()
    );
    let face = nodes::serve::NodeFace::new(node.clone(), &secret, &name, Some(rules))
        .map_err(|e| anyhow::anyhow!("the node's deadlines dir: {e}"))?;
    let drained = (face.clone(), node.clone());
    exit_on_stop(node, move || async move {
        drain(&drained.0, &*drained.1, drain_budget).await
    });
    Ok(crate::listen::serve(listener, face.router(), tls, limits).await?)
}

/// The node's egress side for `uplink`, and the platform denies completed with the addresses
/// of the host (and of the uplink namespace): a sandbox must never reach the machine itself.
fn node_egress(
    uplink: &EgressUplink,
    config: &mut airlock_egress::EgressConfig,
    data_dir: &Path,
) -> anyhow::Result<Arc<NodeEgress>> {
    use airlock_egress::{local_addresses, PlatformDenies, ProxyConfig, Resolver, Uplink};
    let namespace = match &uplink.netns {
        Some(name) => Uplink::netns(&Path::new("/run/netns").join(name))
            .map_err(|e| anyhow::anyhow!("--egress-uplink-netns {name}: {e}"))?,
        None => Uplink::host(),
    };
    let resolver = match uplink.dns {
        Some(addr) => Resolver::new(addr, std::time::Duration::from_secs(5)),
        None if uplink.netns.is_some() => {
            anyhow::bail!("--egress-uplink-netns needs --egress-dns: the host's resolver is not in that namespace")
        }
        None => Resolver::system().map_err(|e| anyhow::anyhow!("egress DNS: {e}; pass --egress-dns <ip:port>"))?,
    }
    .with_uplink(namespace.clone());
    let mut host = local_addresses()?;
    host.extend(namespace.addresses()?);
    tracing::info!(
        "egress: lookups via {}, dials from {:?}, {} host addresses denied",
        resolver.upstream(),
        namespace,
        host.len()
    );
    config.platform = Arc::new(PlatformDenies::new(host));
    let dir = data_dir.join("egress");
    NodeEgress::new(
        Arc::new(resolver),
        ProxyConfig {
            uplink: namespace,
            ..ProxyConfig::default()
        },
        config.clone(),
        dir.clone(),
    )
    .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))
}
