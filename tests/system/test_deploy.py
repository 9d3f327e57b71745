"""deploy/: the Kubernetes manifests validate against the API schemas (offline, bundled with
kubernetes-validate), say what the agent needs, and run commands our CLI accepts; the Helm chart lints,
renders those same manifests with its default values (so the two cannot drift) and its values reach the
pods; the image recipe builds its environment with scripts/install itself."""
from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from rankscope.agent.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
K8S_VERSION = "1.30.0"  # the oldest release with appArmorProfile fields
HELM = ROOT / ".tools" / "helm"  # scripts/install fetches it
CHART = ROOT / "deploy" / "helm" / "rankscope"
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance")  # a release's own
READ_TOKEN, CAPTURE_TOKEN = "read-0123456789", "capture-9876543210"
TOKENS = ("--set", f"token.value={READ_TOKEN}", "--set", f"token.captureValue={CAPTURE_TOKEN}")


def _docs() -> dict[tuple[str, str], dict]:
    out = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_strictly(path):
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError


def test_validator_catches_a_wrong_manifest():
    bad = _docs()[("DaemonSet", "rankscope-agent")]
    bad["spec"]["template"]["spec"]["hostPID"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _helm(*args: str) -> subprocess.CompletedProcess:
    assert HELM.exists(), "helm is missing: scripts/install fetches it into .tools/"
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=60)


def _render(*values: str, release: str = "rankscope", namespace: str = "rankscope",
            tokens: tuple[str, ...] = TOKENS) -> dict[tuple[str, str], dict]:
    out = _helm("template", release, str(CHART), "--namespace", namespace, *tokens, *values)
    assert out.returncode == 0, out.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}
    for doc in docs.values():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    return docs


def _without_helm_labels(node):
    if isinstance(node, dict):
        return {k: _without_helm_labels(v) for k, v in node.items() if k not in HELM_LABELS}
    if isinstance(node, list):
        return [_without_helm_labels(v) for v in node]
    return node


def _container(doc: dict) -> dict:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return c


def test_agent_daemonset_has_what_the_agent_needs():
    ds = _docs()[("DaemonSet", "rankscope-agent")]
    pod = ds["spec"]["template"]["spec"]
    c = _container(ds)
    assert pod["hostPID"] is True
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert ds["metadata"]["labels"]["app.kubernetes.io/name"] == "rankscope"
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert [p["name"] for p in c["ports"]] == ["metrics"]
    caps = set(c["securityContext"]["capabilities"]["add"])
    assert {"BPF", "PERFMON", "SYS_ADMIN", "SYS_PTRACE"} <= caps
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/sys/kernel/tracing", "/sys/kernel/debug", "/host/lib/modules", "/host/usr/src", "/sys/fs/cgroup",
            "/etc/rankscope"} <= mounts
    args = build_parser().parse_args(c["args"])
    assert args.command == "agent" and args.all and args.token_file.startswith("/etc/rankscope/")
    # The BPF cache's sealing key: a file of the same Secret's mount, named by the Secret's key.
    assert env["RANKSCOPE_BPF_CACHE_KEY"]["value"] == "/etc/rankscope/bpf-cache-key"
    assert args.capture_token_file.startswith("/etc/rankscope/") and not args.no_captures
    assert pod["automountServiceAccountToken"] is False and c["resources"]["limits"]["cpu"]
    assert args.listen.endswith(":" + str(c["ports"][0]["containerPort"]))
    analyzer = _docs()[("StatefulSet", "rankscope-analyzer")]["spec"]["template"]["spec"]
    for volumes in (pod["volumes"], analyzer["volumes"]):  # agents and analyzer share the token
        assert next(v for v in volumes if v["name"] == "token")["secret"]["secretName"] == "rankscope-token"


