"""Prefill -> decode handoff between two real engines in one process, without the network.

Real: both engines (a tiny random Llama, fp32), their KV managers, the handoff state on each side
and the bytes moved (gathered on prefill, scattered on decode). Not here: the UCX link and the
HTTP servers (tests/server/test_disagg_servers.py). The reference is transformers' unpaged
greedy forward, so a wrong block, offset or first token shows up as a token difference.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from kvmesh.engine.block_hash import chain_root
from kvmesh.engine.disagg.decode_side import transfer_key
from kvmesh.engine.disagg.errors import NoRoom, TooLarge, TransferMismatch, UnknownTransfer
from kvmesh.engine.disagg.prefill_side import DECODE
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.roles import DecodeClaim, PrefillHandoff

from tests.support.handoff import handoff_once, prefill
from tests.support.tiny_engine import BS, MAX_NEW, OTHER, PROMPTS, greedy, hf_greedy, tiny_engine

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reference(model_dir):  # noqa: F811
    return hf_greedy(model_dir, PROMPTS)



def test_disaggregated_greedy_equals_transformers(model_dir, loaded, reference):  # noqa: F811
    p = tiny_engine(model_dir, loaded, num_kv_blocks=64, max_num_batched_tokens=16).engine  # chunked prefill
    d = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    for i, prompt in enumerate(PROMPTS):
        res, h, toks = handoff_once(p, d, i, prompt, greedy())
        assert toks == reference[i], f"prompt {i}"
        # PROMPTS share a 40-token prefix: from the second on, decode already caches 10 blocks
        # and prefill sends only the rest (prefill too serves them from its own cache).
        if i:
            assert res.hit_blocks == 10 and h.start == 10 and h.first.cached_tokens == 40
    for e in (p, d):
        e.check_integrity()
        assert not e.kv.requests, e.kv.requests  # nothing held, nothing reserved
        assert len(e.prefill) == 0 and len(e.decode) == 0


def test_a_salted_handoff_shares_blocks_only_with_its_salt(model_dir, loaded, reference):  # noqa: F811
    """The decode engine reserves under the request's salted root (the Reserve message carries it):
    no hits on another tenant's blocks, exact tokens, and a claim under another salt is refused."""
    p = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    d = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    handoff_once(p, d, 0, PROMPTS[0], greedy())  # the shared 40-token prefix, unsalted, on both
    res, h, toks = handoff_once(p, d, 1, PROMPTS[1], greedy(), cache_salt="tenant-a")
    assert toks == reference[1]
    assert res.hit_blocks == 0 and h.start == 0 and h.first.cached_tokens == 0
    res, h, toks = handoff_once(p, d, 2, PROMPTS[2], greedy(), cache_salt="tenant-a")
    assert toks == reference[2] and res.hit_blocks == 10 and h.first.cached_tokens == 40
    fut = d.decode.reserve("m", PROMPTS[0], MAX_NEW, root=chain_root("tenant-a"))
    d.idle_tick()
    hp = prefill(p, "pm", PROMPTS[0], greedy(), fut.result(0).hit_blocks, "tenant-a")
    d.decode.check_push("m", hp.start, hp.hashes, True)
    d.decode.fill("m", hp.start, hp.data, True, hp.first)
    d.idle_tick()
    claimed: Future = Future()
    d.add_request("x", PROMPTS[0], greedy(), handoff=DecodeClaim("m", claimed), cache_salt="tenant-b")
    d.idle_tick()
    with pytest.raises(TransferMismatch, match="cache_salt"):
        claimed.result(0)
    d.decode.cancel("m")
    p.prefill.release("pm", DECODE)
    p.idle_tick()
    d.idle_tick()
    for e in (p, d):
        e.check_integrity()
        assert not e.kv.requests, e.kv.requests


