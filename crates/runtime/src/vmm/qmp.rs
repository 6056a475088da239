//! Minimal QMP client: enough to ask QEMU to quit (and, later, to save and restore state).

use serde_json::Value;
use std::path::Path;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

pub struct Qmp {
    reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    writer: tokio::net::unix::OwnedWriteHalf,
}

impl Qmp {
    pub async fn connect(path: &Path) -> std::io::Result<Self> {
        let (r, w) = UnixStream::connect(path).await?.into_split();
        let mut qmp = Self {
            reader: BufReader::new(r),
            writer: w,
        };
        qmp.read_message().await?; // greeting
        qmp.execute("qmp_capabilities", None).await?;
        Ok(qmp)
    }

    async fn read_message(&mut self) -> std::io::Result<Value> {
        let mut line = String::new();
        if self.reader.read_line(&mut line).await? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "QMP closed"));
        }
        serde_json::from_str(&line).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    /// Run a command and return its `return` value (events in between are skipped).
    pub async fn execute(&mut self, cmd: &str, args: Option<Value>) -> std::io::Result<Value> {
        let mut msg = serde_json::json!({ "execute": cmd });
        if let Some(a) = args {
            msg["arguments"] = a;
        }
        let mut bytes = serde_json::to_vec(&msg).expect("serializable");
        bytes.push(b'\n');
        self.writer.write_all(&bytes).await?;
        loop {
            let m = self.read_message().await?;
            if let Some(r) = m.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = m.get("error") {
                return Err(std::io::Error::other(format!("QMP {cmd}: {e}")));
            }
        }
    }
}