def test_analyzer_pulls_the_agents_through_the_headless_service():
    docs = _docs()
    svc = docs[("Service", "rankscope-agent")]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= docs[("DaemonSet", "rankscope-agent")]["spec"]["template"]["metadata"]["labels"].items()
    sts = docs[("StatefulSet", "rankscope-analyzer")]
    c = _container(sts)
    args = build_parser().parse_args(c["args"])
    assert args.command == "cluster" and args.replicas == sts["spec"]["replicas"] == 1
    ns = svc["metadata"]["namespace"]
    assert args.agents == f"dns+http://{svc['metadata']['name']}.{ns}.svc:{svc['spec']['ports'][0]['port']}"
    assert c["securityContext"]["runAsNonRoot"] and "privileged" not in c["securityContext"]
    analyzer_svc = docs[("Service", "rankscope-analyzer")]
    assert analyzer_svc["spec"]["ports"][0]["targetPort"] == "metrics"
    # Each replica by its own name (it serves its own jobs): the StatefulSet's governing Service is headless.
    assert sts["spec"]["serviceName"] == "rankscope-analyzer" and analyzer_svc["spec"]["clusterIP"] == "None"


def test_chart_lints():
    out = _helm("lint", "--strict", str(CHART), *TOKENS)
    assert out.returncode == 0, out.stdout + out.stderr
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert f'\nversion = "{chart["appVersion"]}"\n' in (ROOT / "pyproject.toml").read_text()  # the image's tag


def test_chart_defaults_render_the_manifests():
    rendered = _render()
    manifests = {key: doc for key, doc in _docs().items() if key[0] != "Namespace"}  # helm's --create-namespace
    assert set(rendered) == set(manifests) | {("Secret", "rankscope-token")}
    for key, doc in manifests.items():
        assert _without_helm_labels(rendered[key]) == doc, key
    data = {k: base64.b64decode(v).decode() for k, v in rendered[("Secret", "rankscope-token")]["data"].items()}
    cache_key = data.pop("bpf-cache-key")  # seals the nodes' BPF caches: derived, never a token
    assert data == {"token": READ_TOKEN, "capture-token": CAPTURE_TOKEN}
    assert len(cache_key) >= 32 and cache_key not in (READ_TOKEN, CAPTURE_TOKEN)


def test_chart_makes_up_no_token():
    """A generated token would change with every `helm template` (no cluster to look the Secret up in): the
    chart asks for the tokens instead, and the same values render the same Secret."""
    for given, says in (((), "token.value is needed"), (TOKENS[:2], "token.captureValue is needed"),
                        (("--set", "token.value=same", "--set", "token.captureValue=same"), "must differ")):
        out = _helm("template", "rankscope", str(CHART), *given)
        assert out.returncode != 0 and says in out.stderr, out.stderr
    assert _render()[("Secret", "rankscope-token")] == _render()[("Secret", "rankscope-token")]
    without = _render("--set", "captures.enabled=false", tokens=TOKENS[:2])
    assert set(without[("Secret", "rankscope-token")]["data"]) == {"token", "bpf-cache-key"}
    assert build_parser().parse_args(_container(without[("DaemonSet", "rankscope-agent")])["args"]).no_captures


