//! A cluster in-process: nodes (each a fake-VMM runtime behind its HTTP face, in a tokio runtime
//! of its own, so dropping one is that node dying with its VMs) and API replicas (each a core
//! over a `Cluster` of `RemoteNode`s, in its own tokio runtime) sharing one SQLite store, as
//! replicas share Postgres. Replicas reach the nodes over mutual TLS ([`pki`]), as a cluster
//! in production does.

use super::*;
use airlock_server::nodes::tls::TlsFiles;
use airlock_server::nodes::{Cluster, NodeLink, RemoteNode};

/// Certificates made by openssl once per test process: the cluster's CA with a node's
/// (`serverAuth`, `DNS:airlock-node`) and a replica's (`clientAuth`), and a stranger's CA with the
/// same pair.
pub struct TestPki {
    dir: PathBuf,
}

/// The process's [`TestPki`].
pub fn pki() -> &'static TestPki {
    static PKI: std::sync::OnceLock<TestPki> = std::sync::OnceLock::new();
    PKI.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        let openssl = |args: &[&str]| {
            let out = std::process::Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .expect("openssl runs");
            assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
        for ca in ["cluster", "stranger"] {
            let (key, pem, subj) = (format!("{ca}-ca.key"), format!("{ca}-ca.pem"), format!("/CN={ca} CA"));
            let mut args = vec!["req", "-x509"];
            args.extend(ec);
            args.extend(["-keyout", &key, "-out", &pem, "-days", "3", "-subj", &subj]);
            args.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
            args.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
            openssl(&args);
            for (who, usage, san) in [
                ("node", "serverAuth", "DNS:airlock-node"),
                ("replica", "clientAuth", "DNS:airlock-replica"),
            ] {
                let name = format!("{ca}-{who}");
                let ext = format!("{name}.ext");
                std::fs::write(
                    dir.join(&ext),
                    format!("subjectAltName={san}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"),
                )
                .unwrap();
                let (k, csr, crt) = (format!("{name}.key"), format!("{name}.csr"), format!("{name}.pem"));
                let mut args = vec!["req"];
                args.extend(ec);
                args.extend(["-keyout", &k, "-out", &csr, "-subj", "/CN=airlock"]);
                openssl(&args);
                openssl(&[
                    "x509", "-req", "-in", &csr, "-CA", &pem, "-CAkey", &key, "-CAcreateserial", "-out", &crt, "-days",
                    "3", "-extfile", &ext,
                ]);
            }
        }
        TestPki { dir }
    })
}

impl TestPki {
    /// `who`'s (`node`, `replica`) certificate and key of `ca` (`cluster`, `stranger`), checking
    /// the other side against `trusts`' CA.
    pub fn files(&self, ca: &str, who: &str, trusts: &str) -> TlsFiles {
        TlsFiles {
            cert: self.dir.join(format!("{ca}-{who}.pem")),
            key: self.dir.join(format!("{ca}-{who}.key")),
            ca: self.dir.join(format!("{trusts}-ca.pem")),
        }
    }

    /// A node's TLS with the cluster's certificate.
    pub fn node_tls(&self) -> Arc<rustls::ServerConfig> {
        airlock_server::nodes::tls::server_config(&self.files("cluster", "node", "cluster")).unwrap()
    }

    /// A replica's link to the cluster's nodes: the secret, and TLS with the cluster's
    /// certificate.
    pub fn link(&self) -> NodeLink {
        let tls = airlock_server::nodes::tls::client_config(&self.files("cluster", "replica", "cluster")).unwrap();
        NodeLink::new(NODE_SECRET, Some(tls))
    }
}

/// What the test cluster's replicas reach its nodes with.
pub fn node_link() -> NodeLink {
    pki().link()
}

/// One node of a test cluster.
pub struct ClusterNode {
    /// Its face's address, which is also its name in sandbox records.
    pub addr: SocketAddr,
    pub dir: PathBuf,
    /// Its face (to drain it) and the node behind it.
    pub face: airlock_server::nodes::serve::NodeFace,
    pub node: Arc<dyn Nodes>,
    tokio: Option<tokio::runtime::Runtime>,
}

impl ClusterNode {
    /// A node on `dir` with `capacity`, its face on `127.0.0.1:port` (0: any free port).
    pub async fn start(dir: &Path, capacity: Capacity, port: u16) -> ClusterNode {
        Self::start_named(dir, capacity, port, "test-node").await
    }

    /// [`ClusterNode::start`] for a node that reports `name`.
    pub async fn start_named(dir: &Path, capacity: Capacity, port: u16, name: &str) -> ClusterNode {
        Self::start_ruled(dir, capacity, port, name, None).await
    }

    /// [`ClusterNode::start_named`] for a node that admits creates by `rules` itself.
    pub async fn start_ruled(
        dir: &Path,
        capacity: Capacity,
        port: u16,
        name: &str,
        rules: Option<airlock_server::nodes::NodeRules>,
    ) -> ClusterNode {
        Self::start_full(dir, capacity, port, name, rules, Duration::ZERO, pki().node_tls()).await
    }

