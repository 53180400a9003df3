"""vLLM's bad_words in the engine (engine/logits_processing.py) on the tiny random Llama: greedy
decoding with banned token sequences equals transformers' greedy loop with the same ban, and a
request without them in the same batch stays token for token transformers' plain greedy."""

from __future__ import annotations

from kvmesh.engine.sampling import SamplingParams
from tests.support.tiny_engine import PROMPTS, greedy, hf_greedy, tiny_engine

MAX_NEW = 10


def test_banned_sequences_steer_greedy_decoding_as_transformers_with_the_same_ban(model_dir, loaded):
    plain = hf_greedy(model_dir, PROMPTS[:2], MAX_NEW)
    ours = plain[0]
    words = [[ours[3], ours[4]], [ours[7]]]  # two tokens greedy generates in a row, and one more

    def ban(out: list[int]) -> list[int]:
        return [w[-1] for w in words if len(w) - 1 <= len(out) and out[len(out) - (len(w) - 1):] == w[:-1]]

    expected = hf_greedy(model_dir, PROMPTS[:1], MAX_NEW, banned=ban)[0]
    assert expected[:4] == ours[:4] and expected[4] != ours[4], "the ban changes the step after its head"
    llm = tiny_engine(model_dir, loaded)
    got = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                                                    bad_words_token_ids=words), greedy(MAX_NEW)])
    assert got[0].token_ids == expected
    assert got[1].token_ids == plain[1]
    assert ours[7] not in got[0].token_ids