def test_prefill_holds_blocks_until_decode_confirms(model_dir, loaded):  # noqa: F811
    p = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    h = prefill(p, "r", PROMPTS[0], greedy(), 0)
    ids = p.kv.block_ids("r")
    assert len(ids) == -(-len(PROMPTS[0]) // BS) and all(p.kv.pool.blocks[i].ref_cnt == 1 for i in ids)
    p.idle_tick()
    p.check_integrity()
    assert "r" in p.prefill.held and h.data.shape[0] == len(ids)
    p.prefill.release("r", "someone-else")  # unknown consumers change nothing
    p.idle_tick()
    assert p.kv.block_ids("r") == ids
    p.prefill.release("r", DECODE)
    p.idle_tick()
    assert "r" not in p.prefill.held and not p.kv.requests
    p.check_integrity()


def test_held_blocks_and_reservations_expire(model_dir, loaded, monkeypatch):  # noqa: F811
    p = tiny_engine(model_dir, loaded, num_kv_blocks=64, kv_transfer_timeout=0.05).engine
    d = tiny_engine(model_dir, loaded, num_kv_blocks=64, kv_transfer_timeout=0.05).engine
    prefill(p, "r", PROMPTS[0], greedy(), 0)
    d.decode.reserve("t", PROMPTS[0], MAX_NEW)
    d.idle_tick()
    assert d.kv.block_ids(transfer_key("t"))
    import time

    time.sleep(0.1)
    p.idle_tick()
    d.idle_tick()
    assert not p.kv.requests and not d.kv.requests
    assert p.stats().kv_transfer_timeouts == 1 and d.stats().kv_transfer_timeouts == 1
    p.check_integrity()
    d.check_integrity()


def test_decode_refuses_what_it_cannot_hold(model_dir, loaded):  # noqa: F811
    d = tiny_engine(model_dir, loaded, num_kv_blocks=16).engine
    big = d.decode.reserve("big", PROMPTS[0], 64 * BS)
    d.idle_tick()
    with pytest.raises(TooLarge):
        big.result(0)
    first = d.decode.reserve("a", PROMPTS[0], 8)  # 45 + 7 tokens: 13 of 16 blocks
    second = d.decode.reserve("b", PROMPTS[1], 8)
    d.idle_tick()
    assert first.result(0).num_blocks == 13
    with pytest.raises(NoRoom):
        second.result(0)
    d.check_integrity()
    d.decode.cancel("a")
    d.idle_tick()
    assert d.kv.num_free_blocks == 16 and not d.kv.requests


def test_decode_checks_pushes_and_claims(model_dir, loaded):  # noqa: F811
    p = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    d = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    d.decode.reserve("t", PROMPTS[0], MAX_NEW)
    d.idle_tick()
    h = prefill(p, "r", PROMPTS[0], greedy(), 0)
    bad = list(h.hashes)
    bad[3] = b"\0" * 32
    for args in ((h.start, bad, True), (h.start + 1, h.hashes[1:], True), (h.start, h.hashes[:-1], True)):
        f = d.decode.check_push("t", *args)
        d.idle_tick()
        with pytest.raises(TransferMismatch):
            f.result(0)

    early: Future = Future()
    d.add_request("x", PROMPTS[0], greedy(), handoff=DecodeClaim("t", early))  # not complete yet
    outs = d.idle_tick()
    with pytest.raises(UnknownTransfer):
        early.result(0)
    assert [o.finish_reason for o in outs] == ["abort"]
    d.decode.fill("t", h.start, h.data, True, h.first)
    d.idle_tick()
    other: Future = Future()
    d.add_request("y", PROMPTS[1], greedy(), handoff=DecodeClaim("t", other))
    d.idle_tick()
    with pytest.raises(TransferMismatch):
        other.result(0)
    d.decode.drop_owner(None)  # complete transfers survive their connection
    d.idle_tick()
    assert len(d.decode.transfers) == 1
    d.decode.cancel("t")
    d.idle_tick()
    assert not d.kv.requests
    d.check_integrity()


def test_seeded_sampling_continues_the_same_random_stream(model_dir, loaded):  # noqa: F811
    params = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, seed=1234, ignore_eos=True)
    colocated = tiny_engine(model_dir, loaded, num_kv_blocks=64)
    want = colocated.generate([PROMPTS[2]], params)[0].token_ids
    p = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    d = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    _, _, toks = handoff_once(p, d, 0, PROMPTS[2], params)
    assert toks == want


def test_streamed_handoff_sends_blocks_as_chunks_complete(model_dir, loaded, reference):  # noqa: F811
    """With a streamed PrefillHandoff the prefill engine outputs each step's completed prompt blocks as a part
    (in order, before the first token); the decode engine fills them as they come and the tokens
    are the same as with one push."""

    from tests.support.handoff import _run_until

    p = tiny_engine(model_dir, loaded, num_kv_blocks=64, max_num_batched_tokens=8).engine  # 2 blocks a step
    d = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    prompt = PROMPTS[1]  # 46 tokens: 12 blocks, the last one partial
    d.decode.reserve("s", prompt, MAX_NEW)
    d.idle_tick()
    p.add_request("r", prompt, greedy(), handoff=PrefillHandoff(0, stream=True))
    outs = _run_until(p, lambda o: any(x.finished for x in o))
    parts = [o.handoff for o in outs if o.handoff is not None]
    assert [o.finished for o in outs if o.handoff is not None] == [False] * (len(parts) - 1) + [True]
    assert [h.start for h in parts] == [0, 2, 4, 6, 8, 10] and parts[-1].hashes[-1] is None
    assert all(h.first is None for h in parts[:-1]) and parts[-1].first is not None
    for h in parts:
        f = d.decode.check_push("s", h.start, h.hashes, h.first is not None)
        d.idle_tick()
        f.result(0)
        fill = d.decode.fill("s", h.start, h.data, h.first is not None, h.first)
        d.idle_tick()
        fill.result(0)
    claimed: Future = Future()
    d.add_request("x", prompt, greedy(), handoff=DecodeClaim("s", claimed))
    outs = _run_until(d, lambda o: any(x.finished for x in o))
    assert [t for o in outs for t in o.new_token_ids] == reference[1]
    p.prefill.release("r", DECODE)
    p.idle_tick()
    for e in (p, d):
        e.check_integrity()
        assert not e.kv.requests


