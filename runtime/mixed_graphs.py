"""Whole-forward CUDA graphs of prefill and mixed steps, attention included (vLLM's cudagraph_mode FULL).

The piecewise graphs (runtime/piecewise_graphs.py) leave each layer's attention out, because the
prefill kernel took its grid from the step's query lengths on the host: a 32-layer step still
launches 32 attentions from Python (~100 µs of host time each), which is most of a short prompt's
time to first token once the GEMMs are quick (W4A16, FP8: RESULTS.md session 33). Here the
attention reads its sequences from device buffers instead (kernels.attention.PrefillIndex), in a
grid fixed by the captured token count, so the whole forward of a step is one graph.

A graph of `size` tokens serves any step of n <= size tokens in at most `max_seqs` sequences:
  - every sequence, decode rows too, goes through the prefill kernel: its blocks of queries
    (attention.prefill_blocks) are listed in block_seqs / block_starts, and the rest of the
    max_prefill_blocks(size, max_seqs) programs point at the padding sequence (no query, no key);
  - token rows n..size-1 are padding: their K/V goes to the scratch block, no block covers them, so
    their attention output is what the buffer held (finite), and their outputs are dropped.
The prefill kernel does not split a sequence's keys across programs as the decode kernel does, so a
decode row with a long context would take one program per KV head through all of it: steps whose
longest context exceeds MAX_CONTEXT run eagerly instead (FULL captures no piecewise graphs, as vLLM's
FULL has none).

NOTE (buffers): what the host sets per step is in static buffers: token ids, positions, slots,
context lengths and block-table rows (device-to-device copies of the step's own buffers), and the
index (query lengths, first rows, the blocks: one int32 host-to-device copy). The graphs share the
decode graphs' memory pool, captured after them, largest size first.

Not used by tensor/pipeline-parallel ranks, with cpu_offload_gb, nor on a CPU (where `run` runs the
same forward eagerly: tests).
"""

from __future__ import annotations

import itertools
import logging
import time

import torch
from torch import Tensor

from llmc.kernels.attention import PrefillIndex, max_prefill_blocks, prefill_blocks, prefill_queries_per_block
from llmc.runtime import memory
from llmc.runtime.cuda_graphs import aux_buffer
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.models.decoder import DecoderModel

logger = logging.getLogger("llmc")

MAX_CONTEXT = memory.WHOLE_GRAPH_MAX_CONTEXT  # longest context a step may have to replay these graphs (docstring)


def index_values(query_lens: list[int], max_seqs: int, top_blocks: int, queries_per_block: int) -> list[int]:
    """The flat int32 PrefillIndex of a step's sequences (their rows packed from 0) in graphs of at most max_seqs
    sequences and top_blocks query blocks: query_lens | first_rows, each padded with 0 to max_seqs + 1 sequences
    (the last the padding sequence: no query, context 0) | block_seqs | block_starts, the blocks past the step's the
    padding sequence's (index_views reads it). No sequence: every block the padding sequence's."""
    blocks = prefill_blocks(query_lens, queries_per_block)
    pad, unused = max_seqs + 1 - len(query_lens), top_blocks - len(blocks)
    first_rows = list(itertools.accumulate(query_lens[:-1], initial=0))[: len(query_lens)]
    return [*query_lens, *[0] * pad, *first_rows, *[0] * pad, *(seq for seq, _ in blocks), *[max_seqs] * unused,
            *(start for _, start in blocks), *[0] * unused]


def index_views(index: Tensor, max_seqs: int, top_blocks: int, blocks: int, queries_per_block: int,
                out: Tensor) -> PrefillIndex:
    """The PrefillIndex of a graph of `blocks` query blocks over the flat `index` index_values lays out (max_seqs + 1
    sequences, top_blocks blocks), its attention written to `out`."""
    seqs = max_seqs + 1
    return PrefillIndex(query_lens=index[:seqs], first_rows=index[seqs : 2 * seqs],
                        block_seqs=index[2 * seqs : 2 * seqs + blocks],
                        block_starts=index[2 * seqs + top_blocks : 2 * seqs + top_blocks + blocks],
                        queries_per_block=queries_per_block, out=out)


