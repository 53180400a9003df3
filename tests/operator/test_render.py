import argparse
import copy

import pytest
import yaml

from kvmesh.engine.server.cli import add_serve_arguments
from kvmesh.operator import render as r
from kvmesh.operator.spec import COMPONENTS, SpecError

from tests.support.crs import MINIMAL_SPEC, make_cr, mount_auth_secret


def by_key(objs):
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def deployment(objs, component):
    return by_key(objs)[("Deployment", f"llm-{component}")]


def container(objs, component):
    return deployment(objs, component)["spec"]["template"]["spec"]["containers"][0]


def argv(objs, component):
    c = container(objs, component)
    return c["command"] + c["args"]


def serve_args_of_engines(objs, tmp_path) -> dict[str, argparse.Namespace]:
    """Each engine pool's command line parsed by the real `kvmesh serve` parser, with the rendered
    kvmesh.yaml and the auth secret where the pod would mount them."""
    config = tmp_path / r.CONFIG_FILE
    config.write_text(by_key(objs)[("ConfigMap", "llm-config")]["data"][r.CONFIG_FILE])
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    parsed = {}
    for c in ("prefill", "decode"):
        line = argv(objs, c)
        line[line.index("--config") + 1] = str(config)  # the ConfigMap's mount, here
        parsed[c] = parser.parse_args(mount_auth_secret(line, tmp_path)[2:])
    return parsed


def test_renders_the_full_child_set_with_owner_references(cr):
    objs = r.render_all(cr)
    keys = set(by_key(objs))
    assert keys == {("ConfigMap", "llm-config"), ("NetworkPolicy", "llm-internal")} | {
        (kind, f"llm-{c}") for c in COMPONENTS for kind in ("Deployment", "Service")}
    for o in objs:
        (ref,) = o["metadata"]["ownerReferences"]
        assert ref["uid"] == "uid-1" and ref["controller"] is True
        assert ref["kind"] == "InferenceDeployment"
        assert o["metadata"]["namespace"] == "serving"
        assert o["metadata"]["labels"][r.OWNER_LABEL] == "llm"


def test_rendering_is_deterministic(cr):
    assert r.render_all(cr) == r.render_all(copy.deepcopy(cr))


def test_role_arguments(cr):
    objs = r.render_all(cr)
    assert argv(objs, "prefill")[:4] == ["kvmesh", "serve", "--role", "prefill"]
    assert argv(objs, "decode")[:4] == ["kvmesh", "serve", "--role", "decode"]
    assert argv(objs, "cache")[:4] == ["kvmesh", "cache-node", "--memory", "8Gi"]
    router = argv(objs, "router")
    assert router[:4] == ["kvmesh", "router", "--policy", "cache-aware"]
    assert router[router.index("--prefill-service") + 1] == "llm-prefill.serving.svc:8000"
    assert router[router.index("--decode-service") + 1] == "llm-decode.serving.svc:8000"
    for c in ("prefill", "decode"):
        args = argv(objs, c)
        assert args[args.index("--cache-node") + 1] == "llm-cache.serving.svc:8000"


def test_colocated_serving_runs_both_phases_on_decode():
    cr = make_cr()
    cr["spec"]["prefill"]["replicas"] = 0
    objs = r.render_all(cr)
    assert deployment(objs, "prefill")["spec"]["replicas"] == 0
    assert argv(objs, "decode")[:4] == ["kvmesh", "serve", "--role", "both"]
    assert "--prefill-service" not in argv(objs, "router")
    assert "--kv-transfer-port" not in argv(objs, "decode")  # a colocated engine receives no KV
    assert "kv-transfer" not in {p["name"] for p in container(objs, "decode")["ports"]}
    assert [p["name"] for p in by_key(objs)[("Service", "llm-decode")]["spec"]["ports"]] == ["http"]


def test_no_cache_nodes_means_no_cache_service_argument():
    cr = make_cr()
    cr["spec"]["cache"]["replicas"] = 0
    objs = r.render_all(cr)
    for c in ("prefill", "decode", "router"):
        assert "--cache-node" not in argv(objs, c)


def test_gpu_pools_get_gpu_limits_and_tolerate_the_gpu_taint(cr):
    objs = r.render_all(cr)
    for c in ("prefill", "decode"):
        pod = deployment(objs, c)["spec"]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"][r.GPU_RESOURCE] == "1"
        assert r.GPU_TOLERATION in pod["tolerations"]
    for c in ("cache", "router"):
        pod = deployment(objs, c)["spec"]["template"]["spec"]
        assert r.GPU_RESOURCE not in pod["containers"][0].get("resources", {}).get("limits", {})
        assert "tolerations" not in pod


