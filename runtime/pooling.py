"""Embeddings: vLLM's pooling runner (`runner="pooling"`), its PoolingParams, pooler and outputs.

An embedding request is a prompt that is computed and never sampled. The scheduler runs it as any prompt
(chunked prefill beside other prompts, its KV in the paged cache, preemption by recompute); the engine's
pooling step (Engine._pooling_step) takes the model's final hidden states (after the final norm:
transformers' `last_hidden_state`) of the step's tokens and `Pooler.accumulate` keeps what each request's
pooling needs: the last prompt token's (LAST), the first's (CLS) or the sum over every chunk (MEAN). When a
request's last chunk has run, `Pooler.finish` makes its embedding (the mean divided, `dimensions` kept,
L2-normalized if asked) and the request ends with its blocks freed.

Which pooling an artifact gets is vLLM's rule: `pooler_config` if given, else the checkpoint's
sentence-transformers files (modules.json and its Pooling module's config.json, copied into the artifact's
tokenizer/ folder at build time), else LAST with normalization (vLLM's default for a causal LM used as
an embedding model).
"""

from __future__ import annotations

import json
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from llmc.errors import ConfigError, RequestError
from llmc.kernels import to_device
from llmc.schema import opt

POOLING_TYPES = ("LAST", "MEAN", "CLS")
TASKS = ("embed", "classify")  # what a pooling engine runs (its model's task)
# what its requests may ask: the engine's task, or its token-level form (vLLM's token_embed / token_classify:
# one output per prompt token, pooling ALL)
REQUEST_TASKS = (*TASKS, "token_embed", "token_classify")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "reward")
# sentence-transformers' Pooling config keys, and the pooling each one names (vLLM reads the same)
_ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_cls_token": "CLS"}
ST_MODULES = "modules.json"


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's `pooler_config` (formerly override_pooler_config), the part llmc has: how an embedding is
    made from the hidden states. Unset fields take the checkpoint's sentence-transformers settings, else
    LAST pooling with normalization."""

    pooling_type: str | None = opt(None, choices=list(POOLING_TYPES),
                                   help="LAST (the last prompt token), MEAN (every token) or CLS (the first)")
    normalize: bool | None = opt(None, help="embed: L2-normalize the embedding (a request's `normalize` overrides it)")
    use_activation: bool | None = opt(None, help="classify: apply the classifier's activation (softmax or sigmoid, "
                                      "the default) or give its raw logits (a request's `use_activation` overrides it)")


@dataclass
class PoolingParams:
    """What an embedding request asks (vLLM's PoolingParams, the fields llmc has).

    Fields:
        dimensions: keep the first `dimensions` values (Matryoshka embeddings), then normalize; None: all.
            Refused unless the engine's pooler_config says the model was trained for it.
        normalize: L2-normalize the embedding; None: the engine's pooler_config (default true).
        truncate_prompt_tokens: keep the last k prompt tokens (-1: max_model_len); None: the prompt as is.
        task: "embed" or "classify" (vLLM's task names), which must be the engine's, or its token-level form
            ("token_embed", "token_classify": one output per prompt token); None: the engine's.
        use_activation: classify: apply the classifier's activation (softmax, sigmoid; the default) or return
            its raw logits (false); embed: the same as normalize (vLLM's newer name for it).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise RequestError(f"PoolingParams.dimensions must be an integer >= 1, got {self.dimensions!r}",
                               param="dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise RequestError(f"PoolingParams.normalize must be true or false, got {self.normalize!r}",
                               param="normalize")
        keep = self.truncate_prompt_tokens
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or (keep < 1 and keep != -1)):
            raise RequestError(f"PoolingParams.truncate_prompt_tokens must be -1 or an integer >= 1, got {keep!r}",
                               param="truncate_prompt_tokens")
        if self.task not in (None, *REQUEST_TASKS):
            raise RequestError(f"PoolingParams.task {self.task!r}: an llmc pooling engine runs "
                               f"{', '.join(REQUEST_TASKS)}; score is LLM.score's and the server's /score", param="task")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise RequestError(f"PoolingParams.use_activation must be true or false, got {self.use_activation!r}",
                               param="use_activation")

    # what the server's admission and the engine loop count: one sequence per prompt
    n = 1
    best_of = None


@dataclass
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: the embedding (`embedding`, float32 values as Python floats). It holds the float32
    tensor (`data`, on the host) and makes the list when first read: a server's base64 reply and a score read the
    tensor, and never pay for a list of Python floats (a 4096-wide embedding: ~0.1 ms)."""

    data: Tensor

    @functools.cached_property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def hidden_size(self) -> int:
        return self.data.shape[0]


@dataclass
class ClassificationOutput:
    """vLLM's ClassificationOutput: the class probabilities (the classifier's activation of its logits; the
    logits themselves under use_activation false), as Python floats."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class PooledRequestOutput:
    """What a pooling request's (only, final) output carries. `error` is set, and outputs None, when the request
    failed; finished is always true (a pooled output comes whole)."""

    request_id: str
    outputs: object
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class ClassificationRequestOutput(PooledRequestOutput):
    """vLLM's ClassificationRequestOutput: one prompt's class probabilities (outputs.probs)."""

    outputs: ClassificationOutput | None


