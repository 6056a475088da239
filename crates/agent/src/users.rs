//! User lookup from the guest's /etc/passwd and /etc/group.
//!
//! Parsed directly: the agent is statically linked, and glibc's NSS does not work from a static
//! binary, so `getpwnam` is not an option.

use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    pub shell: String,
    /// Supplementary groups (including the primary one).
    pub groups: Vec<u32>,
}

pub fn lookup(name: &str) -> Option<User> {
    lookup_in(name, Path::new("/etc/passwd"), Path::new("/etc/group"))
}

/// By name, or numerically as `UID` or `UID:GID` (Docker's `--user`): a uid the guest's passwd
/// lacks is an account of its own (its gid the uid unless given, home `/`).
pub fn lookup_in(name: &str, passwd: &Path, group: &Path) -> Option<User> {
    let passwd = std::fs::read_to_string(passwd).ok()?;
    let numeric = || -> Option<(u32, Option<u32>)> {
        let (uid, gid) = match name.split_once(':') {
            Some((u, g)) => (u, Some(g.parse().ok()?)),
            None => (name, None),
        };
        Some((uid.parse().ok()?, gid))
    };
    let mut user = match parse_passwd(&passwd, |n, _| n == name) {
        Some(u) => u,
        None => {
            let (uid, gid) = numeric()?;
            let mut u = parse_passwd(&passwd, |_, id| id == uid).unwrap_or(User {
                name: uid.to_string(),
                uid,
                gid: uid,
                home: "/".into(),
                shell: "/bin/sh".into(),
                groups: vec![uid],
            });
            if let Some(g) = gid {
                u.gid = g;
                u.groups = vec![g];
                return Some(u);
            }
            u
        }
    };
    if let Ok(group) = std::fs::read_to_string(group) {
        user.groups = groups_of(&group, &user.name, user.gid);
    }
    Some(user)
}

/// Name of the account with this uid, for stat output.
pub fn name_of_uid(uid: u32) -> Option<String> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    parse_passwd(&passwd, |_, u| u == uid).map(|u| u.name)
}

pub fn name_of_gid(gid: u32) -> Option<String> {
    let group = std::fs::read_to_string("/etc/group").ok()?;
    group.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        (f.len() >= 3 && f[2].parse::<u32>().ok() == Some(gid)).then(|| f[0].to_string())
    })
}

fn parse_passwd(text: &str, pick: impl Fn(&str, u32) -> bool) -> Option<User> {
    text.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 {
            return None;
        }
        let uid = f[2].parse().ok()?;
        if !pick(f[0], uid) {
            return None;
        }
        let gid = f[3].parse().ok()?;
        Some(User {
            name: f[0].to_string(),
            uid,
            gid,
            home: f[5].to_string(),
            shell: f[6].to_string(),
            groups: vec![gid],
        })
    })
}

fn groups_of(text: &str, name: &str, primary: u32) -> Vec<u32> {
    let mut groups = vec![primary];
    for line in text.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 4 {
            continue;
        }
        let Ok(gid) = f[2].parse::<u32>() else { continue };
        if f[3].split(',').any(|m| m == name) && !groups.contains(&gid) {
            groups.push(gid);
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_user_and_supplementary_groups() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("passwd");
        let g = dir.path().join("group");
        std::fs::write(
            &p,
            "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n",
        )
        .unwrap();
        std::fs::write(&g, "root:x:0:\nsudo:x:27:user\nuser:x:1000:\naudio:x:29:bob,user\n").unwrap();
        let u = lookup_in("user", &p, &g).unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (1000, 1000, "/home/user"));
        assert_eq!(u.groups, vec![1000, 27, 29]);
        assert!(lookup_in("nobody-here", &p, &g).is_none());
        // Numerically: a known uid is its account; an unknown one stands alone; a gid is kept.
        assert_eq!(lookup_in("1000", &p, &g).unwrap().name, "user");
        let n = lookup_in("1234:55", &p, &g).unwrap();
        assert_eq!((n.uid, n.gid, n.name.as_str()), (1234, 55, "1234"));
        assert!(lookup_in("12x", &p, &g).is_none());
    }
}
