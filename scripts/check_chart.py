#!/usr/bin/env python3
"""Lints and renders helm/ragcluster with several value sets and validates every rendered
object against the Kubernetes schemas, offline: helm-python-sdk (Helm v4's Go SDK, no helm
binary) and kubernetes-validate (scripts/setup.sh installs both into ~/.cache/ragcluster-pyenv).

    python scripts/check_chart.py OUT_DIR

Writes OUT_DIR/<value set>/ragcluster.toml (the rendered process config, which
tests/tests/helm.rs loads with the real config code) and prints one JSON line per value set.
Exits non-zero on the first problem.
"""

import json
import pathlib
import sys
import tomllib

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "ragcluster"
KUBE = "1.30.0"
# Custom resources whose schemas kubernetes-validate does not carry; checked by hand below.
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def values_of(name):
    if name == "default":
        return {}
    return yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())


def render(values, release="rag", namespace="search"):
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values, name=release, namespace=namespace, is_install=True)
    objects = []
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append(doc)
    return objects


def by_kind(objects, kind, suffix=""):
    return [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]


def one(objects, kind, suffix):
    found = by_kind(objects, kind, suffix)
    if len(found) != 1:
        fail(f"expected one {kind} *{suffix}, found {len(found)}")
    return found[0]


def check(name, out_dir):
    values = values_of(name)
    report = helm.lint(str(CHART), values, strict=True, kube_version="v" + KUBE)
    bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2] + report.get("errors", [])
    if bad:
        fail(f"{name}: helm lint: {bad}")
    objects = render(values)
    validated = 0
    for o in objects:
        if (o["apiVersion"], o["kind"]) in CRDS:
            continue
        try:
            kubernetes_validate.validate(o, KUBE, strict=True)
        except kubernetes_validate.ValidationError as e:
            fail(f"{name}: {o['kind']} {o['metadata']['name']}: {e.message} at {list(e.path)}")
        validated += 1

    merged = helm.Chart.load(str(CHART)).merge_values(values)
    colocated = merged["coordinator"]["colocated"]
    coords = one(objects, "StatefulSet", "-coordinator")
    worker = one(objects, "Deployment", "-model-worker")
    n_coords = merged["coordinator"]["replicas"]
    if colocated:
        # The coordinator pods are the shard nodes.
        if by_kind(objects, "StatefulSet", "-shard-node") or by_kind(objects, "PodDisruptionBudget", "-shard-node"):
            fail(f"{name}: colocated renders a shard-node StatefulSet")
        shards, n_shards = coords, n_coords
        image = coords["spec"]["template"]["spec"]["containers"][0]["image"]
        if "/colocated:" not in image:
            fail(f"{name}: colocated coordinators run {image}")
        headless = one(objects, "Service", "-coordinator-headless")
        if 7100 not in {p["port"] for p in headless["spec"]["ports"]}:
            fail(f"{name}: the coordinators' headless Service lacks the shard port")
    else:
        shards = one(objects, "StatefulSet", "-shard-node")
        n_shards = merged["shardNode"]["replicas"]
    if shards["spec"]["replicas"] != n_shards or coords["spec"]["replicas"] != n_coords:
        fail(f"{name}: replica counts")
    for ss in (shards, coords):
        if ss["spec"]["serviceName"] not in {s["metadata"]["name"] for s in by_kind(objects, "Service")}:
            fail(f"{name}: {ss['metadata']['name']} has no headless Service")
        if not ss["spec"]["volumeClaimTemplates"]:
            fail(f"{name}: no PVC per replica")
    for w in (shards, coords, worker):
        pod = w["spec"]["template"]
        c = pod["spec"]["containers"][0]
        tls = merged["tls"]["enabled"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c.get(probe, {})
            ok = "health" in p.get("exec", {}).get("command", []) if tls else "grpc" in p
            if not ok:
                fail(f"{name}: {c['name']} {probe} is not a (TLS-aware) gRPC health probe")
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        if tls != ("/etc/ragcluster-tls" in mounts):
            fail(f"{name}: {c['name']} TLS secret mount")
        if pod["spec"]["securityContext"].get("runAsUser") != 10001:
            fail(f"{name}: {c['name']} does not run as the images' user")
        if merged["metrics"]["annotations"] and pod["metadata"]["annotations"].get("prometheus.io/scrape") != "true":
            fail(f"{name}: {c['name']} lacks scrape annotations")
    # Shard nodes: quorum-keeping PDB, anti-affinity as asked.
    if not colocated:
        pdb = one(objects, "PodDisruptionBudget", "-shard-node")
        if pdb["spec"]["maxUnavailable"] != merged["shardNode"]["maxUnavailable"]:
            fail(f"{name}: shard-node PDB")
    aff = shards["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {})
    mode = merged["coordinator" if colocated else "shardNode"]["antiAffinity"]
    key = {"hard": "requiredDuringSchedulingIgnoredDuringExecution",
           "soft": "preferredDuringSchedulingIgnoredDuringExecution"}.get(mode)
    if key and key not in aff:
        fail(f"{name}: shard-node anti-affinity {mode} missing")
    coord_pdbs = by_kind(objects, "PodDisruptionBudget", "-coordinator")
    if (n_coords > 1) != bool(coord_pdbs):
        fail(f"{name}: coordinator PDB")
    if coord_pdbs and coord_pdbs[0]["spec"]["maxUnavailable"] != n_coords - (n_coords // 2 + 1):
        fail(f"{name}: coordinator PDB must keep a majority")
    # GPU requests.
    res = worker["spec"]["template"]["spec"]["containers"][0]["resources"]
    gpu = merged["modelWorker"]["gpu"]
    if gpu["enabled"] != ("nvidia.com/gpu" in res.get("limits", {})):
        fail(f"{name}: nvidia.com/gpu limit")
    # ServiceMonitor.
    sms = by_kind(objects, "ServiceMonitor")
    if merged["metrics"]["serviceMonitor"]["enabled"] != bool(sms):
        fail(f"{name}: ServiceMonitor")
    for sm in sms:
        if sm["spec"]["endpoints"][0]["port"] != "metrics":
            fail(f"{name}: ServiceMonitor port")
    # Scheduled backups: ragctl from the coordinator image, to the coordinator Service, with
    # the CA and admin key where TLS and API keys are on, into a volume.
    jobs = by_kind(objects, "CronJob", "-backup")
    if merged["backup"]["enabled"] != bool(jobs):
        fail(f"{name}: backup CronJob")
    for job in jobs:
        pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        args = c["args"]
        scheme = "https" if merged["tls"]["enabled"] else "http"
        want = f"{scheme}://rag-ragcluster-coordinator:{merged['coordinator']['service']['port']}"
        if c["command"] != ["/usr/local/bin/ragctl"] or args[1] != want:
            fail(f"{name}: backup job calls {c['command']} {args[:2]}")
        if args[-7:] != ["backup", "create", "--to", "/backups", "--stamp", "--keep", str(merged["backup"]["keep"])]:
            fail(f"{name}: backup job args {args}")
        if merged["tls"]["enabled"] != ("--tls-ca" in args):
            fail(f"{name}: backup job TLS")
        keyed = any(e["name"] == "RAGCLUSTER_API_KEY" for e in c.get("env", []))
        if merged["auth"]["enabled"] != keyed:
            fail(f"{name}: backup job API key")
        claim = pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
        pvcs = {o["metadata"]["name"] for o in by_kind(objects, "PersistentVolumeClaim")}
        if not merged["backup"]["existingClaim"] and claim not in pvcs:
            fail(f"{name}: backup claim {claim} is not rendered")
        if pod["securityContext"].get("runAsUser") != 10001:
            fail(f"{name}: backup job user")
    # The rendered process config.
    cm = one(objects, "ConfigMap", "-config")
    toml_text = cm["data"]["ragcluster.toml"]
    cfg = tomllib.loads(toml_text)
    # Members register themselves: no member list in the config, which therefore does not
    # change (nor roll the coordinators) when the shard-node StatefulSet is scaled.
    if cfg["coordinator"]["shard_nodes"] or cfg["coordinator"]["model_worker"]:
        fail(f"{name}: the coordinator config lists members")
    scaled = dict(values, shardNode={**values.get("shardNode", {}), "replicas": n_shards + 2})
    cm2 = one(render(scaled), "ConfigMap", "-config")
    if cm2["data"] != cm["data"]:
        fail(f"{name}: scaling shard nodes changes the config (coordinators would restart)")
    coord_svc = f"rag-ragcluster-coordinator:7000"
    # A colocated shard node registers with the coordinator of its own process.
    sections = ("model_worker",) if colocated else ("shard_node", "model_worker")
    if colocated and "coordinators" in cfg["shard_node"]:
        fail(f"{name}: a colocated shard node must register with its own coordinator")
    if colocated and cfg["shard_node"]["data_dir"] == cfg["coordinator"]["data_dir"]:
        fail(f"{name}: the colocated shard node shares the catalog's data directory")
    for section in sections:
        if not all(a.endswith(coord_svc) for a in cfg[section]["coordinators"]) or not cfg[section]["coordinators"]:
            fail(f"{name}: [{section}] coordinators {cfg[section].get('coordinators')}")
    env = {e["name"]: e for e in shards["spec"]["template"]["spec"]["containers"][0].get("env", [])}
    adv = env.get("RAGCLUSTER__SHARD_NODE__ADVERTISE_ADDRESS", {}).get("value", "")
    headless = "coordinator-headless" if colocated else "shard-node-headless"
    if f"$(POD_NAME).rag-ragcluster-{headless}." not in adv or not adv.endswith(":7100"):
        fail(f"{name}: shard nodes must advertise their stable pod name ({adv!r})")
    if len(cfg["coordinator"].get("peers", [])) != (n_coords if n_coords > 1 else 0):
        fail(f"{name}: peers list")
    scheme = "https://" if merged["tls"]["enabled"] else "http://"
    addrs = cfg["shard_node"].get("coordinators", []) + cfg["model_worker"]["coordinators"] + [adv]
    addrs += [p.split("=", 1)[1] for p in cfg["coordinator"].get("peers", [])]
    if not all(a.startswith(scheme) for a in addrs):
        fail(f"{name}: addresses must be {scheme} ({addrs})")
    for section in ("coordinator", "shard_node", "model_worker"):
        if merged["tls"]["enabled"] != ("tls" in cfg[section]):
            fail(f"{name}: [{section}.tls]")
    if merged["auth"]["enabled"] != cfg["coordinator"].get("auth", {}).get("enabled", False):
        fail(f"{name}: [coordinator.auth]")
    # A model's own device wins (the qwen2 generator says "auto"); the others follow gpu.enabled.
    by_values = {m["name"]: m.get("device") for m in merged["modelWorker"]["models"]}
    want = "cuda" if gpu["enabled"] else "cpu"
    for m in cfg["model_worker"]["models"]:
        if m["device"] != (by_values.get(m["name"]) or want):
            fail(f"{name}: model {m['name']} on device {m['device']}")
    d = pathlib.Path(out_dir) / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "ragcluster.toml").write_text(toml_text)
    kinds = sorted({o["kind"] for o in objects})
    print(json.dumps({"values": name, "objects": len(objects), "validated": validated, "kinds": kinds}))


def check_rejected(name, values, why):
    try:
        render(values)
    except helm.HelmError as e:
        print(json.dumps({"values": name, "rejected": True, "error": str(e)[:160]}))
        return
    fail(f"{name}: {why} was accepted")


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "chart-out"
    for name in ("default", "ha", "gpu", "secure", "colocated"):
        check(name, out_dir)
    check_rejected("even-coordinators", {"coordinator": {"replicas": 2}}, "2 coordinators")
    check_rejected("unknown-key", {"shardNode": {"replica": 3}}, "a misspelt key")
    check_rejected("tls-without-secret", {"tls": {"enabled": True}}, "TLS without a Secret")
    check_rejected("bad-size", {"shardNode": {"persistence": {"size": "lots"}}}, "a bad size")
    check_rejected("bad-schedule", {"backup": {"enabled": True, "schedule": "nightly"}}, "a bad schedule")


if __name__ == "__main__":
    main()
