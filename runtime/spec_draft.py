"""Draft-model speculative decoding: a smaller llmc artifact proposes each step's drafts.

NOTE (algorithm): the draft model is a second `ModelRunner` on the same device. Its KV cache has
the target's block count and is indexed by the target requests' own block tables (vLLM v1's
layout for draft models): the scheduler reserves blocks for a request's k draft positions when it
schedules the verify step, so the draft, which runs between `schedule` and the target's forward,
writes its KV into blocks that already belong to the request. In one engine step:
  1. the draft computes, for every scheduled request that verifies drafts, the tokens its own cache
     lacks up to where the target's forward starts its drafts (its whole prompt the first time, the
     tokens accepted since its last drafts after that), in forwards of at most
     `max_num_batched_tokens` tokens; the last row of a request gives its first draft d1;
  2. k - 1 one-token forwards feed d1, d2, ... and give d2 .. dk;
  3. the target verifies [last token, d1 .. dk] as for n-gram drafts (spec_decode.py).
Drafts are the draft model's argmax: a point-mass proposal, which the verify rule accepts with
the target's probability of the token, so outputs are distributed as without speculation whatever
the draft model is (greedy outputs: identical).

What the draft's cache holds per request is `_DraftSequence.tokens`: positions it wrote. Before a
step the ones the request does not have (rejected drafts) are dropped, so a draft position is
recomputed only when its token changed. Preemption frees the request's blocks: its draft tokens
are dropped too, and the draft recomputes them with the target's re-prefill.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmc.errors import ArtifactError, ConfigError
from llmc.runtime import artifact as art
from llmc.runtime.loader import compute_dtype
from llmc.runtime.model_runner import ModelRunner, graph_allowances, planned_graph_sizes
from llmc.runtime.onnx_model import is_onnx
from llmc.runtime.parallel.layout import kv_bytes_per_token, whole_model_layout
from llmc.runtime.request import Request
from llmc.runtime.scheduler import ScheduledBatch, ScheduledRequest
from llmc.runtime.spec_decode import SpeculativeConfig

logger = logging.getLogger("llmc")


def read_draft_manifest(config: SpeculativeConfig, target_dir: Path, target: art.Manifest,
                        options: art.RuntimeDefaults) -> tuple[Path, art.Manifest]:
    """The draft artifact's folder and manifest, checked against the target: a one-line ConfigError
    says what does not fit (a tokenizer that differs with the same vocabulary size is only logged:
    its drafts are verified like any others, and rarely accepted)."""
    path = Path(config.model).expanduser()
    try:
        manifest = art.read_manifest(path)
    except (ArtifactError, OSError) as e:
        raise ConfigError(f"speculative.model {config.model!r}: {e}") from None
    if is_onnx(manifest) or manifest.parallel.world_size != 1:
        what, change = (("onnx-cpu", "target.device cpu or cuda") if is_onnx(manifest) else
                        (f"split into {manifest.parallel.world_size} ranks", "parallel tensor 1 and pipeline 1"))
        raise ConfigError(f"speculative.model {config.model!r}: the draft must be a single-rank torch artifact "
                          f"(it is {what}); rebuild it with {change}")
    if manifest.model.vocab_size != target.model.vocab_size:
        raise ConfigError(f"speculative.model {config.model!r}: its vocabulary has {manifest.model.vocab_size} tokens, "
                          f"the model's {target.model.vocab_size}; a draft model must share the model's tokenizer")
    tokenizers = [d / "tokenizer" / "tokenizer.json" for d in (path, target_dir)]
    if all(t.is_file() for t in tokenizers) and tokenizers[0].read_bytes() != tokenizers[1].read_bytes():
        logger.warning("speculative.model %s: its tokenizer.json differs from the model's; drafts are token ids of "
                       "the model's vocabulary, so few may be accepted", config.model)
    if options.max_model_len > manifest.model.max_position_embeddings:
        raise ConfigError(f"speculative.model {config.model!r}: it takes at most {manifest.model.max_position_embeddings} "
                          f"positions, fewer than max_model_len {options.max_model_len}; lower max_model_len")
    return path, manifest


def draft_options(options: art.RuntimeDefaults, num_blocks: int | None) -> art.RuntimeDefaults:
    """The draft runner's options: the target's, with its block count, a cache in the draft's own dtype and its
    weights on the device. Its token budget is the target's (the size the target's plan profiles activations
    and plans prefill graphs at): a step's catch-up beyond it runs in several forwards (`_first_drafts`)."""
    return dataclasses.replace(options, num_kv_blocks=num_blocks, kv_cache_dtype="auto", cpu_offload_gb=0.0,
                               speculative=None)


