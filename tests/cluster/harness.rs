//! The cluster the checks share, with real parts only: Postgres (Debian's 15, as the store
//! tests start it), moto as S3 (bound to the fabric's gateway, so nodes reach it), three
//! `airlock node` processes, each in its own namespace on the fabric with its own data dir and
//! VMM uid range, and two `airlock serve --store postgres://...` replicas on loopback that reach
//! the nodes over the fabric. Started on first use; [`stop`] ends it (also after a failed
//! check): sandboxes deleted through a replica, then every process by its PID, the VMs left by
//! their recorded PIDs, then the namespaces and the bridge.

use super::common::*;
use super::pg_cluster::PgCluster;
use airlock_testnet::s3::{Moto, BUCKET};
use airlock_testnet::{Fabric, FABRIC_GATEWAY};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub const NODES: usize = 3;
/// Where every node's face listens in its namespace.
const NODE_PORT: u16 = 7701;
/// A node silent to every replica this long loses its running sandboxes.
pub const NODE_GRACE: Duration = Duration::from_secs(20);
/// What each node's memory budget fits: four default sandboxes (512 MiB each).
pub const FITS: usize = 4;

static CLUSTER: Mutex<Option<Cluster>> = Mutex::new(None);

/// The cluster, started on first use, whole and empty: what a check before this one killed,
/// cut or left (a failed one too) is started, mended or deleted first.
pub fn cluster() -> MutexGuard<'static, Option<Cluster>> {
    let mut c = CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    match c.as_mut() {
        None => *c = Some(Cluster::start()),
        Some(cluster) => {
            cluster.heal();
            cluster.clear();
        }
    }
    c
}

/// End the cluster, if one was started; with `remove`, its data dirs too (else they stay, with
/// the nodes' and replicas' logs, until the next run).
pub fn stop(remove: bool) {
    let c = CLUSTER.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(mut c) = c {
        c.clear();
        let mut dirs: Vec<PathBuf> = c.nodes.iter().map(|n| n.data.clone()).collect();
        dirs.extend(c.replica_data.iter().cloned());
        dirs.extend(c.secret.parent().map(Path::to_path_buf));
        drop(c);
        if remove {
            for d in dirs {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
}

/// One `airlock node`, in namespace `n` of the fabric.
pub struct Node {
    pub n: usize,
    pub data: PathBuf,
    pub addr: SocketAddr,
    netns: PathBuf,
    secret: PathBuf,
    s3: String,
    child: Option<Child>,
}

impl Node {
    pub fn name(&self) -> String {
        self.addr.to_string()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.data.join("node.log")).unwrap_or_default()
    }

    /// Start it (again) and wait until it listens.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "node {} runs already", self.n);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.data.join("node.log"))
            .unwrap();
        // Each node's own memory budget fits FITS sandboxes: the rest is its host's reserve.
        let reserve = host_memory_mib() - (FITS as u64) * 512;
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.netns.display()))
            .arg("--")
            .arg(BIN)
            .arg("--data-dir")
            .arg(&self.data)
            .args(["node", "--listen", &self.addr.to_string(), "--secret-file"])
            .arg(&self.secret)
            .args(["--objects", &format!("s3://{BUCKET}"), "--s3-endpoint", &self.s3])
            .args(["--memory-reserve-mib", &reserve.to_string()])
            .args(["--drain-seconds", "60"])
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            // Distinct uid ranges: three nodes' jailed VMMs on one host never share a uid.
            .env("AIRLOCK_VMM_UID_BASE", (3_000_000 + 100_000 * self.n).to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(300);
        // It listens in its namespace: reached over the fabric, as replicas reach it.
        while std::net::TcpStream::connect_timeout(&self.addr, Duration::from_millis(500)).is_err() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("node {} exited at start ({status}): {}", self.n, self.log());
            }
            assert!(
                Instant::now() < deadline,
                "node {} did not listen: {}",
                self.n,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `kill -9`: the node dies, its VMs (their own processes) run on.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe { libc::kill(c.id() as i32, libc::SIGKILL) };
            let _ = c.wait();
        }
    }

    /// Each change it was asked for, as its log names them: (method, path, operation id, or
    /// `-` for none).
    pub fn changes(&self) -> Vec<(String, String, String)> {
        self.log()
            .lines()
            .filter_map(|l| {
                let mut words = l.split_once("change: ")?.1.split_whitespace();
                let (method, path) = (words.next()?, words.next()?);
                let op = words.next()?.strip_prefix("op=")?;
                Some((method.to_string(), path.to_string(), op.to_string()))
            })
            .collect()
    }

    /// The sandbox has a VM (live, paused or suspended) here.
    pub fn has(&self, id: &str) -> bool {
        self.data.join("sandboxes").join(id).exists()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill9();
        end_vms_left_in(&self.data);
    }
}

/// The host's memory, as a node reads it (MemTotal).
fn host_memory_mib() -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kib / 1024
}

pub struct Cluster {
    /// Dropped in this order: replicas, nodes (and their VMs), S3, Postgres, the fabric.
    pub replicas: Vec<Server>,
    pub nodes: Vec<Node>,
    /// Held for their drop: ended with the cluster.
    _moto: Moto,
    _pg: PgCluster,
    pub fabric: Fabric,
    /// The Postgres URL replicas use.
    pub store: String,
    replica_data: Vec<PathBuf>,
    secret: PathBuf,
}

