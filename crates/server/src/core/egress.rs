//! Egress, the server side (issue 10): what a new sandbox may reach (its profiles and the tenant
//! policy it runs under, decided here once for both doors, and carried to the node with the
//! create: the node serves it, and keeps the counters and recent denials), and the report
//! `GET /v1/sandboxes/{id}/egress` shows.
//!
//! The rules:
//! - A create gets the server's default profiles. `X-Airlock-Egress-Profiles: a,b` selects others
//!   only when the caller is signed in ([`Principal::federated`]); no caller is yet, so today the
//!   header is ignored on every create. An unknown name in an honoured header is a 400.
//! - A sealed create (E2B `allow_internet_access=False`) gets no egress at all.
//! - A create may only narrow its tenant's policy: `allow_only` entries (E2B `allowOut`) must each
//!   be allowed by the tenant's default policy (base + default profiles), and the sandbox then
//!   allows exactly them; `deny` entries (E2B `denyOut`) add denies. With `allow_only` given,
//!   everything else is already denied and E2B gives its allows precedence over its denies, so
//!   `deny` entries are only checked.
//! - What was decided is recorded on the sandbox ([`EgressSpec`]) and fixed for its life: a later
//!   change to the tenant's policy or the profiles' names doesn't reach it.

use super::{Core, Principal};
use crate::error::{CoreError, CoreResult};
use crate::model::{EffectiveEgressPolicy, EgressDenial, EgressInfo, EgressProfileInfo, EgressReport, EgressRules};
use crate::records::{rfc3339, EgressSpec, Tenant};
use airlock_egress::{EgressSnapshot, Policy, Profiles, RawRules, RuleSet, TenantPolicy};
use std::net::IpAddr;

/// The header a signed-in create selects profiles with.
pub const PROFILES_HEADER: &str = "x-airlock-egress-profiles";

/// What a create asks of egress, from either door.
#[derive(Debug, Clone, Default)]
pub struct EgressRequest {
    /// `X-Airlock-Egress-Profiles` as sent (`a,b`): honoured only for a signed-in caller.
    pub profiles: Option<String>,
    /// No egress at all.
    pub sealed: bool,
    /// Allow exactly these (domains, IPs, CIDRs), each allowed by the tenant's default policy.
    pub allow_only: Vec<String>,
    /// Deny these too (domains, IPs, CIDRs).
    pub deny: Vec<String>,
    /// How the caller spells `allow_only` and `deny`, for errors (`network.allowOut`); empty is
    /// `allow_out` / `deny_out`.
    pub allow_field: &'static str,
    pub deny_field: &'static str,
}

/// The profiles a create gets: those the header names when the caller is signed in
/// (`federated`; an unknown name is an error naming it), otherwise the default profiles.
pub fn select_profiles(profiles: &Profiles, federated: bool, header: Option<&str>) -> CoreResult<Vec<String>> {
    match header {
        Some(h) if federated => Ok(profiles.select_header(h)?),
        _ => Ok(profiles.select::<&str>(&[])?),
    }
}

/// Entries as a caller lists them (an IP, a CIDR, or an exact domain) as validated rules;
/// `place` names where they came from in errors.
pub fn parse_entries(place: &str, entries: &[String]) -> CoreResult<RuleSet> {
    let mut raw = RawRules::default();
    for e in entries {
        let t = e.trim();
        if t.parse::<IpAddr>().is_ok() {
            raw.ips.push(t.into());
        } else if t.contains('/') {
            raw.cidrs.push(t.into());
        } else {
            raw.domains.push(t.into());
        }
    }
    Ok(RuleSet::parse(&raw, place)?)
}

/// A tenant base policy from the admin API's shape.
pub fn tenant_policy_from_rules(allow: &EgressRules, deny: &EgressRules) -> CoreResult<TenantPolicy> {
    let raw = |r: &EgressRules| RawRules {
        domains: r.domains.clone(),
        ips: r.ips.clone(),
        cidrs: r.cidrs.clone(),
    };
    Ok(TenantPolicy::from_raw(&raw(allow), &raw(deny))?)
}

pub(crate) fn rules_view(r: &RuleSet) -> EgressRules {
    EgressRules {
        domains: r.domains.iter().cloned().collect(),
        ips: r.ips.iter().map(|i| i.to_string()).collect(),
        cidrs: r.cidrs.iter().map(|c| c.to_string()).collect(),
    }
}