def draft_memory_reserve(path: Path, manifest: art.Manifest, options: art.RuntimeDefaults,
                         device: torch.device) -> tuple[int, int]:
    """(bytes, KV bytes per token) the target's GPU memory plan leaves for the draft runner: its
    weights (their files' size) and CUDA graphs, and its cache's bytes per token of the shared blocks
    (on a CPU only the latter counts: cpu_kv_cache_gib holds both caches)."""
    weight_bytes = sum(f.stat().st_size for f in path.rglob("*.safetensors"))
    dtype = compute_dtype(manifest, device)
    kv_per_token = kv_bytes_per_token(manifest.model, whole_model_layout(manifest.model), dtype.itemsize)
    options = draft_options(options, None)  # what the draft runner plans its graphs with (ModelRunner)
    config = dataclasses.replace(manifest.model, dtype=str(dtype).removeprefix("torch."))  # as build_model sets it
    graph_bytes, _ = graph_allowances(config, *planned_graph_sizes(manifest, options, device), options, device)
    return weight_bytes + graph_bytes, kv_per_token


@dataclass
class _DraftSequence:
    """What the draft's cache holds for one request, shaped as the Request fields StepBuffers reads.

    Fields:
        request: the target's request (its block table, row and tokens).
        tokens: the tokens whose KV the draft wrote, positions 0..len-1 (accepted or not yet checked).
        num_checked: leading entries of `tokens` known to be the request's.
        num_computed_tokens: where this draft forward starts (StepBuffers reads it).
        num_preemptions: the request's count when `tokens` were written (a preemption drops them).
        images: None (a request's images, where StepBuffers reads Qwen2-VL's rotary delta; drafts serve no such request).
    """

    request: Request
    tokens: list[int] = field(default_factory=list)
    num_checked: int = 0
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_pending_tokens: int = 0
    skip_prefix_cache: bool = False
    images: None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def batch_row(self) -> int:
        return self.request.batch_row

    @property
    def block_ids(self) -> list[int]:
        return self.request.block_ids

    def get_token_ids(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]

    def catch_up(self, end: int) -> None:
        """Drop the tokens the request does not have, then extend `tokens` with the request's up to `end`."""
        request = self.request
        if request.num_preemptions != self.num_preemptions:  # its blocks were freed: the KV is gone
            self.tokens, self.num_checked, self.num_preemptions = [], 0, request.num_preemptions
        check_end = min(len(self.tokens), request.num_tokens)
        if check_end > self.num_checked:
            actual = request.get_token_ids(self.num_checked, check_end)
            for offset, token in enumerate(actual):
                if self.tokens[self.num_checked + offset] != token:
                    del self.tokens[self.num_checked + offset:]
                    break
            self.num_checked = min(len(self.tokens), check_end)
        del self.tokens[end:]  # never ahead of the target's real tokens
        self.num_checked = min(self.num_checked, len(self.tokens))
        self.num_computed_tokens = len(self.tokens)
        self.tokens += request.get_token_ids(len(self.tokens), end)


