"""The Helm chart: lint and template clean, installs into the control plane,
and its ServiceAccount's RBAC is enough for the operator (and no more)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tests.support.readme import readme_line

from .helpers import IMAGE, ROOT, OperatorProcess, condition, wait_until

pytestmark = pytest.mark.e2e

CHART = ROOT / "charts" / "kvmesh"
RELEASE, RELEASE_NS = "kvmesh", "kvmesh-system"
SA = f"system:serviceaccount:{RELEASE_NS}:{RELEASE}"


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def kinds(objs: list[dict]) -> list[tuple[str, str]]:
    return sorted((o["kind"], o["metadata"]["name"]) for o in objs)


@pytest.fixture(scope="module")
def helm_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("helm")


def test_lint_is_clean(cluster, helm_home):
    out = cluster.helm("lint", "--strict", str(CHART), home=helm_home)
    assert "0 chart(s) failed" in out.stdout, out.stdout
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


def test_template_defaults(cluster, helm_home):
    objs = docs(cluster.helm("template", RELEASE, str(CHART), "-n", RELEASE_NS,
                             home=helm_home).stdout)
    assert kinds(objs) == [
        ("ClusterRole", "kvmesh"), ("ClusterRoleBinding", "kvmesh"), ("Deployment", "kvmesh"),
        ("Role", "kvmesh-leader-election"), ("RoleBinding", "kvmesh-leader-election"),
        ("ServiceAccount", "kvmesh")]
    dep = next(o for o in objs if o["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 2 and pod["serviceAccountName"] == "kvmesh"
    args = pod["containers"][0]["args"]
    assert pod["containers"][0]["command"] == ["kvmesh"]
    assert args[0] == "operator" and "--lease-name=kvmesh" in args
    assert pod["containers"][0]["image"] == "kvmesh/kvmesh:0.1.0"
    role = next(o for o in objs if o["kind"] == "ClusterRole")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    # Delete only the optional gateway-mode children (operator/gateway.py), which the operator removes
    # when the spec stops asking for them; every other child is the garbage collector's.
    assert not any(v in ("delete", "deletecollection", "update", "*") for g, r, v in granted
                   if r not in ("inferencedeployments/finalizers", "inferencepools", "httproutes")), granted
    assert {v for _, r, v in granted if r in ("inferencepools", "httproutes")} == {"get", "create", "patch", "delete"}
    assert not any(r == "*" for _, r, _ in granted), granted
    # Secrets: create each deployment's token once and read it for drains; never list, patch or delete.
    assert {v for _, r, v in granted if r == "secrets"} == {"get", "create"}, granted
    assert {v for _, r, v in granted if r == "networkpolicies"} == {"get", "list", "watch", "create", "patch"}
    # Pods: read, and patch for the autoscaler's deletion-cost mark; never create or delete.
    assert {v for _, r, v in granted if r == "pods"} == {"get", "list", "patch"}, granted


def test_template_options(cluster, helm_home):
    objs = docs(cluster.helm(
        "template", RELEASE, str(CHART), "-n", RELEASE_NS,
        "--set", "podMonitor.enabled=true", "--set", "grafanaDashboards.enabled=true",
        "--set", "operator.watchNamespaces={team-a,team-b}",
        "--set", "operator.leaderElection.enabled=false", home=helm_home).stdout)
    names = kinds(objs)
    assert [n for k, n in names if k == "PodMonitor"] == [
        "kvmesh-cache", "kvmesh-engines", "kvmesh-operator", "kvmesh-router"]
    operator = next(o for o in objs if o["kind"] == "PodMonitor" and o["metadata"]["name"] == "kvmesh-operator")
    endpoint = operator["spec"]["podMetricsEndpoints"][0]
    # The operator's series name the InferenceDeployment's namespace: kept, not overwritten.
    assert endpoint["port"] == "health" and endpoint["path"] == "/metrics" and endpoint["honorLabels"]
    assert operator["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    engines = next(o for o in objs if o["kind"] == "PodMonitor" and o["metadata"]["name"] == "kvmesh-engines")
    assert engines["spec"]["selector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]
    assert {r["targetLabel"] for r in engines["spec"]["podMetricsEndpoints"][0]["relabelings"]} == {
        "inference_deployment", "component"}
    assert not any(k in ("ClusterRole", "ClusterRoleBinding") for k, _ in names)
    assert sorted(o["metadata"]["namespace"] for o in objs if o["kind"] == "Role") == [
        "team-a", "team-b"]
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert sorted(cm["data"]) == sorted(p.name for p in (ROOT / "dashboards").glob("*.json"))
    for name, text in cm["data"].items():
        assert json.loads(text)["title"], name
        assert text == (ROOT / "dashboards" / name).read_text().rstrip("\n")
    args = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert "--standalone" in args and "--namespace=team-a" in args


@pytest.fixture(scope="module")
def installed(cluster, helm_home):
    """The chart installed with the README's command, run from the repository root as written
    (plus --wait, and the image when KVMESH_E2E_IMAGE names another); uninstalled when the
    module ends."""
    argv = shlex.split(readme_line("bash", "helm install "))
    assert argv[:4] == ["helm", "install", RELEASE, "charts/kvmesh"] and RELEASE_NS in argv, argv
    repository, tag = IMAGE.rsplit(":", 1)
    cluster.helm(*argv[1:], "--wait", "--timeout", "120s",
                 "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
                 home=helm_home, timeout=180, cwd=ROOT)
    yield
    cluster.helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait", home=helm_home,
                 check=False, timeout=180)


def test_install_gives_a_ready_operator_deployment(cluster, installed):
    dep = client.AppsV1Api(cluster.api).read_namespaced_deployment(RELEASE, RELEASE_NS)
    assert dep.status.ready_replicas == 2
    crd = client.ApiextensionsV1Api(cluster.api).read_custom_resource_definition(
        "inferencedeployments.serving.kvmesh.io")
    assert crd.spec.versions[0].name == "v1alpha1"
    pods = cluster.core.list_namespaced_pod(
        RELEASE_NS, label_selector="app.kubernetes.io/component=operator").items
    assert len(pods) == 2
    for p in pods:  # no GPU toleration: the operator lands on a CPU node
        node = cluster.core.read_node(p.spec.node_name)
        assert "nvidia.com/gpu" not in (node.status.allocatable or {}), p.spec.node_name


def _token_kubeconfig(cluster, path: Path) -> Path:
    token = cluster.core.create_namespaced_service_account_token(
        RELEASE, RELEASE_NS, {"spec": {"expirationSeconds": 3600}}).status.token
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {
            "cluster": admin["clusters"][0]["name"], "user": "operator"}}],
        "current-context": "operator",
    }))
    return path


def _allowed(cluster, verb: str, resource: str, group: str = "", ns: str = "default",
             sub: str = "") -> bool:
    review = client.AuthorizationV1Api(cluster.api).create_subject_access_review({
        "spec": {"user": SA, "groups": ["system:serviceaccounts",
                                         f"system:serviceaccounts:{RELEASE_NS}"],
                 "resourceAttributes": {"verb": verb, "resource": resource, "group": group,
                                        "namespace": ns, "subresource": sub}}})
    return review.status.allowed


def test_operator_runs_under_its_service_account(cluster, installed, crd_installed, namespace,
                                                 tmp_path):
    if not cluster.local:
        # On a real cluster the chart's own pods run and hold the Lease; stop
        # them so the operator started here leads and nothing else reconciles.
        cluster.kubectl("scale", "deployment", RELEASE, "-n", RELEASE_NS, "--replicas=0")
        wait_until("chart operator pods gone", lambda: not cluster.core.list_namespaced_pod(
            RELEASE_NS, label_selector="app.kubernetes.io/component=operator").items,
            timeout=120)
    kubeconfig = _token_kubeconfig(cluster, tmp_path / "sa-kubeconfig")
    op = OperatorProcess.start(kubeconfig, tmp_path / "operator.log",
                               "--lease-namespace", RELEASE_NS, "--lease-name", RELEASE)
    try:
        wait_until("the ServiceAccount's operator to lead", op.is_leader, timeout=30)
        cluster.create_cr(namespace, "rbac", {
            "model": {"name": "smollm2-135m-instruct"}, "image": IMAGE, "prefill": {"replicas": 1},
            "decode": {"replicas": 1}, "cache": {"replicas": 1}, "router": {"replicas": 1}})
        wait_until("Ready under the ServiceAccount", lambda: condition(
            cluster.get_cr(namespace, "rbac"), "Ready").get("status") == "True", timeout=90)
        cluster.apps.delete_namespaced_deployment("rbac-decode", namespace)
        wait_until("repair under the ServiceAccount",
                   lambda: "decode" in cluster.deployments(namespace, "rbac"), timeout=60)
    finally:
        op.stop()
    log = op.log.read_text()
    assert f'User "{SA}" cannot' not in log, op.tail()
    assert "Traceback" not in log, op.tail()


@pytest.mark.parametrize("verb,resource,group,sub,allowed", [
    ("patch", "deployments", "apps", "", True),
    ("create", "services", "", "", True),
    ("patch", "inferencedeployments", "serving.kvmesh.io", "status", True),
    ("delete", "deployments", "apps", "", False),
    ("update", "deployments", "apps", "", False),
    ("get", "secrets", "", "", True),
    ("list", "secrets", "", "", False),
    ("patch", "secrets", "", "", False),
    ("delete", "secrets", "", "", False),
    ("patch", "networkpolicies", "networking.k8s.io", "", True),
    ("delete", "networkpolicies", "networking.k8s.io", "", False),
    ("create", "pods", "", "", False),
    ("delete", "pods", "", "", False),
    ("patch", "pods", "", "", True),
    ("patch", "inferencedeployments", "serving.kvmesh.io", "", False),
    ("delete", "inferencedeployments", "serving.kvmesh.io", "", False),
])
def test_service_account_permissions_are_least_privilege(cluster, installed, verb, resource,
                                                         group, sub, allowed):
    assert _allowed(cluster, verb, resource, group, sub=sub) is allowed


def test_namespace_scoped_install_grants_nothing_cluster_wide(cluster, helm_home):
    """The least-privilege install: operator.watchNamespaces gives Roles in those namespaces only."""
    objs = docs(cluster.helm("template", RELEASE, str(CHART), "-n", RELEASE_NS, "--set",
                             "operator.watchNamespaces={team-a,team-b}", home=helm_home).stdout)
    assert not [o for o in objs if o["kind"].startswith("Cluster")], kinds(objs)
    roles = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objs if o["kind"] == "Role"}
    assert roles == {("team-a", RELEASE), ("team-b", RELEASE),
                     (RELEASE_NS, f"{RELEASE}-leader-election")}
    for binding in (o for o in objs if o["kind"] == "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE,
                                        "namespace": RELEASE_NS}]
    # The same rules as the ClusterRole of the cluster-wide install, only namespaced.
    cluster_wide = docs(cluster.helm("template", RELEASE, str(CHART), "-n", RELEASE_NS,
                                     home=helm_home).stdout)
    cluster_rules = next(o for o in cluster_wide if o["kind"] == "ClusterRole")["rules"]
    assert next(o for o in objs if o["kind"] == "Role" and o["metadata"]["namespace"] == "team-a")[
        "rules"] == cluster_rules
    args = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def _can_i_list(cluster, user: str, namespace: str) -> set[tuple[str, str]]:
    """``kubectl auth can-i --list`` as ``user`` (impersonated by the admin): (resource, verb) pairs,
    resource names and non-resource URLs left out (discovery rules every account has)."""
    out = cluster.kubectl("auth", "can-i", "--list", f"--as={user}", "--as-group=system:serviceaccounts",
                          f"--as-group=system:serviceaccounts:{namespace}", "-n", namespace).stdout
    pairs = set()
    for line in out.splitlines()[1:]:
        if not line.strip() or line[0].isspace():
            continue  # a non-resource URL row
        resource = line.split()[0]
        groups = [g.split() for g in line[len(resource):].replace("]", "[").split("[")[1::2]]
        urls, names, verbs = groups if len(groups) == 3 else ([], [], groups[-1] if groups else [])
        if names:
            continue  # a rule on named objects only
        pairs |= {(resource, v) for v in verbs}
    return pairs


# What the chart grants the operator's account in a watched namespace, as the apiserver reports it
# (RBAC plus the rules every authenticated account has). A change here is a change of privilege:
# review it, then update docs/operator.md "Permissions".
OPERATOR_CAN = {
    *{("inferencedeployments.serving.kvmesh.io", v) for v in ("get", "list", "watch")},
    ("inferencedeployments.serving.kvmesh.io/status", "patch"),
    ("inferencedeployments.serving.kvmesh.io/finalizers", "update"),
    *{(r, v) for r in ("deployments.apps", "services", "configmaps", "networkpolicies.networking.k8s.io")
      for v in ("get", "list", "watch", "create", "patch")},
    ("secrets", "get"), ("secrets", "create"), ("events", "create"),
    *{(r, v) for r in ("inferencepools.inference.networking.k8s.io", "httproutes.gateway.networking.k8s.io")
      for v in ("get", "create", "patch", "delete")},
    ("pods", "get"), ("pods", "list"), ("pods", "patch"),
}
EVERYONE_CAN = {("selfsubjectreviews.authentication.k8s.io", "create"),
                ("selfsubjectaccessreviews.authorization.k8s.io", "create"),
                ("selfsubjectrulesreviews.authorization.k8s.io", "create")}


def test_the_operator_account_can_do_exactly_what_is_checked_in(cluster, installed, namespace):
    assert _can_i_list(cluster, SA, namespace) == OPERATOR_CAN | EVERYONE_CAN


def test_an_engine_pods_account_can_do_nothing(cluster, namespace):
    """Engine, router and cache pods run as their namespace's default account (and mount no token)."""
    assert _can_i_list(cluster, f"system:serviceaccount:{namespace}:default", namespace) == EVERYONE_CAN
