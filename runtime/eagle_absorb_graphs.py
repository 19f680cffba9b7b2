"""EAGLE's `absorb` of a decode verify step as one function over static buffers, captured as CUDA graphs.

After each step's sampling `absorb` runs one head forward over the rows whose next token is now known
(runtime/spec_eagle.py): eagerly ~30 small kernels, ~1.8 ms of host time a verify step on an 8B-shaped head with the
GPU waiting (benchmarks/RESULTS.md, session 47). A decode verify step (every request's last chunk: one real token and
at most k drafts, no prefill chunk) gives each request at most k + 1 rows, so its head forward fits a fixed shape:
B requests padded to a captured size b, b * (k + 1) rows (`absorb_rows`), captured once per decode-graph size.

NOTE (rows): the live rows, a request's real position and its accepted drafts' (`after` in absorb: the tokens after
them are known), are packed first, in the eager absorb's order: request i's L_i rows at positions s_i .. s_i + L_i - 1
(s_i its computed tokens before the step), written at their slots through its block table, its attention one
sequence of L_i queries over s_i + L_i keys (the PrefillIndex of runtime/mixed_graphs.py: the prefill kernel reads the
sequences from device buffers, in a grid the size fixes). So the live rows are the eager forward's flat batch, row for
row. The other rows, b * (k + 1) - sum(L_i), are dead: a rejected draft's row, a row past a request's drafts (max_tokens
or the token budget gave it fewer than k), the padding requests'. A dead row writes its K/V to the head cache's scratch
slot (block num_blocks, which no request holds) and belongs to no sequence: no attention program reads or writes
for it (its output row keeps what the buffer held, finite), and its outputs are dropped.
Why that is exactly the eager absorb's cache: a later step (a fill, an absorb, a prefill) reads a request's slots
below its context, and each such slot is either (a) a live row's, written here with the eager absorb's K/V (same
token, hidden state, position and slot; the same values up to the rounding of matmuls over more rows), (b) written
before this step and not by the eager absorb either (earlier positions), or (c) a rejected or unreserved draft
position, which the eager absorb does not write and the next fill rewrites before any step attends to it (its
first head step sits at the request's new N - 1, and each step writes its own slot before it attends). A dead row
that wrote its own position's slot would change (c) (harmless) or, past the slots the scheduler reserved, a block
the request does not hold (another request's): hence the scratch slot. The scratch slot's contents are read only
by padding rows and dead steps of the draft graphs (runtime/eagle_graphs.py), whose outputs are dropped.

NOTE (inputs and outputs): the model's kept hidden states (DecoderModel.aux_hidden, a static buffer of the graph the
verify step replayed, or an eager step's tensor) are gathered into this buffer's rows on the device by a loaded row
index (one index_select before the replay: the source's address changes with the path the step took). Each request's
kept row (its last live row) is gathered on the device: its greedy draft and output hidden state go to static
outputs; the host reads the drafts with one .tolist() and takes a device copy of the hidden states (the next replay
overwrites the buffer; `_HeadState` keeps a view of the copy).

NOTE (capture): as the draft graphs' (runtime/eagle_graphs.py NOTE (capture)): after the model's graphs, for their
batch sizes, largest first, in their pool and on their capture stream, each size warmed up eagerly first. Only where
the runner captured decode graphs; a step with a prefill chunk, more requests than the largest size, a block table
wider than max_model_len's, or a context longer than MAX_CONTEXT (the whole-forward graphs' bound: the prefill kernel
does not split a sequence's keys across programs as the decode kernel does, so one program per KV head would walk a
long context alone) runs the eager absorb. The memory plan holds back `memory.absorb_graph_allowance_bytes`.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from llmc.kernels.attention import max_prefill_blocks, prefill_queries_per_block
from llmc.runtime import memory
from llmc.runtime.cuda_graphs import padded_batch_size
from llmc.runtime.eagle_graphs import HeadGraphs
from llmc.runtime.eagle_head import EagleHead
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.mixed_graphs import index_views, index_values

logger = logging.getLogger("llmc")

MAX_CONTEXT = memory.WHOLE_GRAPH_MAX_CONTEXT  # longest context a step may have to replay these graphs (NOTE (capture))

# A request's rows: (block ids, computed tokens s before the step, the tokens after its live rows' positions, its
# first row in the step's aux_hidden)
AbsorbRow = tuple[list[int], int, list[int], int]


class AbsorbInputs:
    """The buffers, for the largest batch size `top` and k + 1 rows a request, every row dead at first: per row token
    ids, positions, slots and aux_hidden rows (aux_index; `aux` the gathered rows); per sequence (top + 1, the last the
    padding sequence: no query, context 0) block tables and context lengths; the PrefillIndex's int32 index (query
    lens | first rows | block sequences | block starts); per request its kept row, draft and hidden state."""

    def __init__(self, head: EagleHead, max_batch_size: int, k: int, aux_width: int, aux_dtype: torch.dtype,
                 max_num_blocks: int, scratch_block: int, block_size: int, device: torch.device):
        config, dtype = head.config, head.kv_cache[0].dtype
        self.rows_per_request, self.block_size, self.top = k + 1, block_size, max_batch_size
        self.scratch_slot = scratch_block * block_size
        rows, seqs = max_batch_size * (k + 1), max_batch_size + 1
        self.queries_per_block = prefill_queries_per_block(config.num_heads // config.num_kv_heads)
        self.top_blocks = max_prefill_blocks(rows, max_batch_size, self.queries_per_block)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), self.scratch_slot, dtype=torch.long, device=device)
        self.aux_index = torch.zeros(rows, dtype=torch.long, device=device)
        self.aux = torch.zeros(rows, aux_width, dtype=aux_dtype, device=device)
        self.attn = torch.zeros(rows, config.num_heads, config.head_dim, dtype=dtype, device=device)
        self.block_tables = torch.full((seqs, max_num_blocks), scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        self.index = torch.tensor(index_values([], max_batch_size, self.top_blocks, self.queries_per_block),
                                  dtype=torch.int32, device=device)
        self.keep = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.drafts = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.hidden = torch.zeros(max_batch_size, config.hidden_size, dtype=dtype, device=device)

    def batch(self, batch_size: int) -> ForwardBatch:
        """The head forward's ForwardBatch of batch_size requests' rows: views of the buffers."""
        rows = batch_size * self.rows_per_request
        index = index_views(self.index, self.top, self.top_blocks,
                            max_prefill_blocks(rows, batch_size, self.queries_per_block), self.queries_per_block,
                            self.attn[:rows])
        return ForwardBatch(positions=self.positions[:rows], slot_mapping=self.slot_mapping[:rows],
                            block_tables=self.block_tables, context_lens=self.context_lens, query_lens=[rows],
                            max_context_len=self.block_tables.shape[1] * self.block_size,
                            logits_indices=self.positions[:0], prefill_index=index)

    def load(self, rows: list[AbsorbRow], batch_size: int) -> None:
        """The requests' live rows packed first, the rest of batch_size * (k + 1) rows dead (NOTE (rows)); request i
        is sequence i, its kept row its last live row. One host-to-device copy."""
        bs, n, total = self.block_size, len(rows), batch_size * self.rows_per_request
        ids, positions, slots, aux_rows, keep = [], [], [], [], []
        for block_ids, start, after, first in rows:
            for j, token in enumerate(after):
                p = start + j
                ids.append(token)
                positions.append(p)
                slots.append(block_ids[p // bs] * bs + p % bs)
                aux_rows.append(first + j)
            keep.append(len(ids) - 1)
        dead = total - len(ids)
        width = max(len(block_ids) for block_ids, _, _, _ in rows)
        tables = [b for block_ids, _, _, _ in rows for b in block_ids + [0] * (width - len(block_ids))]
        contexts = [start + len(after) for _, start, after, _ in rows]
        index = index_values([len(after) for _, _, after, _ in rows], self.top, self.top_blocks, self.queries_per_block)
        flat = torch.tensor(ids + [0] * dead + positions + [0] * dead + slots + [self.scratch_slot] * dead + aux_rows
                            + [0] * dead + keep + contexts + tables + index, dtype=torch.long)
        parts = flat.to(self.input_ids.device, non_blocking=True).split(
            [total] * 4 + [n, n, len(tables), len(index)])
        for buffer, part in zip((self.input_ids, self.positions, self.slot_mapping, self.aux_index), parts):
            buffer[:total].copy_(part)
        self.keep[:n].copy_(parts[4])
        self.context_lens[:n].copy_(parts[5])
        self.block_tables[:n, :width].copy_(parts[6].view(n, width))
        self.index.copy_(parts[7])


def absorb_rows(head: EagleHead, inputs: AbsorbInputs, batch_size: int) -> None:
    """The graphs' body: the head forward over batch_size * (k + 1) rows (their gathered aux rows), each request's kept
    row's greedy draft and output hidden state written to inputs.drafts and inputs.hidden."""
    rows = batch_size * inputs.rows_per_request
    out = head(inputs.input_ids[:rows], head.combine(inputs.aux[:rows]), inputs.batch(batch_size))
    kept = out[inputs.keep[:batch_size]]
    inputs.hidden[:batch_size].copy_(kept)
    inputs.drafts[:batch_size].copy_(head.greedy_tokens(kept))