def test_reservations_cover_max_tokens_up_to_the_cap(model_dir, loaded, reference):  # noqa: F811
    """A large max_tokens (e.g. a chat request without one) reserves prompt + the cap; past the cap
    the request allocates as it grows, and its tokens do not change."""
    d = tiny_engine(model_dir, loaded, num_kv_blocks=64, kv_transfer_reserve_tokens=3).engine
    p = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    res, _, toks = handoff_once(p, d, 0, PROMPTS[0], greedy())  # 45 prompt tokens, 8 new
    assert res.num_blocks == -(-(45 + 3) // BS)  # not -(-(45 + 7) // BS)
    assert toks == reference[0]
    d.check_integrity()
    assert not d.kv.requests


def test_a_step_thread_call_that_raises_fails_alone(model_dir, loaded, reference):  # noqa: F811
    """A reservation that raises something other than a refusal (here a token id the block hash
    cannot encode, as an unchecked message would bring) once escaped the step and stopped the
    engine; now it fails its own future, leaves nothing reserved, and the next handoff is exact."""
    p = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    d = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    fut = d.decode.reserve("bad", [5, -1, *PROMPTS[0][:40]], 4)
    d.idle_tick()
    assert isinstance(fut.exception(0), ValueError)
    assert not d.kv.requests and len(d.decode.transfers) == 0
    d.check_integrity()
    _, _, toks = handoff_once(p, d, 0, PROMPTS[0], greedy())
    assert toks == reference[0]


def test_a_reservation_that_evicts_saves_the_old_bytes_before_the_push_lands(model_dir, loaded):  # noqa: F811
    """An idle decode engine with a host tier: the reservation (an idle tick) evicts cached blocks,
    whose copy to the host tier is queued; the pushed KV is then written (another idle tick) into
    those same blocks. The copy must take the old bytes: a later plain request that reloads the
    evicted prefix from the host tier is compared with transformers."""
    other = OTHER[0]
    ref_other, ref_prompt = hf_greedy(model_dir, [other, PROMPTS[0]])
    p = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    llm = tiny_engine(model_dir, loaded, num_kv_blocks=16, cpu_kv_bytes=1 << 20)
    d = llm.engine
    assert llm.generate([other], greedy())[0].token_ids == ref_other  # 12 blocks cached, then free
    _, _, toks = handoff_once(p, d, 0, PROMPTS[0], greedy())  # reserving 14 of 16 evicts most of them
    assert toks == ref_prompt
    stored = d.tiers.host.stats.stored
    assert stored > 0, "the reservation evicted nothing into the host tier: the test lost its point"
    again = llm.generate([other], greedy())[0]
    assert d.tiers.host.stats.promotions > 0  # the evicted prefix came back from the host tier
    assert again.token_ids == ref_other
    d.check_integrity()


def test_a_transfer_belongs_to_the_connection_of_its_last_message_and_pushes_extend_it(model_dir, loaded):  # noqa: F811
    """Two regressions of one failed handoff spreading to others: a reservation was owned by the
    connection that made it, so a pooled connection dropped for another transfer freed it; and
    its deadline ran from the reservation, so a prefill longer than the transfer timeout lost it
    mid-stream though its parts kept arriving."""
    from kvmesh.engine.block_hash import hash_blocks

    d = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    tr = d.decode.transfers
    prompt = PROMPTS[0]
    hashes = hash_blocks(prompt, BS, d.kv.extra)
    conn_a, conn_b = object(), object()
    r = tr.reserve("t", prompt, MAX_NEW, now=0.0, owner=conn_a)
    assert r.deadline == tr.transfer_timeout_s
    tr.check_push("t", 0, hashes[:2], False, now=25.0, owner=conn_b)  # the next part, on another connection
    assert r.deadline == 25.0 + tr.transfer_timeout_s
    assert tr.drop_owner(conn_a) == [] and len(tr) == 1  # conn_a dropped: not this transfer's carrier
    assert tr.expire(now=tr.transfer_timeout_s + 1) == [] and len(tr) == 1  # still within the extension
    assert tr.drop_owner(conn_b) == ["t"] and len(tr) == 0
    assert not d.kv.requests
    d.check_integrity()


def test_a_constrained_request_continues_its_grammar_on_the_decode_engine(model_dir, loaded):  # noqa: F811
    """The prefill engine samples the first token under the grammar; the decode engine's matcher
    consumes that token first, so the handed-off answer is the colocated engine's, valid JSON."""
    import json

    from kvmesh.engine.structured.grammar import StructuredOutput

    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "maximum": 99}},
              "required": ["k", "n"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutput.json_schema(schema, "x"))
    alone = tiny_engine(model_dir, loaded, num_kv_blocks=64)
    want = alone.generate([PROMPTS[0]], params)[0]
    p = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    d = tiny_engine(model_dir, loaded, num_kv_blocks=64).engine
    _, _, toks = handoff_once(p, d, 0, PROMPTS[0], params)
    assert toks == want.token_ids and want.finish_reason == "stop"
    doc = json.loads(d.tokenizer.decode(toks))
    assert set(doc) == {"k", "n"} and doc["k"] in ("a", "b")
