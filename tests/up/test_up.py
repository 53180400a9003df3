"""`kvmesh up`: the plan as a pure function, and the supervisor against real `kvmesh` children.

Real: the `kvmesh` argument parser the plan's command lines must satisfy, the child processes
(`python -m kvmesh ...`), their logs and exit codes. The full platform on the real model runs in
tests/up/test_up_platform.py (slow).
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest

from kvmesh.cli import build_parser
from kvmesh.up import ProcSpec, Supervisor, UpError, UpOptions, options_from_args, plan, threads_per_engine


def test_threads_split_the_cores_evenly_and_never_drop_to_zero() -> None:
    assert threads_per_engine(2, 2, None) == 1
    assert threads_per_engine(2, 16, None) == 8
    assert threads_per_engine(4, 2, None) == 1
    assert threads_per_engine(2, 2, 3) == 3
    with pytest.raises(UpError):
        threads_per_engine(2, 2, 0)


def test_plan_starts_engines_then_a_router_that_fronts_them() -> None:
    specs = plan(UpOptions(engines=3, port=9000, engine_base_port=9100, kv_events_base_port=6000), cores=6)
    assert [s.name for s in specs] == ["engine-0", "engine-1", "engine-2", "router"]
    assert [s.url for s in specs] == ["http://127.0.0.1:9100", "http://127.0.0.1:9101",
                                      "http://127.0.0.1:9102", "http://127.0.0.1:9000"]
    router = specs[-1].args
    assert router[router.index("--engines") + 1] == ",".join(s.url for s in specs[:-1])
    kv_ports = [s.args[s.args.index("--kv-events-port") + 1] for s in specs[:-1]]
    assert kv_ports == ["6000", "6002", "6004"]  # each engine also uses port + 1 for replay
    assert all(s.args[s.args.index("--num-threads") + 1] == "2" for s in specs[:-1])
    assert all(s.env["OMP_NUM_THREADS"] == "2" for s in specs[:-1])


@pytest.mark.parametrize("opts", [
    UpOptions(engines=0),
    UpOptions(port=8100),  # collides with engine-0
    UpOptions(engines=2, kv_events_base_port=8100),  # collides with engine-0's HTTP port
    UpOptions(port=70000),
])
def test_impossible_plans_are_refused_with_a_reason(opts: UpOptions) -> None:
    with pytest.raises(UpError, match="must be"):
        plan(opts, cores=2)


def test_every_planned_command_line_parses_with_the_real_cli() -> None:
    parser = build_parser()
    for spec in plan(UpOptions(engines=2, kv_cache_bytes="256MiB", serve_args=("--dtype", "float32")), cores=2):
        args = parser.parse_args(list(spec.args))
        assert args.func is not None, spec


def test_cache_node_starts_first_and_every_engine_uses_it() -> None:
    specs = plan(UpOptions(engines=2, cache_node=True, cache_node_port=9200, cache_node_memory="2GiB",
                           cpu_kv_bytes="512MiB"), cores=2)
    assert [s.name for s in specs] == ["cache-node", "engine-0", "engine-1", "router"]
    node = specs[0]
    assert node.url == "http://127.0.0.1:9200"
    assert node.args[node.args.index("--ucx-port") + 1] == "9201"
    assert node.args[node.args.index("--memory") + 1] == "2GiB"
    for eng in specs[1:3]:
        assert eng.args[eng.args.index("--cache-node") + 1] == "127.0.0.1:9200"
        assert eng.args[eng.args.index("--cpu-kv-bytes") + 1] == "512MiB"
    router = specs[-1].args
    assert router[router.index("--engines") + 1] == "http://127.0.0.1:8100,http://127.0.0.1:8101"
    parser = build_parser()
    for spec in specs:
        assert parser.parse_args(list(spec.args)).func is not None, spec
    assert "--cache-node" not in plan(UpOptions(engines=1), cores=2)[0].args


def test_disaggregated_plan_starts_prefill_then_decode_engines_behind_a_two_stage_router() -> None:
    specs = plan(UpOptions(prefill=1, decode=2, port=9000, engine_base_port=9100, kv_events_base_port=6000,
                           kv_transfer_base_port=9200), cores=6)
    assert [s.name for s in specs] == ["prefill-0", "decode-0", "decode-1", "router"]
    assert [s.url for s in specs[:-1]] == ["http://127.0.0.1:9100", "http://127.0.0.1:9101", "http://127.0.0.1:9102"]

    def arg(spec: ProcSpec, flag: str) -> str | None:
        return spec.args[spec.args.index(flag) + 1] if flag in spec.args else None

    assert [arg(s, "--role") for s in specs[:-1]] == ["prefill", "decode", "decode"]
    assert [arg(s, "--kv-transfer-port") for s in specs[:-1]] == [None, "9200", "9201"]
    assert [arg(s, "--kv-events-port") for s in specs[:-1]] == ["6000", "6002", "6004"]
    assert all(arg(s, "--num-threads") == "2" and s.env["OMP_NUM_THREADS"] == "2" for s in specs[:-1])
    router = specs[-1]
    assert arg(router, "--engines") == "http://127.0.0.1:9101,http://127.0.0.1:9102"  # the decode pool
    assert arg(router, "--prefill-engines") == "http://127.0.0.1:9100"
    parser = build_parser()
    for spec in specs:
        args = parser.parse_args(list(spec.args))
        assert args.func is not None, spec
    engines = [parser.parse_args(list(s.args)) for s in specs[:-1]]
    assert [(a.role, a.kv_transfer_port) for a in engines] == [("prefill", 0), ("decode", 9200), ("decode", 9201)]
    from kvmesh.engine.router.cli import settings_from_args

    settings = settings_from_args(parser.parse_args(list(router.args)))
    assert settings.disaggregated and settings.prefill_engines == ("http://127.0.0.1:9100",)
    args = plan(UpOptions(engines=1), cores=2)[0].args
    assert args[args.index("--role") + 1] == "both"  # colocated engines


def test_threads_split_over_every_engine_of_both_pools() -> None:
    specs = plan(UpOptions(prefill=2, decode=2), cores=16)
    assert {s.args[s.args.index("--num-threads") + 1] for s in specs[:-1]} == {"4"}


@pytest.mark.parametrize("opts,match", [
    (UpOptions(engines=2, prefill=1, decode=1), "give one form, not both"),
    (UpOptions(prefill=1), "must both be >= 1"),
    (UpOptions(decode=2), "must both be >= 1"),
    (UpOptions(prefill=1, decode=1, kv_transfer_base_port=8100), "KV transfer ports"),  # prefill-0's HTTP port
    (UpOptions(prefill=1, decode=2, kv_transfer_base_port=5560), "must be distinct"),  # decode-1's KV events
    (UpOptions(prefill=1, decode=1, kv_transfer_base_port=8000), "must be distinct"),  # the router
    (UpOptions(prefill=1, decode=1, cache_node=True, cache_node_port=8199), "must be distinct"),  # UCX 8200
])
def test_impossible_disaggregated_plans_are_refused_with_a_reason(opts: UpOptions, match: str) -> None:
    with pytest.raises(UpError, match=match):
        plan(opts, cores=2)


def test_up_flags_reach_the_plan() -> None:
    args = build_parser().parse_args(["up", "--prefill", "1", "--decode", "2", "--kv-transfer-base-port", "7000"])
    assert (args.engines, args.prefill, args.decode, args.kv_transfer_base_port) == (None, 1, 2, 7000)
    assert build_parser().parse_args(["up"]).engines is None  # DEFAULT_ENGINES colocated engines
    assert [s.name for s in plan(UpOptions(), cores=2)] == ["engine-0", "engine-1", "router"]


def test_admission_flags_reach_every_engine_and_serve_reads_them() -> None:
    """`kvmesh up --admission TPOTGated --slo-ttft-ms --slo-tpot-ms`: every engine's line, parsed by
    the real `kvmesh serve`, admits TTFT-first with the gate at 75% of the TPOT target (the router
    gets neither flag)."""
    from kvmesh.engine.server.cli import settings_from_args

    parser = build_parser()
    args = parser.parse_args(["up", "--admission", "TPOTGated", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100"])
    specs = plan(options_from_args(args), cores=2)
    for spec in specs[:-1]:
        engine = settings_from_args(parser.parse_args(list(spec.args))).engine
        assert (engine.ttft_slo_ms, engine.admission_tpot_ms) == (1000.0, 75.0)
    assert not {"--ttft-slo-ms", "--admission-tpot-ms"} & set(specs[-1].args)
    default = plan(options_from_args(parser.parse_args(["up"])), cores=2)
    assert not any("--ttft-slo-ms" in s.args or "--admission-tpot-ms" in s.args for s in default)


@pytest.mark.parametrize("opts,match", [
    (UpOptions(admission="TTFTFirst"), "--admission TTFTFirst admits against --slo-ttft-ms: give it"),
    (UpOptions(admission="TPOTGated", slo_ttft_ms=1000), "admits against --slo-tpot-ms"),
    (UpOptions(admission="TPOTGated"), "--slo-ttft-ms and --slo-tpot-ms: give them"),
    (UpOptions(admission="Fastest", slo_ttft_ms=1000), "--admission must be one of FirstCome"),
    (UpOptions(admission="TTFTFirst", slo_ttft_ms=0), "--slo-ttft-ms must be a positive"),
    (UpOptions(admission="TPOTGated", slo_ttft_ms=1000, slo_tpot_ms=float("nan")), "--slo-tpot-ms must be"),
])
def test_an_admission_without_its_targets_is_refused_with_the_flags_to_give(opts: UpOptions, match: str) -> None:
    with pytest.raises(UpError, match=re.escape(match)):
        plan(opts, cores=2)


@pytest.mark.parametrize("port", [8100, 8099, 5557])  # engine-0's port, UCX = 8100, a KV events port
def test_cache_node_ports_must_not_collide(port: int) -> None:
    with pytest.raises(UpError, match="cache node"):
        plan(UpOptions(cache_node=True, cache_node_port=port), cores=2)


def test_a_child_that_dies_stops_up_with_its_last_log_lines(tmp_path: Path) -> None:
    """A real `kvmesh serve` that cannot load its model exits; `up` reports it and exits 1."""
    missing = tmp_path / "missing.gguf"
    spec = ProcSpec("engine-0", ("serve", "--model-path", str(missing), "--port", "1"), "http://127.0.0.1:1")
    out = io.StringIO()
    rc = Supervisor([spec, ProcSpec("router", ("--help",), "http://127.0.0.1:2")], tmp_path,
                    ready_timeout_s=120, grace_s=5, out=out).run(status_interval_s=0)
    text = out.getvalue()
    assert rc == 1, text
    assert "engine-0 exited with code 2" in text
    assert "does not exist" in text  # the child's own error line, from its log
    assert "starting router" not in text  # the router waits for its engines
    assert sys.executable  # children ran under this interpreter (kvmesh_argv)


def test_children_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    """SIGKILL gives `up` no chance to stop its children: the kernel's parent-death signal does.

    Real: `_start` as `up` uses it, a parent process killed with SIGKILL; the child is a sleeping
    interpreter standing in for `kvmesh serve` (only its lifetime matters here)."""
    import os
    import signal
    import subprocess
    import time

    script = f"""
