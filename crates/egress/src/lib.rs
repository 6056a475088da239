//! Sandbox egress, the userspace half: one policy engine ([`Policy`]), a DNS responder that
//! answers only allowed names ([`DnsServer`]), and a TCP proxy that dials by name ([`Proxy`]).
//! The per-sandbox plumbing (namespace, veth, tap, nftables) lives elsewhere and hands this crate
//! sockets made in the sandbox's namespace; upstream lookups and dials happen in the process's
//! own namespace.
//!
//! Wiring one sandbox (see the crate's tests for a running example):
//!
//! ```no_run
//! # async fn wire(host_addrs: Vec<std::net::IpAddr>, tenant_json: &str, header: &str)
//! #               -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use airlock_egress::*;
//! // once, at startup (a bad AIRLOCK_EGRESS_PROFILES stops the server with the entry named)
//! let config = EgressConfig::new(PlatformDenies::new(host_addrs), Profiles::from_env()?);
//! let resolver = Arc::new(Resolver::system()?);
//! let dns = DnsServer::new(resolver.clone(), DnsConfig::default());
//! let proxy = Proxy::new(resolver, ProxyConfig::default());
//! println!("egress digest {}", config.digest());
//! // per sandbox: its profiles are chosen once and recorded
//! let names = config.profiles.select_header(header)?; // or .select(&[] as &[&str]) for the defaults
//! let policy = Policy::new(&config, TenantPolicy::from_json(tenant_json)?, &names)?;
//! let sandbox = SandboxEgress::new("sb-1", policy, SandboxLimits::default());
//! // the plumbing's namespace, with `tcp -> dnat to 10.0.0.1:15001` (except tcp 53) in it
//! let gateway = "10.0.0.1".parse()?;
//! let sockets = SandboxSockets::bind_in_netns("/run/netns/sb-1".as_ref(), gateway, 15001)?;
//! let tasks = serve_sandbox(&dns, &proxy, sockets, sandbox.clone())?;
//! // GET .../egress: sandbox.policy().effective(), sandbox.snapshot()
//! drop(tasks); // on delete: closes every proxied connection
//! # Ok(()) }
//! ```

mod denied;
mod dns;
mod error;
mod http1;
mod log_limit;
pub mod netns;
mod policy;
mod proxy;
mod relay;
mod resolve;
mod sandbox;
mod serve;
pub mod sniff;
mod uplink;

pub use dns::{DnsConfig, DnsServer};
pub use error::{ConfigError, ResolvConfError, ResolveError};
pub use netns::local_addresses;
pub use policy::{
    normalize_domain, Decision, DeniedNameAddrs, EffectivePolicy, EgressConfig, PlatformDenies, Policy, Profile,
    Profiles, RawRules, RuleSet, TenantPolicy, PLATFORM_DENIED, PROFILES_ENV,
};
pub use proxy::{OriginalDst, Proxy, ProxyConfig};
pub use resolve::{Lookup, Resolver};
pub use sandbox::{Denial, EgressCounters, EgressSnapshot, Path, SandboxEgress, SandboxLimits};
pub use serve::{serve_sandbox, EgressTasks, SandboxSockets};
pub use uplink::Uplink;