impl Cluster {
    fn start() -> Cluster {
        let t = Instant::now();
        build_template(&test_data_dir(), "seed");
        let fabric = Fabric::new(NODES).expect("the fabric's namespaces and bridge");
        let pg = PgCluster::start();
        let store = tokio::runtime::Runtime::new().unwrap().block_on(pg.database());
        let moto = Moto::start(Path::new(env!("CARGO_TARGET_TMPDIR")), FABRIC_GATEWAY.into()).expect("moto");
        let shared = PathBuf::from(format!("{}-cluster", test_data_dir().display()));
        std::fs::create_dir_all(&shared).unwrap();
        let secret = shared.join("cluster.secret");
        std::fs::write(&secret, "the cluster test's secret, at least 32 bytes long\n").unwrap();
        let mut nodes = Vec::new();
        for n in 0..NODES {
            // Node 0 has `seed` and puts it in object storage; the others start empty and
            // pull it (check 6 over S3).
            let data = if n == 0 {
                data_dir_with_templates("cluster-node0")
            } else {
                let d = data_dir_with_templates(&format!("cluster-node{n}"));
                for sub in ["blobs", "templates", "accel.json"] {
                    let p = d.join(sub);
                    let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
                }
                d
            };
            let mut node = Node {
                n,
                data,
                addr: SocketAddr::new(Fabric::addr(n).into(), NODE_PORT),
                netns: fabric.host(n).path(),
                secret: secret.clone(),
                s3: moto.endpoint.clone(),
                child: None,
            };
            node.start();
            nodes.push(node);
        }
        let mut cluster = Cluster {
            replicas: Vec::new(),
            nodes,
            _moto: moto,
            _pg: pg,
            fabric,
            store,
            replica_data: Vec::new(),
            secret,
        };
        for r in 0..2 {
            let data = data_dir_with_templates(&format!("cluster-replica{r}"));
            // A replica runs no VM: it needs no template.
            let _ = std::fs::remove_dir_all(data.join("templates"));
            cluster.replica_data.push(data);
        }
        for r in 0..2 {
            let s = cluster.start_replica(r);
            cluster.replicas.push(s);
        }
        println!(
            "cluster: Postgres, S3, {NODES} nodes and 2 replicas up in {:?}",
            t.elapsed()
        );
        cluster
    }

    /// Replica `r` on its data dir; the second shares the first's server secret and key (as a
    /// Kubernetes Secret gives every replica the same).
    fn start_replica(&self, r: usize) -> Server {
        let data = &self.replica_data[r];
        if r > 0 {
            for f in ["server.secret", "credentials"] {
                std::fs::copy(self.replica_data[0].join(f), data.join(f)).unwrap();
            }
        }
        let nodes: Vec<String> = self.nodes.iter().map(|n| n.name()).collect();
        let grace = NODE_GRACE.as_secs().to_string();
        let reserve = (host_memory_mib() - (FITS as u64) * 512).to_string();
        let mut args = vec!["--store", self.store.as_str(), "--node-secret-file"];
        let secret = self.secret.to_string_lossy().to_string();
        args.push(&secret);
        let nodes = nodes.join(",");
        args.extend(["--node", nodes.as_str(), "--node-grace-seconds", grace.as_str()]);
        args.extend([
            "--memory-reserve-mib",
            reserve.as_str(),
            "--max-creates-per-minute",
            "1000",
        ]);
        Server::start_with(data, &args)
    }

    /// Restart replica `r` (after it was killed).
    pub fn restart_replica(&mut self, r: usize) {
        let s = self.start_replica(r);
        self.replicas[r] = s;
    }

    /// The node a sandbox's record names (its address).
    pub fn node_of(&self, id: &str) -> String {
        let (status, sb) = self.replicas[0].call("GET", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(status, 200, "{sb}");
        let holders: Vec<usize> = self.nodes.iter().filter(|n| n.has(id)).map(|n| n.n).collect();
        assert_eq!(holders.len(), 1, "{id} has VMs on nodes {holders:?}");
        self.nodes[holders[0]].name()
    }

    /// The index of the node holding sandbox `id`'s VM.
    pub fn holder(&self, id: &str) -> usize {
        let name = self.node_of(id);
        self.nodes.iter().position(|n| n.name() == name).unwrap()
    }

    /// Every node and replica running, every link up.
    fn heal(&mut self) {
        for n in 0..NODES {
            let _ = self.fabric.mend(n);
            if self.nodes[n].child.is_none() {
                self.nodes[n].start();
            }
        }
        for r in 0..self.replicas.len() {
            if !matches!(self.replicas[r].child.try_wait(), Ok(None)) {
                self.restart_replica(r);
            }
        }
    }

    /// Delete every sandbox the replicas list, through the first one that answers.
    fn clear(&mut self) {
        let Some(s) = self
            .replicas
            .iter()
            .find(|s| ureq::get(&format!("{}/readyz", s.url)).call().is_ok())
        else {
            return;
        };
        // The default list (creating, running, paused, deleting), and the suspended ones.
        for query in ["", "&state=suspended"] {
            let (_, list) = s.call("GET", &format!("/v1/sandboxes?limit=100{query}"), None);
            for sb in list["sandboxes"].as_array().cloned().unwrap_or_default() {
                let id = sb["id"].as_str().unwrap_or_default();
                let _ = s.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while self
            .nodes
            .iter()
            .any(|n| std::fs::read_dir(n.data.join("sandboxes")).is_ok_and(|mut d| d.next().is_some()))
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// A create through `via` that must succeed; the sandbox id.
pub fn create(via: &Server, timeout: &str) -> String {
    via.create(json!({ "template": "seed", "timeout": timeout }))
}

/// A session's stdout, run to its end.
pub fn run(via: &Server, id: &str, argv: &[&str]) -> String {
    let sid = via.session(id, json!({ "argv": argv }));
    decode(&via.events(id, &sid, None, None), "stdout")
}

/// Sandbox `id` as `via` answers it.
pub fn sandbox(via: &Server, id: &str) -> Value {
    via.call("GET", &format!("/v1/sandboxes/{id}"), None).1
}