class MixedGraphs:
    """The whole-forward graphs of prefill and mixed steps of one single-rank model runner."""

    def __init__(self, model: DecoderModel, sizes: list[int], max_seqs: int, max_model_len: int, block_size: int,
                 scratch_block: int, device: torch.device):
        self.model = model
        self.sizes = sorted(sizes)
        top = self.sizes[-1]
        self.max_seqs = min(max_seqs, top)
        self.max_context_len = min(max_model_len, MAX_CONTEXT)
        self.device = device
        self.num_replays = 0
        self._free_before = 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            self._free_before = torch.cuda.mem_get_info(device)[0]
        attn = model.kv_attentions()[0]
        dtype = getattr(torch, model.config.dtype)
        self.queries_per_block = prefill_queries_per_block(attn.num_heads // attn.num_kv_heads)
        self.num_blocks = {size: max_prefill_blocks(size, self.max_seqs, self.queries_per_block) for size in self.sizes}
        self.scratch_slot = scratch_block * block_size
        num_seqs = self.max_seqs + 1  # the last: the padding sequence, context 0 (never written)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((num_seqs, -(-max_model_len // block_size)), scratch_block, dtype=torch.int32,
                                       device=device)
        self.context_lens = torch.zeros(num_seqs, dtype=torch.int32, device=device)
        # query_lens | first_rows | block_seqs | block_starts, int32, set by one copy per step
        self._index = torch.tensor(index_values([], self.max_seqs, self.num_blocks[top], self.queries_per_block),
                                   dtype=torch.int32, device=device)
        self.attn = torch.zeros(top, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(top, model.config.hidden_size, dtype=dtype, device=device)
        self.aux = aux_buffer(model, top, device)  # an EAGLE head's inputs, when the model keeps them
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds, self.graph_bytes = 0.0, 0

    def batch(self, size: int) -> ForwardBatch:
        """The ForwardBatch every step of `size` captured tokens runs with: views of the buffers."""
        prefill_index = index_views(self._index, self.max_seqs, self.num_blocks[self.sizes[-1]], self.num_blocks[size],
                                    self.queries_per_block, self.attn[:size])
        return ForwardBatch(
            positions=self.positions[:size], slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables,
            context_lens=self.context_lens, query_lens=[size], max_context_len=self.max_context_len,
            logits_indices=self.positions[:0], prefill_index=prefill_index,
        )

    def forward(self, size: int) -> None:
        """The captured forward: the final hidden states of `size` tokens into `hidden`."""
        self.hidden[:size].copy_(self.model(self.input_ids[:size], self.batch(size)))
        if self.aux is not None:
            self.aux[:size].copy_(self.model.aux_hidden)

    @torch.inference_mode()
    def capture(self, pool=None, stream: torch.cuda.Stream | None = None) -> None:
        """Every size's graph, largest first, into `pool` on `stream` (the decode graphs', when given)."""
        start = time.perf_counter()
        with torch.cuda.device(self.device):
            stream = stream or torch.cuda.Stream(self.device)
            for size in reversed(self.sizes):
                self.forward(size)  # warm-up: compiles this size's kernels, sets up cuBLAS
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    self.forward(size)
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        torch.cuda.empty_cache()
        self.graph_bytes = self._free_before - torch.cuda.mem_get_info(self.device)[0]

    def log_capture(self, allowance: int) -> None:
        logger.info("CUDA graphs of whole prefill and mixed steps: %d token counts (%s), up to %d sequences and "
                    "%d-token contexts, in %.1f s, %.1f MiB (allowance %.1f MiB)", len(self.sizes),
                    ", ".join(map(str, self.sizes)), self.max_seqs, self.max_context_len, self.capture_seconds,
                    self.graph_bytes / memory.MIB, allowance / memory.MIB)
        memory.warn_over_allowance("CUDA graphs of whole prefill and mixed steps", self.graph_bytes, allowance,
                                   "set compilation_config.max_cudagraph_capture_size lower")

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.num_tokens <= self.sizes[-1] and batch.num_seqs <= self.max_seqs
                and batch.max_context_len <= self.max_context_len
                and batch.block_tables.shape[1] <= self.block_tables.shape[1])

    def load(self, input_ids: Tensor, batch: ForwardBatch) -> int:
        """Copy the step into the buffers (rows n..size-1 padding); returns size, the captured
        token count that holds its n tokens."""
        n, num_seqs = batch.num_tokens, batch.num_seqs
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:size].fill_(self.scratch_slot)
        self.context_lens[:num_seqs].copy_(batch.context_lens)
        self.block_tables[:num_seqs, : batch.block_tables.shape[1]].copy_(batch.block_tables)
        values = index_values(batch.query_lens, self.max_seqs, self.num_blocks[self.sizes[-1]], self.queries_per_block)
        host = torch.tensor(values, dtype=torch.int32)
        self._index.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)
        return size

    def run(self, input_ids: Tensor, batch: ForwardBatch) -> Tensor:
        """The final hidden states [num_tokens, hidden_size] of the step, by replaying the graph of
        the next size up (on a CPU, the same forward eagerly). A view of the static buffer: use it
        before the next step."""
        size = self.load(input_ids, batch)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                self.graphs[size].replay()
        else:
            with torch.inference_mode():
                self.forward(size)
        self.num_replays += 1
        if self.aux is not None:
            self.model.aux_hidden = self.aux[: batch.num_tokens]
        return self.hidden[: batch.num_tokens]