@dataclass
class EmbeddingRequestOutput(PooledRequestOutput):
    """vLLM's EmbeddingRequestOutput: one prompt's embedding (outputs.embedding)."""

    outputs: EmbeddingOutput | None


def pooling_task(options, model=None) -> str | None:
    """The pooling task an engine of `options` (RuntimeDefaults) runs on `model` (an artifact ModelConfig; None
    where it is not known yet: a recipe before its checkpoint is read), under vLLM's `runner` / `convert`: "embed",
    "classify", or None (it generates). auto and none follow the model: a sequence classifier (num_labels)
    classifies, a causal LM generates (runner auto) or embeds (runner pooling)."""
    if options.runner == "generate":
        return None
    if options.convert in TASKS:
        return options.convert
    is_classifier = model is not None and model.is_classifier
    if options.runner == "pooling":
        return "classify" if is_classifier else "embed"
    return "classify" if is_classifier else None


def is_pooling(options, model=None) -> bool:
    """Whether an engine of these options pools (`pooling_task`)."""
    return pooling_task(options, model) is not None


def pooling_problem(options, world_size: int, model=None) -> str | None:
    """What llmc cannot run of these options' runner / convert / pooler_config on `model` (None: not known yet;
    the engine and the build say it alike), or None."""
    if options.convert == "reward":
        return ("convert 'reward': reward models (per-token rewards) are not supported; a sequence classifier "
                "checkpoint runs with convert classify (or auto), a causal LM with convert embed")
    if options.convert in TASKS and options.runner == "generate":
        return (f"convert {options.convert!r} makes a pooling model, which runner 'generate' does not run; use runner "
                "pooling (or auto)")
    if model is not None and model.is_classifier and options.runner == "generate":
        return (f"{model.architecture} is a sequence classifier (its head is `score`, no LM head): runner 'generate' "
                "cannot run it; use runner pooling (or auto)")
    if options.convert == "classify" and model is not None and not model.is_classifier:
        return (f"convert 'classify' needs a sequence classifier checkpoint (a *ForSequenceClassification with its "
                f"`score` head); {model.architecture} has none; use convert embed, or build the classifier checkpoint")
    task = pooling_task(options, model)
    if task is None:
        return ("pooler_config applies to a pooling model; give runner pooling too, or drop it"
                if options.pooler_config is not None else None)
    if world_size != 1:
        return (f"runner pooling ({task}) does not run on a tensor/pipeline-parallel artifact; serve a single-rank "
                "build of the model")
    if options.speculative is not None:
        return "speculative: speculative decoding does not apply to runner pooling (embeddings sample nothing); drop it"
    return None


def _of_kind(modules: list, kind: str) -> list[dict]:
    """The entries of a sentence-transformers modules.json list whose type is `kind` (Pooling, Normalize)."""
    return [m for m in modules if str(m.get("type", "")).endswith("." + kind)]