import sys, time
from pathlib import Path
import kvmesh.up as up
up.kvmesh_argv = lambda: [sys.executable, "-c", "import time; time.sleep(60)"]
child = up._start(up.ProcSpec("sleeper", (), "http://127.0.0.1:1"), Path({str(tmp_path)!r}))
print(child.proc.pid, flush=True)
time.sleep(60)
"""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # running
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the child outlived its killed supervisor")


def test_status_line_reads_an_engines_load_from_its_metrics(tmp_path: Path) -> None:
    """Real: an HTTP server answering /metrics with a Prometheus exposition, read with the
    standard library's client; a port nothing listens on gives "(metrics unavailable)"."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from kvmesh.engine.util.localproc import free_port
    from kvmesh.up import Child, status_line

    exposition = (b"# TYPE kvmesh_num_requests_running gauge\nkvmesh_num_requests_running 3\n"
                  b"# TYPE kvmesh_kv_cache_usage_ratio gauge\nkvmesh_kv_cache_usage_ratio 0.25\n"
                  b"# TYPE kvmesh_prefix_cache_hits counter\n"
                  b'kvmesh_prefix_cache_hits_total{model_name="m",tier="gpu"} 300\n'
                  b'kvmesh_prefix_cache_hits_total{model_name="m",tier="cpu"} 5\n'
                  b"# TYPE kvmesh_prefix_cache_queries counter\n"
                  b'kvmesh_prefix_cache_queries_total{model_name="m",tier="gpu"} 400\n'
                  b'kvmesh_prefix_cache_queries_total{model_name="m",tier="cpu"} 100\n')

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(exposition)))
            self.end_headers()
            self.wfile.write(exposition)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        line = status_line(Child(ProcSpec("engine-0", (), url), tmp_path / "log", SimpleNamespace(pid=7), ready=True))
        assert "running=3 waiting=- kv%=25 gen_tokens=- cache_hit%=75" in line and url in line
    finally:
        httpd.shutdown()
        httpd.server_close()
    dead = ProcSpec("engine-1", (), f"http://127.0.0.1:{free_port()}")
    assert status_line(Child(dead, tmp_path / "log", SimpleNamespace(pid=8), ready=True)).endswith("(metrics unavailable)")


def test_up_writes_a_private_token_that_every_process_is_told(tmp_path: Path) -> None:
    import stat

    from kvmesh.up import write_token

    token = write_token(tmp_path / "run")
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text().strip()) >= 40
    opts = UpOptions(engines=2, cache_node=True, auth_token_file=str(token), api_key_files=("keys",))
    specs = plan(opts, cores=2)
    for spec in specs:
        assert spec.args[list(spec.args).index("--auth-token-file") + 1] == str(token), spec.name
    router = next(s for s in specs if s.name == "router")
    assert router.args[list(router.args).index("--api-key-file") + 1] == "keys"
    (tmp_path / "keys").write_text("k\n")
    for spec in specs:  # every line, token included, parses with the real CLI and makes settings
        args = [a if a != "keys" else str(tmp_path / "keys") for a in spec.args]
        build_parser().parse_args(args)
