//! The debootstrap base, cached by its recipe's `base_key`: debootstrap (retried), the apt step,
//! the `user` account and slimming; the host's Debian mirror; debootstrap's progress lines.

use super::command::{run, run_logged};
use super::error::TemplateError;
use super::packages::apt_install;
use super::progress::Progress;
use super::recipes::SeedRecipe;
use super::store::TemplateStore;
use crate::datadir::random_hex;
use crate::error::{Result, RuntimeError};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

impl TemplateStore {
    pub(super) fn debootstrap_base(&self, recipe: &SeedRecipe, progress: &Progress) -> Result<PathBuf> {
        let base = self.data.cache().join(format!("base-{}", recipe.base_key()));
        if base.join(".complete").exists() {
            return Ok(base);
        }
        let _ = std::fs::remove_dir_all(&base);
        let tmp = self.data.cache().join(format!("base-tmp-{}", random_hex(4)));
        let log = self.data.cache().join("debootstrap.log");
        let res = (|| {
            let started = Instant::now();
            // A mirror that fails a request now and then (a release file once, in CI) costs a
            // retry, not the build.
            const ATTEMPTS: u32 = 3;
            let mut attempt = 1;
            let ran = loop {
                let _ = std::fs::remove_dir_all(&tmp);
                let mut cmd = Command::new("debootstrap");
                cmd.arg(format!("--variant={}", recipe.variant))
                    .arg(format!("--include={}", recipe.packages.join(",")))
                    .arg(&recipe.suite)
                    .arg(&tmp)
                    .arg(&recipe.mirror);
                let mut status = DebootstrapStatus::default();
                let ran = run_logged(&mut cmd, &log, "debootstrap", progress, |line| {
                    if line.starts_with("W: ") || line.starts_with("E: ") {
                        progress.warn(&format!("debootstrap: {line}"));
                    }
                    if status.feed(line) {
                        progress.status(&status.stage_line(), &status.count_line(), &status.display());
                    }
                });
                if ran.is_err() {
                    // debootstrap's own full log is inside the target, which is about to be removed.
                    if let Ok(inner) = std::fs::read(tmp.join("debootstrap/debootstrap.log")) {
                        use std::io::Write;
                        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(&log) {
                            let _ = f.write_all(b"--- debootstrap/debootstrap.log ---\n");
                            let _ = f.write_all(&inner);
                        }
                    }
                }
                if ran.is_ok() || attempt == ATTEMPTS {
                    break ran;
                }
                progress.warn(&format!(
                    "debootstrap failed (attempt {attempt} of {ATTEMPTS}); trying again in 10 s"
                ));
                attempt += 1;
                std::thread::sleep(std::time::Duration::from_secs(10));
            };
            ran?;
            tracing::debug!("debootstrap took {:.1}s", started.elapsed().as_secs_f64());
            if !recipe.apt.is_empty() {
                apt_install(&tmp, &recipe.apt, &log, progress)?;
            }
            progress.status("customizing the base", "customizing the base", "customizing the base");
            customize_base(&tmp)?;
            if recipe.packages.iter().any(|p| p == "python3-matplotlib") {
                let what = "building matplotlib's font cache";
                progress.status(what, what, what);
                // Build matplotlib's font cache now, not on a user's first plot under TCG.
                run(
                    Command::new("chroot").arg(&tmp).args([
                        "runuser",
                        "-u",
                        "user",
                        "--",
                        "env",
                        "HOME=/home/user",
                        "MPLBACKEND=Agg",
                        "python3",
                        "-c",
                        "import matplotlib.pyplot",
                    ]),
                    "matplotlib font cache",
                )?;
            }
            std::fs::write(tmp.join(".complete"), b"").map_err(|e| RuntimeError::io(&tmp, e))?;
            std::fs::rename(&tmp, &base).map_err(|e| RuntimeError::io(&base, e))
        })();
        if res.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        res.map(|_| base)
    }
}

