"""OnnxRunner: the engine's Runner over an ONNX artifact, run by onnxruntime's CPU execution provider.

NOTE (algorithm): every running sequence owns a KV slot, its persistent-batch row (`Request.batch_row`), (a row of each layer's
[num_slots, kv_heads, max_model_len, head_dim] buffer, runtime/onnx_model.py). A step runs:
  - all single-token chunks (decodes) in one call over the slot range they span, slots in between
    idle (query length 0: GroupQueryAttention leaves them alone);
  - each longer chunk (prefill, or a decode with speculative drafts) in a call of its own.
GroupQueryAttention reads the slot's cached rows and writes the new ones in place (past and present
are bound to the same buffer). A slot's length follows the scheduler: a chunk starting at 0 starts
the sequence afresh (new, a new owner of the row, or preempted and recomputed), one starting before
the length drops the rejected draft rows.

A pooling (embedding) step binds the graph's hidden_states output (the final norm's outputs of every position)
and no logits rows, and runs chunks of like lengths in one call, right-padded (`_pool_calls`); its requests'
slots are their rows, freed when their prompts complete, as generation's are when they finish.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import Tensor

from llmc.errors import ConfigError
from llmc.runtime import artifact as art
from llmc.runtime import onnx_model as om
from llmc.runtime.pooling import is_pooling
from llmc.runtime.runner import StepLogits
from llmc.runtime.scheduler import ScheduledBatch
from llmc.runtime.step_inputs import PendingTokens

logger = logging.getLogger("llmc")


def _import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise ConfigError("this artifact is an ONNX model and needs the onnxruntime package: "
                          "pip install onnxruntime") from None
    return onnxruntime


def num_threads() -> int:
    """The machine's cores available to this process, unless OMP_NUM_THREADS says fewer."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = os.environ.get("OMP_NUM_THREADS", "")
    return min(cores, int(limit)) if limit.isdigit() and int(limit) > 0 else cores


@dataclass
class _Chunk:
    """One request's tokens of a call and the rows of them whose logits the step returns."""

    slot: int
    start: int  # position of the first token (the slot's length before the call)
    token_ids: list[int]
    rows: list[int] = field(default_factory=list)  # indices into token_ids


# a pooling call's rows (its slot range times its longest chunk), at most: measured best on 2 cores, ref-llama-12m
# (64 prompts of 16-128 tokens: 1.1-2.2x the tokens/s of one call per chunk; 768 rows was slower again)
MAX_POOL_CALL_ROWS = 512
MAX_CACHED_BINDINGS = 16  # call shapes kept bound: a steady decode, a few prefill chunk lengths


class _Call:
    """One call shape's io binding: input arrays and the logits array allocated once and bound as
    OrtValues over their memory, and each layer's K/V slot range bound as both past and present
    (GroupQueryAttention writes the new rows in place). A call fills the arrays and runs. With
    `hidden_size` (a pooling call), the hidden_states output [batch * seq, hidden_size] is bound too."""

    def __init__(self, session, ort, kv: list[tuple[np.ndarray, np.ndarray]], batch_size: int, seq_len: int,
                 rows: int, vocab_size: int, hidden_size: int | None = None):
        self.input_ids = np.zeros((batch_size, seq_len), np.int64)
        self.query_lens = np.zeros(batch_size, np.int32)
        self.seqlens_k = np.zeros(batch_size, np.int32)
        self.total = np.zeros((), np.int32)
        self.indices = np.zeros(rows, np.int64)
        self.logits = np.zeros((rows, vocab_size), np.float32)
        self.binding = session.io_binding()
        as_value = ort.OrtValue.ortvalue_from_numpy
        self._values = [as_value(a) for a in (self.input_ids, self.query_lens, self.seqlens_k, self.total,
                                              self.indices, self.logits)]  # they must outlive the binding
        for name, value in zip((om.INPUT_IDS, om.QUERY_SEQLENS, om.SEQLENS_K, om.TOTAL_SEQUENCE_LENGTH,
                                om.LOGITS_INDICES), self._values):
            self.binding.bind_ortvalue_input(name, value)
        self.binding.bind_ortvalue_output(om.LOGITS, self._values[-1])
        if hidden_size is not None:
            self.hidden = np.zeros((batch_size * seq_len, hidden_size), np.float32)
            self._values.append(as_value(self.hidden))
            self.binding.bind_ortvalue_output(om.HIDDEN_STATES, self._values[-1])
        for layer, (k, v) in enumerate(kv):
            for past, present, buffer in zip(om.past_names(layer), om.present_names(layer), (k, v)):
                value = as_value(buffer)  # a view of the runner's KV buffer: written in place
                self._values.append(value)
                self.binding.bind_ortvalue_input(past, value)
                self.binding.bind_ortvalue_output(present, value)

    def reset(self, lengths: list[int]) -> None:
        """Every slot of the range idle (no query tokens) at its current length."""
        self.input_ids.fill(0)
        self.query_lens.fill(0)
        for b, length in enumerate(lengths):
            self.seqlens_k[b] = max(length, 1) - 1


