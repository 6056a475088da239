//! Custom templates through `/v1/templates`: a Dockerfile with RUN, COPY, ENV, WORKDIR, USER and
//! a start command builds in a microVM; a sandbox of it starts with the file, the env and the
//! start process up; a failing step names itself; an unchanged rebuild is cached; another
//! tenant sees none of it; bad Dockerfiles are 422s naming the line.

use super::*;

/// A value no earlier run used: steps holding it are built, never taken from the step cache
/// (which outlives a run on the same data dir).
pub(crate) fn nonce() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

/// `files` (path, content) packed as a tar by the host's `tar`.
fn tar_of(files: &[(&str, &str)]) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    for (path, content) in files {
        let p = dir.path().join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }
    let out = Command::new("tar")
        .arg("-c")
        .arg("-C")
        .arg(dir.path())
        .arg(".")
        .output()
        .unwrap();
    assert!(out.status.success());
    out.stdout
}

fn upload_context(s: &Server, key: &str, tar: &[u8]) -> String {
    let resp = ureq::post(&format!("{}/v1/templates/contexts", s.url))
        .set("Authorization", &format!("Bearer {key}"))
        .set("Content-Type", "application/octet-stream")
        .send_bytes(tar)
        .unwrap();
    assert_eq!(resp.status(), 201);
    let body: Value = resp.into_json().unwrap();
    body["hash"].as_str().unwrap().to_string()
}

/// Poll build `id` until it ends (ready or error); returns it.
pub(crate) fn wait_build(s: &Server, id: &str) -> Value {
    wait_build_of(s, &s.key, id)
}