/// Extra steps on the fresh debootstrap: the `user` account, hosts, and slimming.
fn customize_base(root: &Path) -> Result<()> {
    run(
        Command::new("chroot")
            .arg(root)
            .args(["useradd", "-m", "-s", "/bin/bash", "-G", "sudo", "user"]),
        "useradd user",
    )?;
    let w = |rel: &str, text: &str| {
        let p = root.join(rel);
        std::fs::write(&p, text).map_err(|e| RuntimeError::io(&p, e))
    };
    w("etc/sudoers.d/user", "user ALL=(ALL) NOPASSWD:ALL\n")?;
    w(
        "etc/hosts",
        "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n",
    )?;
    w("etc/resolv.conf", "")?;
    for dir in [
        "usr/share/doc",
        "usr/share/man",
        "usr/share/info",
        "var/cache/apt/archives",
        "var/lib/apt/lists",
    ] {
        let p = root.join(dir);
        for e in std::fs::read_dir(&p).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                let _ = std::fs::remove_dir_all(e.path());
            } else {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let _ = std::fs::create_dir_all(root.join("var/lib/apt/lists/partial"));
    let _ = std::fs::create_dir_all(root.join("var/cache/apt/archives/partial"));
    Ok(())
}

/// What debootstrap is doing, from its `I:` lines (`I: Retrieving libc6 2.36-9`, `I: Extracting
/// bash...`, `I: Configuring apt...`): a stage, how many packages it has passed, and the current one.
#[derive(Debug, Default)]
pub(super) struct DebootstrapStatus {
    stage: &'static str,
    count: usize,
    item: String,
}

impl DebootstrapStatus {
    /// Take one line of output; true when the stage, count or item changed.
    fn feed(&mut self, line: &str) -> bool {
        let Some(msg) = line.trim().strip_prefix("I: ") else {
            return false;
        };
        let msg = msg.trim().trim_end_matches("...");
        let (verb, rest) = msg.split_once(' ').unwrap_or((msg, ""));
        let rest = rest.trim();
        // Release and Packages indexes are one word; packages come as `<name> <version>`.
        let index = !rest.contains(' ');
        let (stage, counted) = match verb {
            "Retrieving" | "Validating" if index => ("fetching the package index", false),
            "Checking" | "Valid" if rest.starts_with("Release") => ("fetching the package index", false),
            "Resolving" | "Found" | "Checking" => ("resolving dependencies", false),
            "Retrieving" => ("retrieving packages", true),
            "Extracting" => ("extracting packages", true),
            "Installing" => ("installing core packages", false),
            "Unpacking" | "Configuring" => {
                let stage = if verb == "Unpacking" {
                    "unpacking packages"
                } else {
                    "configuring packages"
                };
                // `Unpacking required packages`, `Configuring the base system` open a round.
                let round = rest.ends_with(" packages") || rest.ends_with(" system");
                (stage, !round)
            }
            "Base" if rest.starts_with("system installed") => ("base system installed", false),
            // `Validating <pkg>` follows each download; `Chosen extractor`, `Keyring`, ...
            _ => return false,
        };
        if stage != self.stage {
            self.stage = stage;
            self.count = 0;
            self.item.clear();
        }
        if counted {
            self.count += 1;
            self.item = rest.to_string();
        }
        true
    }

    /// `debootstrap: retrieving packages`
    fn stage_line(&self) -> String {
        format!("debootstrap: {}", self.stage)
    }

    /// `debootstrap: retrieving packages (37)`
    fn count_line(&self) -> String {
        match self.count {
            0 => self.stage_line(),
            n => format!("debootstrap: {} ({n})", self.stage),
        }
    }

    /// `retrieving packages (37) libc6 2.36-9`, for the spinner (its step already says debootstrap)
    fn display(&self) -> String {
        let line = self.count_line();
        let line = line.trim_start_matches("debootstrap: ");
        match self.item.as_str() {
            "" => line.to_string(),
            item => format!("{line} {item}"),
        }
    }
}

/// The Debian mirror configured on this host (deb822 sources first, then sources.list).
pub fn host_mirror() -> Result<String> {
    if let Ok(m) = std::env::var("AIRLOCK_DEBIAN_MIRROR") {
        return Ok(m);
    }
    let deb822 = std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources").unwrap_or_default();
    let legacy = std::fs::read_to_string("/etc/apt/sources.list").unwrap_or_default();
    mirror_from_sources(&deb822, &legacy).ok_or_else(|| TemplateError::NoMirror.into())
}

pub fn mirror_from_sources(deb822: &str, legacy: &str) -> Option<String> {
    let from_deb822 = deb822
        .lines()
        .filter_map(|l| l.strip_prefix("URIs:"))
        .flat_map(str::split_whitespace)
        .find(|u| !u.contains("security"));
    let from_legacy = || {
        legacy.lines().map(str::split_whitespace).find_map(|mut f| {
            (f.next() == Some("deb"))
                .then(|| f.find(|w| w.contains("://")))
                .flatten()
                .filter(|u| !u.contains("security"))
        })
    };
    from_deb822.or_else(from_legacy).map(String::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_mirror_in_sources() {
        let deb822 = "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n\nURIs: http://mirror.example/debian-security\n";
        assert_eq!(
            mirror_from_sources(deb822, "").as_deref(),
            Some("http://mirror.example/debian")
        );
        let legacy = "deb http://sec.example/debian-security bookworm-security main\ndeb [arch=amd64] http://m.example/debian bookworm main\n";
        assert_eq!(
            mirror_from_sources("", legacy).as_deref(),
            Some("http://m.example/debian")
        );
        assert_eq!(mirror_from_sources("", ""), None);
    }

    /// Lines from a real `debootstrap --variant=minbase bookworm` run (stdout, abridged).
    const DEBOOTSTRAP_LINES: &str = "\
I: Retrieving InRelease 
I: Checking Release signature
I: Valid Release signature (key id 4D64FEC119C2029067D6E791F8D2585B8783D481)
I: Retrieving Packages 
I: Validating Packages 
I: Resolving dependencies of required packages...
I: Resolving dependencies of base packages...
I: Checking component main on http://deb.debian.org/debian...
I: Retrieving adduser 3.134
I: Validating adduser 3.134
I: Retrieving apt 2.6.1
I: Validating apt 2.6.1
I: Retrieving base-files 12.4+deb12u15
I: Validating base-files 12.4+deb12u15
I: Chosen extractor for .deb packages: dpkg-deb
I: Extracting adduser...
I: Extracting apt...
I: Installing core packages...
I: Unpacking required packages...
I: Unpacking base-files...
I: Unpacking base-passwd...
I: Configuring required packages...
I: Configuring base-files...
I: Unpacking the base system...
I: Unpacking libproc2-0:amd64...
I: Configuring the base system...
I: Configuring libc-bin...
I: Configuring ca-certificates...
I: Base system installed successfully.
";

    #[test]
    fn follows_debootstrap_stages() {
        let mut status = DebootstrapStatus::default();
        let mut shown = Vec::new();
        for line in DEBOOTSTRAP_LINES.lines() {
            if status.feed(line) {
                shown.push(status.display());
            }
        }
        let mut deduped = shown.clone();
        deduped.dedup();
        assert_eq!(
            deduped,
            vec![
                "fetching the package index",
                "resolving dependencies",
                "retrieving packages (1) adduser 3.134",
                "retrieving packages (2) apt 2.6.1",
                "retrieving packages (3) base-files 12.4+deb12u15",
                "extracting packages (1) adduser",
                "extracting packages (2) apt",
                "installing core packages",
                "unpacking packages",
                "unpacking packages (1) base-files",
                "unpacking packages (2) base-passwd",
                "configuring packages",
                "configuring packages (1) base-files",
                "unpacking packages",
                "unpacking packages (1) libproc2-0:amd64",
                "configuring packages",
                "configuring packages (1) libc-bin",
                "configuring packages (2) ca-certificates",
                "base system installed",
            ]
        );
        assert_eq!(status.count_line(), "debootstrap: base system installed");
        // `Validating <pkg>` and other lines change nothing.
        let mut s = DebootstrapStatus::default();
        assert!(s.feed("I: Retrieving libc6 2.36-9+deb12u10"));
        assert!(!s.feed("I: Validating libc6 2.36-9+deb12u10"));
        assert!(!s.feed("W: Cannot check Release signature; keyring file not available"));
        assert!(!s.feed("dpkg: warning: something"));
        assert_eq!(s.count_line(), "debootstrap: retrieving packages (1)");
        assert_eq!(s.stage_line(), "debootstrap: retrieving packages");
    }
}
