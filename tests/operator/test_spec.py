import copy

import pytest

from kvmesh.operator import spec as s
from kvmesh.operator.spec import SpecError, parse_spec

from tests.support.crs import MINIMAL_SPEC


def test_minimal_spec_gets_defaults():
    spec = s.parse_spec(MINIMAL_SPEC)
    assert spec.model.name == "smollm2-135m-instruct"
    assert spec.model.source_type == "Embedded"
    assert spec.image == s.DEFAULT_IMAGE
    assert (spec.prefill.replicas, spec.decode.replicas) == (1, 2)
    assert spec.prefill.resources.gpus == s.DEFAULT_GPUS
    assert spec.cache.resources.gpus == 0  # CPU pools never get GPUs
    assert spec.cache.memory == s.DEFAULT_CACHE_MEMORY
    assert spec.router.policy == "cache-aware"
    assert spec.slo.percentile == s.DEFAULT_PERCENTILE
    assert spec.decode.termination_grace_period_seconds == s.DEFAULT_GRACE_S["decode"]
    assert not spec.colocated


def test_empty_components_default_to_one_replica():
    spec = s.parse_spec({"model": {"name": "m"}})
    assert [spec.component(c).replicas for c in s.COMPONENTS] == [1, 1, 1, 1]


def test_prefill_zero_means_colocated():
    assert s.parse_spec({"model": {"name": "m"}, "prefill": {"replicas": 0}}).colocated


def test_missing_model_name_is_reported():
    with pytest.raises(s.SpecError, match="spec.model.name is required"):
        s.parse_spec({"model": {}})


def test_bad_quantity_names_the_field():
    with pytest.raises(s.SpecError, match=r"spec.decode.resources.memory"):
        s.parse_spec({"model": {"name": "m"}, "decode": {"resources": {"memory": "lots"}}})


def test_volume_source_needs_exactly_one_volume():
    base = {"name": "m", "source": {"type": "Volume", "volume": {}}}
    with pytest.raises(s.SpecError, match="exactly one"):
        s.parse_spec({"model": base})
    ok = s.parse_spec({"model": {"name": "m", "source": {
        "type": "Volume", "volume": {"persistentVolumeClaim": {"claimName": "w"},
                                     "path": "/llama/"}}}})
    assert ok.model.volume.claim_name == "w" and ok.model.volume.path == "llama"


def test_uri_source_needs_uri():
    with pytest.raises(s.SpecError, match="uri is required"):
        s.parse_spec({"model": {"name": "m", "source": {"type": "URI"}}})


def test_model_dtype_defaults_to_the_engines_default_and_is_checked():
    assert s.parse_spec({"model": {"name": "m"}}).model.dtype == s.DEFAULT_DTYPE == "auto"
    for dtype in s.DTYPES:
        assert s.parse_spec({"model": {"name": "m", "dtype": dtype}}).model.dtype == dtype
    with pytest.raises(s.SpecError, match=r"spec.model.dtype must be one of auto, bfloat16, float16, float32"):
        s.parse_spec({"model": {"name": "m", "dtype": "fp8"}})


def test_tolerations_are_parsed():
    spec = s.parse_spec({"model": {"name": "m"}, "decode": {"tolerations": [
        {"key": "pool", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}]}})
    assert spec.decode.tolerations[0].to_manifest() == {
        "key": "pool", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}


@pytest.mark.parametrize("checkpoints,message", [
    ({"intervalTokens": 100}, "multiple of the engines' block size"),
    ({"intervalTokens": -16}, "intervalTokens"),
    ({"memory": "lots"}, "stateCheckpoints.memory"),
])
def test_state_checkpoint_settings_the_engine_would_refuse_are_refused(checkpoints, message):
    spec = copy.deepcopy(MINIMAL_SPEC)
    spec["model"]["stateCheckpoints"] = checkpoints
    with pytest.raises(SpecError, match=message):
        parse_spec(spec)


def test_state_checkpoint_defaults_are_the_engines():
    from kvmesh.engine.config import EngineConfig

    model = parse_spec(copy.deepcopy(MINIMAL_SPEC)).model
    assert model.state_checkpoint_interval == EngineConfig.state_checkpoint_interval
    assert model.state_checkpoint_memory == "512Mi" and 512 << 20 == EngineConfig.state_checkpoint_bytes


@pytest.mark.parametrize("slo,message", [
    ({"admission": "TTFTFirst"}, r"admission TTFTFirst admits against spec.slo.ttftMs: set it"),
    ({"admission": "TPOTGated", "ttftMs": 1000}, r"admission TPOTGated admits against spec.slo.tpotMs"),
    ({"admission": "TPOTGated"}, r"spec.slo.ttftMs and spec.slo.tpotMs: set them"),
    ({"admission": "fifo", "ttftMs": 1000}, r"spec.slo.admission must be one of FirstCome, TTFTFirst, TPOTGated"),
])
def test_admission_against_a_target_the_spec_does_not_give_is_refused(slo, message):
    spec = copy.deepcopy(MINIMAL_SPEC)
    spec["slo"] = slo
    with pytest.raises(SpecError, match=message):
        parse_spec(spec)


def test_admission_defaults_to_arrival_order_with_or_without_targets():
    assert parse_spec(copy.deepcopy(MINIMAL_SPEC)).slo.admission == "FirstCome"
    spec = copy.deepcopy(MINIMAL_SPEC)
    spec["slo"] = {"ttftMs": 500, "tpotMs": 50}
    assert parse_spec(spec).slo.admission == "FirstCome"
