"""Per-request cache salts: tenants never share or probe each other's cached prefixes.

Real: the engine (tiny random Llama, fp32, paged KV with prefix caching, a CPU host tier), its KV
manager and the router's prompt hashing; the reference is transformers' greedy forward.
"""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvmesh.engine.block_hash import ROOT_HASH, chain_root, hash_blocks
from kvmesh.engine.kv.kv_manager import KVCacheManager
from kvmesh.engine.router.prompt import PromptInfo

from tests.support.tiny_engine import BS, PROMPTS, greedy, hf_greedy, tiny_engine


def _run(engine, rid: str, prompt: list[int], salt: str | None) -> tuple[list[int], int]:
    engine.add_request(rid, prompt, greedy(), cache_salt=salt)
    tokens, cached = [], -1
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                cached = out.num_cached_tokens
    return tokens, cached


def test_the_salted_root_is_the_documented_encoding():
    assert chain_root(None) == chain_root("") == ROOT_HASH
    raw = "tenant-a".encode()
    want = hashlib.sha256(ROOT_HASH + b"kvmesh-salt-v1" + b"\x01" + struct.pack("<I", len(raw)) + raw).digest()
    assert chain_root("tenant-a") == want != chain_root("tenant-b")


def test_requests_share_cached_blocks_only_under_the_same_salt(model_dir, loaded):
    engine = tiny_engine(model_dir, loaded, num_kv_blocks=64, cpu_kv_bytes=1 << 20).engine
    prompt = PROMPTS[0]
    [want] = hf_greedy(model_dir, [prompt])
    full = (len(prompt) - 1) // BS * BS
    runs = [("a1", "tenant-a", 0), ("b1", "tenant-b", 0), ("n1", None, 0),
            ("a2", "tenant-a", full), ("b2", "tenant-b", full), ("n2", None, full)]
    for rid, salt, cached in runs:
        tokens, got = _run(engine, rid, prompt, salt)
        assert tokens == want, rid  # the salt changes what is shared, never what is computed
        assert got == cached, rid
    engine.check_integrity()


def test_the_router_hashes_a_salted_prompt_as_the_engine_does():
    """Both sides of the contract: the router's PromptInfo and the engine's KV manager."""
    extra = b"kvmesh-extra-v1-test"
    kv = KVCacheManager(64, BS, True, extra)
    tokens = PROMPTS[1]
    n = len(tokens) // BS
    for salt in (None, "tenant-a"):
        engine_chain = kv.extend_chain(f"r-{salt}", tokens, n, chain_root(salt))
        assert PromptInfo(token_ids=tokens, cache_salt=salt).hashes(BS, extra) == engine_chain
    assert not set(kv.chain("r-None")) & set(kv.chain("r-tenant-a"))
    assert hash_blocks(tokens, BS, extra) == kv.chain("r-None")


@pytest.mark.parametrize("salt", ["", "x" * 257])
def test_an_empty_or_huge_salt_is_refused_naming_the_field(salt):
    import pydantic

    from kvmesh.engine.api.protocol import CompletionRequest

    with pytest.raises(pydantic.ValidationError, match="cache_salt"):
        CompletionRequest(prompt="hi", cache_salt=salt)
