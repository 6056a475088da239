//! Templates as callers name them: airlock names (`seed`, `seed:latest`, `sha256:...`) and the
//! aliases other platforms' clients use by default (E2B's `base`).

use super::Core;
use crate::error::{CoreError, CoreResult, Kind};
use crate::records::SandboxRecord;
use airlock_runtime::template::TemplateManifest;

/// Names other clients use for airlock templates: (alias, template). A built template of the same
/// name wins: E2B's `base` is airlock's `base` where that is built, else `seed`.
pub const ALIASES: &[(&str, &str)] = &[("base", "seed")];

/// The airlock template an alias stands for (the name itself when it is none).
pub fn canonical(name: &str) -> &str {
    ALIASES
        .iter()
        .find(|(alias, _)| *alias == name)
        .map(|(_, t)| *t)
        .unwrap_or(name)
}

/// The alias clients know a template by, if it has one.
pub fn alias_of(template: &str) -> Option<&'static str> {
    ALIASES.iter().find(|(_, t)| *t == template).map(|(a, _)| *a)
}

impl Core {
    /// The template `name` names: a template's name or digest, or an alias.
    pub fn resolve_template(&self, name: &str) -> CoreResult<TemplateManifest> {
        self.platform_template(name).ok_or_else(|| CoreError::NotFound {
            kind: Kind::Template,
            id: name.into(),
            hint: format!("; this server has: {}", self.template_names().join(", ")),
        })
    }

    /// The name of the template `name` resolves to (an alias, a digest: the template's own name).
    pub fn template_name(&self, name: &str) -> CoreResult<String> {
        Ok(self.resolve_template(name)?.name)
    }

    /// Remember the name a client created `sandbox_id` under (E2B's `templateID`, an alias or a
    /// snapshot's id), to be echoed back as the client said it.
    pub async fn record_template_name(&self, sandbox_id: &str, name: &str) -> CoreResult<()> {
        Ok(self.store.set_e2b_alias(sandbox_id, name).await?)
    }

    /// The name a client knows `sandbox`'s template by: the one it was created under where that
    /// was recorded, else the template's alias, else the template itself.
    pub async fn template_name_of(&self, sandbox: &SandboxRecord) -> CoreResult<String> {
        let recorded = self.store.e2b_alias(&sandbox.id).await?;
        Ok(recorded
            .or_else(|| alias_of(&sandbox.template).map(String::from))
            .unwrap_or_else(|| sandbox.template.clone()))
    }

    /// The node's built templates as the doors show them.
    pub fn templates(&self) -> Vec<crate::model::Template> {
        self.manifests().into_iter().map(Into::into).collect()
    }

    /// One template by any name `resolve_template` knows, as the doors show it.
    pub fn template(&self, name: &str) -> CoreResult<crate::model::Template> {
        Ok(self.resolve_template(name)?.into())
    }

    /// The platform's templates (a tenant's builds are its own: `builds`).
    fn manifests(&self) -> Vec<TemplateManifest> {
        let mut all = self.nodes.templates();
        all.retain(|m| !m.name.starts_with(super::builds::BUILT_PREFIX));
        all
    }

    /// Template names with their aliases, for error messages.
    pub fn template_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.manifests().into_iter().map(|m| m.name).collect();
        for (alias, t) in ALIASES {
            if names.iter().any(|n| n == t) && !names.iter().any(|n| n == alias) {
                names.push(format!("{alias} (= {t})"));
            }
        }
        names
    }
}