def test_chart_limits_who_reaches_the_agents():
    docs = _render()
    policy = docs[("NetworkPolicy", "rankscope-agent")]["spec"]
    agent_pod = docs[("DaemonSet", "rankscope-agent")]["spec"]["template"]
    analyzer_pod = docs[("StatefulSet", "rankscope-analyzer")]["spec"]["template"]
    assert policy["podSelector"]["matchLabels"].items() <= agent_pod["metadata"]["labels"].items()
    (rule,) = policy["ingress"]
    analyzer, prometheus = rule["from"]
    assert analyzer["podSelector"]["matchLabels"].items() <= analyzer_pod["metadata"]["labels"].items()
    assert prometheus["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    for pod in (agent_pod, analyzer_pod):  # neither calls the Kubernetes API
        assert pod["spec"]["automountServiceAccountToken"] is False
    token = next(v for v in analyzer_pod["spec"]["volumes"] if v["name"] == "token")
    assert token["secret"]["items"] == [{"key": "token", "path": "token"}]  # the analyzer starts no capture
    mine = _render("--set-json", 'networkPolicy.from=[{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]')
    assert mine[("NetworkPolicy", "rankscope-agent")]["spec"]["ingress"][0]["from"][1] == {
        "namespaceSelector": {"matchLabels": {"team": "obs"}}}
    assert ("NetworkPolicy", "rankscope-agent") not in _render("--set", "networkPolicy.enabled=false")


def test_chart_values_reach_the_pods():
    docs = _render("--set", "agent.detail=deep", "--set-json", "agent.window=2.5", "--set", "agent.port=9500",
                   "--set", "agent.listenAddress=[::]", "--set", "agent.privileged=true",
                   "--set-json", 'agent.nodeSelector={"nvidia.com/gpu.present": "true"}',
                   "--set-json", "agent.tolerations=[]", "--set-json", 'agent.resources={"limits": {"memory": "3Gi"}}',
                   "--set", "image.repository=registry.local/rankscope", "--set", "image.tag=dev",
                   "--set", "token.existingSecret=my-token", "--set", "analyzer.window=10",
                   "--set", "analyzer.replicas=3",
                   release="fleet", namespace="ml", tokens=())
    assert not [key for key in docs if key[0] == "Secret"]  # the user's own
    ds = docs[("DaemonSet", "fleet-rankscope-agent")]
    pod, c = ds["spec"]["template"]["spec"], _container(ds)
    args = build_parser().parse_args(c["args"])
    assert (args.detail, args.window, args.listen) == ("deep", 2.5, "[::]:9500")
    assert c["ports"][0]["containerPort"] == 9500 and c["securityContext"]["privileged"] is True
    assert c["image"] == "registry.local/rankscope:dev"
    assert c["resources"]["limits"] == {"cpu": "1", "memory": "3Gi"}  # Helm merges the given map into the default
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"} and "tolerations" not in pod
    analyzer = docs[("StatefulSet", "fleet-rankscope-analyzer")]
    cluster = build_parser().parse_args(_container(analyzer)["args"])
    assert cluster.window == 10 and cluster.agents == "dns+http://fleet-rankscope-agent.ml.svc:9500"
    assert cluster.replicas == analyzer["spec"]["replicas"] == 3 and cluster.replica is None  # from the pod name
    assert docs[("Service", "fleet-rankscope-agent")]["spec"]["ports"][0]["port"] == 9500
    for workload in (ds, analyzer):
        volumes = workload["spec"]["template"]["spec"]["volumes"]
        assert next(v for v in volumes if v["name"] == "token")["secret"]["secretName"] == "my-token"
    assert set(_render("--set", "analyzer.enabled=false")) == {
        ("DaemonSet", "rankscope-agent"), ("Service", "rankscope-agent"), ("Secret", "rankscope-token"),
        ("NetworkPolicy", "rankscope-agent")}


def test_chart_refuses_bad_values():
    out = _helm("template", "rankscope", str(CHART), *TOKENS, "--set", "agent.detail=verbose")
    assert out.returncode != 0 and "agent/detail" in out.stderr


def test_image_builds_with_the_install_script():
    """One source of truth: the image runs scripts/install (build half), its entry point the node half."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    runs = " ".join(re.findall(r"^RUN ((?:.*\\\n)*.*)", dockerfile, re.M))
    assert "scripts/install --image" in runs
    assert "bpfcc" not in runs and "pip install" not in runs  # nothing installed around the script
    assert "rankscope.cupti_shim.build" in runs and "make" not in runs  # the shim outlives the removed cache
    entry = (ROOT / "deploy" / "entrypoint.sh").read_text()
    assert "scripts/install --node" in entry
    assert re.search(r"^FROM debian:", dockerfile, re.M)
    cmd = re.search(r'^CMD (\[.*\])', dockerfile, re.M).group(1)
    assert build_parser().parse_args(yaml.safe_load(cmd)).command == "agent"


def test_install_modes():
    script = ROOT / "scripts" / "install"
    bad = subprocess.run([str(script), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 1 and "usage" in bad.stderr
    node = subprocess.run([str(script), "--node"], capture_output=True, text=True, timeout=60)
    assert node.returncode == 0, node.stderr
    assert "installing" not in node.stdout  # the node half installs no packages and touches no venv
    uname = subprocess.run(["uname", "-r"], capture_output=True, text=True).stdout.strip()
    assert Path(f"/lib/modules/{uname}/build").exists() and Path("/sys/kernel/tracing/uprobe_events").exists()
