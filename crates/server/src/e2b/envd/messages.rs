//! envd's Connect messages (`process.Process`, `filesystem.Filesystem`) as protobuf's JSON
//! mapping spells them (E2B's `process/process.proto`, `filesystem/filesystem.proto`, in
//! e2b-dev/infra's `packages/envd/spec/`): camelCase names (the proto's snake_case names
//! read too), int64 as strings, bytes as base64, enums by name. Requests read as leniently as
//! protobuf's parser does (a null is the default; numbers as strings; unknown fields ignored).
//! Pure wire types: no core calls here.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;

// --- Field codecs

/// A null (or a missing field) reads as the default, as protobuf's JSON parser has it.
fn nullable<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// An integer field, as a number or a decimal string (int64/uint32 in protobuf's JSON).
fn flex_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Flex {
        N(u64),
        S(String),
    }
    match Option::<Flex>::deserialize(d)? {
        None => Ok(None),
        Some(Flex::N(n)) => Ok(Some(n)),
        Some(Flex::S(s)) => s
            .parse()
            .map(Some)
            .map_err(|_| serde::de::Error::custom(format!("{s:?} is not an integer"))),
    }
}

/// A bytes field: base64, standard or URL-safe, padded or not.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Base64(pub Vec<u8>);

impl<'de> Deserialize<'de> for Base64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use base64::Engine as _;
        let s = Option::<String>::deserialize(d)?.unwrap_or_default();
        base64::engine::general_purpose::STANDARD
            .decode(&s)
            .or_else(|_| base64::engine::general_purpose::URL_SAFE.decode(&s))
            .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(s.trim_end_matches('=')))
            .map(Base64)
            .map_err(|e| serde::de::Error::custom(format!("bad base64: {e}")))
    }
}

impl Serialize for Base64 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use base64::Engine as _;
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(&self.0))
    }
}

/// An int64 field as protobuf's JSON writes it: a decimal string.
fn int64_string<S: Serializer>(n: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(n)
}

/// The empty message (`UpdateResponse`, `RemoveResponse`, a `KeepAlive`, ...): `{}`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Empty {}

// --- process.Process

/// `ProcessSelector`: `{pid}` or `{tag}`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ProcessSelector {
    #[serde(default, deserialize_with = "flex_u64")]
    pub pid: Option<u64>,
    #[serde(default)]
    pub tag: Option<String>,
}

/// `ProcessConfig`, in a `StartRequest` and in `ProcessInfo`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ProcessConfig {
    #[serde(default, deserialize_with = "nullable")]
    pub cmd: String,
    #[serde(default, deserialize_with = "nullable")]
    pub args: Vec<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub envs: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
}

/// `PTY`: `{size: {cols, rows}}`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Pty {
    #[serde(default)]
    pub size: Option<PtySize>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct PtySize {
    #[serde(default, deserialize_with = "flex_u64")]
    pub cols: Option<u64>,
    #[serde(default, deserialize_with = "flex_u64")]
    pub rows: Option<u64>,
}

/// `Signal`: its enum name (`SIGNAL_SIGKILL`) or number.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum SignalValue {
    Number(i64),
    Name(String),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StartRequest {
    #[serde(default)]
    pub process: Option<ProcessConfig>,
    #[serde(default)]
    pub pty: Option<Pty>,
    #[serde(default)]
    pub tag: Option<String>,
    #[serde(default)]
    pub stdin: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ConnectRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
}

pub type ListRequest = Empty;

#[derive(Debug, Clone, Default, Deserialize)]
pub struct SendInputRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub input: Option<ProcessInput>,
}

/// `ProcessInput`: `{stdin}` or `{pty}` bytes.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ProcessInput {
    #[serde(default)]
    pub stdin: Option<Base64>,
    #[serde(default)]
    pub pty: Option<Base64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct SendSignalRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub signal: Option<SignalValue>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct UpdateRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub pty: Option<Pty>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct CloseStdinRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
}

/// `StartResponse` and `ConnectResponse`: one `ProcessEvent` each.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessEventMessage {
    pub event: ProcessEvent,
}

pub type StartResponse = ProcessEventMessage;
pub type ConnectResponse = ProcessEventMessage;

/// `ProcessEvent`'s oneof: `{"start": {"pid"}}`, `{"data": {...}}`, `{"end": {...}}`,
/// `{"keepalive": {}}`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessEvent {
    Start { pid: u32 },
    Data(DataEvent),
    End(EndEvent),
    Keepalive {},
}