fn wait_build_of(s: &Server, key: &str, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let (status, b) = s.call_with("GET", &format!("/v1/builds/{id}"), None, Some(key), &[]);
        assert_eq!(status, 200, "{b}");
        if b["status"] == "ready" || b["status"] == "error" {
            return b;
        }
        assert!(Instant::now() < deadline, "build {id} never ended: {b}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Every log line of build `id`, through the SSE stream (which ends with the build).
pub(crate) fn log_lines(s: &Server, id: &str) -> Vec<Value> {
    let resp = ureq::get(&format!("{}/v1/builds/{id}/logs", s.url))
        .set("Authorization", &format!("Bearer {}", s.key))
        .set("Accept", "text/event-stream")
        .timeout(Duration::from_secs(60))
        .call()
        .unwrap();
    let mut lines = Vec::new();
    let mut event = String::new();
    for line in std::io::BufRead::lines(std::io::BufReader::new(resp.into_reader())) {
        let line = line.unwrap();
        if let Some(e) = line.strip_prefix("event:") {
            event = e.trim().to_string();
        } else if let Some(d) = line.strip_prefix("data:") {
            if event == "end" {
                break;
            }
            lines.push(serde_json::from_str(d.trim()).unwrap());
        }
    }
    lines
}

/// Run `cmd` in sandbox `id` with bash; (stdout, exit code).
fn sh(s: &Server, id: &str, cmd: &str) -> (String, i64) {
    let sid = s.session(id, json!({ "argv": ["bash", "-lc", cmd], "timeout": "60s" }));
    let events = s.events(id, &sid, None, None);
    let code = events.last().unwrap().2["exit_code"].as_i64().unwrap_or(-1);
    (decode(&events, "stdout"), code)
}

pub(crate) fn a_dockerfile_builds_a_template_that_starts_restored() {
    let s = server();
    let name = format!("api-app-{}", std::process::id());
    let context = upload_context(
        s,
        &s.key,
        &tar_of(&[
            ("app/hello.txt", "hello from the context\n"),
            ("app/lib/mod.py", "X = 1\n"),
        ]),
    );
    // New content every run (the step cache outlives a run on the same data dir): the RUN's
    // output is logged only when it runs.
    let dockerfile = format!(
        "\
FROM seed
ARG WHO=builder
RUN echo \"built by $WHO\" && echo to-stderr >&2 && echo marker > /etc/airlock-built && echo {}
COPY app/ /opt/app/
ENV GREETING=hello DERIVED=$GREETING-x
WORKDIR /opt/app
USER user
RUN whoami > /home/user/whoami.txt
CMD [\"python3\", \"-m\", \"http.server\", \"8000\"]
",
        nonce()
    );
    let dockerfile = dockerfile.as_str();
    let started = Instant::now();
    let (status, build) = s.call(
        "POST",
        "/v1/templates",
        Some(json!({
            "name": format!("{name}:v1"),
            "dockerfile": dockerfile,
            "context": context,
            "ready_cmd": "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8000))'",
        })),
    );
    assert_eq!(status, 202, "{build}");
    let id = build["id"].as_str().unwrap().to_string();
    let done = wait_build(s, &id);
    let cold = started.elapsed();
    assert_eq!(done["status"], "ready", "{done}");
    let lines = log_lines(s, &id);
    let text: Vec<&str> = lines.iter().map(|l| l["message"].as_str().unwrap()).collect();
    assert!(text.contains(&"built by builder"), "{text:?}");
    // Step 3: after the Dockerfile's implied `USER root` and `WORKDIR /`.
    assert!(
        lines.iter().any(|l| l["message"] == "to-stderr" && l["step"] == "3"),
        "{lines:?}"
    );
    eprintln!("cold build {} ms", cold.as_millis());

    // Listed as the tenant's, with its tag; a sandbox of it has the files, the env, the user's
    // file and the start process serving.
    let (_, list) = s.call("GET", "/v1/templates", None);
    assert!(
        list["templates"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == name.as_str() && t["tag"] == "v1"),
        "{list}"
    );
    let sb = s.create(json!({ "template": format!("{name}:v1"), "timeout": "10m" }));
    let (_, got) = s.call("GET", &format!("/v1/sandboxes/{sb}"), None);
    assert_eq!(got["start"]["from"], "restore", "the first create restores: {got}");
    let (out, code) = sh(
        s,
        &sb,
        "pwd; cat /opt/app/hello.txt /opt/app/lib/mod.py /etc/airlock-built /home/user/whoami.txt; echo $GREETING $DERIVED; \
         stat -c %U /opt/app/hello.txt; \
         python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/hello.txt').read().decode(), end='')\"",
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out,
        "/opt/app\nhello from the context\nX = 1\nmarker\nuser\nhello hello-x\nroot\nhello from the context\n"
    );

    // The same definition again: the built template at once, no VM.
    let again = Instant::now();
    let (status, cached) = s.call(
        "POST",
        "/v1/templates",
        Some(json!({
            "name": format!("{name}:v2"),
            "dockerfile": dockerfile,
            "context": context,
            "ready_cmd": "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8000))'",
        })),
    );
    assert_eq!((status, cached["status"].as_str()), (202, Some("ready")), "{cached}");
    assert_eq!(cached["digest"], done["digest"]);
    eprintln!("cached build {} ms", again.elapsed().as_millis());

    // Another tenant: none of it, as if missing.
    let tenant = format!("tpl-other-{}", std::process::id());
    s.cli_ok(&["tenant", "create", &tenant]);
    let other = s.cli_ok(&["key", "create", "--tenant", &tenant]);
    let other = other.as_str().unwrap();
    let (status, body) = s.call_with("GET", &format!("/v1/templates/{name}:v1"), None, Some(other), &[]);
    assert_eq!(status, 404, "{body}");
    let (status, body) = s.call_with("GET", &format!("/v1/builds/{id}"), None, Some(other), &[]);
    assert_eq!(status, 404, "{body}");
    let (status, body) = s.call_with(
        "POST",
        "/v1/sandboxes",
        Some(json!({ "template": format!("{name}:v1") })),
        Some(other),
        &[],
    );
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("template_not_found")),
        "{body}"
    );
    let (status, body) = s.call_with(
        "POST",
        "/v1/sandboxes",
        Some(json!({ "template": format!("build-{id}") })),
        Some(other),
        &[],
    );
    assert_eq!(status, 404, "{body}");
    // Its own build of the same content is not a cache hit of the first tenant's.
    let (status, body) = s.call_with(
        "POST",
        "/v1/templates",
        Some(json!({ "name": name, "from": "seed", "steps": [{"type": "RUN", "args": ["true"]}] })),
        Some(other),
        &[],
    );
    assert_eq!(status, 202, "{body}");
    assert_ne!(body["status"], "ready", "no cache hit across tenants: {body}");
    let theirs = wait_build_of(s, other, body["id"].as_str().unwrap());
    assert_eq!(theirs["status"], "ready", "{theirs}");

    // Deleting the template leaves its sandbox running.
    let (status, body) = s.call("DELETE", &format!("/v1/templates/{name}"), None);
    assert_eq!(status, 204, "{body}");
    let (status, _) = s.call("GET", &format!("/v1/templates/{name}:v1"), None);
    assert_eq!(status, 404);
    assert_eq!(sh(s, &sb, "cat /etc/airlock-built"), ("marker\n".into(), 0));
    s.delete(&sb);
    // The other tenant goes, its build with it.
    s.cli_ok(&["tenant", "rm", &tenant]);
}

pub(crate) fn a_failing_step_names_itself_and_bad_definitions_are_refused() {
    let s = server();
    let name = format!("api-fail-{}", std::process::id());
    let (status, build) = s.call(
        "POST",
        "/v1/templates",
        Some(json!({
            "name": name,
            "from": "seed",
            "steps": [
                {"type": "ENV", "args": ["A", "1"]},
                {"type": "RUN", "args": ["echo about to fail; echo boom >&2; exit 3"]},
                {"type": "RUN", "args": ["echo never"]},
            ],
        })),
    );
    assert_eq!(status, 202, "{build}");
    let id = build["id"].as_str().unwrap();
    let done = wait_build(s, id);
    assert_eq!(done["status"], "error", "{done}");
    assert_eq!(done["error"]["step"], "2", "{done}");
    assert_eq!(
        done["error"]["message"],
        "failed to run command 'echo about to fail; echo boom >&2; exit 3': command failed: exit status 3"
    );
    let lines = log_lines(s, id);
    assert!(
        lines.iter().any(|l| l["message"] == "boom" && l["step"] == "2"),
        "{lines:?}"
    );
    assert!(!lines.iter().any(|l| l["message"] == "never"), "{lines:?}");
    // Its build sandbox is gone.
    let (_, list) = s.call("GET", "/v1/sandboxes", None);
    assert!(
        !list.to_string().contains(id),
        "the build's sandbox outlived it: {list}"
    );

    for (dockerfile, needle) in [
        (
            "FROM seed\nHEALTHCHECK CMD true\n",
            "line 2: HEALTHCHECK is not supported",
        ),
        (
            "FROM seed AS a\nRUN true\n",
            "line 1: FROM ... AS: multi-stage builds are not supported",
        ),
        ("FROM seed\nRUN true\nFROM seed\n", "line 3: a second FROM"),
        ("FROM no-such-template\nRUN true\n", "not found"),
    ] {
        let (status, body) = s.call(
            "POST",
            "/v1/templates",
            Some(json!({ "name": name, "dockerfile": dockerfile })),
        );
        assert_eq!(
            (status, body["code"].as_str()),
            (422, Some("invalid_argument")),
            "{dockerfile}: {body}"
        );
        assert!(
            body["message"].as_str().unwrap().contains(needle),
            "{dockerfile}: {body}"
        );
    }
    // A platform template's name is not the tenant's to take.
    let (status, body) = s.call(
        "POST",
        "/v1/templates",
        Some(json!({ "name": "seed", "from": "seed", "steps": [] })),
    );
    assert_eq!(status, 409, "{body}");
    let (status, body) = s.call(
        "POST",
        "/v1/templates",
        Some(json!({ "name": "Bad Name", "from": "seed" })),
    );
    assert_eq!(status, 422, "{body}");
}

/// A RUN that reaches for a host the tenant's egress does not allow fails naming the denial; a
/// build past the tenant's quota is refused before anything starts.
pub(crate) fn a_denied_host_is_named_and_a_build_over_quota_is_refused() {
    let s = server();
    let (status, build) = s.call(
        "POST",
        "/v1/templates",
        Some(json!({
            "name": format!("api-denied-{}", std::process::id()),
            "from": "seed",
            "steps": [{"type": "RUN", "args": [
                "timeout 10 python3 -c \"import urllib.request; urllib.request.urlopen('http://pypi.org/simple/', timeout=5)\""
            ]}],
        })),
    );
    assert_eq!(status, 202, "{build}");
    let done = wait_build(s, build["id"].as_str().unwrap());
    assert_eq!(done["status"], "error", "{done}");
    let message = done["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("egress denied by the tenant's policy") && message.contains("pypi.org"),
        "{message}"
    );

    let tenant = format!("tpl-quota-{}", std::process::id());
    s.cli_ok(&["tenant", "create", &tenant]);
    s.cli_ok(&["tenant", "quota", "set", "--tenant", &tenant, "--memory-mib", "256"]);
    let key = s.cli_ok(&["key", "create", "--tenant", &tenant]);
    let (status, body) = s.call_with(
        "POST",
        "/v1/templates",
        Some(json!({ "name": "over", "from": "seed", "steps": [{"type": "RUN", "args": ["true"]}] })),
        Some(key.as_str().unwrap()),
        &[],
    );
    assert_eq!((status, body["code"].as_str()), (429, Some("quota_exceeded")), "{body}");
    let (_, builds) = s.call_with("GET", "/v1/builds", None, Some(key.as_str().unwrap()), &[]);
    assert_eq!(
        builds["builds"],
        json!([]),
        "a refused build leaves no record: {builds}"
    );
    s.cli_ok(&["tenant", "rm", &tenant]);
}

/// `kill -9` of the server while a build runs: after a restart the build ends `error`, its
/// build sandbox (and VM) is gone, and no half template or capture is left.
pub(crate) fn a_server_killed_mid_build_leaves_nothing_behind() {
    let data = own_data_dir("build-kill");
    // Its templates are the shared data dir's (other tests' builds among them): only new ones count.
    let built_before = built_templates(&data);
    let mut s1 = Server::start(&data);
    let (status, build) = s1.call(
        "POST",
        "/v1/templates",
        Some(json!({
            "name": "killed",
            "from": "seed",
            "steps": [{"type": "RUN", "args": ["echo started; sleep 300"]}],
        })),
    );
    assert_eq!(status, 202, "{build}");
    let id = build["id"].as_str().unwrap().to_string();
    wait_step_one(&s1, &id);
    let (_, list) = s1.call("GET", "/v1/sandboxes", None);
    let sandbox = list["sandboxes"][0]["id"].as_str().unwrap().to_string();
    s1.kill9();

    let s2 = Server::start(&data);
    let deadline = Instant::now() + Duration::from_secs(120);
    let ended = loop {
        let (_, b) = s2.call("GET", &format!("/v1/builds/{id}"), None);
        if b["status"] == "error" {
            break b;
        }
        assert!(Instant::now() < deadline, "the build never ended: {b}");
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(
        ended["error"]["message"].as_str().unwrap().contains("interrupted"),
        "{ended}"
    );
    wait_state(&s2, &sandbox, "deleted", Duration::from_secs(60)).expect("the build sandbox is deleted");
    assert!(!data.join("sandboxes").join(&sandbox).exists(), "its VM's dir is gone");
    let pgrep = Command::new("pgrep").args(["-f", &sandbox]).output().unwrap();
    assert!(pgrep.stdout.is_empty(), "no process of its VM is left");
    let leftovers: Vec<String> = built_templates(&data)
        .into_iter()
        .filter(|n| !built_before.contains(n))
        .chain(
            std::fs::read_dir(data.join("cache"))
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.starts_with("capture-")),
        )
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    drop(s2);
}

/// Wait until build `id` runs its first step.
fn wait_step_one(s: &Server, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, b) = s.call("GET", &format!("/v1/builds/{id}"), None);
        if b["step"] == "1" {
            return;
        }
        assert!(Instant::now() < deadline && b["status"] != "error", "{b}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Names of the templates in data dir `data`'s store made of OCI image `image` (its manifest's
/// recipe digest is `oci <image>@<digest>`).
pub(crate) fn pulled_templates(data: &std::path::Path, image: &str) -> Vec<String> {
    let made_of = format!("oci {image}@");
    built_templates(data)
        .into_iter()
        .filter(|n| {
            std::fs::read(data.join("templates").join(n))
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .is_some_and(|m| m["recipe_digest"].as_str().is_some_and(|r| r.starts_with(&made_of)))
        })
        .collect()
}

/// Names of the built templates in data dir `data`'s template store.
fn built_templates(data: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(data.join("templates"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("build-"))
        .collect()
}

/// The CLI: `airlock template build -f Dockerfile -t name:tag DIR` prints the build's log as it
/// runs and the template at the end; `ls` lists it; a failing build exits non-zero naming its
/// step; `rm` deletes it.
pub(crate) fn the_cli_builds_lists_and_removes_a_template() {
    let s = server();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("greeting.txt"), "hi from the cli\n").unwrap();
    std::fs::create_dir(dir.path().join(".git")).unwrap();
    std::fs::write(dir.path().join(".git").join("secret"), "not sent").unwrap();
    std::fs::write(
        dir.path().join("Dockerfile"),
        format!(
            "FROM seed\nCOPY . /srv/\nRUN cat /srv/greeting.txt && test ! -e /srv/.git && echo {}\n",
            nonce()
        ),
    )
    .unwrap();
    let name = format!("cli-app-{}", std::process::id());
    let dir_arg = dir.path().to_str().unwrap();
    let out = s.cli(&["template", "build", "-t", &format!("{name}:v1"), dir_arg]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("hi from the cli"), "the log is shown: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with(&format!("{name}:v1 sha256:")), "{stdout}");
    let ls = s.cli(&["template", "ls"]);
    let listed = String::from_utf8_lossy(&ls.stdout);
    assert!(
        listed.contains(&name) && listed.contains("v1") && listed.contains("seed"),
        "{listed}"
    );

    std::fs::write(dir.path().join("Dockerfile.bad"), "FROM seed\nRUN exit 7\n").unwrap();
    let bad = dir.path().join("Dockerfile.bad");
    let out = s.cli(&["template", "build", "-f", bad.to_str().unwrap(), "-t", &name, dir_arg]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the build failed at step 3: failed to run command 'exit 7': command failed: exit status 7"),
        "{stderr}"
    );
    let out = s.cli(&["template", "rm", &name]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ls = s.cli(&["template", "ls"]);
    assert!(!String::from_utf8_lossy(&ls.stdout).contains(&name));
}

/// The step cache: a second build whose COPY's context changed starts from the VM saved after
/// the steps before it (their output not run again), and the template has both the cached
/// steps' work and the new files. Both builds' times are printed, not asserted.
pub(crate) fn a_changed_copy_reuses_every_step_before_it() {
    let s = server();
    let name = format!("api-steps-{}", std::process::id());
    let dockerfile = format!(
        "FROM seed\nRUN echo slow-step-{} && sleep 3 && echo kept > /etc/kept\nCOPY app/ /opt/app/\nRUN cat /opt/app/version.txt\n",
        nonce()
    );
    let mut took = Vec::new();
    let mut builds = Vec::new();
    for version in ["one", "two"] {
        let context = upload_context(s, &s.key, &tar_of(&[("app/version.txt", version)]));
        let started = Instant::now();
        let (status, build) = s.call(
            "POST",
            "/v1/templates",
            Some(json!({ "name": format!("{name}:{version}"), "dockerfile": dockerfile, "context": context })),
        );
        assert_eq!(status, 202, "{build}");
        let done = wait_build(s, build["id"].as_str().unwrap());
        assert_eq!(done["status"], "ready", "{done}");
        took.push(started.elapsed());
        builds.push(build["id"].as_str().unwrap().to_string());
    }
    eprintln!(
        "first build {} ms, second (one changed COPY) {} ms",
        took[0].as_millis(),
        took[1].as_millis()
    );
    let second = log_lines(s, &builds[1]);
    let text: Vec<String> = second
        .iter()
        .map(|l| format!("{} {}", l["step"].as_str().unwrap(), l["message"].as_str().unwrap()))
        .collect();
    // Steps 1-3 (USER root, WORKDIR /, the slow RUN) come from the cache; the COPY and after run.
    assert!(
        text.iter().any(|l| l.starts_with("3 CACHED RUN echo slow-step")),
        "{text:?}"
    );
    assert!(
        !text.iter().any(|l| l.starts_with("3 slow-step")),
        "the cached RUN ran again: {text:?}"
    );
    assert!(text.iter().any(|l| l == "5 two"), "{text:?}");
    let sb = s.create(json!({ "template": format!("{name}:two"), "timeout": "5m" }));
    assert_eq!(
        sh(s, &sb, "cat /etc/kept /opt/app/version.txt"),
        ("kept\ntwo".into(), 0)
    );
    s.delete(&sb);
    let (status, _) = s.call("DELETE", &format!("/v1/templates/{name}"), None);
    assert_eq!(status, 204);
}

/// An OCI image as the parent: a Dockerfile `FROM <local registry>/...` pulls it (two layers,
/// whiteouts applied), runs RUN and COPY in it with `/bin/sh` (busybox has no bash), and a
/// sandbox of it starts; the image's env is the template's. Again from the same image: no pull
/// of new content, the build cached. An image the registry lacks, and a registry the server may
/// not reach, are 422s naming the image.
pub(crate) fn a_dockerfile_from_a_local_registry_builds() {
    use airlock_testnet::registry::{busybox_image, Registry};
    let s = server();
    let registry = Registry::start().expect("the test registry");
    let layers = busybox_image().expect("busybox layers");
    let config = json!({ "config": {
        "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "FROM_IMAGE=yes"],
        "WorkingDir": "/",
    }});
    let pushed = Instant::now();
    registry.push("tiny/busybox:1", &layers, config).expect("push");
    eprintln!("pushed the image in {} ms", pushed.elapsed().as_millis());
    let n = nonce();
    let context = upload_context(s, &s.key, &tar_of(&[("app/hello.txt", &format!("hello {n}\n"))]));
    let name = format!("api-img-{}", std::process::id());
    let dockerfile = format!(
        "FROM {}/tiny/busybox:1\nRUN echo built-{n} > /etc/built && ls /etc > /etc/listing\nCOPY app/ /srv/app/\nENV GREETING=hi\n",
        registry.host()
    );
    let started = Instant::now();
    let (status, build) = s.call(
        "POST",
        "/v1/templates",
        Some(json!({ "name": name, "dockerfile": dockerfile, "context": context })),
    );
    assert_eq!(status, 202, "{build}");
    let id = build["id"].as_str().unwrap().to_string();
    let done = wait_build(s, &id);
    let lines = log_lines(s, &id);
    assert_eq!(done["status"], "ready", "{done}: {lines:?}");
    eprintln!("image build {} ms", started.elapsed().as_millis());
    let text: Vec<&str> = lines.iter().map(|l| l["message"].as_str().unwrap()).collect();
    assert!(text.iter().any(|l| l.contains("/bin/sh")), "{text:?}");

    let sb = s.create(json!({ "template": name, "timeout": "10m" }));
    let sid = s.session(
        &sb,
        json!({ "argv": ["/bin/sh", "-c",
            "cat /etc/built /srv/app/hello.txt; grep -c layer-2 /etc/listing; ls /etc/removed-by-layer-2 2>&1 | grep -c 'No such'; ls -A /opt/emptied | wc -l; echo $FROM_IMAGE $GREETING; id -un"],
            "timeout": "60s" }),
    );
    let events = s.events(&sb, &sid, None, None);
    let out = decode(&events, "stdout");
    assert_eq!(
        events.last().unwrap().2["exit_code"],
        0,
        "{out} {}",
        decode(&events, "stderr")
    );
    assert_eq!(out, format!("built-{n}\nhello {n}\n1\n1\n0\nyes hi\nuser\n"));
    s.delete(&sb);

    // The same again: the image is the same content, so the build is the one already made.
    let (status, again) = s.call(
        "POST",
        "/v1/templates",
        Some(json!({ "name": format!("{name}:again"), "dockerfile": dockerfile, "context": context })),
    );
    assert_eq!((status, again["status"].as_str()), (202, Some("ready")), "{again}");
    assert_eq!(again["digest"], done["digest"]);

    // Missing: the image, or a registry the server may not pull from.
    for (from, says) in [
        (format!("{}/tiny/nothing:1", registry.host()), "could not be pulled"),
        ("ghcr.io/example/app:1".to_string(), "not one this server pulls from"),
    ] {
        let (status, body) = s.call(
            "POST",
            "/v1/templates",
            Some(json!({ "name": format!("{name}-bad"), "dockerfile": format!("FROM {from}\nRUN true\n") })),
        );
        assert_eq!(
            (status, body["code"].as_str()),
            (422, Some("invalid_argument")),
            "{body}"
        );
        let message = body["message"].as_str().unwrap();
        assert!(message.contains(&from) && message.contains(says), "{message}");
    }
    // Deleted, the template takes the image pulled for it along (no other build was made of it).
    let image = format!("{}/tiny/busybox:1", registry.host());
    assert_eq!(
        pulled_templates(&s.data, &image).len(),
        1,
        "the pulled image is a template"
    );
    let (status, _) = s.call("DELETE", &format!("/v1/templates/{name}"), None);
    assert_eq!(status, 204);
    assert_eq!(
        pulled_templates(&s.data, &image),
        Vec::<String>::new(),
        "the pulled image is left"
    );

    // A registry with an account: refused without it, pulled with it, the password in no log.
    let password = format!("pw-{n}");
    let private = Registry::start_with_account("alice", &password).expect("the registry with an account");
    private
        .push("team/busybox:1", &layers, json!({ "config": {} }))
        .expect("push with the account");
    let from = format!("{}/team/busybox:1", private.host());
    let steps = json!([{"type": "RUN", "args": [format!("echo {n}")]}]);
    let (status, body) = s.call(
        "POST",
        "/v1/templates",
        Some(json!({ "name": format!("{name}-private"), "from": from, "steps": steps })),
    );
    assert_eq!(status, 422, "{body}");
    assert!(body["message"].as_str().unwrap().contains(&from), "{body}");
    let (status, build) = s.call(
        "POST",
        "/v1/templates",
        Some(json!({ "name": format!("{name}-private"), "from": from, "steps": steps,
            "registry_auth": { "username": "alice", "password": password } })),
    );
    assert_eq!(status, 202, "{build}");
    let done = wait_build(s, build["id"].as_str().unwrap());
    assert_eq!(done["status"], "ready", "{done}");
    let logged = std::fs::read_to_string(&s.log).unwrap();
    assert!(!logged.contains(&password), "the password is in the server's log");
    let lines = log_lines(s, build["id"].as_str().unwrap());
    assert!(!format!("{lines:?}{done}").contains(&password));
    for db in ["airlock.db", "airlock.db-wal"] {
        let bytes = std::fs::read(s.data.join(db)).unwrap_or_default();
        assert!(
            !bytes.windows(password.len()).any(|w| w == password.as_bytes()),
            "the password is in the store ({db})"
        );
    }
    assert_eq!(pulled_templates(&s.data, &from).len(), 1);
    let (status, _) = s.call("DELETE", &format!("/v1/templates/{name}-private"), None);
    assert_eq!(status, 204);
    assert_eq!(pulled_templates(&s.data, &from), Vec::<String>::new());
}

/// `DELETE /v1/builds/{id}` mid-step: the build ends `error` naming the cancel, its build
/// sandbox is deleted and no template of it is left; a second cancel answers it as it is.
pub(crate) fn a_cancelled_build_leaves_nothing_behind() {
    let s = server();
    let (status, build) = s.call(
        "POST",
        "/v1/templates",
        Some(json!({
            "name": format!("api-cancel-{}", std::process::id()),
            "from": "seed",
            "steps": [{"type": "RUN", "args": [format!("echo {}; sleep 300", nonce())]}],
        })),
    );
    assert_eq!(status, 202, "{build}");
    let id = build["id"].as_str().unwrap().to_string();
    wait_step_one(s, &id);
    let (_, list) = s.call("GET", "/v1/sandboxes", None);
    let sandbox = list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["metadata"]["airlock.build"] == id.as_str())
        .unwrap_or_else(|| panic!("no build sandbox in {list}"))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, ended) = s.call("DELETE", &format!("/v1/builds/{id}"), None);
    assert_eq!((status, ended["status"].as_str()), (200, Some("error")), "{ended}");
    let message = ended["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("cancelled by"), "{message}");
    wait_state(s, &sandbox, "deleted", Duration::from_secs(60)).expect("the build sandbox is deleted");
    // Its run sees the end and stops; nothing of it stays in the template store.
    std::thread::sleep(Duration::from_secs(2));
    let data = test_data_dir();
    assert!(
        !built_templates(&data).contains(&format!("build-{id}.json")),
        "no template of a cancelled build"
    );
    let (status, again) = s.call("DELETE", &format!("/v1/builds/{id}"), None);
    assert_eq!((status, &again["error"]), (200, &ended["error"]), "{again}");
}

/// Deleting a tenant takes its builds with it: the templates it built and the image it pulled
/// leave the node's store, its step cache's saved VMs go, its contexts and records too (a
/// tenant of the same name later has none of it). On a data dir of its own, so that what is
/// left can be counted.
pub(crate) fn a_deleted_tenant_leaves_no_build_behind() {
    use airlock_testnet::registry::{busybox_image, Registry};
    let data = own_data_dir("build-purge");
    let templates_before = built_templates(&data);
    let s = Server::start(&data);
    let tenant = format!("purged-{}", std::process::id());
    s.cli_ok(&["tenant", "create", &tenant]);
    let key = s.cli_ok(&["key", "create", "--tenant", &tenant]);
    let key = key.as_str().unwrap().to_string();
    let n = nonce();
    let context = upload_context(&s, &key, &tar_of(&[("f.txt", &n)]));
    let registry = Registry::start().expect("the test registry");
    registry
        .push("purge/busybox:1", &busybox_image().unwrap(), json!({ "config": {} }))
        .expect("push");
    let mut builds = Vec::new();
    for (name, from) in [
        ("from-seed", "seed".to_string()),
        ("from-image", format!("{}/purge/busybox:1", registry.host())),
    ] {
        let (status, b) = s.call_with(
            "POST",
            "/v1/templates",
            Some(json!({ "name": name, "from": from, "steps": [
                {"type": "RUN", "args": [format!("echo {n} > /tmp/n")]},
                {"type": "COPY", "args": ["f.txt", "/tmp/f.txt"], "filesHash": context},
                {"type": "RUN", "args": ["cat /tmp/f.txt"]},
            ]})),
            Some(&key),
            &[],
        );
        assert_eq!(status, 202, "{b}");
        let done = wait_build_of(&s, &key, b["id"].as_str().unwrap());
        assert_eq!(done["status"], "ready", "{done}");
        builds.push(done["id"].as_str().unwrap().to_string());
    }
    let made: Vec<String> = built_templates(&data)
        .into_iter()
        .filter(|t| !templates_before.contains(t))
        .collect();
    assert!(made.iter().any(|t| t.starts_with("build-oci-")), "{made:?}");
    let saved = std::fs::read_dir(data.join("images")).unwrap().count();
    assert!(saved >= 4, "the step cache saved the build VMs: {saved}");

    s.cli_ok(&["tenant", "rm", &tenant]);
    let left: Vec<String> = built_templates(&data)
        .into_iter()
        .filter(|t| !templates_before.contains(t))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    let images: Vec<_> = std::fs::read_dir(data.join("images"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(images.is_empty(), "{images:?}");
    let contexts = data.join("build-contexts");
    assert!(
        std::fs::read_dir(&contexts).map_or(true, |d| d.count() == 0),
        "no context is left in {}",
        contexts.display()
    );
    // A new tenant of the same name starts with nothing.
    s.cli_ok(&["tenant", "create", &tenant]);
    let key = s.cli_ok(&["key", "create", "--tenant", &tenant]);
    let key = key.as_str().unwrap();
    for id in &builds {
        let (status, _) = s.call_with("GET", &format!("/v1/builds/{id}"), None, Some(key), &[]);
        assert_eq!(status, 404);
    }
    let (_, list) = s.call_with("GET", "/v1/templates", None, Some(key), &[]);
    let names: Vec<&str> = list["templates"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(
        !names.contains(&"from-seed") && !names.contains(&"from-image"),
        "{list}"
    );
}
