"""envd fidelity with the unmodified SDK (real server, real VMs): symlinks as envd reports them,
CHMOD and entries in watch events, file metadata, signed URLs under E2B_SANDBOX_URL, metrics
windows, and the wording the SDK matches on."""
import datetime
import inspect
import time
import uuid

import httpx
import pytest
from conftest import skip_unless_sdk_has
from e2b import Sandbox


def test_symlinks_report_their_resolved_target_and_its_type(sbx):
    d = f"/home/user/links-{uuid.uuid4().hex[:6]}"
    sbx.commands.run(
        f"mkdir -p {d}/data/sub {d}/ln && echo hi > {d}/data/t.txt && "
        f"ln -s ../data/t.txt {d}/ln/rel && ln -s {d}/data/sub {d}/ln/dir && "
        f"ln -s ../ln/rel {d}/ln/chain && ln -s nowhere {d}/ln/dangling"
    )
    rel = sbx.files.get_info(f"{d}/ln/rel")
    # envd: the target fully resolved (absolute; a chain of links followed to its end).
    assert rel.symlink_target == f"{d}/data/t.txt"
    assert sbx.files.get_info(f"{d}/ln/chain").symlink_target == f"{d}/data/t.txt"
    assert rel.path == f"{d}/ln/rel" and rel.name == "rel"
    newer = hasattr(rel.type, "value") and any(t.value == "symlink" for t in type(rel.type))
    # The link is described by its target's type (newer SDKs see the link itself as SYMLINK).
    assert rel.type.value == ("symlink" if newer else "file")
    assert rel.mode == 0o644 and rel.permissions.startswith("L")
    dir_link = sbx.files.get_info(f"{d}/ln/dir")
    assert dir_link.type.value == ("symlink" if newer else "dir")
    assert dir_link.symlink_target == f"{d}/data/sub"
    listed = {e.name: e for e in sbx.files.list(f"{d}/ln")}
    # A dangling link has no type: the SDK leaves it out of listings, as with envd.
    assert sorted(listed) == ["chain", "dir", "rel"], sorted(listed)
    assert listed["rel"].symlink_target == f"{d}/data/t.txt"
    # A plain file has no target.
    assert sbx.files.get_info(f"{d}/data/t.txt").symlink_target is None


def test_watch_reports_chmod_and_newer_sdks_get_entries(sbx):
    d = f"/home/user/watch-{uuid.uuid4().hex[:6]}"
    sbx.files.make_dir(d)
    sbx.files.write(f"{d}/f.txt", "x")
    with_entries = "include_entry" in inspect.signature(sbx.files.watch_dir).parameters
    handle = sbx.files.watch_dir(d, **({"include_entry": True} if with_entries else {}))
    sbx.commands.run(f"chmod 600 {d}/f.txt && echo more >> {d}/f.txt && echo new > {d}/g.txt")
    events = []
    deadline = time.time() + 20
    while time.time() < deadline:
        events += handle.get_new_events()
        kinds = {(e.name, e.type.name) for e in events}
        if {("f.txt", "CHMOD"), ("g.txt", "CREATE"), ("f.txt", "WRITE")} <= kinds:
            break
        time.sleep(0.3)
    handle.stop()
    kinds = {(e.name, e.type.name) for e in events}
    assert ("f.txt", "CHMOD") in kinds, kinds
    assert ("g.txt", "CREATE") in kinds and ("f.txt", "WRITE") in kinds, kinds
    if with_entries:
        chmod = next(e for e in events if e.type.name == "CHMOD")
        assert chmod.entry is not None and chmod.entry.path == f"{d}/f.txt", chmod
        assert chmod.entry.mode == 0o600
        create = next(e for e in events if (e.name, e.type.name) == ("g.txt", "CREATE"))
        assert create.entry is not None and create.entry.name == "g.txt"


def _events(handle, n, within=10):
    """The watch's events once `n` have come, and whatever follows within a short quiet time."""
    got = []
    deadline = time.time() + within
    while len(got) < n and time.time() < deadline:
        got += handle.get_new_events()
        time.sleep(0.1)
    time.sleep(0.5)
    got += handle.get_new_events()
    return [(e.name, e.type.name) for e in got]


