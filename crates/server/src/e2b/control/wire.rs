//! The E2B control plane's messages as its SDKs send and read them: request bodies and queries
//! (unknown fields kept where they must be refused loudly), and the typed replies.

use crate::model::Snapshot;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};

/// What E2B's `clientID` holds (a cluster node id there); the SDKs only echo it.
pub const CLIENT_ID: &str = "airlock";

/// Request body of `POST /sandboxes` (`NewSandbox`). Unknown fields are kept to be refused loudly.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub timeout: Option<i64>,
    pub auto_pause: Option<bool>,
    /// v2 only: whether an auto-pause keeps memory; airlock's suspend always keeps it.
    pub auto_pause_memory: Option<bool>,
    pub auto_resume: Option<Value>,
    pub env_vars: Option<BTreeMap<String, String>>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub secure: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    pub network: Option<Network>,
    pub mcp: Option<Value>,
    pub volume_mounts: Option<Value>,
    pub iam: Option<Value>,
    #[serde(flatten)]
    pub other: HashMap<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Network {
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub allow_public_traffic: Option<bool>,
    pub mask_request_host: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ForkBody {
    pub timeout: Option<i64>,
    pub count: Option<u32>,
}

/// E2B's snapshot request. Its `memory` (whether the snapshot keeps memory) is not read:
/// airlock's snapshots always do.
#[derive(Debug, Default, Deserialize)]
pub struct SnapshotBody {
    pub name: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotsQuery {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: Option<String>,
    pub name: Option<String>,
    /// 1 to 100; 100 when absent, as E2B.
    pub limit: Option<u32>,
    pub next_token: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct MetricsQuery {
    pub start: Option<i64>,
    pub end: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
pub struct TimeoutBody {
    pub timeout: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MetadataQuery {
    pub metadata: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    pub metadata: Option<String>,
    pub state: Option<String>,
    pub limit: Option<u32>,
    pub next_token: Option<String>,
    /// `asc` or `desc` (the default, as E2B: newest first).
    pub order: Option<String>,
    pub started_after: Option<String>,
    pub started_before: Option<String>,
    pub template: Option<String>,
}

/// A started sandbox (`POST /sandboxes`, `connect`, each fork child): what the SDK needs to
/// reach it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxReply {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: &'static str,
    pub alias: String,
    pub envd_version: &'static str,
    pub envd_access_token: String,
    /// Sandbox ports are never public: this token (`E2B-Traffic-Access-Token`) opens them and
    /// nothing else; envd refuses it.
    pub traffic_access_token: String,
    pub domain: Option<String>,
}

/// `GET /sandboxes/{id}` and each item of a list (`SandboxDetail` / `ListedSandbox`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub alias: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: &'static str,
    pub started_at: String,
    pub end_at: String,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u32,
    /// `running` or `paused` (a suspended sandbox is E2B's paused one).
    pub state: &'static str,
    pub envd_version: &'static str,
    pub metadata: BTreeMap<String, String>,
    pub domain: Option<String>,
    pub allow_internet_access: bool,
    pub lifecycle: LifecycleReply,
    /// The volumes it mounts, by name (`get_info().volume_mounts`).
    #[serde(rename = "volumeMounts", skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMountWire>,
    /// Only on `GET /sandboxes/{id}`, never in a list.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LifecycleReply {
    pub auto_resume: bool,
    /// `kill` or `pause`.
    pub on_timeout: &'static str,
}

/// One child of `POST /sandboxes/{id}/fork`: the sandbox, or its own error.
#[derive(Debug, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ForkResult {
    Sandbox(SandboxReply),
    Error { code: u16, message: String },
}

/// A snapshot as `create_snapshot` and `list_snapshots` read it.
#[derive(Debug, Serialize)]
pub struct SnapshotReply {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub names: Vec<String>,
}

impl From<&Snapshot> for SnapshotReply {
    fn from(s: &Snapshot) -> Self {
        Self {
            snapshot_id: s.id.clone(),
            names: s.name.iter().cloned().collect(),
        }
    }
}

/// `GET /templates/aliases/{alias}`.
#[derive(Debug, Serialize)]
pub struct TemplateAlias {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub public: bool,
}

/// One sample of `GET /sandboxes/{id}/metrics`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MetricsSample {
    pub timestamp: String,
    pub timestamp_unix: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The shapes E2B's SDKs parse: a fork child is `{"sandbox": ...}` or `{"error": ...}`, and a
    /// listed sandbox carries no access token.
    #[test]
    fn replies_have_the_sdks_shapes() {
        let reply = SandboxReply {
            template_id: "base".into(),
            sandbox_id: "abc12345".into(),
            client_id: CLIENT_ID,
            alias: "base".into(),
            envd_version: "0.6.13",
            envd_access_token: "e".into(),
            traffic_access_token: "t".into(),
            domain: None,
        };
        assert_eq!(
            serde_json::to_value(ForkResult::Sandbox(reply)).unwrap(),
            json!({"sandbox": {"templateID": "base", "sandboxID": "abc12345", "clientID": "airlock", "alias": "base",
                "envdVersion": "0.6.13", "envdAccessToken": "e", "trafficAccessToken": "t", "domain": null}})
        );
        assert_eq!(
            serde_json::to_value(ForkResult::Error {
                code: 429,
                message: "m".into()
            })
            .unwrap(),
            json!({"error": {"code": 429, "message": "m"}})
        );
        let detail = SandboxDetail {
            template_id: "base".into(),
            alias: "base".into(),
            sandbox_id: "abc12345".into(),
            client_id: CLIENT_ID,
            started_at: "2026-12-02T00:00:00Z".into(),
            end_at: "2026-12-02T00:05:00Z".into(),
            cpu_count: 1,
            memory_mb: 512,
            disk_size_mb: 2048,
            state: "running",
            envd_version: "0.6.13",
            metadata: BTreeMap::new(),
            domain: None,
            allow_internet_access: false,
            lifecycle: LifecycleReply {
                auto_resume: false,
                on_timeout: "kill",
            },
            volume_mounts: Vec::new(),
            envd_access_token: None,
        };
        let v = serde_json::to_value(&detail).unwrap();
        assert!(v.get("envdAccessToken").is_none());
        assert_eq!(v["memoryMB"], 512);
        assert_eq!(v["diskSizeMB"], 2048);
        assert_eq!(v["startedAt"], "2026-12-02T00:00:00Z");
        assert_eq!(v["lifecycle"], json!({"autoResume": false, "onTimeout": "kill"}));
    }
}

/// Request body of `POST /v3/templates` (`TemplateBuildRequestV3`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewTemplate {
    pub name: Option<String>,
    /// Older SDKs' spelling of `name`.
    pub alias: Option<String>,
    pub tags: Option<Vec<String>>,
    pub cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    pub memory_mb: Option<u32>,
    #[serde(flatten)]
    pub other: HashMap<String, Value>,
}

