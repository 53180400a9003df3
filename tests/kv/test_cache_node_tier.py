"""Cache-node tier on a tiny random model: one engine writes blocks through to a real `kvmesh
cache-node` process, another reloads them instead of recomputing; a stopped, killed or
mismatched node means recompute with the same tokens, never an error."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from fastapi.testclient import TestClient

from kvmesh.engine.kv.events import TIER_REMOTE
from kvmesh.engine.kv.node_link import CacheNodeAddressError, parse_host_port
from kvmesh.engine.transfer.buffers import KVBlock
from kvmesh.engine.transfer.client import KVClient
from kvmesh.engine.server.app import ServerApp
from kvmesh.engine.server.async_engine import AsyncEngine
from kvmesh.engine.transfer.header import BlockHeader, kv_layout
from kvmesh.engine.util.metrics import parse_samples, sample_value

from tests.support.processes import NodeProc
from tests.support.tiny_engine import BS, MAX_NEW, PROMPTS, greedy, hf_greedy, tiny_engine
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reference(model_dir):  # noqa: F811
    return hf_greedy(model_dir, PROMPTS)


@pytest.fixture
def node():
    n = NodeProc(memory="64MiB", events=False).start()
    yield n
    n.stop(signal.SIGKILL)


def _engine(model_dir, loaded, node, **kw):  # noqa: F811
    kw.setdefault("cache_node_timeout", 10.0)
    llm = tiny_engine(model_dir, loaded, num_kv_blocks=64, cache_node=f"127.0.0.1:{node.http_port}", **kw)
    wait_for(lambda: llm.engine._cache_node.clients() is not None, "the engine never resolved the cache node")
    return llm



def _written(llm, n: int) -> None:
    remote = llm.engine.tiers.remote
    wait_for(lambda: remote.inflight_bytes == 0 and remote.snapshot_stats().stored >= n,
          f"write-through did not store {n} blocks: {remote.snapshot_stats()}")


def test_another_engine_reloads_what_one_wrote_through(model_dir, loaded, node, reference):  # noqa: F811
    writer = _engine(model_dir, loaded, node)
    assert writer.generate([PROMPTS[0]], greedy())[0].token_ids == reference[0]
    full = (len(PROMPTS[0]) + MAX_NEW - 1) // BS
    _written(writer, full - 1)
    writer.engine.close()

    reader = _engine(model_dir, loaded, node)
    res = reader.generate([PROMPTS[0], PROMPTS[1]], greedy())
    assert [r.token_ids for r in res] == reference[:2]
    stats = reader.engine.tiers.remote.snapshot_stats()
    assert stats.hits >= (len(PROMPTS[0]) - 1) // BS * BS - BS and stats.promotions > 0, stats
    assert stats.failures == 0
    assert res[0].num_cached_tokens == stats.hits or res[1].num_cached_tokens > 0
    again = reader.generate([PROMPTS[2]], greedy())[0]  # the promoted prefix now hits in the primary pool
    assert again.token_ids == reference[2]
    reader.engine.check_integrity()
    reader.engine.close()


def test_an_engine_built_beside_a_running_node_reloads_on_its_first_request(model_dir, loaded, node,  # noqa: F811
                                                                        reference):
    """A pod that just scaled up: built, it is linked and connected to the node (before: the link
    resolved on a background thread, so the first request found no node and recomputed)."""
    writer = _engine(model_dir, loaded, node)
    assert writer.generate([PROMPTS[0]], greedy())[0].token_ids == reference[0]
    _written(writer, (len(PROMPTS[0]) + MAX_NEW - 1) // BS - 1)
    writer.engine.close()

    reader = tiny_engine(model_dir, loaded, num_kv_blocks=64, cache_node=f"127.0.0.1:{node.http_port}",
                         cache_node_timeout=10.0)
    clients = reader.engine._cache_node.clients()
    assert clients is not None and clients[0].open_connections == 1 and clients[1].open_connections == 1
    res = reader.generate([PROMPTS[0]], greedy())[0]
    assert res.token_ids == reference[0]
    assert res.num_cached_tokens >= (len(PROMPTS[0]) - 1) // BS * BS - BS
    reader.engine.close()


def test_an_idle_servers_metrics_count_a_write_through_confirmed_after_the_last_step(model_dir, loaded,  # noqa: F811
                                                                                  node):
    """Real HTTP app and /metrics over the engine. The node confirms a step's put after the step
    returned; with no request after it, /metrics must still show it (before: the figures stayed
    at the last step's until the next request came)."""

    def remote(name: str) -> float:
        return sample_value(parse_samples(client.get("/metrics").text), name, tier="remote") or 0.0

    with TestClient(ServerApp(AsyncEngine(lambda: _engine(model_dir, loaded, node).engine)).app) as client:
        wait_for(lambda: client.get("/ready").status_code == 200, "engine loaded", timeout=60)
        prompt = [(7 * j) % 300 + 20 for j in range(4 * BS + 1)]
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        wait_for(lambda: remote("kvmesh_kv_tier_stored_total") == 4,
                 "/metrics to count the prompt's 4 full blocks stored, with no request after", timeout=15)
        assert remote("kvmesh_kv_tier_dropped_saves_total") == 0


def test_stopped_then_killed_node_means_recompute(model_dir, loaded, node, reference):  # noqa: F811
    llm = _engine(model_dir, loaded, node, cache_node_timeout=1.0)
    assert llm.generate([PROMPTS[0]], greedy())[0].token_ids == reference[0]
    _written(llm, 1)
    llm.engine.kv.reset_prefix_cache()  # force the next request to look on the node
    node.proc.send_signal(signal.SIGSTOP)  # slow: the get times out
    try:
        assert llm.generate([PROMPTS[1]], greedy())[0].token_ids == reference[1]
        assert llm.engine.tiers.remote.snapshot_stats().failures >= 1
    finally:
        node.proc.send_signal(signal.SIGKILL)
        node.proc.send_signal(signal.SIGCONT)
        node.proc.wait(10)
    llm.engine.kv.reset_prefix_cache()
    assert llm.generate([PROMPTS[2]], greedy())[0].token_ids == reference[2]  # dead: recompute
    llm.engine.check_integrity()
    llm.engine.close()


def test_node_killed_mid_get_means_recompute(model_dir, loaded, node, reference):  # noqa: F811
    llm = _engine(model_dir, loaded, node, cache_node_timeout=30.0)
    eng = llm.engine
    assert llm.generate([PROMPTS[0]], greedy())[0].token_ids == reference[0]
    _written(llm, 1)
    eng.kv.reset_prefix_cache()
    node.proc.send_signal(signal.SIGSTOP)  # the get is sent and waits for an answer ...
    eng.add_request("mid-get", PROMPTS[1], greedy())
    eng.step()
    assert eng.waiting_on_transfers, "the request did not wait for its fetch"
    node.proc.send_signal(signal.SIGKILL)  # ... and the node dies before answering
    node.proc.send_signal(signal.SIGCONT)
    node.proc.wait(10)
    tokens: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for out in eng.step():
            tokens = out.output_token_ids
            if out.finished:
                deadline = 0
        time.sleep(0.001)
    assert tokens == reference[1]
    assert eng.tiers.remote.snapshot_stats().failures >= 1
    eng.check_integrity()
    eng.close()


def test_header_mismatch_is_rejected_and_recomputed(model_dir, loaded, node, reference):  # noqa: F811
    llm = _engine(model_dir, loaded, node)
    eng = llm.engine
    layout = eng.tiers.remote.layout
    # Blocks under this engine's hashes but another dtype: the node refuses to serve them to it.
    wrong = kv_layout(layout.extra_key, "bfloat16", layout.block_size, layout.num_layers, layout.num_kv_heads,
                      layout.head_dim)
    eng.kv.get_computed_blocks("probe", PROMPTS[0])
    chain = eng.kv.block_hashes("probe")
    eng.kv.free("probe")

    blocks, parent = [], None
    for h in chain:
        blocks.append(KVBlock(BlockHeader(wrong, h, parent), np.zeros(wrong.nbytes, np.uint8)))
        parent = h
    with KVClient("127.0.0.1", node.ucx_port, timeout=10) as c:
        assert set(c.put(blocks).result(15)) == {"stored"}
    res = llm.generate([PROMPTS[0]], greedy())[0]
    assert res.token_ids == reference[0]
    stats = eng.tiers.remote.snapshot_stats()
    assert stats.failures >= 1 and stats.hits == 0
    eng.check_integrity()
    eng.close()


def test_unreachable_node_drops_saves_and_recomputes(model_dir, loaded, reference):  # noqa: F811
    from kvmesh.engine.util.localproc import free_ports

    (port,) = free_ports(1)
    llm = tiny_engine(model_dir, loaded, num_kv_blocks=64, cache_node=f"127.0.0.1:{port}", cache_node_timeout=1.0)
    assert llm.generate([PROMPTS[0]], greedy())[0].token_ids == reference[0]
    stats = llm.engine.tiers.remote.snapshot_stats()
    assert stats.dropped > 0 and stats.hits == 0
    assert TIER_REMOTE not in {t for t, h in llm.engine.events.snapshot().hashes.items() if h}
    llm.engine.close()


def test_cache_node_address():
    assert parse_host_port("kv-cache.ns.svc:8000") == ("kv-cache.ns.svc", 8000)
    assert parse_host_port("[::1]:8000") == ("::1", 8000)
    for bad in ("nohost", ":8000", "h:0", "h:x"):
        with pytest.raises(CacheNodeAddressError):
            parse_host_port(bad)


def test_operator_cache_service_means_cache_node():
    from kvmesh.cli import build_parser
    from kvmesh.engine.server.cli import settings_from_args

    args = build_parser().parse_args(["serve", "--cache-service", "demo-cache.ns.svc.cluster.local:8000",
                                      "--cpu-kv-bytes", "1GiB"])
    cfg = settings_from_args(args).engine
    assert cfg.cache_node == "demo-cache.ns.svc.cluster.local:8000" and cfg.cpu_kv_bytes == 1 << 30


def test_an_engine_of_another_header_version_sharing_the_node_recomputes_and_harms_no_one(
        model_dir, loaded, node, reference):  # noqa: F811
    """Two real engines share the node across a rolling upgrade: the second speaks another
    block-header version (its layout says so; its hashes are the same). The node refuses its
    gets and puts by the header, the engine recomputes the same tokens, and the first engine's
    blocks stay intact for the engines that match them."""
    import msgspec

    writer = _engine(model_dir, loaded, node)
    assert writer.generate([PROMPTS[0]], greedy())[0].token_ids == reference[0]
    full = (len(PROMPTS[0]) + MAX_NEW - 1) // BS
    _written(writer, full - 1)

    other = _engine(model_dir, loaded, node)
    remote = other.engine.tiers.remote
    remote.layout = msgspec.structs.replace(remote.layout, version=remote.layout.version + 1)
    res = other.generate([PROMPTS[0], PROMPTS[1]], greedy())
    assert [r.token_ids for r in res] == reference[:2]
    stats = remote.snapshot_stats()
    assert stats.hits == 0 and stats.failures >= 1, stats
    other.engine.check_integrity()
    status, text = node.http("/metrics")
    assert status == 200 and rejected_headers(text.decode()) >= 1, text.decode()[-800:]
    other.engine.close()

    reader = _engine(model_dir, loaded, node)  # the same version as the writer: reloads, exact
    again = reader.generate([PROMPTS[0]], greedy())[0]
    assert again.token_ids == reference[0]
    assert reader.engine.tiers.remote.snapshot_stats().hits > 0
    for llm in (writer, reader):
        llm.engine.close()


def rejected_headers(metrics_text: str) -> float:
    from kvmesh.engine.util.metrics import parse_samples, sample_value

    return sample_value(parse_samples(metrics_text), "kvmesh_cachenode_rejected_headers_total") or 0
