//! Minimal QMP client: quit, pause, save and restore state, and hand QEMU a file (`add-fd`).

use serde_json::Value;
use std::path::Path;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// The longest QMP message read.
const MAX_MESSAGE: u64 = 1 << 20;

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
        use tokio::io::AsyncReadExt;
        let mut line = String::new();
        // Bounded: QEMU runs what the guest drives, and its answers here are a few hundred bytes.
        if (&mut self.reader).take(MAX_MESSAGE).read_line(&mut line).await? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "QMP closed"));
        }
        if !line.ends_with('\n') && line.len() as u64 >= MAX_MESSAGE {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("QMP message longer than {MAX_MESSAGE} bytes"),
            ));
        }
        serde_json::from_str(&line).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    /// Run a command and return its `return` value (events in between are skipped).
    pub async fn execute(&mut self, cmd: &str, args: Option<Value>) -> std::io::Result<Value> {
        let bytes = command(cmd, args);
        self.writer.write_all(&bytes).await?;
        self.answer(cmd).await
    }

    /// Run a command with `fd` passed along (SCM_RIGHTS), as `add-fd` and `getfd` take theirs:
    /// how a jailed QEMU gets a file it cannot open itself, after it started.
    pub async fn execute_with_fd(
        &mut self,
        cmd: &str,
        args: Option<Value>,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> std::io::Result<Value> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        use std::os::fd::AsRawFd;
        let bytes = command(cmd, args);
        let stream: &UnixStream = self.writer.as_ref();
        let sent = loop {
            stream.writable().await?;
            let attempt = stream.try_io(tokio::io::Interest::WRITABLE, || {
                let iov = [std::io::IoSlice::new(&bytes)];
                let fds = [fd.as_raw_fd()];
                let cmsg = [ControlMessage::ScmRights(&fds)];
                sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None).map_err(std::io::Error::from)
            });
            match attempt {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        };
        // The fd went with the first byte; the rest of the line is plain.
        self.writer.write_all(&bytes[sent..]).await?;
        self.answer(cmd).await
    }

    async fn answer(&mut self, cmd: &str) -> std::io::Result<Value> {
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

/// A command as one line of JSON.
fn command(cmd: &str, args: Option<Value>) -> Vec<u8> {
    let mut msg = serde_json::json!({ "execute": cmd });
    if let Some(a) = args {
        msg["arguments"] = a;
    }
    let mut bytes = serde_json::to_vec(&msg).expect("serializable");
    bytes.push(b'\n');
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A QMP socket that greets, then writes `after` for whatever it is sent.
    async fn peer(after: Vec<u8>) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(b"{\"QMP\": {}}\n{\"return\": {}}\n").await.unwrap();
            let _ = s.write_all(&after).await;
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        });
        (dir, path)
    }

    #[tokio::test]
    async fn an_endless_message_is_refused_not_buffered() {
        let (_dir, path) = peer(vec![b'x'; 3 << 20]).await;
        let mut qmp = Qmp::connect(&path).await.unwrap();
        let err = qmp.execute("query-status", None).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");
        assert!(err.to_string().contains("longer than"), "{err}");
    }

    #[tokio::test]
    async fn answers_come_back_past_events() {
        let (_dir, path) = peer(b"{\"event\": \"STOP\"}\n{\"return\": {\"status\": \"paused\"}}\n".to_vec()).await;
        let mut qmp = Qmp::connect(&path).await.unwrap();
        assert_eq!(qmp.execute("query-status", None).await.unwrap()["status"], "paused");
    }
}