impl Core {
    /// Decide a new sandbox's egress (see the module's rules).
    pub(crate) async fn egress_for_create(
        &self,
        principal: &Principal,
        tenant: &Tenant,
        req: &EgressRequest,
    ) -> CoreResult<EgressSpec> {
        // Checked even when sealed: a wildcard or malformed entry is refused by name alike.
        let or = |f: &'static str, default: &'static str| if f.is_empty() { default } else { f };
        let (allow_field, deny_field) = (or(req.allow_field, "allow_out"), or(req.deny_field, "deny_out"));
        let allow_only = parse_entries(allow_field, &req.allow_only)?;
        let deny = parse_entries(deny_field, &req.deny)?;
        let config = &self.config.egress;
        let mut profiles = select_profiles(&config.profiles, principal.federated(), req.profiles.as_deref())?;
        if req.sealed {
            return Ok(EgressSpec::default());
        }
        let mut policy = self.store.egress_policy(&tenant.id).await?;
        if !allow_only.is_empty() {
            let default = Policy::new(config, policy.clone(), &profiles)?;
            let not_allowed = |entry: String| CoreError::EgressNotAllowed {
                field: allow_field.into(),
                entry,
            };
            for d in &allow_only.domains {
                if !default.decide_domain(d).allowed {
                    return Err(not_allowed(d.clone()));
                }
            }
            for ip in &allow_only.ips {
                if !default.decide_ip(*ip).allowed {
                    return Err(not_allowed(ip.to_string()));
                }
            }
            for net in &allow_only.cidrs {
                // Inside a network the tenant (or a profile) allows, with none of the tenant's
                // denies inside it (the platform's apply to every address at run time anyway).
                let within = policy
                    .allow
                    .cidrs
                    .iter()
                    .chain(
                        profiles
                            .iter()
                            .filter_map(|n| config.profiles.get(n))
                            .flat_map(|p| p.rules.cidrs.iter()),
                    )
                    .any(|c| c.contains(net));
                let cut = policy.deny.ips.iter().any(|ip| net.contains(ip))
                    || policy.deny.cidrs.iter().any(|d| d.contains(net) || net.contains(d));
                if !within || cut {
                    return Err(not_allowed(net.to_string()));
                }
            }
            // Exactly these: the profiles' other entries go too.
            policy.allow = allow_only;
            profiles.clear();
        } else {
            policy.deny.domains.extend(deny.domains);
            policy.deny.ips.extend(deny.ips);
            policy.deny.cidrs.extend(deny.cidrs);
        }
        Ok(EgressSpec {
            profiles,
            sealed: false,
            tenant: policy,
        })
    }

    /// `GET .../egress`: the effective policy, and from the sandbox's node the counters and the
    /// recent denials. A sandbox its node no longer has (ended) shows nothing counted.
    pub async fn egress_report(&self, tenant: &Tenant, id: &str) -> CoreResult<EgressReport> {
        let row = self.sandbox(tenant, id).await?;
        // Under this server's configuration (the node applies its own, which the cluster keeps
        // equal: see `EgressConfig::digest`).
        let (policy, _) = row.egress.policy(&self.config.egress);
        let snapshot = self.nodes.egress(&row.id).await.unwrap_or_else(|| EgressSnapshot {
            sandbox: row.id.clone(),
            profiles: Vec::new(),
            counters: Default::default(),
            recent_denials: Vec::new(),
        });
        let effective = policy.effective();
        Ok(EgressReport {
            sandbox_id: row.id.clone(),
            policy: EffectiveEgressPolicy {
                sealed: row.egress.sealed,
                platform_deny: effective.platform_deny,
                tenant_deny: rules_view(&effective.tenant.deny),
                tenant_allow: rules_view(&effective.tenant.allow),
                profiles: effective
                    .profiles
                    .iter()
                    .map(|(n, r)| (n.clone(), rules_view(r)))
                    .collect(),
            },
            counters: snapshot.counters,
            recent_denials: snapshot
                .recent_denials
                .into_iter()
                .map(|d| EgressDenial {
                    at: rfc3339(d.at_unix_ms as i64),
                    path: serde_json::to_value(d.path)
                        .ok()
                        .and_then(|v| v.as_str().map(String::from))
                        .unwrap_or_default(),
                    destination: d.destination,
                    rule: d.rule,
                })
                .collect(),
        })
    }

