"""What the recurrent state adds to a hybrid model's prefill -> decode handoff: bytes and copy time.

For transformers' default ``Qwen3_5TextConfig`` (24 gated DeltaNet + 8 attention layers) in
bfloat16, on this machine's CPU (no weights are loaded: only the state pool and a KV cache of the
engine's shapes), interleaved reps of:

- ``gather_state``: one request's slot copied out to the wire, into a fresh buffer and into a
  reused one (the prefill engine gathers it into the tail of the final part's staging buffer),
  and ``scatter_state``: the buffer written into a slot (what the decode engine does at
  admission);
- ``gather_blocks`` of a prompt's KV blocks into a reused buffer (what the prefill engine does
  for the KV), for a prompt of ``--prompt-tokens`` tokens and for the KV of as many bytes as the
  state.

Reports medians (ms), GB/s and the state's share of the handoff's bytes.

    cd /work/wt-hyb-pd && .venv/bin/python bench/hybrid_handoff_state.py --json /tmp/hybrid_handoff_state.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvmesh.engine.kv.gather import gather_blocks
from kvmesh.engine.kv.slot_wire import gather_state, scatter_state, slot_nbytes
from kvmesh.engine.model.config import ModelConfig
from kvmesh.engine.model.recurrent_state import StatePool


def _ms(fn, reps: list[float]) -> None:
    t0 = time.perf_counter()
    fn()
    reps.append((time.perf_counter() - t0) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import Qwen3_5TextConfig

    cfg = ModelConfig.from_hf_config(Qwen3_5TextConfig().to_dict())
    dtype = torch.bfloat16
    pool = StatePool(cfg, 2, dtype, torch.device("cpu"))
    pool.conv.normal_(), pool.ssm.normal_()
    state_bytes = slot_nbytes(pool)
    bs = args.block_size
    layers = cfg.num_kv_layers
    heads, dim = cfg.num_kv_heads, cfg.head_dim
    per_block = layers * 2 * bs * heads * dim * dtype.itemsize
    prompt_blocks = -(-args.prompt_tokens // bs)
    same_blocks = max(1, round(state_bytes / per_block))
    kv = torch.randn(layers, 2, prompt_blocks + 8, bs, heads, dim).to(dtype)
    buf = torch.empty(state_bytes, dtype=torch.uint8)
    kv_out = torch.empty(prompt_blocks, layers, 2, bs, heads, dim, dtype=dtype)
    t = {"gather_state_fresh": [], "gather_state_reused": [], "scatter_state": [], "gather_kv_prompt_reused": [],
         "gather_kv_same_bytes_reused": []}
    for _ in range(args.reps):  # interleaved, so load changes hit every row alike
        _ms(lambda: gather_state(pool, 0), t["gather_state_fresh"])  # a new buffer each time (page faults)
        _ms(lambda: gather_state(pool, 0, buf), t["gather_state_reused"])  # a staging buffer
        _ms(lambda: scatter_state(pool, 1, buf), t["scatter_state"])
        _ms(lambda: gather_blocks(kv, range(prompt_blocks), kv_out), t["gather_kv_prompt_reused"])
        _ms(lambda: gather_blocks(kv, range(same_blocks), kv_out[:same_blocks]), t["gather_kv_same_bytes_reused"])
    med = {k: statistics.median(v) for k, v in t.items()}
    nbytes = {k: state_bytes for k in t} | {"gather_kv_prompt_reused": prompt_blocks * per_block,
                                             "gather_kv_same_bytes_reused": same_blocks * per_block}
    out = {"config": "Qwen3_5TextConfig() bfloat16", "deltanet_layers": len(cfg.linear_layers),
           "attention_layers": layers, "state_bytes": state_bytes, "kv_bytes_per_token": per_block // bs,
           "prompt_tokens": args.prompt_tokens, "state_share_of_handoff":
           round(state_bytes / (state_bytes + prompt_blocks * per_block), 4), "threads": args.threads,
           "reps": args.reps, "median_ms": {k: round(v, 3) for k, v in med.items()},
           "gb_per_s": {k: round(nbytes[k] / med[k] / 1e6, 2) for k in med}}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
