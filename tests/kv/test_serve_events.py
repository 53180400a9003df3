"""A real `kvmesh serve` process (tiny random model, small KV pool) and subscribers in this process.

The engine runs in another process and evicts constantly; every subscriber must end with exactly
the engine's cache contents: one that joined before the first event (its state is nothing but
the replayed events), a late joiner, and one that loses messages and repairs them by replay.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from kvmesh.engine.block_hash import ROOT_HASH, extra_key
from kvmesh.engine.kv.event_subscriber import KVCacheMirror, KVEventSubscriber
from kvmesh.engine.kv.event_wire import snapshot_from_json
from kvmesh.engine.kv.events import BlockRemoved, KVEventRecord

from tests.support.tiny_models import make_tiny_hf_model
from tests.support.processes import ServerProcess
from kvmesh.engine.util.localproc import free_port_pair

from tests.support.waits import until

pytestmark = pytest.mark.slow  # a real server process: about 15 s

BLOCK = 4
BLOCKS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_hf_model("llama", tmp_path_factory.mktemp("model"))
    port = free_port_pair()
    proc = ServerProcess("--model", str(model), "--dtype", "float32", "--block-size", str(BLOCK),
                         "--num-kv-blocks", str(BLOCKS), "--max-model-len", "96", "--max-num-seqs", "4",
                         "--kv-events-port", str(port))
    proc.start()
    try:
        yield proc, port
    finally:
        proc.stop()


class Follower:
    def __init__(self, info: dict, drop=None) -> None:
        self.mirror = KVCacheMirror()
        self.first_reset_seq: int | None = None
        self.removed = 0
        self.sub = KVEventSubscriber(
            f"tcp://127.0.0.1:{info['kv_events']['port']}", f"tcp://127.0.0.1:{info['kv_events']['replay_port']}",
            "", self.on_event, self.on_reset, retry_s=0.05, drop=drop)
        self.task: asyncio.Future | None = None

    def on_reset(self, snap) -> None:
        if self.first_reset_seq is None:
            self.first_reset_seq = snap.seq
        self.mirror.reset(snap)

    def on_event(self, engine_id: str, rec: KVEventRecord) -> None:
        self.removed += isinstance(rec.event, BlockRemoved)
        self.mirror.on_event(engine_id, rec)

    async def start(self, snapshot_url: str) -> None:
        self.sub.snapshot_url = snapshot_url
        self.task = asyncio.ensure_future(self.sub.run())
        await asyncio.wait_for(self.sub.synced.wait(), 30)

    async def stop(self) -> None:
        await self.sub.stop()
        await self.task


async def _workload(client: httpx.AsyncClient, rng: random.Random, n: int) -> None:
    prefixes = [[rng.randrange(3, 1000) for _ in range(12)] for _ in range(4)]
    sem = asyncio.Semaphore(6)

    async def one() -> None:
        prompt = rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randrange(0, 24))]
        body = {"prompt": prompt, "max_tokens": rng.randrange(1, 8), "temperature": 0, "ignore_eos": True}
        async with sem:
            r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text

    await asyncio.gather(*(one() for _ in range(n)))


def test_subscribers_reproduce_the_engine_cache(server):
    proc, port = server
    info = httpx.get(proc.url("/kv/info")).json()
    assert info["kv_events"] == {"port": port, "replay_port": port + 1, "topic": f"kv-events/{info['engine_id']}",
                                 "format": "kvmesh"}
    assert info["root_hash"] == ROOT_HASH.hex() and info["block_size"] == BLOCK
    assert extra_key(info["model"], info["dtype"], info["lora"], info["cache_salt"]).hex() == info["extra_key"]

    async def main() -> None:
        rng = random.Random(0)
        dropping = True
        early = Follower(info)
        lossy = Follower(info, drop=lambda seq: dropping and seq % 5 == 0)
        late = Follower(info)
        async with httpx.AsyncClient(base_url=proc.base_url, timeout=60) as client:
            await early.start(proc.url("/kv/snapshot"))
            await lossy.start(proc.url("/kv/snapshot"))
            await _workload(client, rng, 30)
            await late.start(proc.url("/kv/snapshot"))
            await _workload(client, rng, 30)
            dropping = False
            # A fresh prompt stores a block, so a loss at the very end is noticed and repaired.
            await _workload(client, random.Random(99), 1)
            snap = snapshot_from_json((await client.get("/kv/snapshot")).json())
        followers = (early, lossy, late)
        try:
            for f in followers:
                await until(lambda f=f: f.sub.last_seq >= snap.seq, timeout=20, what="subscriber at snapshot seq")
        finally:
            for f in followers:
                await f.stop()
        for f in followers:
            assert f.mirror.seq == snap.seq and f.mirror.same_contents(snap)
        assert early.first_reset_seq == 0 and early.sub.stats.resyncs == 1  # built from events alone
        assert early.removed > 0  # the workload evicted
        assert late.first_reset_seq > 0
        assert lossy.sub.stats.dropped > 0 and lossy.sub.stats.replays > 0
        assert snap.hashes["gpu"] and len(snap.hashes["gpu"]) <= BLOCKS

    asyncio.run(main())
