"""The chart's essential fields, in the renderings scripts/helm-check made (one directory of
`v<helm>-<setting>.yaml` files), and every AIRLOCK_* variable the chart sets checked against the
built binary's --help (a renamed flag fails here, not in a cluster). Enum values are asserted
here because kubernetes-validate does not check them."""

import pathlib
import re
import subprocess
import sys

import yaml

HOST_PATH_TYPES = {"", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"}
PULL_POLICIES = {"Always", "IfNotPresent", "Never"}
SERVICE_TYPES = {"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"}
PROTOCOLS = {"TCP", "UDP", "SCTP"}


def objects(path):
    found = {}
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def one(objs, kind):
    matches = [o for (k, _), o in objs.items() if k == kind]
    assert len(matches) == 1, f"{kind}: {len(matches)} found"
    return matches[0]


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def check_pod_spec(spec, name):
    for c in spec["containers"]:
        assert c.get("imagePullPolicy", "IfNotPresent") in PULL_POLICIES, (name, c)
        for p in c.get("ports", []):
            assert p["protocol"] in PROTOCOLS, (name, p)
    for v in spec.get("volumes", []):
        if "hostPath" in v:
            assert v["hostPath"].get("type", "") in HOST_PATH_TYPES, (name, v)


def check_workload(w):
    pod_labels = w["spec"]["template"]["metadata"]["labels"]
    assert selects(w["spec"]["selector"]["matchLabels"], pod_labels), w["metadata"]["name"]
    check_pod_spec(w["spec"]["template"]["spec"], w["metadata"]["name"])
    return pod_labels


def check(objs, setting, help_of):
    api = one(objs, "Deployment")
    node = one(objs, "DaemonSet")
    api_labels, node_labels = check_workload(api), check_workload(node)

    # API: two stateless replicas, ready once their store answers, found by their Service.
    assert api["spec"]["replicas"] == 2
    (a,) = api["spec"]["template"]["spec"]["containers"]
    assert a["args"][0] == "serve"
    assert a["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert {p["name"]: p["containerPort"] for p in a["ports"]} == {"http": 7420}
    env = env_of(a)
    assert env["AIRLOCK_LISTEN"]["value"] == "0.0.0.0:7420"
    assert env["AIRLOCK_NODE_SECRET_FILE"]["value"] == "/etc/airlock/cluster/secret"
    mounts = {m["mountPath"]: m for m in a["volumeMounts"]}
    assert mounts["/var/lib/airlock/server.secret"]["subPath"] == "server.secret"
    assert mounts["/var/lib/airlock/credentials"]["subPath"] == "credentials"
    assert "/etc/airlock/cluster" in mounts
    pod = api["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert a["securityContext"]["allowPrivilegeEscalation"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}, "a replica keeps nothing of its own"
    for name in ("cluster-secret", "server-secret", "admin-key"):
        assert "secretName" in volumes[name]["secret"], name

    # The store: a Secret's URL, or the chart's Postgres by its Service.
    if setting == "postgres.enabled=true":
        pg = one(objs, "StatefulSet")
        check_workload(pg)
        pg_service = objs[("Service", "rel-airlock-postgres")]
        assert selects(pg_service["spec"]["selector"], pg["spec"]["template"]["metadata"]["labels"])
        assert env["AIRLOCK_STORE"]["value"] == "postgres://airlock:$(PGPASSWORD)@rel-airlock-postgres:5432/airlock"
        assert list(env).index("PGPASSWORD") < list(env).index("AIRLOCK_STORE"), "$(PGPASSWORD) expands only if defined first"
    else:
        assert ("StatefulSet", "rel-airlock-postgres") not in objs
        assert env["AIRLOCK_STORE"]["valueFrom"]["secretKeyRef"] == {"name": "airlock-store", "key": "url"}

    # Replicas find nodes through the headless node Service, which selects the node pods.
    node_service = objs[("Service", "rel-airlock-node")]
    assert node_service["spec"]["clusterIP"] == "None"
    assert selects(node_service["spec"]["selector"], node_labels)
    assert not selects(node_service["spec"]["selector"], api_labels)
    pod_spec = api["spec"]["template"]["spec"]
    if setting == "api.discovery=dns":
        assert env["AIRLOCK_NODES_DNS"]["value"] == "rel-airlock-node.sandboxes.svc.cluster.local:7421"
        assert "AIRLOCK_NODES_KUBE" not in env and pod_spec["automountServiceAccountToken"] is False
        assert not any(k in ("Role", "ClusterRole", "ServiceAccount") for k, _ in objs)
    else:
        # Or the Kubernetes API: the node pods by their labels, under a ServiceAccount that may
        # list pods here and read hosts, nothing more.
        assert "AIRLOCK_NODES_DNS" not in env
        selector = dict(kv.split("=") for kv in env["AIRLOCK_NODES_KUBE"]["value"].split(","))
        assert selects(selector, node_labels) and not selects(selector, api_labels), selector
        assert env["AIRLOCK_NODES_KUBE_PORT"]["value"] == "7421"
        account = pod_spec["serviceAccountName"]
        assert ("ServiceAccount", account) in objs
        role = objs[("Role", account)]
        assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
        cluster_role = one(objs, "ClusterRole")
        assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
        for kind, bound in (("RoleBinding", role), ("ClusterRoleBinding", cluster_role)):
            binding = one(objs, kind)
            assert binding["roleRef"]["name"] == bound["metadata"]["name"]
            assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "sandboxes"}]
    api_service = objs[("Service", "rel-airlock-api")]
    assert api_service["spec"]["type"] in SERVICE_TYPES
    assert selects(api_service["spec"]["selector"], api_labels)
    assert not selects(api_service["spec"]["selector"], node_labels)
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert selects(pdb["spec"]["selector"]["matchLabels"], api_labels)

    # Nodes: replaced only by hand, privileged, the host's devices and data dir, named by the
    # Kubernetes node, given time to stop.
    assert node["spec"]["updateStrategy"]["type"] == "OnDelete"
    nspec = node["spec"]["template"]["spec"]
    (n,) = nspec["containers"]
    drain = int(env_of(n)["AIRLOCK_DRAIN_SECONDS"]["value"])
    assert nspec["terminationGracePeriodSeconds"] > drain >= 60, "the node is killed before its drain ends"
    assert n["args"][0] == "node"
    assert n["securityContext"]["privileged"] is True
    nenv = env_of(n)
    assert nenv["AIRLOCK_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert nenv["AIRLOCK_NODE_LISTEN"]["value"] == "0.0.0.0:7421"
    assert n["readinessProbe"]["tcpSocket"]["port"] == "node"
    host = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in nspec["volumes"] if "hostPath" in v}
    nmounts = {m["mountPath"] for m in n["volumeMounts"]}
    assert host["/var/lib/airlock"] == "DirectoryOrCreate" and "/var/lib/airlock" in nmounts
    assert host["/dev/net/tun"] == "CharDevice" and "/dev/net/tun" in nmounts
    if setting == "node.kvm=false":
        assert "/dev/kvm" not in host and "/dev/kvm" not in nmounts
    else:
        assert host["/dev/kvm"] == "CharDevice" and "/dev/kvm" in nmounts

    # Object storage: the bucket and its keys by reference, or nothing.
    if setting.startswith("objects.url="):
        assert nenv["AIRLOCK_OBJECTS"]["value"] == "s3://airlock-templates"
        assert nenv["AIRLOCK_S3_ENDPOINT"]["value"] == "http://objects:9000"
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert nenv[key]["valueFrom"]["secretKeyRef"] == {"name": "airlock-objects", "key": key}
    else:
        assert "AIRLOCK_OBJECTS" not in nenv and "AWS_SECRET_ACCESS_KEY" not in nenv

    # The node face: mutual TLS from the two Secrets, and a NetworkPolicy admitting only the
    # replicas to the node port; both off together in one rendering.
    tls_env = {
        "AIRLOCK_NODES_TLS_CERT": "/etc/airlock/tls/tls.crt",
        "AIRLOCK_NODES_TLS_KEY": "/etc/airlock/tls/tls.key",
        "AIRLOCK_NODES_TLS_CA": "/etc/airlock/tls/ca.crt",
    }
    node_tls_env = {k.replace("NODES_", "NODE_"): v for k, v in tls_env.items()}
    nvolumes = {v["name"]: v for v in nspec["volumes"]}
    policies = [o for (k, _), o in objs.items() if k == "NetworkPolicy"]
    if setting == "nodeTls.enabled=false,networkPolicy.enabled=false":
        assert not any(k in env for k in tls_env) and not any(k in nenv for k in node_tls_env)
        assert "/etc/airlock/tls" not in mounts and "/etc/airlock/tls" not in nmounts
        assert policies == []
    else:
        assert {k: env[k]["value"] for k in tls_env} == tls_env
        assert {k: nenv[k]["value"] for k in node_tls_env} == node_tls_env
        assert mounts["/etc/airlock/tls"]["readOnly"] is True and "/etc/airlock/tls" in nmounts
        assert volumes["replica-tls"]["secret"]["secretName"] == "airlock-replica-tls"
        assert nvolumes["node-tls"]["secret"]["secretName"] == "airlock-node-tls"
        for v in (volumes["replica-tls"], nvolumes["node-tls"]):
            assert {i["key"] for i in v["secret"]["items"]} == {"tls.crt", "tls.key", "ca.crt"}
        (policy,) = policies
        spec = policy["spec"]
        assert selects(spec["podSelector"]["matchLabels"], node_labels)
        assert not selects(spec["podSelector"]["matchLabels"], api_labels)
        assert spec["policyTypes"] == ["Ingress"]
        (rule,) = spec["ingress"]
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}, "replicas of this namespace only"
        assert selects(peer["podSelector"]["matchLabels"], api_labels)
        assert not selects(peer["podSelector"]["matchLabels"], node_labels)
        assert rule["ports"] == [{"port": 7421, "protocol": "TCP"}]

    # Every AIRLOCK_* variable is one the binary reads in that role.
    for container, sub in ((a, "serve"), (n, "node")):
        for name in env_of(container):
            if name.startswith("AIRLOCK_"):
                assert name in help_of(sub), f"`airlock {sub}` reads no {name}"


def main():
    out, binary = pathlib.Path(sys.argv[1]), sys.argv[2]
    helps = {}

    def help_of(sub):
        if sub not in helps:
            text = subprocess.run([binary, sub, "--help"], check=True, capture_output=True, text=True).stdout
            helps[sub] = set(re.findall(r"env: (AIRLOCK_[A-Z0-9_]+)", text))
        return helps[sub]

    files = sorted(out.glob("*.yaml"))
    assert len(files) == 12, files
    for f in files:
        setting = f.stem.split("-", 1)[1]
        check(objects(f), setting, help_of)
        print(f"{f.name}: ok")


if __name__ == "__main__":
    main()
