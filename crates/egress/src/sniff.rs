//! Finding the name a connection is for, from its first bytes: the HTTP/1 request head's Host
//! (port 80) or the TLS ClientHello's SNI (port 443). Pure functions over a buffer the proxy
//! fills (bounded in bytes and time); nothing is decrypted or rewritten.

/// What the bytes so far say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniffed {
    /// Not enough bytes yet.
    NeedMore,
    /// The name the client asked for (as sent: the policy normalizes it).
    Name(String),
    /// A complete head/hello without a name.
    NoName,
    /// Not the expected protocol (the connection is then judged by IP rules alone).
    Invalid(&'static str),
    /// The expected protocol, naming two things (two Hosts, a Host that disagrees with an
    /// absolute request target, two SNI names, a repeated extension): refused outright.
    Ambiguous(&'static str),
}

/// Headers read in one request head (hyper's default limit).
pub(crate) const MAX_HEADERS: usize = 100;

/// Host of an HTTP/1 request head. Absolute-form targets (`GET http://x/`) and CONNECT's
/// authority name the host the request is for, so they must agree with Host.
pub fn http_host(buf: &[u8]) -> Sniffed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Partial) => Sniffed::NeedMore,
        Err(httparse::Error::TooManyHeaders) => Sniffed::Invalid("too many headers"),
        Err(_) => Sniffed::Invalid("not an HTTP/1 request"),
        Ok(httparse::Status::Complete(_)) => request_name(&req),
    }
}

/// Whether `buf` can't be the start of an HTTP/1 request (so a connection to port 80 is not
/// HTTP, and is judged and passed on as bytes).
pub(crate) fn not_http(buf: &[u8]) -> bool {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    matches!(
        httparse::Request::new(&mut headers).parse(buf),
        Err(e) if e != httparse::Error::TooManyHeaders
    )
}

/// The name a parsed request head is for.
pub(crate) fn request_name(req: &httparse::Request) -> Sniffed {
    let mut host = None;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("host") {
            if host.is_some() {
                return Sniffed::Ambiguous("two Host headers");
            }
            match std::str::from_utf8(h.value) {
                Ok(v) => host = Some(strip_port(v.trim()).to_string()),
                Err(_) => return Sniffed::Invalid("Host is not text"),
            }
        }
    }
    let target_host = if req.method.is_some_and(|m| m.eq_ignore_ascii_case("CONNECT")) {
        // authority-form: `CONNECT host:port`
        req.path.map(|p| strip_port(p).to_string())
    } else {
        req.path.and_then(absolute_form_host)
    };
    match (host, target_host) {
        (Some(h), Some(t)) if !h.eq_ignore_ascii_case(&t) => {
            Sniffed::Ambiguous("Host disagrees with the request target")
        }
        (Some(h), _) | (None, Some(h)) if !h.is_empty() => Sniffed::Name(h),
        _ => Sniffed::NoName,
    }
}

/// `http://host:port/path` -> host.
fn absolute_form_host(target: &str) -> Option<String> {
    let rest = target.split_once("://")?.1;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let authority = authority.rsplit_once('@').map(|(_, a)| a).unwrap_or(authority);
    Some(strip_port(authority).to_string())
}

/// `host:80` -> `host`, `[::1]:80` -> `[::1]`.
fn strip_port(v: &str) -> &str {
    if v.starts_with('[') {
        return v.split_once(']').map(|(h, _)| &v[..h.len() + 1]).unwrap_or(v);
    }
    match v.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => v,
    }
}

const HANDSHAKE: u8 = 22;
const CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;
/// Largest ClientHello accepted (real ones with post-quantum key shares are ~2 KiB).
const MAX_HELLO: usize = 16 * 1024;

/// SNI of a TLS ClientHello, reassembled across records if it spans several.
pub fn tls_sni(buf: &[u8]) -> Sniffed {
    // Reassemble the handshake message from the records we have.
    let mut hs = Vec::new();
    let mut rest = buf;
    loop {
        if rest.len() < 5 {
            return if buf.is_empty() || buf[0] == HANDSHAKE {
                Sniffed::NeedMore
            } else {
                Sniffed::Invalid("not TLS")
            };
        }
        if rest[0] != HANDSHAKE || rest[1] != 3 {
            return Sniffed::Invalid("not a TLS handshake record");
        }
        let len = u16::from_be_bytes([rest[3], rest[4]]) as usize;
        if len == 0 || len > 16384 {
            return Sniffed::Invalid("bad TLS record length");
        }
        if rest.len() < 5 + len {
            return Sniffed::NeedMore;
        }
        hs.extend_from_slice(&rest[5..5 + len]);
        rest = &rest[5 + len..];
        if hs.len() >= 4 {
            if hs[0] != CLIENT_HELLO {
                return Sniffed::Invalid("first handshake message is not a ClientHello");
            }
            let body_len = u32::from_be_bytes([0, hs[1], hs[2], hs[3]]) as usize;
            if body_len > MAX_HELLO {
                return Sniffed::Invalid("ClientHello too large");
            }
            if hs.len() >= 4 + body_len {
                return parse_client_hello(&hs[4..4 + body_len]);
            }
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| b[0] as usize)
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]) as usize)
    }
}