def test_user_tolerations_and_node_selector_are_kept_without_duplicates():
    cr = make_cr()
    cr["spec"]["decode"].update({
        "resources": {"gpus": 4},
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [dict(r.GPU_TOLERATION), {"key": "spot", "operator": "Exists"}],
    })
    pod = deployment(r.render_all(cr), "decode")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [r.GPU_TOLERATION, {"key": "spot", "operator": "Exists"}]
    assert pod["containers"][0]["resources"]["limits"][r.GPU_RESOURCE] == "4"


def test_probes_scrape_annotations_and_drain_time(cr):
    objs = r.render_all(cr)
    for c in COMPONENTS:
        tmpl = deployment(objs, c)["spec"]["template"]
        ctr = tmpl["spec"]["containers"][0]
        assert ctr["livenessProbe"]["httpGet"]["path"] == "/health"
        assert ctr["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert ctr["startupProbe"]["httpGet"]["path"] == "/health"
        ann = tmpl["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        assert ann["prometheus.io/port"] == "8000"
        assert ann["prometheus.io/path"] == "/metrics"
        assert tmpl["spec"]["terminationGracePeriodSeconds"] >= 30
        assert tmpl["metadata"]["labels"]["app.kubernetes.io/component"] == c
        assert deployment(objs, c)["spec"]["selector"]["matchLabels"] == r.selector_labels(
            r.Owner("llm", "serving", "uid-1"), c)


def test_services_headless_for_pools_clusterip_for_router(cr):
    objs = by_key(r.render_all(cr))
    for c in ("prefill", "decode", "cache"):
        assert objs[("Service", f"llm-{c}")]["spec"]["clusterIP"] == "None"
    router = objs[("Service", "llm-router")]["spec"]
    assert router["type"] == "ClusterIP" and "clusterIP" not in router
    assert r.router_url(r.Owner("llm", "serving", "u")) == "http://llm-router.serving.svc:8000"


def test_cache_memory_request_covers_kv_capacity():
    cr = make_cr()
    cr["spec"]["cache"].update({"memory": "64Gi", "resources": {"memory": "16Gi"}})
    res = container(r.render_all(cr), "cache")["resources"]
    assert res["requests"]["memory"] == "65Gi" == res["limits"]["memory"]
    cr["spec"]["cache"]["resources"]["memory"] = "128Gi"
    assert container(r.render_all(cr), "cache")["resources"]["requests"]["memory"] == "128Gi"


def test_configmap_holds_the_engine_configuration(cr):
    cm = by_key(r.render_all(cr))[("ConfigMap", "llm-config")]
    cfg = yaml.safe_load(cm["data"][r.CONFIG_FILE])
    assert cfg["model"]["name"] == "smollm2-135m-instruct"
    assert cfg["slo"] == {"ttftMs": 500, "tpotMs": 50, "percentile": 95.0}
    assert cfg["services"]["prefill"] == "llm-prefill.serving.svc:8000"


def test_volume_model_source_is_mounted_read_only():
    cr = make_cr()
    cr["spec"]["model"]["source"] = {"type": "Volume", "volume": {
        "persistentVolumeClaim": {"claimName": "weights"}, "path": "smollm2/model.gguf"}}
    cr["spec"]["model"]["format"] = "GGUF"
    objs = r.render_all(cr)
    pod = deployment(objs, "decode")["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights",
                                                       "readOnly": True}} in pod["volumes"]
    args = pod["containers"][0]["args"]
    assert pod["containers"][0]["command"] == ["kvmesh"] and args[0] == "serve"
    assert args[args.index("--model-path") + 1] == "/models/smollm2/model.gguf"
    assert args[args.index("--model-format") + 1] == "gguf"
    router_pod = deployment(objs, "router")["spec"]["template"]["spec"]
    assert all(v["name"] != "model" for v in router_pod["volumes"])


def _templates(cr):
    objs = r.render_all(cr)
    return {c: deployment(objs, c)["spec"]["template"] for c in COMPONENTS}


def _changed_templates(edit):
    before = make_cr()
    after = make_cr()
    edit(after["spec"])
    old, new = _templates(before), _templates(after)
    return {c for c in COMPONENTS if old[c] != new[c]}


def test_edits_roll_only_the_pools_that_consume_them():
    assert _changed_templates(lambda s: s["decode"].update(replicas=5)) == set()
    assert _changed_templates(lambda s: s["decode"].update(resources={"gpus": 2})) == {"decode"}
    assert _changed_templates(lambda s: s["router"].update(policy="session")) == {"router"}
    assert _changed_templates(lambda s: s["slo"].update(ttftMs=900)) == {"router"}
    assert _changed_templates(lambda s: s["cache"].update(memory="32Gi")) == {"cache"}
    assert _changed_templates(lambda s: s["model"].update(name="other")) == {
        "prefill", "decode", "router"}
    assert _changed_templates(lambda s: s.update(image="kvmesh/kvmesh:0.2.0")) == set(COMPONENTS)
    assert _changed_templates(lambda s: s["model"].update(dtype="float32")) == {"prefill", "decode"}


def test_scaling_changes_only_the_replica_count():
    before, after = make_cr(), make_cr()
    after["spec"]["decode"]["replicas"] = 4
    old, new = r.render_all(before), r.render_all(after)
    diff = [(a, b) for a, b in zip(old, new) if a != b]
    assert len(diff) == 1
    a, b = diff[0]
    assert b["metadata"]["name"] == "llm-decode" and b["spec"]["replicas"] == 4
    a["spec"]["replicas"] = 4
    assert a == b


def test_engines_publish_kv_events_on_exposed_ports(cr):
    objs = r.render_all(cr)
    for c in ("prefill", "decode"):
        args = argv(objs, c)
        assert args[args.index("--kv-events-port") + 1] == str(r.KV_EVENTS_PORT) == "5557"
        ports = {p["name"]: p["containerPort"] for p in container(objs, c)["ports"]}
        transfer = {"kv-transfer": 8001} if c == "decode" else {}
        assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558, **transfer}
        parser = argparse.ArgumentParser()
        add_serve_arguments(parser)
        assert parser.parse_args(args[2:]).kv_events_port == 5557  # what `kvmesh serve` accepts
    for c in ("cache", "router"):
        assert "--kv-events-port" not in argv(objs, c)
    assert [p["name"] for p in container(objs, "router")["ports"]] == ["http"]


