"""Per-step attention metadata and the backend that runs paged attention.

The flat batch is laid out decodes first: sequences [0, num_decodes) contribute
exactly one query token each (tokens [0, num_decodes)), the remaining sequences
contribute prefill chunks of any length. Backends rely on that order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvmesh.engine.dtype_choice import cpu_flags


@dataclass
class AttnMetadata:
    """Tensors describing one forward pass over the paged KV cache.

    Invariants: len(positions) == len(slot_mapping) == query_start_loc[-1];
    seq_lens[i] counts the context of sequence i including this step's tokens,
    whose K/V are written before attention reads them.
    """

    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    num_decodes: int
    max_seq_len: int
    max_query_len: int
    # Derived once per step so the 30-odd layers don't each slice/sync.
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    decode_max_seq_len: int = 0

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def finalize(self) -> "AttnMetadata":
        nd = self.num_decodes
        self.decode_seq_lens = self.seq_lens[:nd]
        self.decode_block_tables = self.block_tables[:nd]
        if nd < self.num_seqs:
            qsl = self.query_start_loc[nd:]
            self.prefill_query_start_loc = qsl - qsl[0]
            self.prefill_seq_lens = self.seq_lens[nd:]
            self.prefill_block_tables = self.block_tables[nd:]
        return self


class AttentionBackend:
    """Chooses between the Triton kernels (CUDA) and their torch references (CPU).

    Both implement the same contract (engine/kernels/__init__.py); the engine
    picks one at start-up and every layer uses it. On CPU, attention and the bf16 and
    fp32 elementwise ops run the native C kernels (`native_cpu`; each falls back to its
    torch reference where it cannot be built or does not apply), except bf16 prefill
    attention on CPUs with AMX-BF16, where torch's SDPA is the faster. Host-side lengths
    from the metadata are passed down so no kernel reads sequence lengths back from
    the device (which would also break CUDA graph capture).
    """

    def __init__(self, name: str, native_cpu: bool = True) -> None:
        if name not in ("torch", "triton"):
            raise ValueError(f"unknown attention backend {name!r}")
        self.name = name
        from kvmesh.engine.kernels import activation, decode_attention, extend_attention, rmsnorm, rope

        self.silu_mul = activation.silu_mul_ref
        self._decode_step = None  # fused RoPE + KV write + decode attention, where there is one
        if name == "triton":
            self.rms_norm = rmsnorm.rms_norm_triton
            self.rope_write_kv = rope.rope_write_kv_triton
            self._decode = decode_attention.paged_decode_attention_triton
            self._extend = extend_attention.paged_extend_attention_triton
        elif native_cpu:
            from kvmesh.engine.kernels import cpu_native as nat

            self.rms_norm = nat.rms_norm_cpu
            self.rope_write_kv = nat.rope_write_kv_cpu
            self.silu_mul = nat.silu_mul_cpu
            self._decode_step = nat.decode_step_cpu
            self._decode = nat.paged_decode_attention_cpu
            self._extend = nat.paged_extend_attention_cpu
            if nat.sdpa_beats_native_bf16_extend(cpu_flags()):
                self._extend = functools.partial(nat.paged_extend_attention_cpu, bf16_sdpa=True)
        else:
            self.rms_norm = rmsnorm.rms_norm_ref
            self.rope_write_kv = rope.rope_write_kv_ref
            self._decode = decode_attention.paged_decode_attention_ref
            self._extend = extend_attention.paged_extend_attention_ref

    def qkv_attention(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        meta: AttnMetadata,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Fused q|k|v projection rows [T, (Hq + 2 Hkv) D] -> attention output [T, Hq D].

        Optional per-head RMSNorm of q and k (qk_norm = (q_weight, k_weight, eps), as in
        Qwen3), RoPE on q and k, k and v written to the cache at meta.slot_mapping, then
        paged attention. Decode-only steps without qk_norm run it as one native call
        where the backend has one.
        """
        t = qkv.shape[0]
        d = k_cache.shape[-1]
        qd, kvd = num_heads * d, num_kv_heads * d
        if self._decode_step is not None and qk_norm is None and meta.num_decodes == meta.num_seqs:
            out = self._decode_step(qkv, num_heads, meta.positions, cos_sin, meta.slot_mapping, k_cache, v_cache,
                                    meta.decode_block_tables, meta.decode_seq_lens, scale)
            if out is not None:
                return out
        q = qkv[:, :qd].view(t, num_heads, d)
        k = qkv[:, qd:qd + kvd].view(t, num_kv_heads, d)
        v = qkv[:, qd + kvd:].view(t, num_kv_heads, d)
        if qk_norm is not None:
            q_weight, k_weight, eps = qk_norm
            q, _ = self.rms_norm(q, q_weight, eps)
            k, _ = self.rms_norm(k, k_weight, eps)
        q, _ = self.rope_write_kv(q, k, v, meta.positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
        return self.attention(q, k_cache, v_cache, meta, scale).reshape(t, qd)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, Hq, D] with decodes first; returns [T, Hq, D]."""
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return self._decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                                max_seq_len=meta.decode_max_seq_len)
        if nd == 0:
            return self._extend(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                max_query_len=meta.max_query_len,
            )
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                                max_seq_len=meta.decode_max_seq_len)
        out[nd:] = self._extend(
            q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
            meta.prefill_seq_lens, scale, max_query_len=meta.max_query_len,
        )
        return out