class OnnxRunner:
    """The `Runner` (runtime/runner.py) of an ONNX artifact: one onnxruntime session, a KV slot per
    persistent-batch row. Synchronous: onnxruntime returns when the step is computed."""

    can_overlap = False

    def __init__(self, artifact_dir: Path, manifest: art.Manifest, options: art.RuntimeDefaults, device: torch.device):
        ort = _import_onnxruntime()
        if device.type != "cpu":
            logger.info("ONNX artifact: runs on onnxruntime's CPU execution provider, not on %s", device)
        self.device = torch.device("cpu")
        model = manifest.model
        art.verify_for_load(artifact_dir, manifest, [om.MODEL_PATH, str(Path(om.MODEL_PATH).parent / om.DATA_NAME)])
        # (a classifier's graph gives num_labels logits: its `score` head)
        self.num_layers, self.vocab_size, self.hidden_size = model.num_layers, om.logits_width(model), model.hidden_size
        self._model_path = Path(artifact_dir) / om.MODEL_PATH
        self._classifier: Tensor | None = None  # [num_labels, hidden_size]: read from the graph when first used
        self.capacity = options.max_model_len
        self.num_slots = min(options.max_num_seqs, om.num_kv_slots(model, options))
        blocks_per_seq = -(-options.max_model_len // options.block_size)
        self.num_blocks = self.num_slots * blocks_per_seq  # the scheduler's token budget; no paging here
        shape = (self.num_slots + 1, model.num_kv_heads, self.capacity, model.head_dim)  # + score()'s slot
        self.kv = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(self.num_layers)]
        self.lengths = [0] * (self.num_slots + 1)
        self._ort = ort
        self._calls: dict[tuple[int, int, int, int, bool], _Call] = {}  # io bindings by call shape, oldest first
        self.session = ort.InferenceSession(str(Path(artifact_dir) / om.MODEL_PATH), self._session_options(ort),
                                            providers=["CPUExecutionProvider"])
        if is_pooling(options, model) and om.HIDDEN_STATES not in {o.name for o in self.session.get_outputs()}:
            raise ConfigError(f"runner pooling: this onnx-cpu artifact's graph has no {om.HIDDEN_STATES} output (built "
                              "before llmc pooled on onnx-cpu); rebuild it with this llmc to make embeddings")
        logger.info("ONNX runtime: %d KV slots of %d tokens, %d threads", self.num_slots, self.capacity,
                    self.session.get_session_options().intra_op_num_threads)

    @staticmethod
    def _session_options(ort):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = num_threads()
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        return opts

    def close(self) -> None:
        """Drop the session and the KV buffers."""
        self.session, self.kv, self._calls = None, [], {}

    # ---- slots -----------------------------------------------------------------------------

    def _slot_for(self, request, start: int) -> int:
        """The request's KV slot is its persistent-batch row (the engine's max_num_seqs <= num_slots)."""
        slot = request.batch_row
        if start > self.lengths[slot]:
            raise RuntimeError(f"request {request.request_id}: chunk starts at {start} but its KV slot holds "
                               f"{self.lengths[slot]} tokens (prefix caching must be off for ONNX artifacts)")
        self.lengths[slot] = start  # 0: a fresh start (a new owner); below the length: drop rejected drafts
        return slot

    # ---- steps -----------------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch, pending: PendingTokens | None = None) -> StepLogits:
        """Run one step (synchronously: can_overlap is False, so `pending` is always None). The logits
        rows are ModelRunner's: one per chunk that ends its sequence plus one per draft, then prompt rows."""
        if all(s.num_new_tokens == 1 and s.is_last_chunk and not s.draft_token_ids and not s.request.skip_prefix_cache
               for s in batch.requests):
            return self._execute_decodes(batch)
        chunks, sample_rows, prompt_rows = [], [], []
        for scheduled in batch.requests:
            request, num_new = scheduled.request, scheduled.num_new_tokens
            start, num_drafts = request.num_computed_tokens, len(scheduled.draft_token_ids)
            tokens = request.get_token_ids(start, start + num_new - num_drafts) + list(scheduled.draft_token_ids)
            chunk = _Chunk(self._slot_for(request, start), start, tokens)
            if scheduled.is_last_chunk:
                sample_rows.append((len(chunks), range(num_new - 1 - num_drafts, num_new)))
            if request.skip_prefix_cache:  # prompt logprobs: positions whose next token is in the prompt
                end = min(start + num_new, request.num_prompt_tokens - 1)
                if end > start:
                    prompt_rows.append((len(chunks), request.request_id, start, range(end - start)))
            chunks.append(chunk)
        for index, rows in sample_rows:
            chunks[index].rows.extend(rows)
        for index, _, _, rows in prompt_rows:
            chunks[index].rows.extend(rows)
        logits = self._run_chunks(chunks)  # per chunk: [len(rows), vocab]
        sampled = [logits[index][: len(rows)] for index, rows in sample_rows]
        num_sampled_of = {index: len(rows) for index, rows in sample_rows}
        prompt_logits = {request_id: (first, torch.from_numpy(logits[index][num_sampled_of.get(index, 0):]))
                         for index, request_id, first, _ in prompt_rows}
        out = np.concatenate(sampled) if sampled else np.zeros((0, self.vocab_size), np.float32)
        rows = torch.tensor([s.request.batch_row for s in batch.requests if s.is_last_chunk], dtype=torch.long)
        return StepLogits(torch.from_numpy(out), rows, prompt_logits)

    def _execute_decodes(self, batch: ScheduledBatch) -> StepLogits:
        """A step of one sampled token per sequence: one call over the slot range, filled in place,
        and the logits returned are a view of the call's output array (the engine samples from
        them before the next step). Slots of the range without a request are reset to idle."""
        requests = [s.request for s in batch.requests]
        starts = [r.num_computed_tokens for r in requests]
        slots = [self._slot_for(r, start) for r, start in zip(requests, starts)]
        first = min(slots)
        batch_size = max(slots) - first + 1
        call = self._binding(first, batch_size, 1, len(requests))
        if batch_size > len(requests):
            call.reset(self.lengths[first: first + batch_size])
        for i, (request, start, slot) in enumerate(zip(requests, starts, slots)):
            b = slot - first
            call.input_ids[b, 0] = request.get_token_ids(start, start + 1)[0]
            call.query_lens[b], call.seqlens_k[b], call.indices[i] = 1, start, b
            self.lengths[slot] = start + 1
        call.total[()] = call.seqlens_k.max() + 1
        self.session.run_with_iobinding(call.binding)
        return StepLogits(torch.from_numpy(call.logits), torch.tensor([r.batch_row for r in requests]), {})

    def classify(self, vectors: Tensor) -> Tensor:
        """A sequence classifier's logits [n, num_labels] float32 of pooled hidden states [n, hidden_size]: the graph's
        own `score` initializer, read once from the model file and its external data."""
        if self._classifier is None:
            graph = onnx.load(str(self._model_path), load_external_data=False).graph
            [weight] = [t for t in graph.initializer if t.name == om.CLASSIFIER_WEIGHT]
            array = numpy_helper.to_array(weight, base_dir=str(self._model_path.parent))  # [hidden, num_labels]
            self._classifier = torch.from_numpy(np.ascontiguousarray(array.T))
        return torch.nn.functional.linear(vectors.float(), self._classifier)

    def pool_hidden(self, batch: ScheduledBatch) -> Tensor:
        """A pooling step's forward (runtime/pooling.py): the final norm's outputs [num_tokens, hidden_size]
        of its tokens, in batch order (ModelRunner.pool_hidden's). No logits; chunks share calls by
        `_pool_calls`."""
        chunks = []
        for scheduled in batch.requests:
            request, start = scheduled.request, scheduled.request.num_computed_tokens
            chunks.append(_Chunk(self._slot_for(request, start), start,
                                 request.get_token_ids(start, start + scheduled.num_new_tokens)))
        out: list[np.ndarray | None] = [None] * len(chunks)
        for call in self._pool_calls(chunks):
            for i, hidden in zip(call, self._run([chunks[i] for i in call], pool=True)):
                out[i] = hidden
        return torch.from_numpy(np.concatenate(out))

    def _pool_calls(self, chunks: list[_Chunk]) -> list[list[int]]:
        """Which chunks of a pooling step share a call (indices into `chunks`; the slots' lengths are the
        chunks' starts): longest first, a chunk joins the first call whose rows (its slot range times its
        longest chunk: idle slots and padding are computed too) stay within twice the tokens it computes and
        MAX_POOL_CALL_ROWS, and where every slot of the range, idle ones included, has room for the longest
        chunk after its length (GroupQueryAttention refuses padding past the capacity); else it starts one.
        Short prompts gain most: per-call costs dominate them (benchmarks/RESULTS.md session 41)."""
        calls: list[list[int]] = []
        for i in sorted(range(len(chunks)), key=lambda i: -len(chunks[i].token_ids)):
            chunk = chunks[i]
            for call in calls:
                longest = len(chunks[call[0]].token_ids)
                slots = [chunks[j].slot for j in call] + [chunk.slot]
                first, last = min(slots), max(slots)
                tokens = sum(len(chunks[j].token_ids) for j in call) + len(chunk.token_ids)
                if ((last - first + 1) * longest <= min(2 * tokens, MAX_POOL_CALL_ROWS)
                        and max(self.lengths[first: last + 1]) + longest <= self.capacity):
                    call.append(i)
                    break
            else:
                calls.append([i])
        return calls

    def greedy_window(self, request, num_steps: int, stop_ids: set[int]) -> list[int]:
        """Up to `num_steps` one-token calls for a lone plain-greedy `request`, back to back: each call's
        argmax (numpy's, the first of equal maxima as torch's) is the next call's input, with no
        Python between calls beyond filling the bound arrays. Ends after a token in `stop_ids`.
        The caller reserved the KV room and records the tokens; returns them."""
        start = request.num_computed_tokens
        slot = self._slot_for(request, start)
        call = self._binding(slot, 1, 1, 1)
        call.query_lens[0], call.indices[0] = 1, 0
        ids, seqlens, total, logits = call.input_ids, call.seqlens_k, call.total, call.logits[0]
        run, binding = self.session.run_with_iobinding, call.binding
        token, tokens = request.get_token_ids(start, start + 1)[0], []
        for position in range(start, start + num_steps):
            ids[0, 0], seqlens[0], total[()] = token, position, position + 1
            run(binding)
            token = int(logits.argmax())
            tokens.append(token)
            if token in stop_ids:
                break
        self.lengths[slot] = start + len(tokens)
        return tokens

    def _run_chunks(self, chunks: list[_Chunk]) -> list[np.ndarray]:
        """Logits [len(chunk.rows), vocab] per chunk: single tokens in one call, the rest one call each."""
        out: list[np.ndarray | None] = [None] * len(chunks)
        singles = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        if singles:
            for i, rows in zip(singles, self._run([chunks[i] for i in singles])):
                out[i] = rows
        for i, chunk in enumerate(chunks):
            if out[i] is None:
                out[i] = self._run([chunk])[0]
        return out

    def _run(self, chunks: list[_Chunk], pool: bool = False) -> list[np.ndarray]:
        """One session call over the slot range of `chunks`; advances their slots' lengths. `pool`: no logits
        rows; returns each chunk's final hidden states instead."""
        first, last = min(c.slot for c in chunks), max(c.slot for c in chunks)
        seq_len = max(len(c.token_ids) for c in chunks)
        counts = [len(c.rows) for c in chunks]
        call = self._binding(first, last - first + 1, seq_len, 0 if pool else sum(max(n, 1) for n in counts), pool)
        call.reset(self.lengths[first: last + 1])
        row = 0
        for c in chunks:
            b, n = c.slot - first, len(c.token_ids)
            call.input_ids[b, :n] = c.token_ids
            call.query_lens[b], call.seqlens_k[b] = n, c.start + n - 1
            for r in [] if pool else c.rows or [n - 1]:  # a chunk that needs no logits still takes one row (dropped)
                call.indices[row] = b * seq_len + r
                row += 1
        call.total[()] = call.seqlens_k.max() + 1
        self.session.run_with_iobinding(call.binding)
        for c in chunks:
            self.lengths[c.slot] = c.start + len(c.token_ids)
        if pool:
            return [call.hidden[(c.slot - first) * seq_len:][: len(c.token_ids)].copy() for c in chunks]
        results, offset = [], 0
        for count in counts:
            results.append(call.logits[offset: offset + count].copy())
            offset += max(count, 1)
        return results

    def _binding(self, first: int, batch_size: int, seq_len: int, rows: int, pool: bool = False) -> _Call:
        """The io binding of a call shape over slots [first, first + batch_size): made once and kept
        (most recently used first), so a steady decode re-binds nothing. `pool`: hidden_states bound too."""
        key = (first, batch_size, seq_len, rows, pool)
        call = self._calls.pop(key, None)
        if call is None:
            kv = [(k[first: first + batch_size], v[first: first + batch_size]) for k, v in self.kv]  # views
            call = _Call(self.session, self._ort, kv, batch_size, seq_len, rows, self.vocab_size,
                         self.hidden_size if pool else None)
            while len(self._calls) >= MAX_CACHED_BINDINGS:
                self._calls.pop(next(iter(self._calls)))
        self._calls[key] = call
        return call

    def score(self, token_ids: list[int], block_ids: list[int], chunk_size: int) -> Tensor:
        """Logits [len(token_ids), vocab_size] float32 at every position of one sequence, prefilled in
        chunks of chunk_size tokens into the scratch slot (`block_ids` only reserve the scheduler's room)."""
        slot, logits = self.num_slots, []
        self.lengths[slot] = 0
        for start in range(0, len(token_ids), chunk_size):
            tokens = token_ids[start: start + chunk_size]
            logits.append(self._run([_Chunk(slot, start, tokens, list(range(len(tokens))))])[0])
        self.lengths[slot] = 0
        return torch.from_numpy(np.concatenate(logits))
