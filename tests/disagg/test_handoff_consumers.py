"""A prefill engine's handed-off blocks wait for every consumer: the decode engine and a real cache node.

Real: a `kvmesh cache-node` process receiving the prefill engine's write-through over UCX, the
prefill engine (tiny random Llama) holding the request's blocks. The cache node is stopped
(SIGSTOP) while its write is in flight, which proves the blocks are not freed when only the decode
side confirmed; once the node runs again and confirms, they are freed and nothing leaks.
"""

from __future__ import annotations

import signal
import time

import pytest

from kvmesh.engine.disagg.prefill_side import DECODE

from tests.support.processes import NodeProc
from tests.support.waits import wait_for
from tests.support.tiny_engine import PROMPTS, greedy, tiny_engine
from tests.support.handoff import prefill

pytestmark = pytest.mark.timeout(300)


def test_blocks_are_freed_only_after_decode_and_the_cache_node_confirmed(model_dir, loaded):  # noqa: F811
    node = NodeProc(memory="64MiB", events=False).start()
    try:
        p = tiny_engine(model_dir, loaded, num_kv_blocks=64, cache_node=f"127.0.0.1:{node.http_port}",
                        cache_node_timeout=20.0, kv_transfer_timeout=60.0).engine
        wait_for(lambda: p._cache_node.clients() is not None, "the engine never resolved the cache node")
        # Stop the node right before the step's write-through is sent (after admission's fetch).
        real_after_step = p.tiers.after_step

        def stop_node_then_save(segments):
            node.proc.send_signal(signal.SIGSTOP)
            return real_after_step(segments)

        p.tiers.after_step = stop_node_then_save
        try:
            prefill(p, "r", PROMPTS[0], greedy(), 0)
            p.tiers.after_step = real_after_step
            ids = p.kv.block_ids("r")
            pending = p.prefill.held.pending_consumers("r")
            assert DECODE in pending and any(c.startswith("cache-node:") for c in pending), pending
            p.prefill.release("r", DECODE)
            for _ in range(20):  # the decode side confirmed; the node has not: the blocks stay held
                p.idle_tick()
                time.sleep(0.01)
            assert "r" in p.prefill.held and p.kv.block_ids("r") == ids
            assert all(p.kv.pool.blocks[i].ref_cnt == 1 for i in ids)
            p.check_integrity()
        finally:
            node.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: (p.idle_tick(), "r" not in p.prefill.held)[1], "the cache node's confirmation never released the blocks")
        assert not p.kv.requests and p.tiers.remote.snapshot_stats().stored >= len(PROMPTS[0]) // 4
        p.check_integrity()
        p.close()
    finally:
        node.stop(signal.SIGKILL)
