//! The requests of a plain-HTTP connection, framed as they stream from the guest, so that every
//! request head is judged before it is passed on (not only the first: a keep-alive or pipelined
//! request naming another host would otherwise reach the first one's address).
//!
//! Bodies are framed as RFC 9112 §6 says a server does: `Transfer-Encoding: chunked`, else
//! `Content-Length`, else none. What two parsers could frame differently is refused, not guessed:
//! both headers, two Transfer-Encodings, any coding but `chunked` alone, Content-Lengths that
//! disagree or aren't digits, a chunk line that isn't `hex[;ext]CRLF`, a head past the limit.
//! Bytes are passed on only once they are known to be body or framing, so a refused stream never
//! hands the upstream a whole request it was not meant to get.

use crate::sniff::{self, Sniffed};

/// One request head, complete, not yet passed on.
#[derive(Debug)]
pub(crate) struct RequestHead {
    /// The head as read, to pass on once judged.
    pub bytes: Vec<u8>,
    pub name: Sniffed,
    /// 1 for the connection's first request.
    pub index: u64,
    pub connect: bool,
    pub upgrade: Option<Upgrade>,
    /// Whether a body follows.
    pub has_body: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Upgrade {
    WebSocket,
    Other,
}

#[derive(Debug)]
pub(crate) enum Step<'a> {
    /// Body bytes (or chunk framing), checked: pass them on.
    Pass(&'a [u8]),
    /// A complete head: judge it, then pass on its bytes.
    Head(RequestHead),
    /// The input is used up.
    More,
    /// The stream can't be framed safely: stop passing anything on.
    Refuse(&'static str),
}

#[derive(Debug)]
pub(crate) struct RequestFramer {
    state: State,
    head: Vec<u8>,
    max_head: usize,
    requests: u64,
}

#[derive(Debug, Clone, Copy)]
enum State {
    Head,
    Body(u64),
    Chunk(Chunk),
    Refused(&'static str),
}

/// Where in a chunked body (RFC 9112 §7.1), byte by byte.
#[derive(Debug, Clone, Copy)]
enum Chunk {
    /// The size's hex digits so far.
    Size {
        digits: u8,
        size: u64,
    },
    /// `;ext` after the size, up to CR.
    Ext {
        size: u64,
        len: usize,
    },
    SizeLf {
        size: u64,
    },
    Data(u64),
    DataCr,
    DataLf,
    /// A trailer line (`len` bytes of it so far; 0: at its start), `total` trailer bytes.
    Trailer {
        len: usize,
        total: usize,
    },
    TrailerLf {
        total: usize,
    },
    EndLf,
}

/// Longest chunk extension accepted.
const MAX_CHUNK_EXT: usize = 1024;

enum Framing {
    Length(u64),
    Chunked,
}

impl RequestFramer {
    /// `max_head`: the largest request head accepted (and the largest trailer section).
    pub fn new(max_head: usize) -> Self {
        RequestFramer {
            state: State::Head,
            head: Vec::new(),
            max_head,
            requests: 0,
        }
    }

    /// The next thing `input` holds, consuming what it covers.
    pub fn step<'a>(&mut self, input: &mut &'a [u8]) -> Step<'a> {
        let step = match self.state {
            State::Refused(why) => return Step::Refuse(why),
            _ if input.is_empty() => return Step::More,
            State::Head => self.head_step(input),
            State::Body(left) => {
                let n = left.min(input.len() as u64) as usize;
                let (body, rest) = input.split_at(n);
                *input = rest;
                self.state = if left == n as u64 {
                    State::Head
                } else {
                    State::Body(left - n as u64)
                };
                Step::Pass(body)
            }
            State::Chunk(c) => self.chunk_step(c, input),
        };
        if let Step::Refuse(why) = step {
            self.state = State::Refused(why);
        }
        step
    }

    fn head_step<'a>(&mut self, input: &mut &'a [u8]) -> Step<'a> {
        let before = self.head.len();
        let take = input.len().min(self.max_head - before);
        let new = &input[..take];
        self.head.extend_from_slice(new);
        // A head ends with a newline: parse only when one arrives (a guest dripping a byte at a
        // time costs a parse per line, not per byte), or while it is short (to refuse what is
        // not HTTP at once).
        if before < 16 || new.contains(&b'\n') {
            let mut headers = [httparse::EMPTY_HEADER; sniff::MAX_HEADERS];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&self.head) {
                Ok(httparse::Status::Partial) => {}
                Err(httparse::Error::TooManyHeaders) => return Step::Refuse("too many request headers"),
                Err(_) => return Step::Refuse("not an HTTP/1 request"),
                Ok(httparse::Status::Complete(len)) => {
                    let framing = match framing(&req) {
                        Ok(f) => f,
                        Err(why) => return Step::Refuse(why),
                    };
                    let name = sniff::request_name(&req);
                    let connect = req.method.is_some_and(|m| m.eq_ignore_ascii_case("CONNECT"));
                    let upgrade = req
                        .headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case("upgrade"))
                        .map(|h| {
                            if std::str::from_utf8(h.value).is_ok_and(|v| v.trim().eq_ignore_ascii_case("websocket")) {
                                Upgrade::WebSocket
                            } else {
                                Upgrade::Other
                            }
                        });
                    *input = &input[len - before..];
                    self.head.truncate(len);
                    let bytes = std::mem::take(&mut self.head);
                    self.state = match framing {
                        Framing::Length(0) => State::Head,
                        Framing::Length(n) => State::Body(n),
                        Framing::Chunked => State::Chunk(Chunk::Size { digits: 0, size: 0 }),
                    };
                    self.requests += 1;
                    return Step::Head(RequestHead {
                        bytes,
                        name,
                        index: self.requests,
                        connect,
                        upgrade,
                        has_body: !matches!(self.state, State::Head),
                    });
                }
            }
        }
        *input = &input[take..];
        if self.head.len() >= self.max_head {
            return Step::Refuse("request head too large");
        }
        Step::More
    }

    /// Checks chunk framing byte by byte (data in bulk) and passes on what it covered.
    fn chunk_step<'a>(&mut self, mut c: Chunk, input: &mut &'a [u8]) -> Step<'a> {
        let data = *input;
        let mut i = 0;
        while i < data.len() {
            if let Chunk::Data(left) = c {
                let n = left.min((data.len() - i) as u64);
                i += n as usize;
                c = if n == left {
                    Chunk::DataCr
                } else {
                    Chunk::Data(left - n)
                };
                continue;
            }
            let b = data[i];
            c = match (c, b) {
                (Chunk::Size { digits, size }, _) if b.is_ascii_hexdigit() => {
                    // 15 hex digits: below 2^60, no overflow, and no body is that long.
                    if digits >= 15 {
                        return Step::Refuse("a malformed chunk");
                    }
                    let v = (b as char).to_digit(16).expect("a hex digit") as u64;
                    Chunk::Size {
                        digits: digits + 1,
                        size: size * 16 + v,
                    }
                }
                (Chunk::Size { digits, size }, b';') if digits > 0 => Chunk::Ext { size, len: 0 },
                (Chunk::Size { digits, size }, b'\r') if digits > 0 => Chunk::SizeLf { size },
                (Chunk::Ext { size, .. }, b'\r') => Chunk::SizeLf { size },
                (Chunk::Ext { size, len }, _) if len < MAX_CHUNK_EXT && (b == b'\t' || (b >= 0x20 && b != 0x7f)) => {
                    Chunk::Ext { size, len: len + 1 }
                }
                (Chunk::SizeLf { size: 0 }, b'\n') => Chunk::Trailer { len: 0, total: 0 },
                (Chunk::SizeLf { size }, b'\n') => Chunk::Data(size),
                (Chunk::DataCr, b'\r') => Chunk::DataLf,
                (Chunk::DataLf, b'\n') => Chunk::Size { digits: 0, size: 0 },
                (Chunk::Trailer { len: 0, .. }, b'\r') => Chunk::EndLf,
                (Chunk::Trailer { total, .. }, b'\r') => Chunk::TrailerLf { total },
                (Chunk::Trailer { len, total }, _)
                    if total < self.max_head && (b == b'\t' || (b >= 0x20 && b != 0x7f)) =>
                {
                    Chunk::Trailer {
                        len: len + 1,
                        total: total + 1,
                    }
                }
                (Chunk::TrailerLf { total }, b'\n') => Chunk::Trailer { len: 0, total },
                (Chunk::EndLf, b'\n') => {
                    // The body is over: what follows is the next request's head.
                    i += 1;
                    self.state = State::Head;
                    let (pass, rest) = data.split_at(i);
                    *input = rest;
                    return Step::Pass(pass);
                }
                _ => return Step::Refuse("a malformed chunk"),
            };
            i += 1;
        }
        self.state = State::Chunk(c);
        *input = &[];
        Step::Pass(data)
    }
}

