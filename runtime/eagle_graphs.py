"""EAGLE's draft steps (`EagleProposer.fill`) as one function over static buffers, captured as CUDA graphs.

Before each verify step `fill` runs k - 1 one-row head steps per request (runtime/spec_eagle.py), each ~30 small
kernels: eagerly, ~1 ms of host time a step on an 8B-shaped head (benchmarks/RESULTS.md, session 46). Here the
k - 1 steps of a batch of B requests are one body (`draft_steps`) over buffers padded to B rows, captured once per
decode-graph batch size and replayed, so one launch does them all.

NOTE (rows): row i of step s (1 .. k - 1) is request i's head step at position N - 2 + s (N its tokens), reading
draft s - 1 and the previous step's output hidden state, writing its K/V at that position's slot and draft s into
drafts[i, s]. Every row computes every step; only a request's first n drafts are kept (n = its num_drafts this step,
which max_tokens and the token budget may cut below k). Its steps s >= n are dead: they are not given their
position's slot, since the scheduler reserved the verify step's slots only through position N - 1 + n, and a dead
step's position may lie past them, in a block the request does not hold. Dead steps and padding rows (i >= the
batch) run as the decode graphs' padding rows (runtime/cuda_graphs.py NOTE (padding)): K/V written to the head
cache's scratch slot (its block `num_blocks`, which no request holds), context length 1. A padding row's block
table row starts with the scratch block, so it attends to that slot, which it wrote; a dead step of a real row
attends to its request's position 0, which `absorb` wrote with its first chunk. So the head cache's writes are
exactly the eager fill's, and the graph's kept drafts are the eager fill's. The absorb of a decode verify step that
follows (runtime/eagle_absorb_graphs.py) rewrites the verified positions with the model's hidden states and leaves
the rejected ones as this fill wrote them (as the eager absorb does); its dead rows write the same scratch slot.

NOTE (capture): after the model's graphs, for their batch sizes (largest first, in their memory pool and on their
capture stream), each size run once eagerly first (Triton compiles its launches), the attention bounded by
max_model_len as the decode graphs'. Captured only where the runner has decode graphs (a CUDA device, not
enforce_eager, a cudagraph_mode with full decode graphs: FULL_AND_PIECEWISE, FULL_DECODE_ONLY, FULL); a batch
above the largest size, or a block table wider than max_model_len's, runs the eager fill. The memory plan holds
back `memory.draft_graph_allowance_bytes` for them (spec_eagle.eagle_memory_reserve). The absorb graphs
(runtime/eagle_absorb_graphs.py) are captured right after these, for the same sizes, in the same pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor

from llmc.runtime import memory
from llmc.runtime.cuda_graphs import padded_batch_size
from llmc.runtime.eagle_head import EagleHead
from llmc.runtime.forward_batch import ForwardBatch

logger = logging.getLogger("llmc")


class DraftInputs:
    """The draft steps' buffers, rows for the largest batch size, every row a padding row at first. drafts [rows, k]:
    column 0 the first drafts (loaded), columns 1 .. k - 1 what the steps write; per step [k - 1, rows] positions,
    slots and context lengths; hidden [rows, hidden_size] the kept hidden states; block_tables [rows, width]."""

    def __init__(self, max_batch_size: int, k: int, max_num_blocks: int, scratch_block: int, block_size: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.k, self.block_size, self.device = k, block_size, device
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        rows, steps = max_batch_size, k - 1
        self.drafts = torch.zeros(rows, k, dtype=torch.long, device=device)
        self.hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(steps, rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((steps, rows), self.scratch_slot, dtype=torch.long, device=device)
        self.context_lens = torch.ones(steps, rows, dtype=torch.int32, device=device)
        self.block_tables = torch.full((rows, max_num_blocks), scratch_block, dtype=torch.int32, device=device)
        self.no_logits = torch.empty(0, dtype=torch.long, device=device)

    def load(self, first_drafts: list[int], hidden: list[Tensor], rows: list[tuple[list[int], int, int]],
             batch_size: int) -> None:
        """Rows 0 .. n - 1 from the requests' (block ids, tokens N, num_drafts) (NOTE (rows)); rows n .. batch_size
        - 1 become padding rows (an earlier, larger batch may have left a request there)."""
        n, bs, scratch = len(rows), self.block_size, self.scratch_slot
        positions, slots, contexts = [], [], []
        for step in range(1, self.k):
            for block_ids, num_tokens, num_drafts in rows:
                p = num_tokens - 2 + step
                live = step < num_drafts
                positions.append(p if live else 0)
                slots.append(block_ids[p // bs] * bs + p % bs if live else scratch)
                contexts.append(p + 1 if live else 1)
        width = max(len(block_ids) for block_ids, _, _ in rows)
        tables = [b for block_ids, _, _ in rows for b in block_ids + [0] * (width - len(block_ids))]
        # one host-to-device copy (pageable memory is staged before the call returns: no wait for the device)
        flat = torch.tensor(first_drafts + positions + slots + contexts + tables, dtype=torch.long)
        first, positions, slots, contexts, tables = flat.to(self.device, non_blocking=True).split(
            [n, len(positions), len(slots), len(contexts), len(tables)])
        self.drafts[:n, 0].copy_(first)
        torch.stack(hidden, out=self.hidden[:n])
        self.positions[:, :n].copy_(positions.view(-1, n))
        self.slot_mapping[:, :n].copy_(slots.view(-1, n))
        self.context_lens[:, :n].copy_(contexts.view(-1, n))
        self.block_tables[:n, :width].copy_(tables.view(n, width))
        self.slot_mapping[:, n:batch_size].fill_(scratch)
        self.context_lens[:, n:batch_size].fill_(1)
        self.block_tables[n:batch_size, 0].fill_(self.scratch_block)

    def step_batch(self, step: int, batch_size: int, max_context_len: int) -> ForwardBatch:
        """Step `step`'s (1 .. k - 1) ForwardBatch of the first batch_size rows: views of the buffers."""
        return ForwardBatch(
            positions=self.positions[step - 1, :batch_size],
            slot_mapping=self.slot_mapping[step - 1, :batch_size],
            block_tables=self.block_tables[:batch_size],
            context_lens=self.context_lens[step - 1, :batch_size],
            query_lens=[1] * batch_size,
            max_context_len=max_context_len,
            logits_indices=self.no_logits,
        )