def test_disaggregated_decode_engines_listen_for_kv_on_an_exposed_port(cr):
    """Prefill engines push KV to the port a decode engine reports in /kv/info: the decode pool
    is told a fixed one, and its container and headless Service carry it; prefill engines
    dial out only."""
    objs = r.render_all(cr)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    decode = parser.parse_args(argv(objs, "decode")[2:])
    assert (decode.role, decode.kv_transfer_port) == ("decode", r.KV_TRANSFER_PORT) == ("decode", 8001)
    assert parser.parse_args(argv(objs, "prefill")[2:]).kv_transfer_port == 0
    assert "--kv-transfer-port" not in argv(objs, "prefill")
    assert {"name": "kv-transfer", "containerPort": 8001, "protocol": "TCP"} in container(objs, "decode")["ports"]
    assert "kv-transfer" not in {p["name"] for p in container(objs, "prefill")["ports"]}
    svc = by_key(objs)[("Service", "llm-decode")]["spec"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["ports"]} == {"http": (8000, "http"),
                                                                               "kv-transfer": (8001, "kv-transfer")}
    assert [p["name"] for p in by_key(objs)[("Service", "llm-prefill")]["spec"]["ports"]] == ["http"]


def test_cache_nodes_expose_their_ucx_port(cr, tmp_path):
    """Engines reach a cache node's HTTP port through --cache-node and read the UCX port from its
    /kv/info: the container and the headless Service must carry that port too."""
    from kvmesh.cli import build_parser
    from kvmesh.engine.cachenode.cli import settings_from_args

    objs = r.render_all(cr)
    args = argv(objs, "cache")
    settings = settings_from_args(build_parser().parse_args(mount_auth_secret(args[1:], tmp_path) + ["--memory", "8Gi"]))
    assert settings.ucx_port == r.CACHE_UCX_PORT == 8001
    ports = {p["name"]: p["containerPort"] for p in container(objs, "cache")["ports"]}
    assert ports == {"http": 8000, "ucx": 8001}
    svc = by_key(objs)[("Service", "llm-cache")]["spec"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["ports"]} == {"http": (8000, "http"),
                                                                               "ucx": (8001, "ucx")}
    assert svc["clusterIP"] == "None"
    engine_args = argv(objs, "decode")
    assert engine_args[engine_args.index("--cache-node") + 1] == "llm-cache.serving.svc:8000"


