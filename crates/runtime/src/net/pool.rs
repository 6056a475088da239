//! The pool of /31 host-side pairs sandbox links are cut from (`AIRLOCK_NET_POOL`).

use super::*;
use airlock_proto::net as guest;
use std::net::Ipv4Addr;

/// The pool of /31 host-side pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkPool {
    base: Ipv4Addr,
    prefix_len: u8,
}

impl std::fmt::Display for LinkPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.base, self.prefix_len)
    }
}

impl Default for LinkPool {
    fn default() -> Self {
        DEFAULT_POOL.parse().expect("default pool")
    }
}

impl std::str::FromStr for LinkPool {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: &str| NetError::InvalidPool {
            pool: s.into(),
            reason: reason.into(),
        };
        let (addr, len) = s.split_once('/').ok_or_else(|| bad("expected a.b.c.d/len"))?;
        let base: Ipv4Addr = addr.parse().map_err(|_| bad("not an IPv4 address"))?;
        let prefix_len: u8 = len.parse().map_err(|_| bad("not a prefix length"))?;
        if !(8..=30).contains(&prefix_len) {
            return Err(bad("the prefix length must be between 8 and 30"));
        }
        let mask = u32::MAX << (32 - prefix_len);
        if u32::from(base) & !mask != 0 {
            return Err(bad("host bits are set"));
        }
        let pool = Self { base, prefix_len };
        let guest_net = u32::from(Ipv4Addr::from(guest::GATEWAY)) & (u32::MAX << (32 - guest::PREFIX_LEN));
        if pool.contains(guest_net) || pool.contains(guest_net + 3) {
            return Err(bad("it overlaps the guest link 100.96.0.0/30"));
        }
        Ok(pool)
    }
}

impl LinkPool {
    pub(super) fn contains(&self, a: u32) -> bool {
        let mask = u32::MAX << (32 - self.prefix_len);
        a & mask == u32::from(self.base)
    }
    pub(super) fn pairs(&self) -> u32 {
        1 << (31 - self.prefix_len)
    }
    /// `(H, N)` of pair `index`, unless the pair is one never to use.
    pub(super) fn pair(&self, index: u32) -> Option<(Ipv4Addr, Ipv4Addr)> {
        let h = u32::from(self.base) + 2 * index;
        // Clouds answer their metadata service at 169.254.169.254: leave its /24 alone.
        if h & 0xffff_ff00 == u32::from(Ipv4Addr::new(169, 254, 169, 0)) {
            return None;
        }
        Some((Ipv4Addr::from(h), Ipv4Addr::from(h + 1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_parses_and_hands_out_pairs() {
        let p = LinkPool::default();
        assert_eq!(p.pairs(), 32768);
        assert_eq!(
            p.pair(0),
            Some((Ipv4Addr::new(169, 254, 0, 0), Ipv4Addr::new(169, 254, 0, 1)))
        );
        assert_eq!(
            p.pair(130),
            Some((Ipv4Addr::new(169, 254, 1, 4), Ipv4Addr::new(169, 254, 1, 5)))
        );
        // 169.254.169.0/24 (the metadata service's) is never handed out.
        assert_eq!(p.pair(169 * 128 + 127), None);
        let q: LinkPool = "10.123.0.0/20".parse().unwrap();
        assert_eq!(q.pairs(), 2048);
        for bad in [
            "10.0.0.1/16",
            "10.0.0.0",
            "10.0.0.0/31",
            "100.96.0.0/16",
            "x/16",
            "10.0.0.0/4",
        ] {
            assert!(bad.parse::<LinkPool>().is_err(), "{bad}");
        }
    }
}
