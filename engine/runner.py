"""Batch tensors -> model -> sampler.

The runner owns the KV cache tensor and turns a SchedulerOutput into one flat
forward pass. Input preparation works per sequence and per block, never per
token: positions and slot mappings are built with tensor ops.
"""

from __future__ import annotations

import torch

from kvmesh.engine.cuda_graphs import CudaGraphDecoder
from kvmesh.engine.kv.hybrid_state import StepStatePlan
from kvmesh.engine.logits_processing import LogitsProcessor
from kvmesh.engine.prompt_logprobs import prompt_logprob_rows
from kvmesh.engine.structured.masking import GrammarMasks
from kvmesh.engine.model.attention import AttnMetadata
from kvmesh.engine.model.llama import LlamaModel
from kvmesh.engine.model.qwen3_5 import Qwen35Model
from kvmesh.engine.model.recurrent_state import StateBatch, StatePool
from kvmesh.engine.sampler import SampleResult, sample
from kvmesh.engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaModel | Qwen35Model, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 seed: int = 0, eos_token_ids: tuple[int, ...] = (), num_state_slots: int = 0,
                 num_state_checkpoints: int = 0) -> None:
        c = model.config
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # [layers, K/V, blocks, block_size, kv_heads, head_dim]; empty, not zeros: unwritten
        # slots are never read (attention stops at seq_len). One extra block at index
        # num_blocks is scratch space for CUDA-graph padding rows; no request owns it.
        # Only attention layers have KV (all layers, except in hybrid models).
        self.kv_cache = torch.empty(
            (c.num_kv_layers, 2, num_blocks + 1, block_size, c.num_kv_heads, c.head_dim),
            dtype=kv_dtype, device=self.device,
        )
        # Hybrid models: one slot of DeltaNet state per running request (slots assigned by the
        # scheduler's StateSlots; the slot count is its capacity).
        self.states = StatePool(c, num_state_slots, kv_dtype, self.device, num_state_checkpoints) if c.is_hybrid else None
        self.graphs: CudaGraphDecoder | None = None
        # Noise for requests without a seed of their own: one engine-wide stream, so the same
        # requests submitted in the same order sample the same tokens.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.logits_processor = LogitsProcessor(c.vocab_size, eos_token_ids, self.device)
        self.grammar_masks = GrammarMasks(c.vocab_size)

    def capture_cuda_graphs(self, batch_sizes: tuple[int, ...], max_model_len: int) -> None:
        """Capture decode graphs (CUDA only); later decode-only steps that fit replay them."""
        if self.device.type != "cuda" or not batch_sizes:
            return
        self.graphs = CudaGraphDecoder(self.model, self.kv_cache, self.block_size, self.num_blocks,
                                       max_model_len, batch_sizes)

    def prepare(self, out: SchedulerOutput, block_ids: list[list[int]]) -> tuple[torch.Tensor, AttnMetadata]:
        """Build input ids and attention metadata for the scheduled sequences (decodes first)."""
        bs = self.block_size
        dev = self.device
        input_ids: list[int] = []
        q_lens: list[int] = []
        starts: list[int] = []
        for s in out.seqs:
            c, n = s.num_computed_tokens, s.num_new_tokens
            input_ids.extend(s.request.all_token_ids[c:c + n])
            q_lens.append(n)
            starts.append(c)
        max_blocks = max(len(b) for b in block_ids)
        # One tensor from padded rows (0 is a valid block id; attention stops at seq_len).
        table = torch.tensor([b + [0] * (max_blocks - len(b)) for b in block_ids], dtype=torch.int32)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        starts_t = torch.tensor(starts, dtype=torch.int64)
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=cu[1:])
        t = int(cu[-1])
        seq_idx = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)
        positions = starts_t[seq_idx] + (torch.arange(t) - cu[:-1][seq_idx])
        slots = table[seq_idx, positions // bs].to(torch.int64) * bs + positions % bs
        for i, s in enumerate(out.seqs):
            if s.num_cached_new:  # KV already cached (a shared block): its write lands in the scratch block
                lo = int(cu[i])
                slots[lo:lo + s.num_cached_new] = self.num_blocks * bs + positions[lo:lo + s.num_cached_new] % bs
        seq_lens = (starts_t + q_lens_t).to(torch.int32)
        nd = out.num_decodes
        seq_lens_list = [c + n for c, n in zip(starts, q_lens)]
        meta = AttnMetadata(
            positions=positions.to(dev, non_blocking=True),
            slot_mapping=slots.to(dev, non_blocking=True),
            query_start_loc=cu.to(torch.int32).to(dev, non_blocking=True),
            seq_lens=seq_lens.to(dev, non_blocking=True),
            block_tables=table.to(dev, non_blocking=True),
            num_decodes=out.num_decodes,
            max_seq_len=max(seq_lens_list),
            max_query_len=max(q_lens),
            decode_max_seq_len=max(seq_lens_list[:nd], default=0),
        ).finalize()
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
        return ids, meta

    def state_batch(self, out: SchedulerOutput, plan: StepStatePlan | None) -> StateBatch | None:
        """Restore the plan's checkpoints into their slots and return the step's recurrent-state
        view (hybrid models); None for attention-only models."""
        if self.states is None:
            return None
        if plan is None or len(plan.slots) != len(out.seqs):
            raise ValueError("a hybrid model's step needs one state slot per scheduled sequence")
        for entry, slot in plan.restores:
            self.states.restore(entry, slot)
        return StateBatch(self.states, list(plan.slots), [s.num_computed_tokens > 0 for s in out.seqs],
                          [s.num_new_tokens for s in out.seqs], out.num_decodes,
                          captures=plan.captures or None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_ids: list[list[int]],
                state_plan: StepStatePlan | None = None) -> SampleResult | None:
        """Run one forward; sample for the sequences whose chunk ends at their last known token.

        ``state_plan``: hybrid models only, the sequences' slots, restores and checkpoint captures.
        Returns tokens in the order of [s for s in out.seqs if s.produces_token].
        """
        ids, meta = self.prepare(out, block_ids)
        extra = {} if self.states is None else {"state": self.state_batch(out, state_plan)}
        producing = [i for i, s in enumerate(out.seqs) if s.produces_token]
        reqs = [out.seqs[i].request for i in producing]
        masks = self.grammar_masks
        # Grammar masks depend only on tokens already sampled: computed while the model runs.
        pending = masks.start(reqs) if masks.needed(reqs) else None
        # Rows that produce a token: the last of each such sequence's chunk.
        last = meta.query_start_loc[1:].to(torch.int64) - 1
        if len(producing) < len(out.seqs):
            last = last[torch.tensor(producing, dtype=torch.int64, device=last.device)]
        g = self.graphs
        wanted = prompt_logprob_rows(out, meta.query_start_loc)
        if wanted is not None:  # prompt rows too: kept after the sampling rows
            hidden = self.model.forward(ids, meta, self.kv_cache, keep=torch.cat([last, wanted.rows.to(last.device)]),
                                        **extra)
            wanted.record(self.model, hidden[len(producing):])
            hidden = hidden[:len(producing)]
        elif g is not None and out.num_decodes == len(out.seqs) and g.padded_size(len(out.seqs)):
            hidden = g.run(ids, meta)[last]
        elif len(producing) == ids.shape[0]:  # decode-only step: every row is kept, in order
            hidden = self.model.forward(ids, meta, self.kv_cache, **extra)
        else:
            hidden = self.model.forward(ids, meta, self.kv_cache, keep=last, **extra)
        if not producing:
            return None
        logits = self.model.compute_logits(hidden)
        proc = self.logits_processor
        raw = None
        controls = proc.needed(reqs)
        if pending is not None and not controls:
            # Grammar alone: masked in the model's dtype (the -inf it writes and the logits it keeps
            # upcast exactly, so the sampler picks what the fp32 path picked), and in place unless
            # logprobs need the unmasked logits.
            if any(r.params.logprobs is not None for r in reqs):
                raw = logits
                logits = logits.clone()
            masks.apply(logits, pending, raw, False)
        elif pending is not None or controls:
            raw = logits
            logits = logits.float()
            if logits is raw:  # already fp32: the raw logits stay for logprobs
                logits = logits.clone()
            if controls:
                proc.apply(logits, reqs)
            if pending is not None:
                masks.apply(logits, pending, raw, controls)
        result = sample(logits, [r.params for r in reqs], [r.generator for r in reqs], self.generator,
                        raw_logits=raw)
        proc.record(reqs, result.token_ids)
        if pending is not None:
            masks.advance(reqs, result.token_ids)
        return result
