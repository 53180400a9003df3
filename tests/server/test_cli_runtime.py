"""`kvmesh serve` flags, the drain sequence and the async engine's dispatch, without a model."""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading

import pytest

from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.server import cli
from kvmesh.engine.util.cliargs import parse_size
from kvmesh.engine.server.async_engine import AsyncEngine, SeqSubmission, ServerState, retry_after_seconds
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.server.runtime import build_server
from kvmesh.engine.server.settings import ServeSettings

from tests.support.fake_step_engine import FakeEngine


@pytest.mark.parametrize("text,expected", [("1000", 1000), ("2GiB", 2 << 30), ("512MiB", 512 << 20),
                                           ("1.5G", 1_500_000_000), ("64 kib", 65536),
                                           # Kubernetes quantities, as the CRD's cache.memory holds them
                                           ("8Gi", 8 << 30), ("64M", 64_000_000), ("1e9", 10**9),
                                           ("0.5Ki", 512), ("2Pi", 2 << 50), ("1E", 10**18)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "5 parsecs", "0", "-1GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def _parse(*argv: str) -> argparse.Namespace:
    from kvmesh.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_flags_map_to_settings():
    args = _parse("--model", "m.gguf", "--dtype", "float32", "--kv-cache-bytes", "1GiB", "--block-size", "8",
                  "--max-num-seqs", "7", "--max-model-len", "512", "--port", "9001", "--host", "0.0.0.0",
                  "--served-model-name", "a", "--served-model-name", "b", "--max-waiting-requests", "3",
                  "--drain-timeout", "12", "--no-prefix-caching")
    assert args.func is cli.handler
    s = cli.settings_from_args(args)
    e = s.engine
    assert (e.model, e.dtype, e.kv_cache_bytes, e.block_size, e.max_num_seqs, e.max_model_len) == \
        ("m.gguf", "float32", 1 << 30, 8, 7, 512)
    assert e.enable_prefix_caching is False
    assert (s.host, s.port, s.served_model_names, s.max_waiting_requests, s.drain_timeout_s) == \
        ("0.0.0.0", 9001, ["a", "b"], 3, 12.0)


def test_defaults():
    s = cli.settings_from_args(_parse())
    assert (s.engine.model, s.host, s.port, s.engine.block_size) == ("default", "127.0.0.1", 8000, 16)
    assert _parse().role == "both"


def test_roles_and_kv_transfer_flags():
    s = cli.settings_from_args(_parse("--role", "decode", "--kv-transfer-port", "8001",
                                      "--kv-transfer-timeout", "7.5", "--no-kv-transfer-overlap"))
    assert (s.role, s.kv_transfer_port, s.engine.kv_transfer_timeout, s.kv_transfer_overlap) == \
        ("decode", 8001, 7.5, False)
    d = cli.settings_from_args(_parse("--role", "prefill"))
    assert (d.role, d.kv_transfer_port, d.engine.kv_transfer_timeout, d.kv_transfer_overlap) == \
        ("prefill", 0, 30.0, True)


@pytest.mark.parametrize("flags", [("--role", "middle"), ("--kv-transfer-port", "70000"),
                                   ("--kv-transfer-port", "x")])
def test_bad_role_or_transfer_port_is_a_usage_error(flags):
    with pytest.raises(SystemExit):
        _parse(*flags)


def test_non_positive_transfer_timeout_exits_2(capsys):
    assert cli.handler(_parse("--kv-transfer-timeout", "0")) == 2
    assert "kv_transfer_timeout" in capsys.readouterr().err


def test_invalid_engine_config_exits_2(capsys):
    assert cli.handler(_parse("--block-size", "0")) == 2
    assert "block_size" in capsys.readouterr().err


def test_retry_after_bounds():
    assert retry_after_seconds(10, 8, None) == 1
    assert retry_after_seconds(16, 8, 2.0) == 4
    assert retry_after_seconds(10_000, 1, 30.0) == 60
    assert retry_after_seconds(1, 128, 0.01) == 1


# ---- AsyncEngine -----------------------------------------------------------------------------------


def _seqs(prefix: str, n: int, max_tokens: int = 3) -> list[SeqSubmission]:
    return [SeqSubmission(f"{prefix}-{i}", [5, 6], SamplingParams(max_tokens=max_tokens)) for i in range(n)]


async def _started(engine: FakeEngine, **kw) -> AsyncEngine:
    ae = AsyncEngine(lambda: engine, **kw)
    ae.start()
    await asyncio.wait_for(ae.loaded.wait(), 10)
    return ae


def test_one_dispatch_per_step_and_group_ordering():
    async def main() -> None:
        engine = FakeEngine(max_num_seqs=8)
        ae = await _started(engine)
        calls = []
        orig = ae._dispatch
        ae._dispatch = lambda outs, t: (calls.append(len(outs)), orig(outs, t))
        g1 = ae.submit(_seqs("a", 3))
        g2 = ae.submit(_seqs("b", 2))
        got: dict[str, list[int]] = {}
        for g in (g1, g2):
            while True:
                outs = await g.next_outputs()
                if not outs:
                    break
                for o in outs:
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert sorted(got) == ["a-0", "a-1", "a-2", "b-0", "b-1"]
        assert all(len(v) == 3 for v in got.values())
        assert len(calls) <= engine.num_steps  # never more than one callback per step
        assert sum(calls) == 15
        ae.release(g1)
        ae.release(g2)
        assert ae.num_active_requests == 0 and ae.num_queued == 0
        await ae.shutdown()

    asyncio.run(main())


def test_failed_submission_adds_nothing():
    async def main() -> None:
        engine = FakeEngine()
        ae = await _started(engine)
        seqs = _seqs("x", 2) + [SeqSubmission("x-2", [5], SamplingParams(max_tokens=1000))]
        with pytest.raises(ValueError):
            ae.submit(seqs)
        assert ae.num_active_requests == 0 and ae.num_queued == 0
        await asyncio.sleep(0.2)
        assert not engine.has_unfinished_requests()  # the two added first were aborted
        await ae.shutdown()

    asyncio.run(main())


def test_release_aborts_unfinished_sequences():
    async def main() -> None:
        engine = FakeEngine(step_delay_s=0.01, max_model_len=100_000)
        ae = await _started(engine)
        finished = []
        ae.on_finished = finished.append
        g = ae.submit(_seqs("r", 2, max_tokens=1000))
        await g.next_outputs()
        ae.release(g)
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not engine.has_unfinished_requests()
        await asyncio.sleep(0.05)
        assert sorted(o.finish_reason for o in finished) == ["abort", "abort"]
        assert ae.num_queued == 0
        await ae.shutdown()

    asyncio.run(main())


def test_engine_failure_reaches_waiting_requests():
    class Exploding(FakeEngine):
        def step(self):
            raise RuntimeError("kernel crashed")

    async def main() -> None:
        ae = await _started(Exploding())
        g = ae.submit(_seqs("f", 1))
        with pytest.raises(APIError, match="kernel crashed"):
            await asyncio.wait_for(g.next_outputs(), 10)
        assert ae.state is ServerState.FAILED
        with pytest.raises(APIError) as e:
            ae.submit(_seqs("g", 1))
        assert e.value.status == 500

    asyncio.run(main())


# ---- drain ------------------------------------------------------------------------------------------


def test_drain_times_out_then_aborts_and_exits():
    async def main() -> None:
        engine = FakeEngine(step_delay_s=0.01, max_model_len=100_000)
        server = build_server(ServeSettings(drain_timeout_s=0.3), engine_factory=lambda: engine)
        ae = server.aengine
        ae.start()
        await ae.loaded.wait()
        g = ae.submit(_seqs("d", 1, max_tokens=10_000))
        outs = []

        async def handler() -> None:  # what a route does: read to the end, then release
            while batch := await g.next_outputs():
                outs.extend(batch)
            ae.release(g)

        consumer = asyncio.ensure_future(handler())
        t0 = asyncio.get_running_loop().time()
        await server.drain("test")
        assert asyncio.get_running_loop().time() - t0 < 3.0  # timeout 0.3 s, then the abort lands
        assert server.should_exit and ae.state is ServerState.DRAINING
        await consumer
        assert outs[-1].finish_reason == "abort"
        await ae.shutdown()

    asyncio.run(main())


def test_signal_handler_drains_instead_of_exiting():
    """The first SIGTERM starts a drain (no immediate exit); a second SIGINT forces exit."""

    async def main() -> None:
        server = build_server(ServeSettings(drain_timeout_s=5), engine_factory=FakeEngine)
        server._loop = asyncio.get_running_loop()
        server.aengine.start()
        await server.aengine.loaded.wait()
        assert threading.current_thread() is threading.main_thread()
        with server.capture_signals():
            signal.raise_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            assert server._draining is not None
            assert server.aengine.state is ServerState.DRAINING
            await asyncio.wait_for(server._draining, 5)
            assert server.should_exit and not server.force_exit
            signal.raise_signal(signal.SIGINT)
            assert server.force_exit
        await server.aengine.shutdown()

    asyncio.run(main())
