"""`kvmesh serve` accepts the command line the operator renders for engine pods."""

from __future__ import annotations

import argparse

import pytest

from kvmesh.engine.server.cli import ServeArgsError, add_serve_arguments, resolve_model
from kvmesh.operator import render


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


def test_operator_rendered_args_parse(tmp_path):
    from kvmesh.operator import spec as s

    cr_spec = s.parse_spec({"model": {"name": "smollm2-135m-instruct"}, "prefill": {"replicas": 0},
                            "decode": {"replicas": 1}, "cache": {"replicas": 1}, "router": {"replicas": 1},
                            "slo": {"ttftMs": 500, "tpotMs": 50}})
    owner = render.Owner(name="demo", namespace="default", uid="u1")
    args = render.component_args(cr_spec, owner, "decode")
    assert args[:2] == ["kvmesh", "serve"]
    cfg = tmp_path / "kvmesh.yaml"
    cfg.write_text("model: {name: smollm2-135m-instruct, source: {type: Default}}\n")
    argv = [a if a != f"{render.CONFIG_DIR}/{render.CONFIG_FILE}" else str(cfg) for a in args[2:]]
    ns = _parse(argv)
    assert ns.role == "both" and ns.port == render.ENGINE_PORT
    assert resolve_model(ns) == ("smollm2-135m-instruct", [])


def test_model_path_serves_under_model_name(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    ns = _parse(["--model", "my-model", "--model-path", str(f), "--model-format", "gguf"])
    assert resolve_model(ns) == (str(f), ["my-model"])


def test_config_file_supplies_the_path(tmp_path):
    d = tmp_path / "weights"
    d.mkdir()
    cfg = tmp_path / "kvmesh.yaml"
    cfg.write_text(f"model: {{name: x, source: {{type: Volume, path: {d}}}}}\n")
    assert resolve_model(_parse(["--model", "x", "--config", str(cfg)])) == (str(d), ["x"])


@pytest.mark.parametrize("argv,msg", [
    (["--model-uri", "s3://bucket/m"], "not supported yet"),
    (["--model-path", "/nonexistent/m.gguf"], "does not exist"),
    (["--config", "/nonexistent/kvmesh.yaml"], "cannot read"),
])
def test_bad_model_args_are_clear_errors(argv, msg):
    with pytest.raises(ServeArgsError, match=msg):
        resolve_model(_parse(argv))


def test_format_mismatch(tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    with pytest.raises(ServeArgsError, match="gguf"):
        resolve_model(_parse(["--model-path", str(d), "--model-format", "gguf"]))
