"""E2B's template builder, unmodified SDK code against airlock: `Template()` steps build in a
microVM through the E2B door (`/v3/templates`, signed uploads, the build's steps, its status and
logs), then `Sandbox.create(name)` starts it with its files, env and start process; a failing
step raises the SDK's build error with the step's message; tags and `exists` answer."""
import urllib.error
import uuid

import pytest
import registry
from conftest import _native
from e2b import BuildException, Sandbox, Template, wait_for_port

# The templates this module builds: deleted when it ends (and the images pulled for them), since
# the suite's runs share one data dir.
BUILT = []


def _name(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _built(prefix):
    name = _name(prefix)
    BUILT.append(name)
    return name


@pytest.fixture(scope="module", autouse=True)
def delete_what_was_built(airlock_server):
    yield
    for name in BUILT:
        try:
            _native(airlock_server["url"], airlock_server["key"], "DELETE", f"/v1/templates/{name}")
        except urllib.error.HTTPError as e:
            if e.code != 404:  # a build refused before it was recorded has nothing to delete
                raise


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One template of the E2B builder's common calls, built once for the module."""
    ctx = tmp_path_factory.mktemp("ctx")
    (ctx / "folder").mkdir()
    (ctx / "folder" / "hello.txt").write_text("hello from the builder\n")
    (ctx / "folder" / "sub").mkdir()
    (ctx / "folder" / "sub" / "deep.txt").write_text("deep\n")
    # New content every run: the server's step cache (shared by the suite's runs on one data
    # dir) would otherwise answer the RUN from an earlier run, and its output would not be logged.
    nonce = uuid.uuid4().hex[:12]
    template = (
        Template(file_context_path=str(ctx))
        .from_template("base")
        .copy("folder/*", "/app/folder/")
        .run_cmd(f"echo built-{nonce} && echo built > /home/user/built.txt")
        .set_envs({"GREETING": "hello"})
        .set_start_cmd("python3 -m http.server 8000 --directory /app/folder", wait_for_port(8000))
    )
    name = _built("e2b-tpl")
    logs = []
    info = Template.build(template, f"{name}:v1", cpu_count=1, memory_mb=1024, on_build_logs=logs.append)
    return {"name": name, "info": info, "logs": logs, "nonce": nonce}


def test_builder_code_builds_and_the_sandbox_starts_with_it(built):
    messages = [str(getattr(e, "message", e)) for e in built["logs"]]
    assert any(m.strip().endswith(f"built-{built['nonce']}") for m in messages), messages
    sbx = Sandbox.create(f"{built['name']}:v1", timeout=300)
    try:
        r = sbx.commands.run(
            "cat /app/folder/hello.txt /app/folder/sub/deep.txt /home/user/built.txt; echo $GREETING; "
            "python3 -c \"import urllib.request; "
            "print(urllib.request.urlopen('http://127.0.0.1:8000/hello.txt').read().decode(), end='')\""
        )
        assert r.stdout == "hello from the builder\ndeep\nbuilt\nhello\nhello from the builder\n", r
        assert sbx.commands.run("stat -c %U /app/folder/hello.txt").stdout.strip() == "user"
    finally:
        sbx.kill()


def test_exists_and_tags(built):
    name = built["name"]
    assert Template.exists(name)
    assert Template.exists("base")
    assert not Template.exists(_name("no-such-template"))
    if not hasattr(Template, "assign_tags"):
        pytest.skip("this e2b has no assign_tags")
    assigned = Template.assign_tags(f"{name}:v1", ["production", "stable"])
    assert set(assigned.tags) >= {"production", "stable"}, assigned
    sbx = Sandbox.create(f"{name}:production", timeout=120)
    try:
        assert sbx.commands.run("cat /home/user/built.txt").stdout == "built\n"
    finally:
        sbx.kill()
    if hasattr(Template, "get_tags"):
        tags = {t.tag for t in Template.get_tags(name)}
        assert {"v1", "production", "stable"} <= tags, tags
    if hasattr(Template, "remove_tags"):
        Template.remove_tags(name, ["stable"])
        with pytest.raises(Exception):
            Sandbox.create(f"{name}:stable", timeout=60)


def test_a_failing_step_raises_the_build_error_with_its_output():
    template = Template().from_template("base").run_cmd("echo about to fail && false")
    logs = []
    with pytest.raises(BuildException) as e:
        Template.build(template, _built("e2b-fail"), cpu_count=1, memory_mb=1024, on_build_logs=logs.append)
    assert "failed to run command 'echo about to fail && false': command failed: exit status 1" in str(e.value)
    messages = [str(getattr(x, "message", x)) for x in logs]
    assert any("about to fail" in m for m in messages), messages


def test_an_image_nobody_mirrors_fails_naming_it():
    template = Template().from_image("registry.invalid/nobody/mirrors:this").run_cmd("true")
    with pytest.raises(Exception) as e:
        Template.build(template, _built("e2b-image"), cpu_count=1, memory_mb=1024)
    assert "registry.invalid/nobody/mirrors:this" in str(e.value)


def test_an_image_the_operator_mirrors_builds(airlock_server):
    """`from_image` of a Docker Hub name the operator mirrors (`--registry-mirror docker.io=`):
    pulled from the mirror, its RUN run as `user` (made after the image, as E2B does), and a
    sandbox of it starts."""
    tag = "e2b-" + uuid.uuid4().hex[:8]
    registry.push_busybox(airlock_server["mirror"], "library/busybox", tag)
    nonce = uuid.uuid4().hex[:12]
    template = Template().from_image(f"busybox:{tag}").run_cmd(f"echo {nonce} > /tmp/built; id -un >> /tmp/built")
    name = _built("e2b-mirror")
    Template.build(template, name, cpu_count=1, memory_mb=1024)
    sbx = Sandbox.create(name, timeout=120)
    try:
        assert sbx.files.read("/tmp/built") == f"{nonce}\nuser\n"
    finally:
        sbx.kill()
