//! A template definition: a parent, then steps, then a start command and its ready check. One
//! step format for both doors (E2B's: `{"type", "args", "filesHash", "force"}`), and a Dockerfile
//! subset parsed into it. Pure data and parsing: nothing here runs.
//!
//! BuildStep arguments, by type:
//! - `RUN [cmd, user?]`: `/bin/bash -l -c cmd`, as `user` for this step only.
//! - `COPY [src, dest, user?, mode?]` + `filesHash`: `src` (a path or glob) from the uploaded
//!   context `filesHash` to `dest`, owned by `user` (else the current user), `mode` applied.
//! - `ENV [k1, v1, k2, v2, ...]`, `WORKDIR [path]`, `USER [name]`.

use crate::error::{CoreError, CoreResult};
pub use crate::model::{BuildStep, StepKind};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// Steps in one definition at most.
pub const MAX_STEPS: usize = 256;
/// Bytes of one step's arguments, all told.
const MAX_STEP_BYTES: usize = 64 * 1024;

/// What a build makes, as the core checked it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Definition {
    /// The parent: a platform template, the tenant's own (`name[:tag]`), else an OCI image
    /// reference (see `Core::build_parent`).
    pub from: String,
    pub steps: Vec<BuildStep>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
    /// Rebuild every step (no cached result used).
    #[serde(default)]
    pub force: bool,
    /// The build VM's shape (and the template's default), where asked; not part of its content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpu: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u32>,
    /// The registry account to pull an image parent with: used by the request that starts the
    /// build, never stored (the definition is) nor logged.
    #[serde(skip)]
    pub registry_auth: Option<airlock_runtime::template::RegistryCredentials>,
}

impl Definition {
    /// Check every step's arguments; the message names the step (1-based) and what is wrong.
    pub fn validate(&self) -> CoreResult<()> {
        if self.from.trim().is_empty() {
            return Err(CoreError::invalid("from", "name the parent template"));
        }
        if self.steps.len() > MAX_STEPS {
            return Err(CoreError::invalid("steps", format!("at most {MAX_STEPS} steps")));
        }
        for (i, step) in self.steps.iter().enumerate() {
            let bad = |why: &str| CoreError::invalid("steps", format!("step {} ({}): {why}", i + 1, step.kind.name()));
            if step.args.iter().map(|a| a.len()).sum::<usize>() > MAX_STEP_BYTES {
                return Err(bad("its arguments are over 64 KiB"));
            }
            if step.args.iter().any(|a| a.contains('\0')) {
                return Err(bad("an argument holds a NUL byte"));
            }
            match step.kind {
                StepKind::Run if step.args.first().is_none_or(|c| c.trim().is_empty()) => {
                    return Err(bad("needs a command"))
                }
                StepKind::Run if step.args.len() > 2 => return Err(bad("takes a command and a user")),
                StepKind::Copy => {
                    if step.args.len() < 2 || step.args.len() > 4 || step.args[0].is_empty() || step.args[1].is_empty()
                    {
                        return Err(bad("takes a source, a destination, and optionally a user and a mode"));
                    }
                    if !step.files_hash.as_deref().is_some_and(is_sha256_hex) {
                        return Err(bad("needs filesHash: the sha256 of its uploaded context"));
                    }
                    if let Some(mode) = step.args.get(3).filter(|m| !m.is_empty()) {
                        if u32::from_str_radix(mode, 8).map_or(true, |m| m > 0o7777) {
                            return Err(bad(&format!("mode {mode:?} is not an octal file mode")));
                        }
                    }
                    if step.args[0].split('/').any(|c| c == "..") {
                        return Err(bad("its source may not leave the context (..)"));
                    }
                }
                StepKind::Env if step.args.is_empty() || step.args.len() % 2 != 0 => {
                    return Err(bad("takes names and values in pairs"))
                }
                StepKind::Env => {
                    for name in step.args.iter().step_by(2) {
                        if !valid_env_name(name) {
                            return Err(bad(&format!("{name:?} is not a variable name")));
                        }
                    }
                }
                StepKind::Workdir if step.args.len() != 1 || step.args[0].is_empty() => {
                    return Err(bad("takes one path"))
                }
                StepKind::User if step.args.len() != 1 || !valid_user(&step.args[0]) => {
                    return Err(bad("takes one user name ([a-z_][a-z0-9_-]*)"))
                }
                _ => {}
            }
            if step.kind == StepKind::Run {
                if let Some(user) = step.args.get(1).filter(|u| !u.is_empty()) {
                    if !valid_user(user) {
                        return Err(bad(&format!("{user:?} is not a user name")));
                    }
                }
            }
        }
        Ok(())
    }