class HeadGraphs:
    """What the draft and absorb graphs share: static buffers (`make_inputs(largest batch size)`) and one CUDA graph of
    `body(batch size)` per size on a GPU, captured largest first, each run once eagerly before (Triton compiles its
    launches), in `pool` (the first graph's where None) on `stream`: the model's graphs' pool and capture stream; on a
    CPU the body runs eagerly over the same buffers (tests: what a replay computes from its padded inputs).
    graph_bytes: what the buffers, the pool's growth and the graphs took."""

    def __init__(self, batch_sizes: list[int], device: torch.device, make_inputs: Callable[[int], object],
                 body: Callable[[int], None], pool=None, stream: torch.cuda.Stream | None = None):
        self.batch_sizes, self.device, self.body = sorted(batch_sizes), device, body
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0] if cuda else 0
        self.inputs = make_inputs(self.batch_sizes[-1])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch size -> graph (none on a CPU)
        self.num_replays = 0  # runs (replayed, or the body run eagerly on a CPU)
        self.graph_bytes, self.capture_seconds = 0, 0.0
        if cuda:
            self._capture(pool, stream)
            torch.cuda.empty_cache()  # the warm-up runs' intermediates are not graph memory
            self.graph_bytes = free_before - torch.cuda.mem_get_info(device)[0]

    @torch.inference_mode()
    def _capture(self, pool, stream: torch.cuda.Stream | None) -> None:
        start = time.perf_counter()
        with torch.cuda.device(self.device):
            stream = stream if stream is not None else torch.cuda.Stream(self.device)
            for batch_size in reversed(self.batch_sizes):
                self.body(batch_size)  # warm-up
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    self.body(batch_size)
                pool = pool if pool is not None else graph.pool()
                self.graphs[batch_size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start

    def launch(self, batch_size: int) -> None:
        """The body over the loaded buffers' first batch_size rows: its graph replayed, or run eagerly on a CPU."""
        if self.graphs:
            with torch.cuda.device(self.device):
                self.graphs[batch_size].replay()
        else:
            self.body(batch_size)
        self.num_replays += 1


def draft_steps(head: EagleHead, inputs: DraftInputs, batch_size: int, max_context_len: int) -> None:
    """The graphs' body: the k - 1 head steps of the first batch_size rows, drafts written to inputs.drafts[:, 1:]."""
    hidden = inputs.hidden[:batch_size]
    for step in range(1, inputs.k):
        batch = inputs.step_batch(step, batch_size, max_context_len)
        hidden = head(inputs.drafts[:batch_size, step - 1], hidden, batch)
        inputs.drafts[:batch_size, step] = head.greedy_tokens(hidden)


class EagleFillGraphs(HeadGraphs):
    """The draft steps of batch sizes `batch_sizes` for num_speculative_tokens k (HeadGraphs: graphs on a GPU, in the
    model's graphs' pool and stream)."""

    def __init__(self, head: EagleHead, batch_sizes: list[int], k: int, max_model_len: int, block_size: int,
                 scratch_block: int, device: torch.device, pool=None, stream: torch.cuda.Stream | None = None):
        super().__init__(batch_sizes, device, lambda rows: DraftInputs(
            rows, k, -(-max_model_len // block_size), scratch_block, block_size, head.config.hidden_size,
            head.kv_cache[0].dtype, device),
            lambda batch_size: draft_steps(head, self.inputs, batch_size, max_model_len), pool, stream)

    def log_capture(self, allowance_bytes: int) -> None:
        logger.info("CUDA graphs: EAGLE's %d draft steps captured for %d batch sizes in %.1f s, %.1f MiB of GPU memory "
                    "(allowance %.1f MiB)", self.inputs.k - 1, len(self.batch_sizes), self.capture_seconds,
                    self.graph_bytes / memory.MIB, allowance_bytes / memory.MIB)
        memory.warn_over_allowance("EAGLE's draft graphs", self.graph_bytes, allowance_bytes, "set enforce_eager")

    def can_run(self, num_rows: int, width: int) -> bool:
        """A batch of num_rows requests whose block tables are `width` blocks wide fits the buffers."""
        return num_rows <= self.batch_sizes[-1] and width <= self.inputs.block_tables.shape[1]

    def run(self, first_drafts: list[int], hidden: list[Tensor], rows: list[tuple[list[int], int, int]]) -> Tensor:
        """The drafts [n, k] of n requests ((block ids, tokens N, num_drafts) each, its first draft and kept hidden
        state): a view of the buffer, valid until the next run; row i's first num_drafts are its drafts."""
        batch_size = padded_batch_size(self.batch_sizes, len(rows))
        self.inputs.load(first_drafts, hidden, rows, batch_size)
        self.launch(batch_size)
        return self.inputs.drafts[: len(rows)]
