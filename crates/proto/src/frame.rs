//! Binary framing of a process's event stream.
//!
//! Each frame: `tag: u8 | seq: u64 BE | len: u32 BE | payload`. `seq` numbers every frame of one
//! process from 1 so a reader can resume after the last frame it saw, without loss or duplicates.
//! Output travels as raw bytes (no base64 inside the VM, where CPU is scarce under TCG).

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::ExitStatus;

pub const HEADER_LEN: usize = 1 + 8 + 4;
/// Largest payload a frame may carry; bigger output is split.
pub const MAX_PAYLOAD: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    Stdout(Bytes),
    Stderr(Bytes),
    Exit(ExitStatus),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub seq: u64,
    pub kind: EventKind,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("unknown frame tag {0}")]
    UnknownTag(u8),
    #[error("frame payload of {0} bytes exceeds the limit")]
    TooLarge(usize),
    #[error("bad exit payload: {0}")]
    BadExit(String),
}

const TAG_STDOUT: u8 = 1;
const TAG_STDERR: u8 = 2;
const TAG_EXIT: u8 = 3;

impl Event {
    pub fn encode(&self, out: &mut BytesMut) {
        let (tag, payload): (u8, Bytes) = match &self.kind {
            EventKind::Stdout(b) => (TAG_STDOUT, b.clone()),
            EventKind::Stderr(b) => (TAG_STDERR, b.clone()),
            EventKind::Exit(status) => (
                TAG_EXIT,
                Bytes::from(serde_json::to_vec(status).expect("exit status serializes")),
            ),
        };
        out.reserve(HEADER_LEN + payload.len());
        out.put_u8(tag);
        out.put_u64(self.seq);
        out.put_u32(payload.len() as u32);
        out.put_slice(&payload);
    }

    /// Number of bytes this event occupies on the wire (used to bound retained output).
    pub fn wire_len(&self) -> usize {
        HEADER_LEN
            + match &self.kind {
                EventKind::Stdout(b) | EventKind::Stderr(b) => b.len(),
                EventKind::Exit(_) => 64,
            }
    }
}

/// Incremental decoder: feed bytes as they arrive, take whole events out.
#[derive(Default)]
pub struct Decoder {
    buf: BytesMut,
}

impl Decoder {
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Next complete event, `Ok(None)` when more bytes are needed.
    pub fn next_event(&mut self) -> Result<Option<Event>, FrameError> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let tag = self.buf[0];
        let seq = u64::from_be_bytes(self.buf[1..9].try_into().expect("8 bytes"));
        let len = u32::from_be_bytes(self.buf[9..13].try_into().expect("4 bytes")) as usize;
        if len > MAX_PAYLOAD {
            return Err(FrameError::TooLarge(len));
        }
        if self.buf.len() < HEADER_LEN + len {
            return Ok(None);
        }
        self.buf.advance(HEADER_LEN);
        let payload = self.buf.split_to(len).freeze();
        let kind = match tag {
            TAG_STDOUT => EventKind::Stdout(payload),
            TAG_STDERR => EventKind::Stderr(payload),
            TAG_EXIT => {
                EventKind::Exit(serde_json::from_slice(&payload).map_err(|e| FrameError::BadExit(e.to_string()))?)
            }
            other => return Err(FrameError::UnknownTag(other)),
        };
        Ok(Some(Event { seq, kind }))
    }

    /// Bytes received that do not yet form a whole frame.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(events: &[Event]) -> Vec<Event> {
        let mut wire = BytesMut::new();
        for e in events {
            e.encode(&mut wire);
        }
        // Feed one byte at a time: the decoder must cope with any split.
        let mut dec = Decoder::default();
        let mut out = Vec::new();
        for b in wire.iter() {
            dec.push(&[*b]);
            while let Some(e) = dec.next_event().unwrap() {
                out.push(e);
            }
        }
        assert_eq!(dec.pending(), 0);
        out
    }

    #[test]
    fn frames_roundtrip_across_arbitrary_splits() {
        let events = vec![
            Event {
                seq: 1,
                kind: EventKind::Stdout(Bytes::from_static(b"hello\n")),
            },
            Event {
                seq: 2,
                kind: EventKind::Stderr(Bytes::from_static(b"\x00\xffbinary")),
            },
            Event {
                seq: 3,
                kind: EventKind::Stdout(Bytes::new()),
            },
            Event {
                seq: 4,
                kind: EventKind::Exit(ExitStatus {
                    exit_code: None,
                    signal: Some(9),
                    timed_out: true,
                }),
            },
        ];
        assert_eq!(roundtrip(&events), events);
    }

    #[test]
    fn rejects_unknown_tag_and_oversized_payload() {
        let mut dec = Decoder::default();
        dec.push(&[9, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]);
        assert_eq!(dec.next_event(), Err(FrameError::UnknownTag(9)));

        let mut dec = Decoder::default();
        let mut hdr = vec![1u8];
        hdr.extend_from_slice(&1u64.to_be_bytes());
        hdr.extend_from_slice(&((MAX_PAYLOAD as u32) + 1).to_be_bytes());
        dec.push(&hdr);
        assert_eq!(dec.next_event(), Err(FrameError::TooLarge(MAX_PAYLOAD + 1)));
    }
}
