"""The E2B door's egress options on real sandboxes, against the suite's test internet
(tests/net/internet.py): `allow_internet_access` and `network` map onto the tenant's base policy
(conftest.TENANT_ALLOWS), which they may only narrow."""
import json
import os

import pytest
from e2b import Sandbox

from conftest import TENANT_ALLOWS

PROBE = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "guest", "egress.py")).read()


def network(**rules):
    """`network=`; e2b 2.21.1 sends allowPublicTraffic=true unless told otherwise (airlock refuses it)."""
    return dict(rules, allow_public_traffic=False)


def probe(sbx, *args):
    sbx.files.write("/tmp/egress.py", PROBE)
    r = sbx.commands.run("python3 /tmp/egress.py " + " ".join(args), timeout=60)
    return json.loads(r.stdout.strip())


def reaches(sbx, name, internet):
    """The name resolves and its own site answers."""
    v = probe(sbx, "http", name)
    return v["ok"] and v["body"].startswith(f"served-by {internet['hosts'][name]}:80 ")


def refused(sbx, name):
    return probe(sbx, "dns", name)["rcode"] == "REFUSED" and not probe(sbx, "http", name)["ok"]


def test_default_reaches_what_the_tenant_allows_and_nothing_else(sbx, airlock_server):
    internet = airlock_server["internet"]
    for name in TENANT_ALLOWS:
        assert reaches(sbx, name, internet), name
    assert refused(sbx, "pypi.test")


def test_allow_internet_access_false_is_sealed(airlock_server):
    s = Sandbox.create(allow_internet_access=False, timeout=300)
    try:
        for name in TENANT_ALLOWS:
            assert refused(s, name), name
    finally:
        s.kill()


def test_network_narrows_the_tenant_policy(airlock_server):
    internet = airlock_server["internet"]
    # E2B's usual form: deny everything, allow these. Only what the tenant allows may be named.
    s = Sandbox.create(network=network(allow_out=["allowed.test"], deny_out=["0.0.0.0/0"]), timeout=300)
    try:
        assert reaches(s, "allowed.test", internet)
        assert refused(s, "other.test")
    finally:
        s.kill()
    s = Sandbox.create(network=network(deny_out=["allowed.test"]), timeout=300)
    try:
        assert refused(s, "allowed.test")
        assert reaches(s, "other.test", internet)
    finally:
        s.kill()


@pytest.mark.parametrize("entry", ["pypi.test", "*.allowed.test", "203.0.113.0/24"])
def test_allow_out_beyond_the_tenant_policy_is_refused_by_name(airlock_server, entry):
    with pytest.raises(Exception) as e:
        Sandbox.create(network=network(allow_out=[entry]), timeout=300)
    assert entry in str(e.value) and "allowOut" in str(e.value)