/// `DataEvent`'s oneof.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DataEvent {
    Stdout(Base64),
    Stderr(Base64),
    Pty(Base64),
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `ProcessInfo`, an entry of `ListResponse`.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessInfo {
    pub config: ProcessConfig,
    pub pid: u32,
    pub tag: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ListResponse {
    pub processes: Vec<ProcessInfo>,
}

pub type SendInputResponse = Empty;
pub type SendSignalResponse = Empty;
pub type UpdateResponse = Empty;
pub type CloseStdinResponse = Empty;

// --- filesystem.Filesystem

#[derive(Debug, Clone, Default, Deserialize)]
pub struct PathRequest {
    #[serde(default, deserialize_with = "nullable")]
    pub path: String,
}

pub type StatRequest = PathRequest;
pub type MakeDirRequest = PathRequest;
pub type RemoveRequest = PathRequest;

#[derive(Debug, Clone, Default, Deserialize)]
pub struct MoveRequest {
    #[serde(default, deserialize_with = "nullable")]
    pub source: String,
    #[serde(default, deserialize_with = "nullable")]
    pub destination: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ListDirRequest {
    #[serde(default, deserialize_with = "nullable")]
    pub path: String,
    #[serde(default, deserialize_with = "flex_u64")]
    pub depth: Option<u64>,
}

/// `WatchDirRequest` and `CreateWatcherRequest`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchRequest {
    #[serde(default, deserialize_with = "nullable")]
    pub path: String,
    #[serde(default, deserialize_with = "nullable")]
    pub recursive: bool,
    /// Newer SDKs' `include_entry=True`: each event carries the entry.
    #[serde(default, deserialize_with = "nullable", alias = "include_entry")]
    pub include_entry: bool,
}

pub type WatchDirRequest = WatchRequest;
pub type CreateWatcherRequest = WatchRequest;

/// `GetWatcherEventsRequest` and `RemoveWatcherRequest`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatcherRequest {
    #[serde(default, deserialize_with = "nullable", alias = "watcher_id")]
    pub watcher_id: String,
}

pub type GetWatcherEventsRequest = WatcherRequest;
pub type RemoveWatcherRequest = WatcherRequest;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum FileType {
    #[serde(rename = "FILE_TYPE_UNSPECIFIED")]
    Unspecified,
    #[serde(rename = "FILE_TYPE_FILE")]
    File,
    #[serde(rename = "FILE_TYPE_DIRECTORY")]
    Directory,
}

/// `EntryInfo`, with the fields newer envds add (`isSymlink`, `metadata`) where they apply.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub file_type: FileType,
    pub path: String,
    #[serde(serialize_with = "int64_string")]
    pub size: u64,
    pub mode: u32,
    pub permissions: String,
    pub owner: String,
    pub group: String,
    /// RFC 3339.
    pub modified_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub is_symlink: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// `StatResponse`, `MakeDirResponse`, `MoveResponse`: one entry.
#[derive(Debug, Clone, Serialize)]
pub struct EntryResponse {
    pub entry: EntryInfo,
}

pub type StatResponse = EntryResponse;
pub type MakeDirResponse = EntryResponse;
pub type MoveResponse = EntryResponse;

#[derive(Debug, Clone, Serialize)]
pub struct ListDirResponse {
    pub entries: Vec<EntryInfo>,
}

pub type RemoveResponse = Empty;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum EventType {
    #[serde(rename = "EVENT_TYPE_CREATE")]
    Create,
    #[serde(rename = "EVENT_TYPE_WRITE")]
    Write,
    #[serde(rename = "EVENT_TYPE_REMOVE")]
    Remove,
    #[serde(rename = "EVENT_TYPE_RENAME")]
    Rename,
    #[serde(rename = "EVENT_TYPE_CHMOD")]
    Chmod,
}