    /// The server's egress configuration as `/v1/system` shows it.
    pub fn egress_info(&self) -> EgressInfo {
        let profiles = &self.config.egress.profiles;
        EgressInfo {
            digest: self.config.egress.digest(),
            profiles: profiles
                .names()
                .map(|n| EgressProfileInfo {
                    name: n.into(),
                    default: profiles.get(n).is_some_and(|p| p.default),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profiles() -> Profiles {
        Profiles::from_json(
            r#"{"pypi": {"domains": ["pypi.org"], "default": true}, "gh": {"domains": ["github.com"]}}"#,
        )
        .unwrap()
    }

    #[test]
    fn the_openapi_document_shows_the_egress_route_and_fields() {
        let doc: serde_json::Value = serde_json::from_str(&crate::openapi_json()).unwrap();
        let get = &doc["paths"]["/v1/sandboxes/{id}/egress"]["get"];
        assert_eq!(
            get["responses"]["200"]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/EgressReport"
        );
        let schemas = &doc["components"]["schemas"];
        for s in [
            "EgressReport",
            "EffectiveEgressPolicy",
            "EgressRules",
            "EgressCounters",
            "EgressDenial",
        ] {
            assert!(schemas.get(s).is_some(), "{s}");
        }
        assert_eq!(
            schemas["Sandbox"]["properties"]["egress"]["$ref"],
            "#/components/schemas/SandboxEgress"
        );
        assert!(schemas["SandboxEgress"]["properties"]["profiles"].is_object());
        assert_eq!(
            schemas["SystemInfo"]["properties"]["egress"]["$ref"],
            "#/components/schemas/EgressInfo"
        );
        let params = doc["paths"]["/v1/sandboxes"]["post"]["parameters"].to_string();
        assert!(params.contains("X-Airlock-Egress-Profiles"), "{params}");
    }

    #[test]
    fn the_header_is_honoured_only_for_a_signed_in_caller() {
        let p = profiles();
        // Not signed in (every caller today): the defaults, whatever the header says.
        assert_eq!(select_profiles(&p, false, Some("gh")).unwrap(), ["pypi"]);
        assert_eq!(select_profiles(&p, false, Some("nope")).unwrap(), ["pypi"]);
        assert_eq!(select_profiles(&p, false, None).unwrap(), ["pypi"]);
        // Signed in: the named ones; none named is the defaults.
        assert_eq!(select_profiles(&p, true, Some("gh, pypi")).unwrap(), ["gh", "pypi"]);
        assert_eq!(select_profiles(&p, true, Some("gh")).unwrap(), ["gh"]);
        assert_eq!(select_profiles(&p, true, None).unwrap(), ["pypi"]);
        // An unknown name is a 400 naming it.
        let e = select_profiles(&p, true, Some("gh,nope")).unwrap_err();
        assert_eq!(e.code().status, 400);
        assert!(e.to_string().contains("\"nope\""), "{e}");
    }

    #[test]
    fn entries_are_sorted_into_domains_ips_and_cidrs_and_wildcards_are_refused() {
        let r = parse_entries(
            "allow_out",
            &["Example.COM.".into(), "1.1.1.1".into(), "10.0.0.0/8".into()],
        )
        .unwrap();
        assert_eq!(rules_view(&r).domains, ["example.com"]);
        assert_eq!(rules_view(&r).ips, ["1.1.1.1"]);
        assert_eq!(rules_view(&r).cidrs, ["10.0.0.0/8"]);
        for bad in ["*.example.com", ".example.com", "1.2.3.4/33", "exa mple.com"] {
            let e = parse_entries("allow_out", &[bad.into()]).unwrap_err();
            assert_eq!(e.code().status, 400, "{bad}");
            assert!(e.to_string().contains(bad), "{bad}: {e}");
        }
        let rules = |domains: &[&str], ips: &[&str], cidrs: &[&str]| EgressRules {
            domains: domains.iter().map(|s| s.to_string()).collect(),
            ips: ips.iter().map(|s| s.to_string()).collect(),
            cidrs: cidrs.iter().map(|s| s.to_string()).collect(),
        };
        let none = rules(&[], &[], &[]);
        let e = tenant_policy_from_rules(&none, &rules(&["*.x.test"], &[], &[])).unwrap_err();
        assert!(
            e.to_string().contains("tenant deny") && e.to_string().contains("*.x.test"),
            "{e}"
        );
        let e = tenant_policy_from_rules(&rules(&[], &[], &["example.com"]), &none).unwrap_err();
        assert!(
            e.to_string().contains("tenant allow") && e.to_string().contains("example.com"),
            "{e}"
        );
        let p = tenant_policy_from_rules(&rules(&["a.test"], &["198.51.100.7"], &["203.0.113.0/24"]), &none).unwrap();
        assert_eq!(rules_view(&p.allow).ips, ["198.51.100.7"]);
        assert_eq!(rules_view(&p.allow).cidrs, ["203.0.113.0/24"]);
    }
}
