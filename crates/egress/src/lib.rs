//! Sandbox egress, the userspace half: one policy engine ([`Policy`]), a DNS responder that
//! answers only allowed names ([`DnsServer`]), and a TCP proxy that dials by name ([`Proxy`]).
//! The per-sandbox plumbing (namespace, veth, tap, nftables) lives elsewhere and hands this crate
//! sockets made in the sandbox's namespace; upstream lookups and dials happen in the process's
//! own namespace.
//!
//! Wiring one sandbox (see the crate's tests for a running example):
//!
//! ```no_run
//! # async fn wire(host_addrs: Vec<std::net::IpAddr>, tenant_json: &str, header: &str,
//! #               dns_sock: tokio::net::UdpSocket, proxy_listener: tokio::net::TcpListener)
//! #               -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use airlock_egress::*;
//! // once, at startup (a bad AIRLOCK_EGRESS_PROFILES stops the server with the entry named)
//! let config = EgressConfig::new(PlatformDenies::new(host_addrs), Profiles::from_env()?);
//! let resolver = Arc::new(Resolver::system()?);
//! let dns = DnsServer::new(resolver.clone(), DnsConfig::default());
//! let proxy = Proxy::new(resolver, ProxyConfig::default());
//! println!("egress digest {}", config.digest());
//! // per sandbox
//! let names = config.profiles.select_header(header)?; // or select(&[]) for the defaults
//! let policy = Policy::new(&config, TenantPolicy::from_json(tenant_json)?, &names)?;
//! let sandbox = SandboxEgress::new("sb-1", policy, SandboxLimits::default());
//! let (d, p) = (dns.clone(), proxy.clone());
//! let (s1, s2) = (sandbox.clone(), sandbox.clone());
//! let dns_task = tokio::spawn(async move { d.serve_udp(dns_sock, s1).await });
//! let proxy_task = tokio::spawn(async move { p.serve(proxy_listener, s2).await });
//! // on delete: dns_task.abort(); proxy_task.abort(); (closes every proxied connection)
//! # Ok(()) }
//! ```

mod dns;
mod error;
mod policy;
mod proxy;
mod resolve;
mod sandbox;
pub mod sniff;
#[doc(hidden)]
pub mod testnet;

pub use dns::{DnsConfig, DnsServer};
pub use error::{ConfigError, ResolvConfError, ResolveError};
pub use policy::{
    normalize_domain, Decision, EffectivePolicy, EgressConfig, PlatformDenies, Policy, Profile, Profiles, RawRules,
    RuleSet, TenantPolicy, PLATFORM_DENIED, PROFILES_ENV,
};
pub use proxy::{OriginalDst, Proxy, ProxyConfig};
pub use resolve::{Lookup, Resolver};
pub use sandbox::{Denial, EgressCounters, EgressSnapshot, Path, SandboxEgress, SandboxLimits};
