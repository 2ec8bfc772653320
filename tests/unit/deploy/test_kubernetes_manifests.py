"""deploy/kubernetes without a cluster: render every kustomization with kubectl's kustomize,
validate each object against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: an
unknown field fails) or the vendored CRD schema of LeaderWorkerSet, ScaledObject and
ServiceMonitor (tests/unit/deploy/schemas, strict too), check the references between objects,
and run each container's entry point (bin/start.sh) with the pod's environment into moed's own
config loader and pre-flight checks, so a misspelt key, variable or flag fails here.

Not checked (no API server here): admission webhooks, defaulting, the LWS/KEDA/prometheus
controllers' behaviour, scheduling, DNS and networking (docs/kubernetes.md, "What is tested").
"""
from __future__ import annotations

import copy
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml

from moed import cli, preflight
from moed.cli import settings
from moed.config import OTHER_ENV, env_fields, load, rules

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).parent / "schemas"
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not on PATH (CI installs it: .ci/run; Debian's "
                            "kubernetes-client package ships one with kustomize built in)")

# The Kubernetes releases the objects must be valid for: the oldest LWS v0.10 supports that
# kubernetes-validate still ships, and the newest it ships.
K8S_VERSIONS = ("1.29.0", "1.37.0")
# what the kustomizations render: the base alone (no Secret: an overlay adds it) and the two
# installable overlays
OVERLAYS = ("overlays/pd", "overlays/pd-ep")
CRDS = {  # (apiVersion, kind) -> vendored schema file
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "lws-v0.10.0-leaderworkerset-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda-v2.20.2-scaledobject-v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"):
        "prometheus-operator-v0.93.0-servicemonitor-v1.json",
}
WORKLOADS = ("Deployment", "LeaderWorkerSet")
POD_IP, PEERS = "10.1.0.5", ("10.1.0.6", "10.1.0.7")


# ---- rendering -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/kubernetes with the secret files an operator would create."""
    root = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(DEPLOY, root)
    for overlay in OVERLAYS:
        d = root / overlay / "secrets"
        (d / "api-keys").write_text("sk-test-1\nsk-test-2\n")
        (d / "admin-token").write_text("admin-test-token\n")
        (d / "cluster-key").write_text(secrets.token_hex(32) + "\n")
    return root