    /// [`ClusterNode::start`] serving its face with `tls` (another CA's certificate).
    pub async fn start_tls(dir: &Path, capacity: Capacity, tls: Arc<rustls::ServerConfig>) -> ClusterNode {
        Self::start_full(dir, capacity, 0, "test-node", None, Duration::ZERO, tls).await
    }

    /// [`ClusterNode::start`] for a node whose creates take `create_delay` longer.
    pub async fn start_slow(dir: &Path, capacity: Capacity, create_delay: Duration) -> ClusterNode {
        Self::start_full(dir, capacity, 0, "test-node", None, create_delay, pki().node_tls()).await
    }

    /// [`ClusterNode::start_ruled`] for a node whose creates take `create_delay` longer.
    pub async fn start_ruled_slow(
        dir: &Path,
        capacity: Capacity,
        rules: airlock_server::nodes::NodeRules,
        create_delay: Duration,
    ) -> ClusterNode {
        Self::start_full(
            dir,
            capacity,
            0,
            "test-node",
            Some(rules),
            create_delay,
            pki().node_tls(),
        )
        .await
    }

    async fn start_full(
        dir: &Path,
        capacity: Capacity,
        port: u16,
        name: &str,
        rules: Option<airlock_server::nodes::NodeRules>,
        create_delay: Duration,
        tls: Arc<rustls::ServerConfig>,
    ) -> ClusterNode {
        let name = name.to_string();
        let tokio_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("airlock-test-node")
            .enable_all()
            .build()
            .unwrap();
        let d = dir.to_path_buf();
        let (addr, face, node) = tokio_rt
            .spawn(async move {
                let egress = Config::default().egress;
                let (node, _runtime, _egress) =
                    test_node(&d, &egress, capacity, create_delay, Default::default(), true).await;
                let face =
                    airlock_server::nodes::serve::NodeFace::new(node.clone(), NODE_SECRET, &name, rules).unwrap();
                let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.unwrap();
                let addr = listener.local_addr().unwrap();
                tokio::spawn(airlock_server::listen::serve(
                    listener,
                    face.router(),
                    Some(tls),
                    Limits::default(),
                ));
                (addr, face, node)
            })
            .await
            .unwrap();
        ClusterNode {
            addr,
            dir: dir.to_path_buf(),
            face,
            node,
            tokio: Some(tokio_rt),
        }
    }

    /// Stop as `airlock node` does on SIGTERM, waiting at most `budget` for the replicas
    /// (`node_daemon::drain`); returns how long it took.
    pub async fn drain(&self, budget: Duration) -> Duration {
        let (face, node) = (self.face.clone(), self.node.clone());
        let started = Instant::now();
        self.tokio
            .as_ref()
            .unwrap()
            .spawn(async move { airlock_server::node_daemon::drain(&face, &*node, budget).await })
            .await
            .unwrap();
        started.elapsed()
    }

    /// The node dies at once: its face, its connections and its (fake) VMs go.
    pub fn kill(mut self) {
        if let Some(rt) = self.tokio.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        if let Some(rt) = self.tokio.take() {
            rt.shutdown_background();
        }
    }
}

impl Server {
    /// An API replica: a core over a `Cluster` of the nodes at `nodes`, its store the SQLite
    /// file in `dir` (shared with the other replicas on `dir`), with `config`.
    pub async fn start_replica(dir: &Path, nodes: &[SocketAddr], key: Option<&str>, config: Config) -> Server {
        let tokio_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("airlock-test-replica")
            .enable_all()
            .build()
            .unwrap();
        let (d, nodes, known_key) = (dir.to_path_buf(), nodes.to_vec(), key.map(String::from));
        let (addr, key, core, cluster) = tokio_rt
            .spawn(async move {
                // One file for all replicas, as Postgres is; each leases as a replica of its own.
                let store = SqliteStore::open(&d.join("airlock.db"))
                    .await
                    .unwrap()
                    .with_lease(airlock_server::store::Lease::replica());
                let minted = airlock_server::bootstrap_admin_key(&store, &d, &"127.0.0.1:0".parse().unwrap())
                    .await
                    .unwrap();
                let key = known_key
                    .or(minted)
                    .or_else(|| airlock_server::read_credentials_key(&d).unwrap())
                    .expect("an admin key");
                let mut members: Vec<(String, Arc<dyn Nodes>)> = Vec::new();
                for addr in nodes {
                    members.push((addr.to_string(), Arc::new(RemoteNode::open(addr, node_link()).await)));
                }
                let cluster = Arc::new(Cluster::new(members));
                let (addr, core) = serve_core(Arc::new(store), cluster.clone(), config, false, Limits::default()).await;
                (addr, key, core, cluster)
            })
            .await
            .unwrap();
        Server {
            dir: dir.to_path_buf(),
            max: 0,
            addr,
            key,
            core: Some(core),
            runtime: None,
            tokio: Some(tokio_rt),
            tmp: None,
            node_face: None,
            node_egress: None,
            cluster: Some(cluster),
        }
    }
}