    /// The contexts its COPY steps name.
    pub fn contexts(&self) -> Vec<&str> {
        let mut out: Vec<&str> = self.steps.iter().filter_map(|s| s.files_hash.as_deref()).collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// What its content comes from: the parent's digest, then every step (a forced one too:
    /// forcing reruns it, the result stands for the same input) and the start and ready
    /// commands. Two builds with equal keys make the same template.
    pub fn cache_key(&self, parent_digest: &str) -> String {
        let mut h = Sha256::new();
        h.update(b"airlock-build-v1\n");
        h.update(parent_digest.as_bytes());
        for s in &self.steps {
            let step = serde_json::json!([s.kind.name(), s.args, s.files_hash]);
            h.update(b"\n");
            h.update(step.to_string().as_bytes());
        }
        let tail = serde_json::json!([self.start_cmd, self.ready_cmd]);
        h.update(b"\n");
        h.update(tail.to_string().as_bytes());
        format!("sha256:{}", hex::encode(h.finalize()))
    }
}

/// The step cache's keys of `def`: `[0]` its start (the parent's digest, the context the steps
/// begin in, the build VM's shape), then one per step, each over the one before it and the step
/// (a COPY by its context's hash). A changed step changes its key and every later one.
pub fn step_keys(def: &Definition, parent_digest: &str, context: &str, shape: &str) -> Vec<String> {
    let mut keys = Vec::with_capacity(def.steps.len() + 1);
    let mut h = Sha256::new();
    h.update(format!("airlock-step-v1\n{parent_digest}\n{context}\n{shape}").as_bytes());
    keys.push(format!("sha256:{}", hex::encode(h.finalize())));
    for s in &def.steps {
        let mut h = Sha256::new();
        h.update(keys.last().expect("one at least").as_bytes());
        h.update(
            serde_json::json!([s.kind.name(), s.args, s.files_hash])
                .to_string()
                .as_bytes(),
        );
        keys.push(format!("sha256:{}", hex::encode(h.finalize())));
    }
    keys
}

pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn valid_env_name(name: &str) -> bool {
    let mut b = name.bytes();
    b.next().is_some_and(|c| c.is_ascii_alphabetic() || c == b'_') && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

pub fn valid_user(name: &str) -> bool {
    let mut b = name.bytes();
    name.len() <= 32
        && b.next().is_some_and(|c| c.is_ascii_lowercase() || c == b'_')
        && b.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_' || c == b'-')
}

/// A Dockerfile subset into a definition: FROM (an airlock template), RUN, COPY and ADD of
/// local files (from `context`), ENV, WORKDIR, USER, ARG, CMD or ENTRYPOINT as the start
/// command; comments, blank lines and `\` continuations. Anything else, a second FROM (a
/// multi-stage build) or a flag is refused naming its line.
pub fn parse_dockerfile(text: &str, context: Option<&str>) -> CoreResult<Definition> {
    let mut from = None;
    let mut steps = Vec::new();
    let mut start_cmd = None;
    let mut args: BTreeMap<String, String> = BTreeMap::new();
    for (line_no, line) in logical_lines(text) {
        let bad = |why: String| CoreError::invalid("dockerfile", format!("line {line_no}: {why}"));
        let (word, rest) = line.split_once(char::is_whitespace).unwrap_or((&line, ""));
        let rest = rest.trim();
        let instruction = word.to_ascii_uppercase();
        if from.is_none() && !matches!(instruction.as_str(), "FROM" | "ARG") {
            return Err(bad(format!("{instruction} before FROM")));
        }
        if rest.starts_with("--") && !matches!(instruction.as_str(), "RUN" | "CMD" | "ENTRYPOINT") {
            let flag = rest.split_whitespace().next().unwrap_or(rest);
            return Err(bad(format!("{instruction} {flag}: flags are not supported")));
        }
        let rest = substitute(rest, &args);
        match instruction.as_str() {
            "FROM" => {
                if from.is_some() {
                    return Err(bad("a second FROM: multi-stage builds are not supported".into()));
                }
                let mut parts = rest.split_whitespace();
                let image = parts.next().ok_or_else(|| bad("FROM needs a template".into()))?;
                if parts.next().is_some() {
                    return Err(bad("FROM ... AS: multi-stage builds are not supported".into()));
                }
                from = Some(image.to_string());
            }
            "ARG" => {
                let (name, value) = rest.split_once('=').unwrap_or((&rest, ""));
                if !valid_env_name(name.trim()) {
                    return Err(bad(format!("ARG {rest:?}: not a name[=default]")));
                }
                args.insert(name.trim().to_string(), unquote(value.trim()));
            }
            "RUN" => {
                if rest.starts_with("--") {
                    return Err(bad("RUN flags are not supported".into()));
                }
                let cmd = match json_array(&rest) {
                    Some(argv) => shell_join(&argv),
                    None => rest.clone(),
                };
                if cmd.is_empty() {
                    return Err(bad("RUN needs a command".into()));
                }
                steps.push(step(StepKind::Run, vec![cmd], None));
            }
            "COPY" | "ADD" => {
                let items = json_array(&rest).unwrap_or_else(|| rest.split_whitespace().map(String::from).collect());
                if items.len() < 2 {
                    return Err(bad(format!("{instruction} needs a source and a destination")));
                }
                let Some(context) = context else {
                    return Err(bad(format!(
                        "{instruction} needs a build context: upload one and name it"
                    )));
                };
                let (dest, srcs) = items.split_last().expect("two or more");
                for src in srcs {
                    if instruction == "ADD" && (src.contains("://") || src.starts_with("git@")) {
                        return Err(bad(format!("ADD {src}: only local files can be added")));
                    }
                    let src = src.trim_start_matches("./");
                    let dest = match srcs.len() > 1 && !dest.ends_with('/') {
                        true => format!("{dest}/"),
                        false => dest.clone(),
                    };
                    steps.push(step(
                        StepKind::Copy,
                        vec![if src.is_empty() { ".".into() } else { src.into() }, dest],
                        Some(context.to_string()),
                    ));
                }
            }
            "ENV" => {
                let pairs = env_pairs(&rest).ok_or_else(|| bad(format!("ENV {rest:?}: expected NAME=value")))?;
                steps.push(step(StepKind::Env, pairs, None));
            }
            "WORKDIR" => steps.push(step(StepKind::Workdir, vec![unquote(&rest)], None)),
            "USER" => steps.push(step(StepKind::User, vec![rest.clone()], None)),
            "CMD" | "ENTRYPOINT" => {
                start_cmd = Some(match json_array(&rest) {
                    Some(argv) => shell_join(&argv),
                    None => rest.clone(),
                });
            }
            "" => {}
            other => {
                return Err(bad(format!(
                    "{other} is not supported (FROM, RUN, COPY, ADD, ENV, WORKDIR, USER, ARG, CMD, ENTRYPOINT are)"
                )))
            }
        }
    }
    let from = from.ok_or_else(|| CoreError::invalid("dockerfile", "no FROM line"))?;
    // Docker's defaults, as E2B's `from_dockerfile` spells them: the steps run as root in `/`,
    // and the template's sandboxes run as `user` in its home unless the Dockerfile said.
    let has = |kind| steps.iter().any(|s: &BuildStep| s.kind == kind);
    let (user_set, workdir_set) = (has(StepKind::User), has(StepKind::Workdir));
    let mut all = vec![
        step(StepKind::User, vec!["root".into()], None),
        step(StepKind::Workdir, vec!["/".into()], None),
    ];
    all.extend(steps);
    if !user_set {
        all.push(step(StepKind::User, vec!["user".into()], None));
    }
    if !workdir_set {
        all.push(step(StepKind::Workdir, vec!["/home/user".into()], None));
    }
    let steps = all;
    let def = Definition {
        from,
        steps,
        start_cmd,
        ..Default::default()
    };
    def.validate()?;
    Ok(def)
}

fn step(kind: StepKind, args: Vec<String>, files_hash: Option<String>) -> BuildStep {
    BuildStep {
        kind,
        args,
        files_hash,
        force: false,
    }
}

/// The Dockerfile's instructions with their first line's number: comments and blank lines
/// dropped, `\` continuations joined.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_none()) {
            continue;
        }
        let (part, continues) = match trimmed.strip_suffix('\\') {
            Some(p) => (p.trim_end(), true),
            None => (trimmed, false),
        };
        let entry = current.get_or_insert_with(|| (i + 1, String::new()));
        if !entry.1.is_empty() && !part.is_empty() {
            entry.1.push(' ');
        }
        entry.1.push_str(part);
        if !continues {
            out.extend(current.take());
        }
    }
    out.extend(current);
    out
}

