//! Templates as callers name them: airlock names (`seed`, `seed:latest`, `sha256:...`) and the
//! aliases other platforms' clients use by default (E2B's `base`).

use super::Core;
use crate::error::{CoreError, CoreResult, Kind};
use airlock_runtime::template::{Template, TemplateManifest};

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
    pub fn resolve_template(&self, name: &str) -> CoreResult<Template> {
        let templates = self.nodes.templates();
        templates
            .resolve(name)
            .or_else(|_| templates.resolve(canonical(name)))
            .map_err(|_| CoreError::NotFound {
                kind: Kind::Template,
                id: name.into(),
                hint: format!("; this server has: {}", self.template_names().join(", ")),
            })
    }

    pub fn templates(&self) -> Vec<TemplateManifest> {
        self.nodes.templates().list()
    }

    /// Template names with their aliases, for error messages.
    pub fn template_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.templates().into_iter().map(|m| m.name).collect();
        for (alias, t) in ALIASES {
            if names.iter().any(|n| n == t) && !names.iter().any(|n| n == alias) {
                names.push(format!("{alias} (= {t})"));
            }
        }
        names
    }
}
