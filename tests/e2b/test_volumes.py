"""E2B's volumes, unmodified SDK code against airlock: `Volume.create`, `connect`, `list`,
`destroy`; files through the volume's own content API (its token); a sandbox created with
`volume_mounts` reads what the API wrote and writes what the API then reads; a volume in use
is not destroyed."""
import os
import uuid

import pytest
from e2b import Sandbox, Volume

# Volumes live on one node, and a node process's face does not carry their calls yet: the
# replica route (sandboxes on an `airlock node`) refuses them with 503 "this node cannot keep
# volumes". Single-host mode has them.
pytestmark = pytest.mark.skipif(
    os.environ.get("E2B_SUITE_ROUTE") == "replica",
    reason="volumes through a remote node's face are not built yet (single-host only)",
)


def _name():
    return f"e2b-vol-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def volume():
    vol = Volume.create(_name())
    yield vol
    try:
        Volume.destroy(vol.volume_id)
    except Exception:
        pass


def test_create_connect_list_destroy():
    name = _name()
    vol = Volume.create(name)
    assert vol.name == name and vol.volume_id and vol.token
    again = Volume.connect(vol.volume_id)
    assert (again.volume_id, again.name, again.token) == (vol.volume_id, name, vol.token)
    assert any(v.volume_id == vol.volume_id and v.name == name for v in Volume.list())
    assert Volume.destroy(vol.volume_id) is True
    assert all(v.volume_id != vol.volume_id for v in Volume.list())
    assert Volume.destroy(vol.volume_id) is False
    with pytest.raises(Exception):
        Volume.connect(vol.volume_id)


def test_files_through_the_volume_api(volume):
    info = volume.write_file("/docs/hello.txt", "hello from the volume API\n")
    assert info.path == "/docs/hello.txt" and info.size == 26 and info.type.value == "file"
    assert volume.read_file("/docs/hello.txt") == "hello from the volume API\n"
    assert volume.read_file("/docs/hello.txt", format="bytes") == b"hello from the volume API\n"
    made = volume.make_dir("/docs/sub/deeper")
    assert made.type.value == "directory"
    names = sorted(e.name for e in volume.list("/docs"))
    assert names == ["hello.txt", "sub"], names
    assert volume.get_info("/docs/hello.txt").size == 26
    assert volume.exists("/docs/hello.txt") and not volume.exists("/docs/nope.txt")
    volume.remove("/docs/sub")
    assert not volume.exists("/docs/sub")
    # Another volume's token reaches nothing of this one.
    other = Volume.create(_name())
    try:
        foreign = Volume(volume.volume_id, volume.name, token=other.token)
        with pytest.raises(Exception):
            foreign.read_file("/docs/hello.txt")
    finally:
        Volume.destroy(other.volume_id)


def test_a_sandbox_mounts_the_volume(volume):
    volume.write_file("/in/greeting.txt", "written before the sandbox\n")
    sbx = Sandbox.create("base", timeout=300, volume_mounts={"/mnt/data": volume})
    try:
        r = sbx.commands.run(
            "cat /mnt/data/in/greeting.txt && echo from-the-sandbox > /mnt/data/out.txt && stat -c %U /mnt/data/out.txt"
        )
        assert r.stdout == "written before the sandbox\nuser\n", r
        assert sbx.get_info().volume_mounts == [{"name": volume.name, "path": "/mnt/data"}]
        # While the sandbox has it, the API goes through it: it reads what the guest wrote.
        assert volume.read_file("/out.txt") == "from-the-sandbox\n"
        # In use: not destroyed.
        with pytest.raises(Exception):
            Volume.destroy(volume.volume_id)
    finally:
        sbx.kill()
    # By name too, and what the API wrote meanwhile is there.
    volume.write_file("/after.txt", "after\n")
    sbx = Sandbox.create("base", timeout=300, volume_mounts={"/work": volume.name})
    try:
        assert sbx.commands.run("cat /work/out.txt /work/after.txt").stdout == "from-the-sandbox\nafter\n"
    finally:
        sbx.kill()
