"""Every command line the operator renders parses with the real `kvmesh` argument parser.

A pod whose args the CLI rejects crash-loops, so this walks every component of a set of
representative specs (colocated, disaggregated, with and without cache nodes, each model
source, format and dtype, each router policy) through ``operator/render.py``'s ``component_args`` and
``kvmesh.cli.build_parser``, and checks the flags land where they must: the engines' roles, the
decode engines' KV transfer port, the engines' dtype, the router's prefill and decode pools.
"""

from __future__ import annotations

import copy

import pytest

from kvmesh.cli import build_parser
from kvmesh.engine.router import cli as router_cli
from kvmesh.engine.router.policies import POLICIES, uses_prefix
from kvmesh.operator import gateway as gw
from kvmesh.operator import render as r
from kvmesh.operator import spec as s
from tests.support.crs import MINIMAL_SPEC, mount_auth_secret

VOLUME = {"type": "Volume", "volume": {"persistentVolumeClaim": {"claimName": "models"}, "path": "smol"}}


def _spec(**changes):
    spec = copy.deepcopy(MINIMAL_SPEC)
    for path, value in changes.items():
        node = spec
        *head, last = path.split("__")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = value
    return spec


SPECS = {
    "disaggregated-with-cache": _spec(),
    "colocated": _spec(prefill__replicas=0, cache__replicas=0),
    "colocated-with-cache": _spec(prefill__replicas=0),
    "disaggregated-no-cache": _spec(cache__replicas=0),
    "volume-gguf": _spec(model__source=VOLUME, model__format="GGUF"),
    "volume-safetensors": _spec(model__source=VOLUME, model__format="Safetensors", prefill__replicas=0),
    "uri": _spec(model__source={"type": "URI", "uri": "s3://bucket/model"}),
    **{f"policy-{p}": _spec(router__policy=p) for p in POLICIES},
    **{f"dtype-{d}": _spec(model__dtype=d) for d in s.DTYPES},
    "colocated-float32": _spec(model__dtype="float32", prefill__replicas=0, cache__replicas=0),
    "client-keys": _spec(auth__apiKeysSecret="llm-keys"),
    "client-keys-isolated": _spec(auth__apiKeysSecret="llm-keys", auth__isolateTenants=True),
    "gateway": _spec(prefill__replicas=0, router__mode="gateway"),
    "hybrid-checkpoints": _spec(model__stateCheckpoints={"intervalTokens": 256, "memory": "1Gi"}),
    "gateway-client-keys": _spec(prefill__replicas=0, router__mode="gateway", auth__apiKeysSecret="llm-keys",
                                 router__gateway={"parentRef": {"name": "inference-gateway"}}),
}
OWNER = r.Owner("llm", "serving", "uid-1")
PARSER = build_parser()


def _cases():
    for name, raw in SPECS.items():
        for component in s.COMPONENTS:
            marks = []
            if component == "cache" and "cache-node" not in PARSER._subparsers._group_actions[0].choices:
                marks.append(pytest.mark.xfail(strict=True, reason="`kvmesh cache-node` is not implemented yet"))
            yield pytest.param(name, raw, component, id=f"{name}-{component}", marks=marks)


@pytest.mark.parametrize("name,raw,component", list(_cases()))
def test_rendered_command_line_parses(name, raw, component, tmp_path):
    spec = s.parse_spec(raw)
    argv = r.component_args(spec, OWNER, component)
    assert argv[0] == "kvmesh"
    assert argv[argv.index("--auth-token-file") + 1] == r.AUTH_TOKEN_FILE  # every role checks the token
    argv = mount_auth_secret(argv, tmp_path)
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as e:  # argparse reports the offending flag on stderr
        pytest.fail(f"`{' '.join(argv)}` does not parse (exit {e.code})")
    assert callable(args.func)
    if component in ("prefill", "decode"):
        # A disaggregated deployment runs prefill and decode engines; the decode ones listen for KV.
        assert args.role == ("both" if component == "decode" and spec.colocated else component)
        assert args.kv_transfer_port == (r.KV_TRANSFER_PORT if args.role == "decode" else 0)
        assert args.dtype == spec.model.dtype == raw["model"].get("dtype", s.DEFAULT_DTYPE)
        # Hybrid models' checkpoint settings reach the engine as the CR (or its defaults) says.
        assert args.state_checkpoint_interval == spec.model.state_checkpoint_interval
        assert args.state_checkpoint_bytes == (1 << 30 if "stateCheckpoints" in raw["model"] else 512 << 20)
        # Behind a gateway, clients reach the serving engines directly: they check the client keys.
        keyed = bool(spec.auth.api_keys_secret) and spec.gateway.enabled and component == "decode"
        assert (args.api_key_file is not None) == keyed
    if component == "router":
        assert args.policy == spec.router.policy
        settings = router_cli.settings_from_args(args)  # the flags also make valid settings
        assert [f"{x.host}:{x.port}" for x in settings.services] == [f"{r.service_host(OWNER, 'decode')}:8000"]
        assert settings.disaggregated == (not spec.colocated)
        prefill = [f"{x.host}:{x.port}" for x in settings.prefill_services]
        assert prefill == ([] if spec.colocated else [f"{r.service_host(OWNER, 'prefill')}:8000"])
        # The client keys Secret, when the CR names one, is what the router checks.
        assert settings.auth.client_keys() == ({"a-client-key"} if spec.auth.api_keys_secret else set())
        assert settings.auth.isolate_tenants == spec.auth.isolate_tenants
        # The InferencePool's endpointPickerRef names this port of the router Service.
        assert args.ext_proc_port == (gw.EXT_PROC_PORT if spec.gateway.enabled else None)


def test_router_policies_match_the_crd():
    assert router_cli.POLICIES == POLICIES == s.ROUTER_POLICIES
    # The operator reports CacheAwareRouting for exactly the policies the router tokenizes for.
    assert tuple(p for p in POLICIES if uses_prefix(p)) == s.PREFIX_ROUTER_POLICIES