def test_watch_events_are_envds_for_writes_renames_and_removes(sbx):
    """The sequences E2B's own tests count (envd's fsnotify): a write is create (or a
    truncating write), chmod (envd gives the file to its user), write."""
    d = f"/home/user/envd-watch-{uuid.uuid4().hex[:6]}"
    sbx.files.make_dir(f"{d}/nested")
    handle = sbx.files.watch_dir(d)
    sbx.files.write(f"{d}/f.txt", "new")
    assert _events(handle, 3) == [("f.txt", "CREATE"), ("f.txt", "CHMOD"), ("f.txt", "WRITE")]
    sbx.files.write(f"{d}/f.txt", "again")
    assert _events(handle, 3) == [("f.txt", "WRITE"), ("f.txt", "CHMOD"), ("f.txt", "WRITE")]
    sbx.files.rename(f"{d}/f.txt", f"{d}/g.txt")
    assert _events(handle, 2) == [("f.txt", "RENAME"), ("g.txt", "CREATE")]
    sbx.files.remove(f"{d}/g.txt")
    assert _events(handle, 1) == [("g.txt", "REMOVE")]
    handle.stop()
    deep = sbx.files.watch_dir(d, recursive=True)
    sbx.files.write(f"{d}/nested/n.txt", "deep")
    assert _events(deep, 3) == [("nested/n.txt", "CREATE"), ("nested/n.txt", "CHMOD"), ("nested/n.txt", "WRITE")]
    deep.stop()


def test_file_metadata_round_trips(sbx):
    skip_unless_sdk_has("metadata" in inspect.signature(sbx.files.write).parameters, "files.write(metadata=)")
    p = f"/home/user/meta-{uuid.uuid4().hex[:6]}.txt"
    info = sbx.files.write(p, "data", metadata={"Owner": "team-a", "stage": "raw"})
    assert info.metadata == {"owner": "team-a", "stage": "raw"}
    assert sbx.files.get_info(p).metadata == {"owner": "team-a", "stage": "raw"}
    listed = [e for e in sbx.files.list(p.rsplit("/", 1)[0]) if e.path == p]
    assert listed[0].metadata == {"owner": "team-a", "stage": "raw"}
    # An upload replaces the set: without metadata, none is left.
    again = sbx.files.write(p, "more")
    assert again.metadata is None and sbx.files.get_info(p).metadata is None
    from e2b.exceptions import InvalidArgumentException

    with pytest.raises(InvalidArgumentException):
        sbx.files.write(p, "x", metadata={"k": "v" * 5000})


def test_signed_urls_work_under_the_sandbox_url(airlock_server):
    s = Sandbox.create(timeout=300, secure=True)
    try:
        p = f"/home/user/signed-{uuid.uuid4().hex[:6]}.txt"
        up = s.upload_url(p)
        assert up.startswith(airlock_server["url"]), up
        # No headers at all: the URL alone (its signature) names the sandbox.
        r = httpx.post(up, files={"file": ("x.txt", b"signed upload")})
        assert r.status_code == 200, r.text
        assert s.files.read(p) == "signed upload"
        down = s.download_url(p, use_signature_expiration=120)
        r = httpx.get(down)
        assert (r.status_code, r.content) == (200, b"signed upload")
        # A genuine signature past its time: envd's exact answer.
        r = httpx.get(s.download_url(p, use_signature_expiration=-10))
        assert (r.status_code, r.json()) == (401, {"code": 401, "message": "signature is already expired"})
        # Another path than the signed one is refused as a missing sandbox would be.
        r = httpx.get(down.replace(p.replace("/", "%2F"), "%2Fetc%2Fshadow"))
        assert r.status_code == 502, r.text
    finally:
        s.kill()
    # The sandbox gone, its URLs answer as for a missing sandbox.
    assert httpx.get(down).status_code == 502


def test_metrics_windows_and_the_gone_sandbox_wording(airlock_server):
    s = Sandbox.create(timeout=300)
    try:
        first = s.get_metrics()
        assert first and first[-1].mem_total > 0
        created = first[0].timestamp
        time.sleep(6)  # past one sampling period
        later = s.get_metrics()
        assert len(later) >= 2, later
        # A window before the sandbox existed has nothing; one around now has the newest.
        hour_ago = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=1)
        assert s.get_metrics(start=hour_ago, end=hour_ago + datetime.timedelta(minutes=5)) == []
        recent = s.get_metrics(start=created + datetime.timedelta(seconds=1))
        assert recent and all(m.timestamp >= created for m in recent)
        assert len(recent) < len(s.get_metrics())
        from e2b.exceptions import SandboxException

        with pytest.raises(SandboxException):
            s.get_metrics(start=datetime.datetime.now(datetime.timezone.utc), end=hour_ago)
    finally:
        s.kill()
    # envd of a sandbox that is gone answers as E2B's proxy does ("... was not found"): newer SDKs
    # tell it apart from an unreachable one by that wording.
    import e2b.exceptions as ex

    gone = getattr(ex, "SandboxNotRunningException", ex.TimeoutException)
    with pytest.raises(gone):
        s.files.read("/etc/hostname")
