"""Attention, RMSNorm, RoPE and gated delta rule kernels for the kvmesh engine.

Every module pairs a torch reference (``*_ref``, the production CPU path, also the test
oracle) with a Triton kernel (``*_triton``, the CUDA path) of the same signature:

- ``rmsnorm.rms_norm_*(x, weight, eps, residual=None) -> (out, h | None)``: HF LlamaRMSNorm
  numerics; with a residual, ``h = x + residual`` is normalised and returned.
- ``rope.build_cos_sin_cache(head_dim, max_position, base, scaling=None, device=None)``: fp32
  ``[max_position, head_dim]`` table, cos in the first half, sin in the second.
- ``rope.rope_write_kv_*(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
  -> (q_rot, k_rot)``: NeoX-style rotation, rotated k and v stored at their slots.
- ``decode_attention.paged_decode_attention_*(q, k_cache, v_cache, block_tables, seq_lens, scale)``:
  one query per sequence; the Triton version takes ``num_splits`` (split-K).
- ``extend_attention.paged_extend_attention_*(q, k_cache, v_cache, block_tables,
  query_start_loc, seq_lens, scale)``: causal attention for a flat batch of new tokens.
- ``gated_delta.chunked`` / ``recurrent_step`` and ``gated_delta_triton.chunked_triton`` /
  ``recurrent_step_triton``: the gated delta rule of hybrid models (prefill scan with
  checkpoint captures, decode step), chosen as a set by ``gated_delta.gated_delta_kernels``.

``cpu_native.paged_decode_attention_cpu`` has the decode contract too: a C kernel built on
first use that reads K/V straight from the paged cache instead of gathering a padded copy;
the CPU engine uses it for decode and falls back to the reference where it cannot be built.

KV cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's slot
is ``block_id * block_size + offset``. ``seq_lens`` counts the tokens of the current step, whose
K/V are written (by ``rope_write_kv_*``) before attention runs. Query head ``h`` uses kv head
``h // (num_q_heads // num_kv_heads)``.

Triton is imported only when a ``*_triton`` function is first called, so this package works
without Triton, and ``TRITON_INTERPRET=1`` (set before that first call) runs the kernels on CPU.
"""