fn json_array(s: &str) -> Option<Vec<String>> {
    s.starts_with('[').then(|| serde_json::from_str(s).ok()).flatten()
}

/// argv as one shell command line, each word single-quoted.
fn shell_join(argv: &[String]) -> String {
    argv.iter()
        .map(|a| format!("'{}'", a.replace('\'', r"'\''")))
        .collect::<Vec<_>>()
        .join(" ")
}

fn unquote(s: &str) -> String {
    let t = s.trim();
    for q in ['"', '\''] {
        if t.len() >= 2 && t.starts_with(q) && t.ends_with(q) {
            return t[1..t.len() - 1].to_string();
        }
    }
    t.to_string()
}

/// `ENV A=1 B="two words"` or the old `ENV A value with spaces`.
fn env_pairs(s: &str) -> Option<Vec<String>> {
    let first = s.split_whitespace().next()?;
    if !first.contains('=') {
        let (name, value) = s.split_once(char::is_whitespace)?;
        return Some(vec![name.to_string(), value.trim().to_string()]);
    }
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let (name, after) = rest.split_once('=')?;
        let (value, next) = match after.chars().next() {
            Some(q @ ('"' | '\'')) => {
                let end = after[1..].find(q)? + 1;
                (after[1..end].to_string(), &after[end + 1..])
            }
            _ => {
                let end = after.find(char::is_whitespace).unwrap_or(after.len());
                (after[..end].to_string(), &after[end..])
            }
        };
        out.push(name.trim().to_string());
        out.push(value);
        rest = next.trim_start();
    }
    Some(out)
}