/// `FilesystemEvent`: a name relative to the watched dir, with the entry when asked for.
#[derive(Debug, Clone, Serialize)]
pub struct FilesystemEvent {
    pub name: String,
    #[serde(rename = "type")]
    pub event_type: EventType,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

/// `WatchDirResponse`'s oneof: `{"start": {}}`, `{"filesystem": {...}}`, `{"keepalive": {}}`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "lowercase")]
#[allow(clippy::large_enum_variant)] // one message at a time, serialized at once
pub enum WatchDirResponse {
    Start {},
    Filesystem(FilesystemEvent),
    Keepalive {},
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateWatcherResponse {
    pub watcher_id: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct GetWatcherEventsResponse {
    pub events: Vec<FilesystemEvent>,
}

pub type RemoveWatcherResponse = Empty;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn requests_read_as_protobufs_json_parser_does() {
        // The SDK's Start, with int-as-string and a null the parser treats as unset.
        let r: StartRequest = read(json!({
            "process": { "cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": null, "cwd": "/tmp" },
            "pty": { "size": { "cols": "100", "rows": 30 } },
            "stdin": false,
            "unknown": 1,
        }));
        let p = r.process.unwrap();
        assert_eq!((p.cmd.as_str(), p.args.len(), p.envs.len()), ("/bin/bash", 3, 0));
        let size = r.pty.unwrap().size.unwrap();
        assert_eq!((size.cols, size.rows, r.stdin), (Some(100), Some(30), Some(false)));
        let s: SendSignalRequest = read(json!({ "process": { "pid": "7" }, "signal": "SIGNAL_SIGKILL" }));
        assert_eq!(s.process.unwrap().pid, Some(7));
        assert!(matches!(s.signal, Some(SignalValue::Name(n)) if n == "SIGNAL_SIGKILL"));
        let s: SendSignalRequest = read(json!({ "process": { "tag": "t" }, "signal": 15 }));
        assert!(matches!(s.signal, Some(SignalValue::Number(15))));
        let i: SendInputRequest = read(json!({ "process": { "pid": 7 }, "input": { "stdin": "aGVsbG8K" } }));
        assert_eq!(i.input.unwrap().stdin.unwrap().0, b"hello\n");
        // Both spellings of a field whose JSON name differs.
        let w: WatcherRequest = read(json!({ "watcherId": "w1" }));
        assert_eq!(w.watcher_id, "w1");
        let w: WatcherRequest = read(json!({ "watcher_id": "w2" }));
        assert_eq!(w.watcher_id, "w2");
        let w: WatchRequest = read(json!({ "path": "/a", "include_entry": true }));
        assert!(w.include_entry && !w.recursive);
        let l: ListDirRequest = read(json!({ "path": "/a" }));
        assert_eq!(l.depth, None);
        assert!(serde_json::from_value::<ListDirRequest>(json!({ "depth": "deep" })).is_err());
    }

    #[test]
    fn responses_are_protobufs_json() {
        let start = ProcessEventMessage {
            event: ProcessEvent::Start { pid: 4242 },
        };
        assert_eq!(
            serde_json::to_value(&start).unwrap(),
            json!({"event": {"start": {"pid": 4242}}})
        );
        let data = ProcessEventMessage {
            event: ProcessEvent::Data(DataEvent::Stdout(Base64(b"hello\n".to_vec()))),
        };
        assert_eq!(
            serde_json::to_value(&data).unwrap(),
            json!({"event": {"data": {"stdout": "aGVsbG8K"}}})
        );
        let end = ProcessEvent::End(EndEvent {
            exit_code: 0,
            exited: true,
            status: "exit status 0".into(),
            error: None,
        });
        assert_eq!(
            serde_json::to_value(&end).unwrap(),
            json!({"end": {"exitCode": 0, "exited": true, "status": "exit status 0"}})
        );
        assert_eq!(
            serde_json::to_value(ProcessEvent::Keepalive {}).unwrap(),
            json!({"keepalive": {}})
        );
        assert_eq!(
            serde_json::to_value(WatchDirResponse::Start {}).unwrap(),
            json!({"start": {}})
        );
        assert_eq!(serde_json::to_value(Empty {}).unwrap(), json!({}));
        let entry = EntryInfo {
            name: "probe.txt".into(),
            file_type: FileType::File,
            path: "/home/user/probe.txt".into(),
            size: 17,
            mode: 0o644,
            permissions: "-rw-r--r--".into(),
            owner: "user".into(),
            group: "user".into(),
            modified_time: "2025-01-01T00:00:00Z".into(),
            is_symlink: None,
            symlink_target: None,
            metadata: BTreeMap::new(),
        };
        assert_eq!(
            serde_json::to_value(&entry).unwrap(),
            json!({"name": "probe.txt", "type": "FILE_TYPE_FILE", "path": "/home/user/probe.txt", "size": "17",
                   "mode": 420, "permissions": "-rw-r--r--", "owner": "user", "group": "user",
                   "modifiedTime": "2025-01-01T00:00:00Z"})
        );
        assert_eq!(
            serde_json::to_value(CreateWatcherResponse {
                watcher_id: "w1".into()
            })
            .unwrap(),
            json!({"watcherId": "w1"})
        );
    }
}
