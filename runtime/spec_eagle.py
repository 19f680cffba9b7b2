"""EAGLE speculative decoding (EAGLE-3, EAGLE-1): a draft head reads the model's hidden states and proposes drafts.
Method mtp runs the artifact's own multi-token-prediction layer (runtime/mtp_head.py) as such a head, as EAGLE-1's
(the final hidden states), eagerly: the graphs below are EagleHead's.

NOTE (algorithm): the head (runtime/eagle_head.py) at position p reads the model's hidden states of position p
(EAGLE-3: three layers' inputs; EAGLE-1: the final norm's output)
and the token at p + 1, so it can only follow the model: its rows for the positions a step's forward computed run
right after that step's sampling (`absorb`), when the tokens after them are known:
  - a prefill chunk [s, e) gives head rows s .. e - 1 (the token at e is the prompt's);
  - a request's last chunk or verify step gives rows s .. N - 2, N the request's tokens after the step: the real
    positions and the accepted drafts' (rejected drafts' rows are not computed: their hidden states are not the
    request's). The last row's argmax is the next step's first draft d1, and its output hidden state is kept.
The model's hidden states are the step's, read on the spot (DecoderModel.aux_hidden), so nothing is stored
across steps but one (d1, hidden state) per request. Before the next verify step's forward `fill` runs k - 1
one-row head steps per request (d1 at position N - 1 with the kept hidden state gives d2, and so on), at positions
the scheduler reserved for the verify step; `absorb` rewrites them with the model's hidden states once verified.
On a GPU with decode graphs those k - 1 steps replay one CUDA graph (runtime/eagle_graphs.py, which writes exactly
the head rows the eager steps write: a request with fewer than k drafts reserved fewer slots), and so does `absorb`
after a decode verify step (runtime/eagle_absorb_graphs.py: k + 1 rows a request, the dead ones on the scratch slot).
The head's one-layer KV cache is indexed by the model's block tables (as the draft model's, runtime/spec_draft.py):
preemption drops a request's head state with its blocks (its re-prefill recomputes both), and a prefix-cache hit
reads the head rows the request that computed the blocks wrote, which are this request's: the scheduler gives a
hit one block fewer (SchedulerConfig.recompute_last_cached_block, vLLM's rule), so the row before the first
computed token, which reads the next token, is recomputed with this request's. Drafts are the head's argmax: point masses the
verify rule accepts with the model's probability, so outputs are distributed as without speculation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from llmc.errors import ConfigError
from llmc.kernels import device_num_sms
from llmc.runtime import artifact as art
from llmc.runtime import memory
from llmc.runtime.eagle_absorb_graphs import AbsorbRow, EagleAbsorbGraphs
from llmc.runtime.eagle_graphs import EagleFillGraphs
from llmc.runtime.eagle_head import EagleHead, EagleHeadConfig, aux_layers, read_head_config, read_head_tensors
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.loader import compute_dtype
from llmc.runtime.model_runner import planned_graph_sizes
from llmc.runtime.mtp_head import MtpHead
from llmc.runtime.request import Request
from llmc.runtime.scheduler import ScheduledBatch
from llmc.runtime.spec_decode import SpeculativeConfig

logger = logging.getLogger("llmc")


def read_eagle_head(config: SpeculativeConfig, target: art.Manifest,
                    options: art.RuntimeDefaults) -> tuple[Path, EagleHeadConfig, tuple[int, ...]]:
    """The head's folder, config and the model's layers it reads, checked against the model (one-line ConfigErrors)."""
    name = f"speculative.model {config.model!r}"
    path = Path(config.model).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{name}: no folder there; give the {'EAGLE-3' if config.method == 'eagle3' else 'EAGLE'} "
                          "head's Hugging Face folder (config.json and safetensors)")
    head = read_head_config(path, name, config.method)
    layers = aux_layers(head, target.model, name)
    if options.max_model_len > head.max_position_embeddings:
        logger.info("%s: max_model_len %d is past the head's max_position_embeddings %d (its rotary table is "
                    "extended; drafts there may be accepted less)", name, options.max_model_len,
                    head.max_position_embeddings)
    return path, head, layers


def eagle_memory_reserve(path: Path, head: EagleHeadConfig, manifest: art.Manifest, options: art.RuntimeDefaults,
                         device: torch.device) -> tuple[int, int]:
    """(bytes, KV bytes per token) the model's memory plan leaves for the head: its weights' files and its draft
    steps' and its absorb's graphs (on a GPU: memory.draft_graph_allowance_bytes and absorb_graph_allowance_bytes at
    the decode graphs' sizes, where it captures them; runtime/eagle_graphs.py, eagle_absorb_graphs.py) and its
    one-layer cache's share of every block (cpu_kv_cache_gib holds both caches on a CPU)."""
    itemsize = compute_dtype(manifest, device).itemsize
    if head.method == "mtp":  # (runtime/mtp_head.py: its one file, no graphs of its own)
        weight_bytes = (path / art.MTP_WEIGHTS).stat().st_size if device.type == "cuda" else 0
        return weight_bytes, head.kv_bytes_per_token(itemsize)
    weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors")) if device.type == "cuda" else 0
    graph_sizes = planned_graph_sizes(manifest, options, device)[0]
    k = options.speculative.num_speculative_tokens
    graph_bytes = memory.draft_graph_allowance_bytes(
        head, itemsize, graph_sizes, k, options.max_model_len, options.block_size,
        device_num_sms(device) if graph_sizes else memory.DEFAULT_NUM_SMS)
    graph_bytes += memory.absorb_graph_allowance_bytes(head, itemsize, graph_sizes, k, options.max_model_len,
                                                       options.block_size)
    return weight_bytes + graph_bytes, head.kv_bytes_per_token(itemsize)


@dataclass
class _HeadState:
    """A request's next first draft and the head's output hidden state it came from (`absorb`).

    Fields:
        request: the request.
        num_tokens: the request's tokens when it was computed (valid for the step that verifies after them).
        num_preemptions: the request's count then (a preemption drops the head's cache rows).
        draft: d1, the model's token id.
        hidden: [hidden_size], the head's output at position num_tokens - 2.
    """

    request: Request
    num_tokens: int
    num_preemptions: int
    draft: int
    hidden: Tensor


class EagleProposer:
    """Runs an EAGLE head beside the model's runner: `absorb` after each step, `fill` before each verify."""

    fills_drafts = True  # (as DraftModelProposer's)

    def __init__(self, config: SpeculativeConfig, path: Path, head_config: EagleHeadConfig, layers: tuple[int, ...],
                 runner, options: art.RuntimeDefaults, device: torch.device):
        self.config = config
        self.runner = runner
        model = runner.model
        dtype = model.embed.weight.dtype
        is_mtp = head_config.method == "mtp"  # the artifact's own MTP layer (runtime/mtp_head.py), `path` the artifact
        if is_mtp:
            self.head = MtpHead(path, art.read_manifest(path), head_config, model, runner.num_blocks + 1,
                                options.block_size, device, dtype)
        else:
            tensors = read_head_tensors(path, head_config, f"speculative.model {config.model!r}")
            # its cache's block num_blocks (which no request holds) is the draft graphs' scratch block
            self.head = EagleHead(head_config, tensors, model.embed.weight, model.compute_logits, runner.num_blocks + 1,
                                  options.block_size, max(options.max_model_len, head_config.max_position_embeddings),
                                  device, dtype)
        # the model's forward keeps these layers' inputs (EAGLE-3) or its final hidden states (EAGLE-1, MTP): the
        # runner was made so (its graphs keep them too)
        assert (model.aux_layer_ids, model.keeps_final_hidden) == (tuple(layers), head_config.reads_final_hidden)
        self.block_size, self.device = options.block_size, device
        self._states: dict[str, _HeadState] = {}
        self.num_unprepared = 0  # requests verified with placeholder drafts (no head state: never expected)
        # the draft steps replayed from CUDA graphs, captured where the runner captured decode graphs (their sizes,
        # their pool); None: `fill` runs them eagerly (runtime/eagle_graphs.py)
        self.graphs: EagleFillGraphs | None = None
        model_graphs, k = getattr(runner, "graphs", None), config.num_speculative_tokens
        if model_graphs is not None and k > 1 and not is_mtp:  # (the MTP head's steps run eagerly)
            self.graphs = EagleFillGraphs(self.head, model_graphs.batch_sizes, k, options.max_model_len,
                                          options.block_size, runner.num_blocks, device, model_graphs.pool,
                                          model_graphs.capture_stream)
            self.graphs.log_capture(memory.draft_graph_allowance_bytes(
                head_config, dtype.itemsize, model_graphs.batch_sizes, k, options.max_model_len, options.block_size,
                device_num_sms(device)))
        # absorb's head forward of decode verify steps, replayed from CUDA graphs where the runner captured decode
        # graphs (any k); None: it runs eagerly (runtime/eagle_absorb_graphs.py)
        self.absorb_graphs: EagleAbsorbGraphs | None = None
        if model_graphs is not None and not is_mtp:
            self.absorb_graphs = EagleAbsorbGraphs(self.head, model_graphs.batch_sizes, k, model.aux_width(),
                                                   model_graphs.aux.dtype, options.max_model_len, options.block_size,
                                                   runner.num_blocks, device, model_graphs.pool,
                                                   model_graphs.capture_stream)
            self.absorb_graphs.log_capture(memory.absorb_graph_allowance_bytes(
                head_config, dtype.itemsize, model_graphs.batch_sizes, k, options.max_model_len, options.block_size))
        logger.info("speculative decoding: %s head %s reading %s, draft vocabulary %d, %d tokens per step",
                    config.method, path, f"layers {list(layers)}" if layers else "the final hidden states",
                    head_config.draft_vocab_size, config.num_speculative_tokens)

    @torch.inference_mode()
    def absorb(self, batch: ScheduledBatch, new_tokens: dict[str, list[int]]) -> None:
        """After the model's forward over `batch` and its sampling (before the scheduler's update): the head's rows
        for the positions whose hidden states and next tokens are now known; the last chunks' last rows give the
        requests' next first drafts. `new_tokens`: request_id -> the tokens the step appends (sampled requests)."""
        aux = getattr(self.runner.model, "aux_hidden", None)
        rows, offset = [], 0  # (request, first position, tokens after each position, first aux row, keeps a state)
        for scheduled in batch.requests:
            request, start, drafts = scheduled.request, scheduled.request.num_computed_tokens, scheduled.draft_token_ids
            num_real, new = scheduled.num_new_tokens - len(drafts), new_tokens.get(request.request_id, [])
            if not scheduled.is_last_chunk:
                after, keeps = request.get_token_ids(start + 1, start + scheduled.num_new_tokens + 1), False
            else:  # the real positions and the accepted drafts' (their hidden states are the request's)
                accepted = next((i for i, (d, t) in enumerate(zip(drafts, new)) if d != t), min(len(drafts), len(new)))
                after = (request.get_token_ids(start + 1, start + num_real) + new)[: num_real + accepted]
                keeps = bool(new) and len(after) == num_real - 1 + len(new)  # its last row reads the newest token
            if after and not request.is_finished:
                rows.append((request, start, after, offset, keeps))
            offset += scheduled.num_new_tokens
        if not rows or aux is None:
            return
        graph_rows = [(r.block_ids, start, after, first) for r, start, after, first, _ in rows]
        if self.absorb_graphs is not None and self._replays_absorb(batch, graph_rows, aux):
            drafts, hidden = self.absorb_graphs.run(aux, graph_rows)  # hidden: this step's copy, one row a request
            for (request, start, after, _, keeps), draft, state_hidden in zip(rows, drafts, hidden):
                if keeps:
                    self._states[request.request_id] = _HeadState(request, start + len(after) + 1,
                                                                  request.num_preemptions, draft, state_hidden)
            return
        hidden = self.head.combine(torch.cat([aux[first : first + len(after)] for _, _, after, first, _ in rows]))
        batch_in = self._forward_batch([(r, start, len(after)) for r, start, after, _, _ in rows])
        ids = torch.tensor([t for _, _, after, _, _ in rows for t in after], dtype=torch.long, device=self.device)
        out = self.head(ids, hidden, batch_in)
        ends = torch.tensor([len(after) for _, _, after, _, _ in rows]).cumsum(0) - 1
        keep = [i for i, row in enumerate(rows) if row[4]]
        if not keep:
            return
        last = out[ends[keep].to(self.device)]
        drafts = self.head.greedy_tokens(last).tolist()
        for i, draft, state_hidden in zip(keep, drafts, last):
            request, start, after = rows[i][0], rows[i][1], rows[i][2]
            self._states[request.request_id] = _HeadState(request, start + len(after) + 1, request.num_preemptions,
                                                          draft, state_hidden)

    def _replays_absorb(self, batch: ScheduledBatch, rows: list[AbsorbRow], aux: Tensor) -> bool:
        """A decode verify step (every request's last chunk, one real token and its drafts: at most k + 1 rows each)
        that the absorb graphs' buffers hold (runtime/eagle_absorb_graphs.py)."""
        return (all(s.is_last_chunk and s.num_new_tokens - len(s.draft_token_ids) == 1 for s in batch.requests)
                and self.absorb_graphs.can_run(aux, rows))

    @torch.inference_mode()
    def fill(self, batch: ScheduledBatch) -> None:
        """Before the model's forward: every scheduled request with draft placeholders gets d1 (from `absorb`) and
        d2 .. dk from one-row head steps at positions N - 1 .. N + k - 3 (slots its verify step reserved): replayed
        from the draft graphs where they hold the batch, else eagerly."""
        self._forget_finished()
        work = []  # (scheduled, state)
        for scheduled in batch.requests:
            if not scheduled.draft_token_ids:
                continue
            request = scheduled.request
            state = self._states.get(request.request_id)
            if (state is None or state.request is not request or state.num_tokens != request.num_tokens
                    or state.num_preemptions != request.num_preemptions):
                self.num_unprepared += 1  # its placeholders are verified as they are (still exact)
                continue
            work.append((scheduled, state))
        num_drafts = [len(scheduled.draft_token_ids) for scheduled, _ in work]
        if not work or max(num_drafts) == 1:
            for scheduled, state in work:
                scheduled.draft_token_ids[:] = [state.draft]
            return
        width = max(len(scheduled.request.block_ids) for scheduled, _ in work)
        if self.graphs is not None and self.graphs.can_run(len(work), width):  # eagle_graphs.py NOTE (rows)
            rows = [(s.request.block_ids, state.num_tokens, n) for (s, state), n in zip(work, num_drafts)]
            drafts = self.graphs.run([state.draft for _, state in work], [state.hidden for _, state in work], rows)
            for (scheduled, _), ids, n in zip(work, drafts.tolist(), num_drafts):
                scheduled.draft_token_ids[:] = ids[:n]
            return
        # the drafts stay on the device from one head step to the next (no host round trip per step): [work, k]
        drafts = torch.zeros(len(work), max(num_drafts), dtype=torch.long, device=self.device)
        drafts[:, 0] = torch.tensor([state.draft for _, state in work], dtype=torch.long, device=self.device)
        hidden = torch.stack([state.hidden for _, state in work])
        for step in range(1, max(num_drafts)):
            live = [i for i, n in enumerate(num_drafts) if n > step]
            batch_in = self._forward_batch([(work[i][0].request, work[i][1].num_tokens - 2 + step, 1) for i in live])
            rows = (slice(None) if len(live) == len(work)
                    else torch.tensor(live, dtype=torch.long, device=self.device))
            out = self.head(drafts[rows, step - 1], hidden[rows], batch_in)
            drafts[rows, step] = self.head.greedy_tokens(out)
            hidden[rows] = out
        for (scheduled, _), ids, n in zip(work, drafts.tolist(), num_drafts):
            scheduled.draft_token_ids[:] = ids[:n]

    def _forward_batch(self, spans: list[tuple[Request, int, int]]) -> ForwardBatch:
        """The head's ForwardBatch of (request, first position, rows) spans, through the requests' block tables."""
        bs, device = self.block_size, self.device
        positions, slots = [], []
        for request, start, n in spans:
            for p in range(start, start + n):
                positions.append(p)
                slots.append(request.block_ids[p // bs] * bs + p % bs)
        width = max(len(r.block_ids) for r, _, _ in spans)
        tables = [r.block_ids + [0] * (width - len(r.block_ids)) for r, _, _ in spans]
        ends = [start + n for _, start, n in spans]
        return ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            context_lens=torch.tensor(ends, dtype=torch.int32, device=device),
            query_lens=[n for _, _, n in spans],
            max_context_len=max(ends),
            logits_indices=torch.empty(0, dtype=torch.long, device=device),
        )

    def _forget_finished(self) -> None:
        for request_id in [rid for rid, state in self._states.items() if state.request.is_finished]:
            del self._states[request_id]

    def close(self) -> None:
        """Nothing to release (the head lives in this process)."""