/// `$NAME` and `${NAME}` of earlier ARGs; others are left for the shell.
fn substitute(s: &str, args: &BTreeMap<String, String>) -> String {
    let mut out = s.to_string();
    for (k, v) in args {
        out = out.replace(&format!("${{{k}}}"), v).replace(&format!("${k}"), v);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    #[test]
    fn parses_the_subset() {
        let d = parse_dockerfile(
            "# a comment\nARG V=3\nFROM base\nRUN apt-get update && \\\n    echo $V\nCOPY app.py lib/ /app/\nENV A=1 B=\"two words\"\nWORKDIR /app\nUSER user\nCMD [\"python3\", \"app.py\"]\n",
            Some(CTX),
        )
        .unwrap();
        assert_eq!(d.from, "base");
        assert_eq!(
            (d.steps[0].kind, &d.steps[0].args[..]),
            (StepKind::User, &["root".to_string()][..])
        );
        assert_eq!(d.steps[1].args, vec!["/"]);
        let d = Definition {
            steps: d.steps[2..].to_vec(),
            ..d
        };
        assert_eq!(d.steps[0].args, vec!["apt-get update && echo 3"]);
        assert_eq!(d.steps[1].args, vec!["app.py", "/app/"]);
        assert_eq!(d.steps[2].args, vec!["lib/", "/app/"]);
        assert_eq!(d.steps[3].args, vec!["A", "1", "B", "two words"]);
        assert_eq!(d.steps[4].kind, StepKind::Workdir);
        assert_eq!(d.steps[5].args, vec!["user"]);
        assert_eq!(d.steps.len(), 6, "USER and WORKDIR were set: no defaults after");
        assert_eq!(d.start_cmd.as_deref(), Some("'python3' 'app.py'"));
    }

    #[test]
    fn refuses_what_it_lacks_naming_the_line() {
        for (text, line, what) in [
            ("FROM base\nHEALTHCHECK CMD true\n", 2, "HEALTHCHECK is not supported"),
            ("FROM base AS b\n", 1, "multi-stage"),
            ("FROM base\nRUN true\nFROM seed\n", 3, "multi-stage"),
            ("FROM base\nCOPY --from=b /x /y\n", 2, "flags are not supported"),
            ("RUN true\n", 1, "before FROM"),
            ("FROM base\nADD https://example.com/x /x\n", 2, "only local files"),
        ] {
            let e = parse_dockerfile(text, Some(CTX)).unwrap_err().to_string();
            assert!(
                e.contains(&format!("line {line}:")) && e.contains(what),
                "{text:?}: {e}"
            );
        }
        let e = parse_dockerfile("FROM base\nCOPY a /a\n", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs a build context"), "{e}");
    }

    #[test]
    fn checks_steps() {
        let def = |steps| Definition {
            from: "base".into(),
            steps,
            ..Default::default()
        };
        assert!(def(vec![step(StepKind::Run, vec!["".into()], None)])
            .validate()
            .is_err());
        assert!(def(vec![step(StepKind::Copy, vec!["a".into(), "/b".into()], None)])
            .validate()
            .is_err());
        assert!(def(vec![step(
            StepKind::Copy,
            vec!["../a".into(), "/b".into()],
            Some(CTX.into())
        )])
        .validate()
        .is_err());
        assert!(def(vec![step(StepKind::Env, vec!["1A".into(), "x".into()], None)])
            .validate()
            .is_err());
        assert!(def(vec![step(StepKind::User, vec!["Root".into()], None)])
            .validate()
            .is_err());
        assert!(def(vec![step(
            StepKind::Copy,
            vec!["a".into(), "/b".into(), "".into(), "0755".into()],
            Some(CTX.into())
        )])
        .validate()
        .is_ok());
    }

    #[test]
    fn step_keys_chain() {
        let a = parse_dockerfile("FROM base\nRUN echo a\nRUN echo b\n", None).unwrap();
        let b = parse_dockerfile("FROM base\nRUN echo a\nRUN echo c\n", None).unwrap();
        let (ka, kb) = (step_keys(&a, "p", "{}", "1"), step_keys(&b, "p", "{}", "1"));
        assert_eq!(ka.len(), a.steps.len() + 1);
        assert_eq!(ka[..4], kb[..4], "the steps before the changed one keep their keys");
        assert_ne!(ka[4], kb[4]);
        assert_ne!(ka[5], kb[5], "and every later one changes");
        assert_ne!(
            step_keys(&a, "p", "{}", "2")[1],
            ka[1],
            "another shape is another cache"
        );
    }

    #[test]
    fn the_key_follows_content_not_force() {
        let mut d = parse_dockerfile("FROM base\nRUN echo hi\n", None).unwrap();
        let k = d.cache_key("sha256:p");
        assert_ne!(k, d.cache_key("sha256:q"));
        d.steps[2].force = true;
        assert_eq!(k, d.cache_key("sha256:p"));
        d.steps[2].args[0] = "echo ho".into();
        assert_ne!(k, d.cache_key("sha256:p"));
    }
}