class DraftModelProposer:
    """Fills each scheduled request's draft placeholders with a draft model's greedy tokens."""

    fills_drafts = True  # the scheduler reserves placeholders; `fill` sets them before the target's forward

    def __init__(self, config: SpeculativeConfig, path: Path, manifest: art.Manifest, options: art.RuntimeDefaults,
                 device: torch.device, num_blocks: int):
        self.config = config
        runner_options = draft_options(options, num_blocks)
        self.runner = ModelRunner(path, manifest, runner_options, device)
        self.max_tokens = runner_options.max_num_batched_tokens
        self._sequences: dict[str, _DraftSequence] = {}
        logger.info("speculative decoding: draft model %s (%s), %d tokens per step", path, manifest.model.architecture,
                    config.num_speculative_tokens)

    @torch.inference_mode()
    def fill(self, batch: ScheduledBatch) -> None:
        """Run the draft over `batch` (before the target's forward): for every scheduled request with draft
        placeholders, the tokens the draft's cache lacks up to its drafts, then one-token steps; each such
        ScheduledRequest's draft_token_ids get their values. Requests without drafts cost the draft nothing."""
        self._forget_finished()
        work = []  # (sequence, end of its real tokens, number of drafts)
        for scheduled in batch.requests:
            if not scheduled.draft_token_ids:  # nothing to propose: its catch-up waits for a step that drafts
                continue
            request = scheduled.request
            sequence = self._sequences.get(request.request_id)
            if sequence is None or sequence.request is not request:
                sequence = self._sequences[request.request_id] = _DraftSequence(request, num_preemptions=request.num_preemptions)
            end = request.num_computed_tokens + scheduled.num_new_tokens - len(scheduled.draft_token_ids)
            sequence.catch_up(end)
            if sequence.num_computed_tokens >= end:
                sequence.num_computed_tokens = end - 1  # d1 comes from the last real token's logits
            work.append((sequence, end, len(scheduled.draft_token_ids)))
        drafts = self._first_drafts(work)
        for step in range(1, max((n for _, _, n in work), default=0)):
            rows = [(sequence, ids) for (sequence, _, n), ids in zip(work, drafts) if n > step]
            for sequence, ids in rows:  # the previous draft is this step's input, at the next position
                sequence.num_computed_tokens = len(sequence.tokens)
                sequence.tokens.append(ids[-1])
            tokens = self._forward([ScheduledRequest(sequence, 1, True) for sequence, _ in rows])
            for (_, ids), token in zip(rows, tokens):
                ids.append(token)
        for scheduled, ids in zip([s for s in batch.requests if s.draft_token_ids], drafts):
            scheduled.draft_token_ids[:] = ids

    def _first_drafts(self, work: list[tuple[_DraftSequence, int, int]]) -> list[list[int]]:
        """Forwards over every sequence's missing tokens, `max_tokens` at a time; each sequence's d1 comes from
        its last token's row. Returns [d1] per sequence."""
        drafts: list[list[int]] = [[] for _ in work]
        todo = [(i, sequence, end) for i, (sequence, end, _) in enumerate(work)]  # each has >= 1 token (fill)
        while todo:
            chunk, sampled, left, budget = [], [], [], self.max_tokens
            for i, sequence, end in todo:
                take = min(end - sequence.num_computed_tokens, budget)
                if take <= 0:
                    left.append((i, sequence, end))
                    continue
                is_last = sequence.num_computed_tokens + take == end
                chunk.append(ScheduledRequest(sequence, take, is_last))
                if is_last:
                    sampled.append(i)
                else:
                    left.append((i, sequence, end))
                budget -= take
            tokens = self._forward(chunk)
            for scheduled in chunk:
                scheduled.request.num_computed_tokens += scheduled.num_new_tokens
            for i, token in zip(sampled, tokens):
                drafts[i].append(token)
            todo = left
        return drafts

    def _forward(self, requests: list[ScheduledRequest]) -> list[int]:
        """One draft forward; the argmax token of each last-chunk entry, in order."""
        step = self.runner.execute(ScheduledBatch(requests=requests, num_batched_tokens=sum(r.num_new_tokens for r in requests)))
        if not step.logits.shape[0]:
            return []
        return step.logits.argmax(dim=-1).tolist()

    def _forget_finished(self) -> None:
        finished = [rid for rid, sequence in self._sequences.items() if sequence.request.is_finished]
        for request_id in finished:
            del self._sequences[request_id]

    def close(self) -> None:
        self.runner.close()