/// How a request's body is delimited, or why that is not safe to say.
fn framing(req: &httparse::Request) -> Result<Framing, &'static str> {
    let mut te = None;
    let mut cl = None;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if te.is_some() {
                return Err("two Transfer-Encoding headers");
            }
            te = Some(h.value);
        } else if h.name.eq_ignore_ascii_case("content-length") {
            match cl {
                Some(v) if v != h.value => return Err("two different Content-Length values"),
                _ => cl = Some(h.value),
            }
        }
    }
    match (te, cl) {
        (Some(_), Some(_)) => Err("both Content-Length and Transfer-Encoding"),
        (Some(te), None) => {
            let chunked = std::str::from_utf8(te).is_ok_and(|v| v.trim().eq_ignore_ascii_case("chunked"));
            if !chunked {
                Err("a Transfer-Encoding other than chunked")
            } else if req.version != Some(1) {
                Err("Transfer-Encoding in an HTTP/1.0 request")
            } else {
                Ok(Framing::Chunked)
            }
        }
        (None, Some(cl)) => {
            let digits = std::str::from_utf8(cl).map(str::trim).unwrap_or("");
            if digits.is_empty() || digits.len() > 18 || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err("a malformed Content-Length");
            }
            Ok(Framing::Length(digits.parse().expect("up to 18 digits")))
        }
        (None, None) => Ok(Framing::Length(0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `bytes` in pieces of `piece`; what was passed on (heads included), the heads' names,
    /// and the refusal, if any.
    fn run(bytes: &[u8], piece: usize) -> (Vec<u8>, Vec<Sniffed>, Option<&'static str>) {
        let mut f = RequestFramer::new(1024);
        let (mut out, mut names) = (Vec::new(), Vec::new());
        for chunk in bytes.chunks(piece) {
            let mut input = chunk;
            loop {
                match f.step(&mut input) {
                    Step::Pass(b) => out.extend_from_slice(b),
                    Step::Head(h) => {
                        out.extend_from_slice(&h.bytes);
                        names.push(h.name);
                    }
                    Step::More => break,
                    Step::Refuse(why) => return (out, names, Some(why)),
                }
            }
        }
        (out, names, None)
    }

    fn name(n: &str) -> Sniffed {
        Sniffed::Name(n.into())
    }

    #[test]
    fn every_head_is_found_whatever_the_pieces() {
        let inner = "GET / HTTP/1.1\r\nHost: b.test\r\n\r\n";
        let stream = format!(
            "GET / HTTP/1.1\r\nHost: a.test\r\n\r\n\
             POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: {}\r\n\r\n{inner}\
             \r\nPOST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: Chunked\r\n\r\n\
             3\r\nGET\r\n{:x};name=\"v\"\r\n{}\r\n0\r\nTrailer: x\r\n\r\n\
             GET / HTTP/1.0\r\n\r\n\
             GET / HTTP/1.1\r\nHost: c.test\r\n\r\n",
            inner.len(),
            inner.len() - 3,
            &inner[3..]
        );
        for piece in [1, 2, 3, 7, 64, 4096] {
            let (out, names, refused) = run(stream.as_bytes(), piece);
            assert_eq!(refused, None, "piece {piece}");
            assert_eq!(out, stream.as_bytes(), "piece {piece}");
            // An empty line before a request line is skipped, as servers do.
            assert_eq!(
                names,
                [
                    name("a.test"),
                    name("a.test"),
                    name("a.test"),
                    Sniffed::NoName,
                    name("c.test")
                ],
                "piece {piece}"
            );
        }
    }

    #[test]
    fn what_could_be_framed_two_ways_is_refused() {
        let head = "POST / HTTP/1.1\r\nHost: a.test\r\n";
        for (bytes, why) in [
            (
                format!("{head}Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n"),
                "both Content-Length and Transfer-Encoding",
            ),
            (
                format!("{head}Transfer-Encoding: chunked, identity\r\n\r\n"),
                "a Transfer-Encoding other than chunked",
            ),
            (
                format!("{head}Transfer-Encoding: identity\r\n\r\n"),
                "a Transfer-Encoding other than chunked",
            ),
            (
                format!("{head}Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"),
                "two Transfer-Encoding headers",
            ),
            (
                "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n".into(),
                "Transfer-Encoding in an HTTP/1.0 request",
            ),
            (
                format!("{head}Content-Length: 1\r\nContent-Length: 2\r\n\r\n"),
                "two different Content-Length values",
            ),
            (
                format!("{head}Content-Length: 1, 1\r\n\r\n"),
                "a malformed Content-Length",
            ),
            (
                format!("{head}Content-Length: -1\r\n\r\n"),
                "a malformed Content-Length",
            ),
            (
                format!("{head}Content-Length: 99999999999999999999\r\n\r\n"),
                "a malformed Content-Length",
            ),
            (format!("{head}Content-Length :1\r\n\r\n"), "not an HTTP/1 request"),
            (
                format!("{head}Transfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n"),
                "a malformed chunk",
            ),
            (
                format!("{head}Transfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n"),
                "a malformed chunk",
            ),
            (
                format!("{head}Transfer-Encoding: chunked\r\n\r\n5\r\nhelloGET / HTTP/1.1\r\n"),
                "a malformed chunk",
            ),
            (
                format!("{head}Transfer-Encoding: chunked\r\n\r\nfffffffffffffffff\r\n"),
                "a malformed chunk",
            ),
            (
                format!(
                    "{head}Transfer-Encoding: chunked\r\n\r\n0\r\nX: {}\r\n\r\n",
                    "y".repeat(2000)
                ),
                "a malformed chunk",
            ),
            (
                format!("GET / HTTP/1.1\r\nX: {}\r\n\r\n", "y".repeat(2000)),
                "request head too large",
            ),
            ("\x16\x03\x01\x00\x05hello".into(), "not an HTTP/1 request"),
        ] {
            for piece in [1, 5, 4096] {
                let (out, _, refused) = run(bytes.as_bytes(), piece);
                assert_eq!(refused, Some(why), "{bytes:?} in pieces of {piece}");
                // Nothing past the refused point went through.
                assert!(bytes.as_bytes().starts_with(&out), "{bytes:?}");
            }
        }
        // A second Content-Length with the same value is one length.
        let ok = format!("{head}Content-Length: 2\r\nContent-Length: 2\r\n\r\nhi");
        assert_eq!(run(ok.as_bytes(), 3).2, None);
    }

    #[test]
    fn heads_say_what_they_ask_for() {
        let mut f = RequestFramer::new(1024);
        let mut input: &[u8] = b"GET /ws HTTP/1.1\r\nHost: a.test\r\nUpgrade: WebSocket\r\nConnection: upgrade\r\n\r\n\
              CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n\
              POST / HTTP/1.1\r\nHost: a.test\r\nUpgrade: h2c\r\nContent-Length: 1\r\n\r\nx";
        let mut heads = Vec::new();
        loop {
            match f.step(&mut input) {
                Step::Head(h) => heads.push((h.index, h.connect, h.upgrade, h.has_body)),
                Step::Pass(_) => {}
                Step::More => break,
                Step::Refuse(why) => panic!("{why}"),
            }
        }
        assert_eq!(
            heads,
            [
                (1, false, Some(Upgrade::WebSocket), false),
                (2, true, None, false),
                (3, false, Some(Upgrade::Other), true)
            ]
        );
    }
}