class EagleAbsorbGraphs(HeadGraphs):
    """The decode verify steps' absorb for batch sizes `batch_sizes` and num_speculative_tokens k (HeadGraphs: graphs
    on a GPU, in the model's graphs' pool and stream)."""

    def __init__(self, head: EagleHead, batch_sizes: list[int], k: int, aux_width: int, aux_dtype: torch.dtype,
                 max_model_len: int, block_size: int, scratch_block: int, device: torch.device, pool=None,
                 stream: torch.cuda.Stream | None = None):
        self.k = k
        self.max_context_len = min(max_model_len, MAX_CONTEXT)
        super().__init__(batch_sizes, device, lambda rows: AbsorbInputs(
            head, rows, k, aux_width, aux_dtype, -(-max_model_len // block_size), scratch_block, block_size, device),
            lambda batch_size: absorb_rows(head, self.inputs, batch_size), pool, stream)

    def log_capture(self, allowance_bytes: int) -> None:
        logger.info("CUDA graphs: EAGLE's absorb of decode verify steps (%d rows a request) captured for %d batch "
                    "sizes in %.1f s, %.1f MiB of GPU memory (allowance %.1f MiB)", self.k + 1, len(self.batch_sizes),
                    self.capture_seconds, self.graph_bytes / memory.MIB, allowance_bytes / memory.MIB)
        memory.warn_over_allowance("EAGLE's absorb graphs", self.graph_bytes, allowance_bytes, "set enforce_eager")

    def can_run(self, aux: Tensor, rows: list[AbsorbRow]) -> bool:
        """The buffers hold these requests' rows over `aux`: at most the largest size of requests, k + 1 rows each,
        block tables at most max_model_len's wide, contexts at most MAX_CONTEXT, aux rows of the buffer's width and
        dtype."""
        return (0 < len(rows) <= self.batch_sizes[-1] and aux.shape[1:] == self.inputs.aux.shape[1:]
                and aux.dtype == self.inputs.aux.dtype
                and all(len(after) <= self.k + 1 and len(block_ids) <= self.inputs.block_tables.shape[1]
                        and start + len(after) <= self.max_context_len for block_ids, start, after, _ in rows))

    def run(self, aux: Tensor, rows: list[AbsorbRow]) -> tuple[list[int], Tensor]:
        """(each request's first draft, its kept hidden states [n, hidden_size]: a copy, not the buffer) of n
        requests' rows over `aux` (the step's aux_hidden)."""
        batch_size = padded_batch_size(self.batch_sizes, len(rows))
        inputs, total = self.inputs, batch_size * self.inputs.rows_per_request
        inputs.load(rows, batch_size)
        torch.index_select(aux, 0, inputs.aux_index[:total], out=inputs.aux[:total])
        self.launch(batch_size)
        hidden = inputs.hidden[: len(rows)].clone()
        return inputs.drafts[: len(rows)].tolist(), hidden