fn parse_client_hello(body: &[u8]) -> Sniffed {
    fn inner(body: &[u8]) -> Option<Sniffed> {
        let mut r = Reader(body);
        r.take(2 + 32)?; // version, random
        let n = r.u8()?;
        r.take(n)?; // session id
        let n = r.u16()?;
        r.take(n)?; // cipher suites
        let n = r.u8()?;
        r.take(n)?; // compression methods
        if r.0.is_empty() {
            return Some(Sniffed::NoName); // no extensions at all
        }
        let n = r.u16()?;
        let mut exts = Reader(r.take(n)?);
        let mut name = None;
        let mut seen = Vec::new();
        while !exts.0.is_empty() {
            let ty = exts.u16()? as u16;
            let len = exts.u16()?;
            let data = exts.take(len)?;
            if seen.contains(&ty) {
                return Some(Sniffed::Ambiguous("duplicate TLS extension"));
            }
            seen.push(ty);
            if ty == EXT_SERVER_NAME {
                let mut sn = Reader(data);
                let list_len = sn.u16()?;
                let mut list = Reader(sn.take(list_len)?);
                while !list.0.is_empty() {
                    let kind = list.u8()?;
                    let l = list.u16()?;
                    let host = list.take(l)?;
                    if kind == 0 {
                        if name.is_some() {
                            return Some(Sniffed::Ambiguous("two SNI host names"));
                        }
                        match std::str::from_utf8(host) {
                            Ok(h) => name = Some(h.to_string()),
                            Err(_) => return Some(Sniffed::Invalid("SNI is not text")),
                        }
                    }
                }
            }
        }
        Some(match name {
            Some(n) => Sniffed::Name(n),
            None => Sniffed::NoName,
        })
    }
    inner(body).unwrap_or(Sniffed::Invalid("malformed ClientHello"))
}

/// A minimal TLS 1.2/1.3-shaped ClientHello with an SNI (for tests and the bench).
pub fn client_hello(sni: Option<&str>) -> Vec<u8> {
    let mut exts = Vec::new();
    if let Some(sni) = sni {
        let name = sni.as_bytes();
        let mut list = vec![0u8];
        list.extend_from_slice(&(name.len() as u16).to_be_bytes());
        list.extend_from_slice(name);
        let mut data = (list.len() as u16).to_be_bytes().to_vec();
        data.extend_from_slice(&list);
        exts.extend_from_slice(&EXT_SERVER_NAME.to_be_bytes());
        exts.extend_from_slice(&(data.len() as u16).to_be_bytes());
        exts.extend_from_slice(&data);
    }
    // supported_versions: TLS 1.3
    exts.extend_from_slice(&[0x00, 0x2b, 0x00, 0x03, 0x02, 0x03, 0x04]);
    let mut body = vec![0x03, 0x03];
    body.extend_from_slice(&[7u8; 32]);
    body.push(0); // session id
    body.extend_from_slice(&[0x00, 0x02, 0x13, 0x01]); // TLS_AES_128_GCM_SHA256
    body.extend_from_slice(&[0x01, 0x00]); // null compression
    body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
    body.extend_from_slice(&exts);
    let mut hs = vec![CLIENT_HELLO];
    hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(&body);
    let mut rec = vec![HANDSHAKE, 3, 1];
    rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    rec.extend_from_slice(&hs);
    rec
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_header() {
        assert_eq!(
            http_host(b"GET / HTTP/1.1\r\nHost: allowed.test:80\r\n\r\n"),
            Sniffed::Name("allowed.test".into())
        );
        assert_eq!(
            http_host(b"GET / HTTP/1.1\r\nHost: allowed.test\r\n"),
            Sniffed::NeedMore
        );
        assert_eq!(http_host(b"GET / HTTP/1.1\r\n\r\n"), Sniffed::NoName);
        assert_eq!(
            http_host(b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n"),
            Sniffed::Name("[::1]".into())
        );
        assert!(matches!(
            http_host(b"GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n"),
            Sniffed::Ambiguous(_)
        ));
        assert!(matches!(
            http_host(b"GET http://other.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n"),
            Sniffed::Ambiguous(_)
        ));
        assert_eq!(
            http_host(b"GET http://u@Allowed.test:80/x HTTP/1.1\r\nHost: allowed.test\r\n\r\n"),
            Sniffed::Name("allowed.test".into())
        );
        assert!(matches!(http_host(b"\x16\x03\x01\x00\x05hello"), Sniffed::Invalid(_)));
        assert!(matches!(
            http_host(b"CONNECT other.test:443 HTTP/1.1\r\nHost: allowed.test\r\n\r\n"),
            Sniffed::Ambiguous(_)
        ));
        assert_eq!(
            http_host(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n"),
            Sniffed::Name("allowed.test".into())
        );
    }

    #[test]
    fn sni() {
        let hello = client_hello(Some("allowed.test"));
        assert_eq!(tls_sni(&hello), Sniffed::Name("allowed.test".into()));
        for cut in 0..hello.len() {
            assert_eq!(tls_sni(&hello[..cut]), Sniffed::NeedMore, "cut {cut}");
        }
        assert_eq!(tls_sni(&client_hello(None)), Sniffed::NoName);
        assert!(matches!(tls_sni(b"GET / HTTP/1.1\r\n"), Sniffed::Invalid(_)));
        // The same hello split over two records.
        let hs = &hello[5..];
        let (a, b) = hs.split_at(10);
        let mut two = vec![22, 3, 1, 0, a.len() as u8];
        two.extend_from_slice(a);
        two.extend_from_slice(&[22, 3, 1, 0, b.len() as u8]);
        two.extend_from_slice(b);
        assert_eq!(tls_sni(&two), Sniffed::Name("allowed.test".into()));
    }
}