def render(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered(tree: Path) -> dict[str, list[dict[str, Any]]]:
    return {name: render(tree / name) for name in ("base", "ep", *OVERLAYS)}


def objects(rendered: dict[str, list[dict[str, Any]]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, docs in rendered.items():
        for d in docs:
            yield name, d


def pod_templates(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every workload."""
    for d in docs:
        if d["kind"] == "Deployment":
            yield d, d["spec"]["template"]
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            yield d, lwt["workerTemplate"]
            if "leaderTemplate" in lwt:
                yield d, lwt["leaderTemplate"]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_every_kustomization_renders(rendered) -> None:
    kinds = {(n, d["kind"]) for n, d in objects(rendered)}
    for overlay in OVERLAYS:
        for kind in ("Namespace", "Secret", "ConfigMap", "Deployment", "Service",
                     "PodDisruptionBudget", "ServiceMonitor", "ScaledObject",
                     "PersistentVolumeClaim"):
            assert (overlay, kind) in kinds
    assert ("overlays/pd-ep", "LeaderWorkerSet") in kinds
    assert ("overlays/pd", "LeaderWorkerSet") not in kinds     # LWS is optional
    names = [d["metadata"]["name"] for d in rendered["overlays/pd-ep"]]
    assert {"moed-router", "moed-prefill", "moed-decode", "moed-decode-ep",
            "moed-peers"} <= set(names)


# ---- schemas -------------------------------------------------------------------------------

def strict(schema: Any) -> Any:
    """A CRD schema as the API server's field validation (Strict) applies it: an object with
    `properties` takes no other field unless it says so (additionalProperties or
    x-kubernetes-preserve-unknown-fields); otherwise the server would drop it silently."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (strict(v) if k != "properties" else {p: strict(s) for p, s in v.items()})
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_validators() -> dict[tuple[str, str], jsonschema.Validator]:
    out = {}
    for key, file in CRDS.items():
        doc = json.loads((SCHEMAS / file).read_text())
        assert (f"{doc['group']}/{doc['version']}", doc["kind"]) == key
        schema = strict(doc["openAPIV3Schema"])
        # metadata is ObjectMeta (the API server's own schema checks it); `status` is not ours
        schema["properties"]["metadata"] = {"type": "object"}
        out[key] = jsonschema.Draft7Validator(schema)
    return out


def test_vendored_schemas_say_where_they_come_from() -> None:
    for file in CRDS.values():
        doc = json.loads((SCHEMAS / file).read_text())
        assert doc["source"].startswith("github.com/") and " v" in doc["source"]
        assert doc["openAPIV3Schema"]["type"] == "object"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid(rendered, crd_validators, version) -> None:
    problems = []
    for name, d in objects(rendered):
        where = f"{name}: {d['kind']}/{d['metadata']['name']}"
        key = (d["apiVersion"], d["kind"])
        if key in crd_validators:
            problems += [f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
                         for e in crd_validators[key].iter_errors(d)]
            continue
        try:
            kubernetes_validate.validate(copy.deepcopy(d), version, strict=True)
        except kubernetes_validate.ValidationError as e:    # its str() holds the schema
            problems.append(f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{where}: no schema for {key} (vendor its CRD's schema)")
    assert not problems, "\n".join(problems)


def test_the_strict_validation_can_fail(crd_validators) -> None:
    """A misspelt field in a custom resource and in a native one is refused."""
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
           "metadata": {"name": "x"},
           "spec": {"leaderWorkerTemplate": {"size": 2, "restartPolicy": "RecreateGroupOnPodRestart",
                                             "workerTemplte": {}}}}
    assert list(crd_validators[("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")]
                .iter_errors(lws))
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"selecter": {"a": "b"}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, K8S_VERSIONS[-1], strict=True)


# ---- references between objects -----------------------------------------------------------

def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_pods_and_ports_exist(rendered, overlay) -> None:
    docs = rendered[overlay]
    pods = list(pod_templates(docs))
    for svc in by_kind(docs, "Service").values():
        selected = [t for _, t in pods if matches(svc["spec"]["selector"], t["metadata"]["labels"])]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            for t in selected:
                cports = {(p["name"], p.get("protocol", "TCP")): p["containerPort"]
                          for c in t["spec"]["containers"] for p in c.get("ports", ())}
                assert (port["targetPort"], port.get("protocol", "TCP")) in cports, (
                    svc["metadata"]["name"], port)
                assert cports[(port["targetPort"], port.get("protocol", "TCP"))] == port["port"]
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(matches(sel, t["metadata"]["labels"]) for _, t in pods), pdb["metadata"]
    for w, t in pods:     # a workload's selector picks its own pods
        if w["kind"] == "Deployment":
            assert matches(w["spec"]["selector"]["matchLabels"], t["metadata"]["labels"])
    services = by_kind(docs, "Service")
    for sm in by_kind(docs, "ServiceMonitor").values():
        picked = [s for s in services.values()
                  if matches(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert len(picked) == 1
        names = {p["name"] for p in picked[0]["spec"]["ports"]}
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= names
        # every workload's pods are behind the scraped Service
        for _, t in pods:
            assert matches(picked[0]["spec"]["selector"], t["metadata"]["labels"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_volumes_configmaps_secrets_and_claims_exist(rendered, overlay) -> None:
    docs = rendered[overlay]
    cms, secs = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    pvcs = by_kind(docs, "PersistentVolumeClaim")
    assert set(secs["moed-secrets" + secs_suffix(secs)]["data"]) == {
        "api-keys", "admin-token", "cluster-key"}
    for w, t in pod_templates(docs):
        for v in t["spec"]["volumes"]:
            if "configMap" in v:
                assert v["configMap"]["name"] in cms, (w["metadata"]["name"], v)
            if "secret" in v:
                assert v["secret"]["secretName"] in secs, (w["metadata"]["name"], v)
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs
        for c in t["spec"]["containers"]:
            mounted = {m["name"] for m in c["volumeMounts"]}
            assert mounted <= {v["name"] for v in t["spec"]["volumes"]}
            for path in pod_paths(c):            # every file the container names is there
                assert file_in_volume(t, c, path, cms, secs) is not None, (
                    w["metadata"]["name"], path)


def secs_suffix(secs: dict[str, Any]) -> str:
    name = next(n for n in secs if n.startswith("moed-secrets"))
    return name.removeprefix("moed-secrets")


def pod_paths(c: dict[str, Any]) -> list[str]:
    """Files the container refers to: --config, the entry point, the hook, *_FILE settings."""
    paths = [a for a in [*c.get("command", ()), *c.get("args", ())] if a.startswith("/etc/")
             or a.startswith("/opt/moed-k8s/")]
    paths += [a for a in c["lifecycle"]["preStop"]["exec"]["command"]
              if a.startswith("/opt/moed-k8s/")]
    paths += [e["value"] for e in c.get("env", ()) if e["name"].endswith("_FILE")]
    return paths


def file_in_volume(t: dict[str, Any], c: dict[str, Any], path: str, cms: dict[str, Any],
                   secs: dict[str, Any]) -> bytes | None:
    """The content a path has in the container, from the ConfigMap or Secret mounted there."""
    import base64
    vols = {v["name"]: v for v in t["spec"]["volumes"]}
    for m in c["volumeMounts"]:
        prefix = m["mountPath"].rstrip("/") + "/"
        if not path.startswith(prefix):
            continue
        key, v = path.removeprefix(prefix), vols[m["name"]]
        if "configMap" in v:
            data = cms[v["configMap"]["name"]].get("data", {})
            return data[key].encode() if key in data else None
        if "secret" in v:
            data = secs[v["secret"]["secretName"]].get("data", {})
            return base64.b64decode(data[key]) if key in data else None
    return None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_can_take_moed_settings_from_the_environment(rendered, overlay) -> None:
    valid = set(env_fields()) | set(OTHER_ENV)
    for w, t in pod_templates(rendered[overlay]):
        spec = t["spec"]
        # one MOED_<SERVICE>_* variable per Service would make moed refuse to start
        assert spec["enableServiceLinks"] is False, w["metadata"]["name"]
        for c in spec["containers"]:
            bad = [e["name"] for e in c["env"] if e["name"].startswith("MOED_")
                   and e["name"] not in valid]
            assert not bad, (w["metadata"]["name"], bad)
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
            http = {p["name"] for p in c["ports"] if p["containerPort"] == 8000}
            assert c["livenessProbe"]["httpGet"]["port"] in http
            assert c["readinessProbe"]["httpGet"]["port"] in http
            assert c["lifecycle"]["preStop"]["exec"]["command"][-1].endswith("/drain.py")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscalers_target_workloads_and_real_metrics(rendered, overlay) -> None:
    from moed.obs.metrics import REGISTRY      # every area's metrics

    families = list(REGISTRY.collect())       # a labelled metric has no sample before use
    known = {s.name for m in families for s in m.samples} | {m.name for m in families} \
        | {f"{m.name}_total" for m in families if m.type == "counter"}
    docs = rendered[overlay]
    deployments = by_kind(docs, "Deployment")
    namespace = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert len(namespace) == 1
    components = {t["metadata"]["labels"]["app.kubernetes.io/component"]
                  for _, t in pod_templates(docs)}
    for so in by_kind(docs, "ScaledObject").values():
        assert so["spec"]["scaleTargetRef"]["name"] in deployments
        for trig in so["spec"]["triggers"]:
            # the thresholds are per pod: replicas = ceil(query / threshold)
            assert (trig["type"], trig["metricType"]) == ("prometheus", "AverageValue")
            # KEDA's schema takes any metadata key: a misspelt one would be ignored
            assert set(trig["metadata"]) <= {"serverAddress", "query", "threshold",
                                             "activationThreshold"}, trig["metadata"]
            q = trig["metadata"]["query"]
            for name in re.findall(r"\b(moed_[a-z_]+)\b", q):
                assert name in known, f"{so['metadata']['name']}: {name} is no moed metric"
            assert set(re.findall(r'namespace="([^"]+)"', q)) == namespace
            assert set(re.findall(r'component="([^"]+)"', q)) <= components
            float(trig["metadata"]["threshold"])


# ---- each container's entry point into moed's config loader --------------------------------

def fake_env(w: dict[str, Any], c: dict[str, Any], group_index: int = 0,
             worker_index: int = 0) -> dict[str, str]:
    """The environment kubelet (and LWS) would give the container."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        src = e["valueFrom"]
        if "fieldRef" in src:
            env[e["name"]] = {"metadata.name": f"{w['metadata']['name']}-abc12",
                              "status.podIP": POD_IP}[src["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in src:
            assert src["resourceFieldRef"]["resource"] == "limits.cpu"
            env[e["name"]] = str(int(c["resources"]["limits"]["cpu"]))
        else:
            raise AssertionError(f"unhandled env source {src}")
    if w["kind"] == "LeaderWorkerSet":
        name = w["metadata"]["name"]
        env.update(LWS_WORKER_INDEX=str(worker_index),
                   LWS_GROUP_SIZE=str(w["spec"]["leaderWorkerTemplate"]["size"]),
                   LWS_LEADER_ADDRESS=f"{name}-{group_index}.{name}.{w['metadata']['namespace']}")
    return env


def run_entry(tmp: Path, t: dict[str, Any], c: dict[str, Any], env: dict[str, str],
              cms: dict[str, Any], secs: dict[str, Any], peers: tuple[str, ...]
              ) -> tuple[list[str], dict[str, str]]:
    """Run the container's command (bin/start.sh from its ConfigMap) with a stub moed that
    records its arguments and environment; mount paths become directories under tmp."""
    def local(path: str) -> str:
        content = file_in_volume(t, c, path, cms, secs)
        if content is None:
            return path
        p = tmp / "root" / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
        return str(p)

    stubs = tmp / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    (stubs / "getent").write_text("#!/bin/sh\n" + "".join(
        f"echo '{ip}      STREAM {args}'\necho '{ip}      DGRAM'\n"
        for ip, args in ((p, "moed-peers.moed.svc.cluster.local") for p in peers)))
    record = tmp / "record.json"
    (stubs / "moed").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n")
    for s in stubs.iterdir():
        s.chmod(0o755)
    cmd = [local(a) for a in [*c["command"], *c["args"]]]
    env = {k: local(v) for k, v in env.items()}
    env.update(PATH=f"{stubs}:{env['PATH']}", SEED_WAIT_S="0")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(record.read_text())
    return got["argv"], got["env"]


def moed_config(argv: list[str], env: dict[str, str]):
    """What `moed serve ARGV` builds from this environment, and its pre-flight checks that
    need no model (secret files, cluster key, the expert-parallel fields)."""
    assert argv[0] == "serve"
    args = cli.build_parser(argv).parse_args(argv)
    settings.resolve(args)
    cfg = load(args.config, environ=env, overrides=settings.overrides(args))
    saved = dict(os.environ)
    try:                      # the key readers take their *_env variables from os.environ
        os.environ.clear()
        os.environ.update(env)
        if rules.needs_cluster_key(cfg):
            preflight.cluster_key(cfg)
        preflight.key_sources(cfg)
        rules.parallel(cfg)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return cfg


def containers(docs):
    for w, t in pod_templates(docs):
        for c in t["spec"]["containers"]:
            yield w, t, c


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_container_starts_moed_with_a_valid_config(rendered, overlay, tmp_path) -> None:
    docs = rendered[overlay]
    cms, secs = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    peers_svc = by_kind(docs, "Service")["moed-peers"]
    gossip = {p["protocol"]: p["port"] for p in peers_svc["spec"]["ports"]
              if p["name"].startswith("gossip")}
    seen = set()
    for i, (w, t, c) in enumerate(containers(docs)):
        ranks = range(w["spec"]["leaderWorkerTemplate"]["size"]) \
            if w["kind"] == "LeaderWorkerSet" else (0,)
        for rank in ranks:
            argv, env = run_entry(tmp_path / f"{i}-{rank}", t, c, fake_env(w, c, 0, rank),
                                  cms, secs, (POD_IP, *PEERS))
            cfg = moed_config(argv, env)
            seen.add(cfg.server.role)
            ports = {(p["name"]): p["containerPort"] for p in c["ports"]}
            assert cfg.server.port == ports["http"]
            assert cfg.server.host == "0.0.0.0"
            assert cfg.cluster.enabled and cfg.cluster.bind_port == ports["gossip-udp"] \
                == ports["gossip-tcp"] == gossip["UDP"] == gossip["TCP"]
            assert cfg.cluster.advertise_host == POD_IP
            assert cfg.server.node_name == f"{w['metadata']['name']}-abc12"
            # every peer the headless Service publishes, never this pod itself
            assert cfg.cluster.seeds == tuple(f"{p}:{gossip['UDP']}" for p in PEERS)
            assert cfg.server.api_keys_file and cfg.server.admin_token_file \
                and cfg.cluster.key_file
            grace = t["spec"]["terminationGracePeriodSeconds"]
            assert grace >= cfg.server.shutdown_grace_s + 5 + 10   # preStop delay + margin
            if cfg.server.role != "router":
                assert cfg.model.path == next(m["mountPath"] for m in c["volumeMounts"]
                                              if m["name"] == "model")
                assert cfg.engine.num_threads == int(c["resources"]["limits"]["cpu"]) - 1
            if w["kind"] == "LeaderWorkerSet":
                size = w["spec"]["leaderWorkerTemplate"]["size"]
                assert (cfg.parallel.ep_rank, cfg.parallel.ep_size) == (rank, size)
                name, ns = w["metadata"]["name"], w["metadata"]["namespace"]
                assert cfg.parallel.ep_init == f"tcp://{name}-0.{name}.{ns}:{ports['ep-rendezvous']}"
            else:
                assert cfg.parallel.ep_size == 1
    assert seen == {"router", "prefill", "decode"}


def test_the_first_pod_starts_with_no_seed(rendered, tmp_path) -> None:
    """The headless Service publishes only this pod: no seed (moed drops itself anyway), and
    start.sh does not wait past SEED_WAIT_S."""
    docs = rendered["overlays/pd"]
    cms, secs = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    w, t, c = next((w, t, c) for w, t, c in containers(docs)
                   if w["metadata"]["name"] == "moed-router")
    argv, env = run_entry(tmp_path, t, c, fake_env(w, c), cms, secs, (POD_IP,))
    assert moed_config(argv, env).cluster.seeds == ()


def test_a_misspelt_setting_in_a_config_map_fails(rendered, tmp_path) -> None:
    """The loader behind the checks above refuses an unknown key: the check can fail."""
    docs = rendered["overlays/pd"]
    cms = by_kind(docs, "ConfigMap")
    conf = next(cm for n, cm in cms.items() if n.startswith("moed-conf"))
    bad = tmp_path / "router.toml"
    bad.write_text(conf["data"]["router.toml"].replace("backend_roles", "backend_role"))
    from moed.config import ConfigError
    with pytest.raises(ConfigError, match="unknown key router.backend_role"):
        load(bad, environ={})
