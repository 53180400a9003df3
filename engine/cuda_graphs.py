"""CUDA graph capture and replay of decode-only steps.

A small model is launch-bound at decode time: 30 layers of a dozen kernels each
cost more in launches than in math. We capture one graph per batch size in
`batch_sizes` and replay the smallest one that fits, padding the batch.

Invariants: captured graphs read their inputs from static buffers owned here;
padding rows point at a scratch block that no request ever owns, so their
K/V writes cannot corrupt live blocks; the decode kernel runs with a fixed
split count so nothing in the graph depends on a host-side value.
"""

from __future__ import annotations

import torch

from kvmesh.engine.model.attention import AttnMetadata
from kvmesh.engine.model.llama import LlamaModel


class CudaGraphDecoder:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        block_size: int,
        scratch_block: int,
        max_model_len: int,
        batch_sizes: tuple[int, ...],
    ) -> None:
        dev = model.device
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        maxb = self.batch_sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.max_seq_len = max_model_len
        self.input_ids = torch.zeros(maxb, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(maxb, dtype=torch.int64, device=dev)
        self.slots = torch.full((maxb,), self.scratch_slot, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(maxb, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((maxb, self.max_blocks), scratch_block, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(maxb + 1, dtype=torch.int32, device=dev)
        self.scratch_block = scratch_block
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def _meta(self, b: int) -> AttnMetadata:
        return AttnMetadata(
            positions=self.positions[:b], slot_mapping=self.slots[:b],
            query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], num_decodes=b, max_seq_len=self.max_seq_len,
            max_query_len=1, decode_max_seq_len=self.max_seq_len,
        ).finalize()

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        for b in reversed(self.batch_sizes):  # largest first so smaller graphs reuse its pool
            meta = self._meta(b)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: Triton compiles and autotunes outside capture
                    self.model.forward(self.input_ids[:b], meta, self.kv_cache)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model.forward(self.input_ids[:b], meta, self.kv_cache)
            pool = graph.pool()
            self.graphs[b] = graph
            self.outputs[b] = out
        torch.cuda.synchronize()

    def padded_size(self, n: int) -> int | None:
        for b in self.batch_sizes:
            if b >= n:
                return b
        return None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """Replay the graph for a decode-only batch of n <= max captured size; returns hidden [n, H]."""
        n = input_ids.shape[0]
        b = self.padded_size(n)
        assert b is not None and meta.num_decodes == n
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        w = meta.block_tables.shape[1]
        self.block_tables[:n, :w].copy_(meta.block_tables, non_blocking=True)
        if b > n:  # padding rows: one token at position 0 in the scratch block
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(self.scratch_slot)
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b].fill_(self.scratch_block)
        self.graphs[b].replay()
        return self.outputs[b][:n]