/// Reply of `POST /v3/templates`; the SDK needs every field.
#[derive(Debug, Serialize)]
pub struct TemplateCreated {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub public: bool,
    pub names: Vec<String>,
    pub aliases: Vec<String>,
    pub tags: Vec<String>,
}

/// Reply of `GET /templates/{id}/files/{hash}`: whether the context is here, and where to PUT
/// it (always given: a forced upload needs it too).
#[derive(Debug, Serialize)]
pub struct FileLink {
    pub present: bool,
    pub url: String,
}

/// Request body of `POST /v2/templates/{id}/builds/{buildID}` (`TemplateBuildStartV2`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateBuildStart {
    pub from_image: Option<String>,
    pub from_template: Option<String>,
    pub from_image_registry: Option<Value>,
    pub force: Option<bool>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    #[serde(default)]
    pub steps: Vec<crate::model::BuildStep>,
    #[serde(flatten)]
    pub other: HashMap<String, Value>,
}

/// Query of `GET /templates/{id}/builds/{buildID}/status`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildStatusQuery {
    pub logs_offset: Option<i64>,
    pub limit: Option<i64>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildLogEntry {
    pub timestamp: String,
    pub level: String,
    pub message: String,
    pub step: String,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildReason {
    pub message: String,
    pub step: String,
    pub log_entries: Vec<BuildLogEntry>,
}

/// Reply of the build status call (`TemplateBuildInfo`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildStatusReply {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub status: String,
    pub logs: Vec<String>,
    pub log_entries: Vec<BuildLogEntry>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<BuildReason>,
}

/// Request body of `POST /templates/tags`.
#[derive(Debug, Deserialize)]
pub struct AssignTags {
    pub target: String,
    pub tags: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct TagsAssigned {
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub tags: Vec<String>,
}

/// Request body of `DELETE /templates/tags`.
#[derive(Debug, Deserialize)]
pub struct RemoveTags {
    pub name: String,
    pub tags: Vec<String>,
}

/// One entry of `GET /templates/{id}/tags`.
#[derive(Debug, Serialize)]
pub struct TagInfo {
    pub tag: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    #[serde(rename = "createdAt")]
    pub created_at: String,
}

/// `POST /volumes`.
#[derive(Debug, Deserialize)]
pub struct NewVolume {
    pub name: String,
}

/// A volume as `GET /volumes` lists it.
#[derive(Debug, Serialize)]
pub struct VolumeReply {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
}

/// A volume with its content token (`POST /volumes`, `GET /volumes/{id}`).
#[derive(Debug, Serialize)]
pub struct VolumeAndToken {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
    pub token: String,
}

/// One of a create's `volumeMounts`: the volume by name.
#[derive(Debug, Deserialize, Serialize)]
pub struct VolumeMountWire {
    pub name: String,
    pub path: String,
}

/// The content API's query: a path in the volume, and for writes who owns what is made.
#[derive(Debug, Deserialize)]
pub struct VolumePathQuery {
    pub path: String,
    pub depth: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
    pub force: Option<bool>,
}

/// A file or directory of a volume (`VolumeEntryStat`).
#[derive(Debug, Serialize)]
pub struct VolumeEntryStat {
    pub name: String,
    /// `file`, `directory`, `symlink` or `unknown`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: String,
    pub mtime: String,
    pub ctime: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}