def sentence_transformers_pooling(folder: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from a sentence-transformers model's modules.json and its Pooling module's
    config.json in `folder` (vLLM's rule: normalize when a Normalize module follows); None without them."""
    path = folder / ST_MODULES
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
        pooling = _of_kind(modules, "Pooling")
        if not pooling:
            return None
        config = json.loads((folder / pooling[0]["path"] / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ConfigError(f"{path}: not a readable sentence-transformers module list ({type(e).__name__}: {e}); "
                          "fix it, or set pooler_config's pooling_type and normalize") from None
    modes = [kind for key, kind in _ST_POOLING_MODES.items() if config.get(key)]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_POOLING_MODES)
    if others or len(modes) != 1:
        named = ", ".join(others) if others else f"{len(modes)} modes"
        raise ConfigError(f"{path}: the Pooling module asks {named}; llmc pools by one of lasttoken, mean_tokens or "
                          "cls_token: set pooler_config's pooling_type")
    normalize = bool(_of_kind(modules, "Normalize"))
    return modes[0], normalize


def sentence_transformers_files(model_dir: Path) -> list[str]:
    """The checkpoint's sentence-transformers files that say how it pools (modules.json and its Pooling
    module's config.json, relative paths), for the build to copy beside the tokenizer; [] without them."""
    if not (model_dir / ST_MODULES).is_file():
        return []
    try:
        modules = json.loads((model_dir / ST_MODULES).read_text(encoding="utf-8"))
        paths = [f"{m['path']}/config.json" for m in _of_kind(modules, "Pooling")]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return [ST_MODULES]  # copied as it is: the engine names the problem if it pools by it
    return [ST_MODULES, *(p for p in paths if (model_dir / p).is_file())]


class PoolingState:
    """One embedding request in the engine (as a SequenceState is for generation): its scheduler Request
    and what the pooler has kept of its hidden states so far."""

    def __init__(self, request, group_id: str, task: str, mode: str):
        """task: the request's (Pooler.task_of); mode: its pooling, LAST, MEAN, CLS or ALL (Pooler.mode_of)."""
        self.request = request
        self.group_id = group_id
        self.task, self.mode = task, mode
        # float32 device rows: LAST/CLS one [hidden_size], MEAN one sum per chunk, ALL one [chunk tokens, hidden_size]
        # per chunk
        self.parts: list[Tensor] = []

    def restart(self) -> None:
        """Preempted: its prompt is computed again from the first token."""
        self.parts = []


@dataclass
class PoolingGroup:
    """An embedding request as the engine's request maps hold it (the RequestGroup of generation)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: PoolingParams
    arrival_time: float
    sequences: list[PoolingState] = field(default_factory=list)
    first_scheduled_time: float | None = None

    def mark_scheduled(self, now: float) -> None:
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def output(self, values: Tensor | list[float], task: str
               ) -> EmbeddingRequestOutput | ClassificationRequestOutput | PoolingRequestOutput:
        """Its (only, final) output, once its prompt is pooled into `values` (an embedding's float32 tensor, class
        probabilities, or a token task's [num_prompt_tokens, width] float32 tensor)."""
        kind, output = {"embed": (EmbeddingRequestOutput, EmbeddingOutput),
                        "classify": (ClassificationRequestOutput, ClassificationOutput)}.get(
                            task, (PoolingRequestOutput, PoolingOutput))
        output = output(values)
        return kind(self.request_id, output, self.prompt_token_ids, prompt=self.prompt,
                    num_cached_tokens=self.sequences[0].request.num_cached_tokens,
                    metrics={"arrival_time": self.arrival_time, "first_scheduled_time": self.first_scheduled_time})


# a classifier's activation (artifact ModelConfig.classifier_activation) over a [n, num_labels] float32 tensor
ACTIVATIONS = {"softmax": lambda x: x.softmax(-1), "sigmoid": torch.sigmoid, "identity": lambda x: x}


class Pooler:
    """Pools a step's final hidden states into its requests' embeddings (task embed) or, through the model's
    classifier head, their class probabilities (task classify)."""

    def __init__(self, pooling_type: str, normalize: bool, hidden_size: int, task: str = "embed",
                 head: Callable[[Tensor], Tensor] | None = None, activation: str | None = None,
                 use_activation: bool = True):
        """head: classify: the model's classifier, pooled hidden states [n, hidden_size] → float32 logits
        [n, num_labels] (DecoderModel.classify); activation: what turns them into probabilities."""
        self.pooling_type, self.normalize, self.hidden_size = pooling_type, normalize, hidden_size
        self.task, self.head, self.activation, self.use_activation = task, head, activation, use_activation

    @classmethod
    def for_engine(cls, config: PoolerConfig | None, tokenizer_dir: Path, model, task: str,
                   head: Callable[[Tensor], Tensor] | None = None) -> Pooler:
        """vLLM's order: pooler_config's fields, then the sentence-transformers files, then LAST + normalize.
        `model`: the artifact's ModelConfig; `head`: classify's (DecoderModel.classify)."""
        config = config or PoolerConfig()
        if task == "classify":
            if config.normalize is not None:
                raise ConfigError("pooler_config.normalize applies to embeddings; a classifier's outputs take "
                                  "use_activation (true: probabilities, false: raw logits)")
            return cls(config.pooling_type or "LAST", False, model.hidden_size, task, head, model.classifier_activation,
                       config.use_activation is not False)
        if config.use_activation is not None:
            raise ConfigError("pooler_config.use_activation applies to classifiers; an embedding model's vectors "
                              "take normalize")
        found = sentence_transformers_pooling(tokenizer_dir)
        pooling_type = config.pooling_type or (found[0] if found else "LAST")
        normalize = config.normalize if config.normalize is not None else (found[1] if found else True)
        return cls(pooling_type, normalize, model.hidden_size)

    def task_of(self, params: PoolingParams) -> str:
        return params.task or self.task

    def mode_of(self, params: PoolingParams) -> str:
        """A request's pooling: ALL for a token task, else the engine's pooling_type."""
        return "ALL" if self.task_of(params).startswith("token_") else self.pooling_type

    @staticmethod
    def reads_cached_prefix(mode: str) -> bool:
        """LAST reads only the last token's state, which is computed whatever the prefix cache holds; MEAN,
        CLS and ALL need every prompt token (or the first) computed, so their requests skip the cache."""
        return mode == "LAST"

    def check(self, params: PoolingParams) -> None:
        if params.task not in (None, self.task, f"token_{self.task}"):
            raise RequestError(f"task {params.task!r}: this model runs task {self.task!r} or {'token_' + self.task!r} ("
                               f"{'an embedding model' if self.task == 'embed' else 'a sequence classifier'})",
                               param="task")
        if self.task == "classify":
            given = [k for k in ("dimensions", "normalize") if getattr(params, k) is not None]
            if given:
                raise RequestError(f"{given[0]} applies to embeddings; a classifier's request takes use_activation "
                                   "(and truncate_prompt_tokens)", param=given[0])
            return
        if params.dimensions is not None and params.dimensions != self.hidden_size:
            raise RequestError(f"dimensions {params.dimensions}: this model does not support Matryoshka "
                               "representation (its embeddings are trained whole); changing the output dimensions "
                               f"would give poor results; leave dimensions out (or {self.hidden_size})",
                               param="dimensions")

    def accumulate(self, hidden: Tensor, batch, states: list[PoolingState]) -> list[PoolingState]:
        """Keep what each scheduled request's pooling needs of `hidden` [num_tokens, hidden_size] (the
        step's tokens in batch order; `states[i]` is batch.requests[i]'s); returns the states whose
        prompt this step completed."""
        requests = batch.requests
        offsets, at = [], 0
        for scheduled in requests:
            offsets.append(at)
            at += scheduled.num_new_tokens
        modes = {state.mode for state in states}
        if "MEAN" in modes:  # each token's request, made on the host: one copy
            counts = torch.tensor([s.num_new_tokens for s in requests])
            segments = to_device(torch.repeat_interleave(torch.arange(len(requests)), counts), hidden.device)
            sums = torch.zeros(len(requests), hidden.shape[1], dtype=torch.float32, device=hidden.device)
            sums.index_add_(0, segments, hidden[:at].float())
            for i, state in enumerate(states):
                if state.mode == "MEAN":
                    state.parts.append(sums[i])
        picks = [(i, offsets[i] + s.num_new_tokens - 1) for i, s in enumerate(requests)
                 if s.is_last_chunk and states[i].mode == "LAST"]
        picks += [(i, offsets[i]) for i, s in enumerate(requests)
                  if s.request.num_computed_tokens == 0 and states[i].mode == "CLS"]
        if picks:
            rows = hidden[to_device(torch.tensor([row for _, row in picks]), hidden.device)].float()
            for j, (i, _) in enumerate(picks):
                states[i].parts = [rows[j]]
        for i, (state, scheduled) in enumerate(zip(states, requests)):
            if state.mode == "ALL":  # (a copy: `hidden` may be a graph's buffer, rewritten by the next step)
                rows = hidden[offsets[i] : offsets[i] + scheduled.num_new_tokens]
                state.parts.append(rows.to(torch.float32, copy=True))
        return [state for state, scheduled in zip(states, requests) if scheduled.is_last_chunk]

    def finish(self, states: list[PoolingState], params: list[PoolingParams]) -> list[Tensor | list[float]]:
        """The outputs of requests whose prompt is complete, in order: embeddings (float32 host tensors), class
        probabilities (lists), a token task's [num_prompt_tokens, width] float32 host tensors."""
        done: list = [None] * len(states)
        pooled = [i for i, s in enumerate(states) if s.mode != "ALL"]
        if pooled:  # one vector each, stacked: one copy to the host
            values = self._finish_vectors([states[i] for i in pooled], [params[i] for i in pooled])
            for i, value in zip(pooled, values):
                done[i] = value
        for i, (state, p) in enumerate(zip(states, params)):
            if state.mode == "ALL":
                rows = torch.cat(state.parts)  # [num_prompt_tokens, hidden_size]
                if self.task == "classify":
                    done[i] = self._activated(self.head(rows), p).cpu()
                else:
                    done[i] = self._normalized(rows, p).cpu()
        return done

    def _activated(self, logits: Tensor, p: PoolingParams) -> Tensor:
        """A classifier's logits [..., num_labels] through its activation, unless the request (else the engine) asks
        for the raw logits (use_activation false)."""
        activates = self.use_activation if p.use_activation is None else p.use_activation
        return ACTIVATIONS[self.activation](logits) if activates else logits

    def _normalized(self, vectors: Tensor, p: PoolingParams) -> Tensor:
        """Each row L2-normalized if the request (else the engine) asks it."""
        normalize = p.use_activation if p.normalize is None else p.normalize  # (vLLM's newer name for it)
        if self.normalize if normalize is None else normalize:
            return torch.nn.functional.normalize(vectors, dim=-1)
        return vectors

    def _finish_vectors(self, states: list[PoolingState], params: list[PoolingParams]) -> list[Tensor | list[float]]:
        vectors = torch.stack([s.parts[0] if len(s.parts) == 1 else torch.stack(s.parts).sum(0) for s in states])
        if self.pooling_type == "MEAN":
            counts = torch.tensor([s.request.num_prompt_tokens for s in states], dtype=torch.float32)
            vectors = vectors / to_device(counts, vectors.device).unsqueeze(1)
        if self.task == "classify":
            logits = self.head(vectors).cpu()  # [n, num_labels] float32
            return [self._activated(row, p).tolist() for row, p in zip(logits, params)]
        return [self._normalized(vector[: p.dimensions], p) for vector, p in zip(vectors.cpu(), params)]


@dataclass
class PoolingOutput:
    """vLLM's PoolingOutput: the pooled output as a float32 tensor (LLM.encode): a vector, or for a token task
    one row per prompt token ([num_prompt_tokens, hidden_size] or [num_prompt_tokens, num_labels])."""

    data: Tensor


@dataclass
class PoolingRequestOutput(PooledRequestOutput):
    """vLLM's PoolingRequestOutput (LLM.encode, LLM.reward): one prompt's pooled output."""

    outputs: PoolingOutput | None


@dataclass
class ScoringOutput:
    """vLLM's ScoringOutput: one pair's score (here the cosine similarity of the two texts' embeddings)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's ScoringRequestOutput: one (text_1, text_2) pair's score; prompt_token_ids are the two texts'
    tokens one after the other, as vLLM reports them for an embedding model's scores."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


# why truncate_prompt_tokens is refused for a cross-encoder's pairs (LLM.score and the server say it alike)
CROSS_ENCODER_TRUNCATION = ("a cross-encoder's input is the two texts as one pair, which "
                            "cutting its first tokens would cut the first text from; shorten the texts instead")


def top_label(labels: list[str], probs: list[float]) -> str:
    """The name of a classifier's most likely class (vLLM's /classify `label`)."""
    return labels[max(range(len(probs)), key=probs.__getitem__)]


def check_cross_encoder(model) -> None:
    """A classifier scores pairs only as a cross-encoder, of one label (vLLM's rule); RequestError otherwise."""
    if model.num_labels != 1:
        raise RequestError(f"scores need a cross-encoder (a classifier of one label); {model.architecture} has "
                           f"{model.num_labels} labels: ask for its class probabilities (classify) instead")


def score_pairs(num_1: int, num_2: int, what: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[int, int]]:
    """vLLM's pairing of score inputs: one first text against each second text, or two lists of one length
    pairwise; RequestError (naming `what`) otherwise."""
    if not num_1 or not num_2:
        raise RequestError(f"{what[0] if not num_1 else what[1]}: give at least one text", param=what[0] if not num_1 else what[1])
    if num_1 == 1:
        return [(0, j) for j in range(num_2)]
    if num_1 != num_2:
        raise RequestError(f"{what[0]} has {num_1} texts and {what[1]} {num_2}: give one {what[0]} (scored against "
                           f"each {what[1]}) or as many as {what[1]} (scored in pairs)", param=what[0])
    return [(i, i) for i in range(num_1)]


def cosine_similarity(a: Tensor, b: Tensor) -> float:
    """The cosine of two embeddings (EmbeddingOutput.data), in float64 (vLLM's embedding score; eps 1e-8 as torch's)."""
    x, y = a.to(torch.float64), b.to(torch.float64)
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0, eps=1e-8))