def test_configmap_carries_the_autoscaler_bounds_per_resized_pool():
    cr = make_cr()
    cr["spec"]["decode"].update({"minReplicas": 1, "maxReplicas": 6})
    cr["spec"]["autoscaling"] = {"enabled": True}
    cfg = yaml.safe_load(by_key(r.render_all(cr))[("ConfigMap", "llm-config")]["data"][r.CONFIG_FILE])
    assert cfg["autoscaling"]["pools"] == {"prefill": {"minReplicas": None, "maxReplicas": None},
                                          "decode": {"minReplicas": 1, "maxReplicas": 6}}
    cr["spec"]["prefill"]["replicas"] = 0  # colocated: only the decode pool is resized
    cfg = yaml.safe_load(by_key(r.render_all(cr))[("ConfigMap", "llm-config")]["data"][r.CONFIG_FILE])
    assert set(cfg["autoscaling"]["pools"]) == {"decode"}


@pytest.mark.parametrize("dtype", [None, "auto", "bfloat16", "float16", "float32"])
@pytest.mark.parametrize("colocated", [False, True])
def test_engines_run_the_model_dtype(dtype, colocated, tmp_path):
    """Every engine command line names the dtype (the default too), and `kvmesh serve` parses it,
    with the rendered kvmesh.yaml, into the engine configuration as given; routers and cache nodes
    get none."""
    from kvmesh.engine.config import parse_dtype
    from kvmesh.engine.server.cli import settings_from_args

    cr = make_cr()
    if dtype is not None:
        cr["spec"]["model"]["dtype"] = dtype
    if colocated:
        cr["spec"]["prefill"]["replicas"] = 0
    objs = r.render_all(cr)
    want = dtype or "auto"
    for args in serve_args_of_engines(objs, tmp_path).values():
        assert args.dtype == want
        engine = settings_from_args(args).engine
        assert engine.dtype == want
        engine.validate()
        assert engine.torch_dtype() == parse_dtype(engine.dtype_choice().dtype)
    for c in ("cache", "router"):
        assert "--dtype" not in argv(objs, c)
    cfg = yaml.safe_load(by_key(objs)[("ConfigMap", "llm-config")]["data"][r.CONFIG_FILE])
    assert "dtype" not in cfg["model"]  # only the engines read it, from their arguments


