"""The fleet's view of each engine's cache stays the engine's: no orphan subscriber, a restart
at the same address resyncs, and an engine hashing another chain is never prefix-matched.

Real: the Fleet with its aiohttp probes against fake engines served over real TCP (fakes.py);
the KV event subscriber is a stub that applies one snapshot (what an idle engine publishes).
"""

from __future__ import annotations

import asyncio

import aiohttp

from kvmesh.engine.kv.events import KVSnapshot
from kvmesh.engine.router.discovery import Fleet, chain_mismatch
from kvmesh.engine.router.prompt import PromptInfo

from kvmesh.engine.util.asgi import ServerThread

from tests.support.fake_http_engine import BLOCK_SIZE, EXTRA, FakeEngine, StubSubscriber

EVENTS = {"endpoint": "tcp://127.0.0.1:1", "replay_endpoint": "tcp://127.0.0.1:2", "topic": "kv"}


def _snap(tokens: list[int], engine_id: str = "e") -> KVSnapshot:
    from kvmesh.engine.block_hash import hash_blocks

    return KVSnapshot(seq=0, engine_id=engine_id, hashes={"gpu": frozenset(hash_blocks(tokens, BLOCK_SIZE, EXTRA))})


def _fleet(session, engines, snapshots):
    def sub(url, info, on_event, on_reset, session):
        snap = snapshots.get(info.get("engine_id"))
        return None if snap is None else StubSubscriber(snap, on_reset)

    return Fleet(session, urls=[e.url for e in engines], subscriber_factory=sub)


def _run(engines, main) -> None:
    """Serve ``engines`` over real TCP while ``main(session)`` runs."""
    threads = [ServerThread(e).start() for e in engines]
    for e, t in zip(engines, threads):
        e.url = t.url

    async def with_session():
        async with aiohttp.ClientSession() as s:
            await main(s)

    try:
        asyncio.run(with_session())
    finally:
        for t in threads:
            t.stop()


async def _synced(fleet):
    assert await fleet.wait_synced(10)


def test_an_engine_restarted_at_the_same_address_is_resynced_from_its_new_snapshot():
    eng = FakeEngine("e", kv_events=EVENTS, engine_id="first")
    prompt = list(range(100, 116))
    snapshots = {"first": _snap(prompt), "second": _snap([])}

    async def main(s):
        fleet = _fleet(s, [eng], snapshots)
        await fleet.refresh_members()
        await fleet.probe_all()
        await _synced(fleet)
        info = PromptInfo(token_ids=prompt)
        assert fleet.prefix_matches(info)[0][eng.url].blocks == 4
        eng.engine_id = "second"  # restarted between probes, with an empty cache
        await fleet.probe_all()
        await fleet.probe_all()
        await _synced(fleet)
        assert fleet.prefix_matches(info)[0][eng.url].blocks == 0
        await fleet.stop()

    _run([eng], main)


def test_an_engine_removed_while_its_probe_waits_leaves_nothing_behind():
    eng = FakeEngine("e", kv_events=EVENTS, kv_info_delay_s=0.5)
    snapshots = {"e": _snap(list(range(100, 116)))}

    async def main(s):
        fleet = _fleet(s, [eng], snapshots)
        fleet.probe_timeout_s = 5
        await fleet.refresh_members()
        state = fleet.engines[eng.url]
        probe = asyncio.create_task(fleet.probe(state))
        await asyncio.sleep(0.2)  # the probe now waits for /kv/info
        await fleet._remove(eng.url)
        await probe
        await asyncio.sleep(0.1)
        assert state.subscriber is None and fleet.index.size() == {}
        await fleet.stop()

    _run([eng], main)


def test_an_engine_with_another_hash_chain_is_never_prefix_matched():
    good, odd = FakeEngine("good"), FakeEngine("odd", hash_function="xxh3-64")

    async def main(s):
        fleet = _fleet(s, [good, odd], {})
        await fleet.refresh_members()
        await fleet.probe_all()
        assert fleet.mismatches() == {odd.url: "hash_function"}
        matches, _ = fleet.prefix_matches(PromptInfo(token_ids=list(range(100, 116))))
        assert set(matches) == {good.url}
        await fleet.stop()

    _run([good, odd], main)


def test_chain_mismatch_names_the_field():
    from kvmesh.engine.block_hash import ROOT_HASH

    assert chain_mismatch({"hash_function": "sha256", "root_hash": ROOT_HASH.hex()}) is None
    assert chain_mismatch({"hash_function": "md5"}) == "hash_function"
    assert chain_mismatch({"root_hash": "00" * 32}) == "root_hash"


def test_an_engine_with_another_tokenizer_is_never_prefix_matched():
    """Another tokenizer (or chat template) gives other ids, so other block hashes: the router
    compares each engine's fingerprint with its own once it has a tokenizer."""
    same, other, silent = (FakeEngine("same", tokenizer="fp-a"), FakeEngine("other", tokenizer="fp-b"),
                           FakeEngine("silent"))

    async def main(s):
        fleet = _fleet(s, [same, other, silent], {})
        await fleet.refresh_members()
        await fleet.probe_all()
        prompt = PromptInfo(token_ids=list(range(100, 116)))
        assert fleet.mismatches() == {} and len(fleet.prefix_matches(prompt)[0]) == 3  # no tokenizer: no check
        fleet.tokenizer = "fp-a"
        assert fleet.mismatches() == {other.url: "tokenizer"}
        assert set(fleet.prefix_matches(prompt)[0]) == {same.url, silent.url}  # silent: reports none
        await fleet.stop()

    _run([same, other, silent], main)