def test_engines_drain_within_their_grace_period():
    cr = make_cr()
    cr["spec"]["decode"]["terminationGracePeriodSeconds"] = 200
    objs = r.render_all(cr)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    for c, grace in (("prefill", 120), ("decode", 200)):
        args = argv(objs, c)
        pod = deployment(objs, c)["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == grace
        timeout = parser.parse_args(args[2:]).drain_timeout_s  # the ServeSettings field the flag sets
        assert timeout == grace - r.DRAIN_MARGIN_S  # aborted leftovers still finish before SIGKILL
    assert "--drain-timeout" not in argv(objs, "router") + argv(objs, "cache")


def test_every_pod_mounts_the_deployments_token_and_checks_it(cr):
    """The Secret is mounted read-only in every pool and named by --auth-token-file; it is never
    rendered (its token is random: reconcile creates it once) and never on a command line."""
    objs = r.render_all(cr)
    assert not [o for o in objs if o["kind"] == "Secret"]
    for component in ("prefill", "decode", "cache", "router"):
        pod = deployment(objs, component)["spec"]["template"]["spec"]
        vol = next(v for v in pod["volumes"] if v["name"] == "auth")
        assert vol["secret"]["secretName"] == "llm-auth"
        mount = next(m for m in container(objs, component)["volumeMounts"] if m["name"] == "auth")
        assert mount == {"name": "auth", "mountPath": r.AUTH_DIR, "readOnly": True}
        line = argv(objs, component)
        assert line[line.index("--auth-token-file") + 1] == r.AUTH_TOKEN_FILE
    secret = r.render_auth_secret(r.Owner.from_object(cr), "tok")
    assert secret["stringData"] == {"token": "tok"} and secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_every_pod_meets_the_restricted_pod_security_standard(cr):
    """The checks of the "restricted" profile (kubernetes.io/docs/concepts/security/pod-security-standards),
    applied to every rendered pod; the real apiserver enforces them in the real-node e2e."""
    allowed_volumes = {"configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected", "downwardAPI",
                       "csi", "ephemeral"}
    for component in COMPONENTS:
        pod = by_key(r.render_all(cr))[("Deployment", f"llm-{component}")]["spec"]["template"]["spec"]
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for v in pod["volumes"]:
            assert set(v) - {"name"} <= allowed_volumes, v
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
            assert not sc.get("privileged") and not any("hostPort" in p for p in c["ports"])
            # Engines write compiled kernels beside the model; the router and cache nodes write nothing.
            assert sc["readOnlyRootFilesystem"] is (component in ("router", "cache")), component


def test_the_network_policy_closes_engine_and_cache_ports_to_outsiders(cr):
    pol = by_key(r.render_all(cr))[("NetworkPolicy", "llm-internal")]["spec"]
    sel = pol["podSelector"]
    assert sel["matchLabels"] == {r.OWNER_LABEL: "llm"}
    assert sel["matchExpressions"] == [{"key": "app.kubernetes.io/component", "operator": "In",
                                        "values": [c for c in COMPONENTS if c != "router"]}]
    assert pol["policyTypes"] == ["Ingress"]
    (rule,) = pol["ingress"]
    assert "ports" not in rule  # every port, for the peers named; nothing for anyone else
    own, operator, scrapers = rule["from"]
    assert own == {"podSelector": {"matchLabels": {r.OWNER_LABEL: "llm"}}}
    assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert scrapers == {"namespaceSelector": {"matchLabels": {r.SCRAPER_NAMESPACE_LABEL: "true"}}}


def test_the_client_keys_secret_is_mounted_into_the_router_alone():
    cr = make_cr(dict(MINIMAL_SPEC, auth={"apiKeysSecret": "team-keys", "apiKeysKey": "list", "isolateTenants": True}))
    objs = by_key(r.render_all(cr))
    router = objs[("Deployment", "llm-router")]["spec"]["template"]["spec"]
    assert {"name": "api-keys", "secret": {"secretName": "team-keys", "items": [{"key": "list", "path": "keys"}]}} \
        in router["volumes"]
    args = router["containers"][0]["args"]
    assert args[args.index("--api-key-file") + 1] == r.API_KEYS_FILE and "--isolate-tenants" in args
    for component in ("prefill", "decode", "cache"):
        pod = objs[("Deployment", f"llm-{component}")]["spec"]["template"]["spec"]
        assert all(v["name"] != "api-keys" for v in pod["volumes"])  # engines trust the router's token
    with pytest.raises(SpecError, match="isolateTenants needs spec.auth.apiKeysSecret"):
        r.render_all(make_cr(dict(MINIMAL_SPEC, auth={"isolateTenants": True})))


def test_a_disaggregated_deployment_gives_both_pools_the_checkpoint_settings():
    """P/D handoffs carry a hybrid model's recurrent state (docs/disagg.md), so a disaggregated
    deployment of one renders like a colocated one: both engine pools get the CR's checkpoint
    settings (the prefill pool's checkpoints give its repeated prompts their prefix hits)."""
    cr = make_cr()
    cr["spec"]["model"]["stateCheckpoints"] = {"intervalTokens": 256, "memory": "1Gi"}
    assert cr["spec"]["prefill"]["replicas"] > 0
    objs = r.render_all(cr)
    for c in ("prefill", "decode"):
        line = argv(objs, c)
        assert line[line.index("--role") + 1] == c
        assert line[line.index("--state-checkpoint-interval") + 1] == "256"
        assert line[line.index("--state-checkpoint-bytes") + 1] == str(1 << 30)


@pytest.mark.parametrize("admission,ttft,gate", [
    ("FirstCome", None, None), ("TTFTFirst", 800.0, None), ("TPOTGated", 800.0, 60.0)])
@pytest.mark.parametrize("colocated", [False, True])
def test_engines_admit_as_the_slo_says(admission, ttft, gate, colocated, tmp_path):
    """spec.slo.admission becomes the engines' admission flags, at the targets of spec.slo (the
    gate at 75% of tpotMs, the level bench/fleet.py measured), and the real `kvmesh serve` parses
    them into its engine configuration; routers and cache nodes get none."""
    from kvmesh.engine.server.cli import settings_from_args

    cr = make_cr()
    cr["spec"]["slo"] = {"ttftMs": 800, "tpotMs": 80, "admission": admission}
    if colocated:
        cr["spec"]["prefill"]["replicas"] = 0
    objs = r.render_all(cr)
    for args in serve_args_of_engines(objs, tmp_path).values():
        engine = settings_from_args(args).engine
        assert (engine.ttft_slo_ms, engine.admission_tpot_ms) == (ttft or 0.0, gate or 0.0)
        engine.validate()
    for c in ("cache", "router"):
        assert not {"--ttft-slo-ms", "--admission-tpot-ms"} & set(argv(objs, c))
