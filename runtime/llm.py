"""`LLM`: the offline Python API, as vLLM's — `LLM(artifact, **options).generate(prompts, params)`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from llmc.errors import RequestError
from llmc.runtime.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from llmc.runtime.engine import Engine
from llmc.runtime.engine_faults import RequestFailedError
from llmc.runtime.multimodal import chat_images, has_image_parts, images_of
from llmc.runtime.outputs import RequestOutput
from llmc.runtime.parallel.launcher import LaunchConfig
from llmc.runtime.pooling import (CROSS_ENCODER_TRUNCATION, REQUEST_TASKS, TASKS, ClassificationRequestOutput, EmbeddingRequestOutput,
                                  PoolingOutput, PoolingParams, PoolingRequestOutput, ScoringOutput, ScoringRequestOutput,
                                  check_cross_encoder, cosine_similarity, score_pairs)
from llmc.runtime.sampling_params import RequestOutputKind, SamplingParams
from llmc.runtime.tokenizer import apply_chat_template, checked_tools, encode_pair

PromptType = str | list[int] | dict


def _lora_requests(lora_request, num_prompts: int) -> list:
    """vLLM's lora_request: one LoRARequest for every prompt, a list of one per prompt, or None."""
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != num_prompts:
            raise RequestError(f"got {len(lora_request)} lora_requests for {num_prompts} prompts; give one per prompt "
                               "(None for the base model), or one for all")
        return list(lora_request)
    return [lora_request] * num_prompts


class LLM:
    """Load an artifact and generate. Keyword options are the recipe's `runtime` names
    (max_model_len, max_num_seqs, max_num_batched_tokens, num_kv_blocks, ...) or vLLM's where they differ
    (num_gpu_blocks_override, speculative_config, ...); `device` picks cpu/cuda.

    A tensor/pipeline-parallel artifact starts its other ranks as processes on this host (or joins
    the torchrun launch this process is part of; `launch` for several hosts). Call `close()` or use
    `with LLM(...) as llm:` to stop them; they are also stopped when the LLM is garbage-collected
    and at interpreter exit.
    """

    def __init__(self, artifact: str | Path | None = None, device: str | None = None, launch: LaunchConfig | None = None,
                 tokenizer_pool_size: int = 0, *, model: str | Path | None = None, **options):
        if (artifact is None) == (model is None):
            raise RequestError("give the artifact directory once: LLM(artifact) or, as vLLM names it, LLM(model=artifact)")
        artifact = artifact if artifact is not None else model
        if not (isinstance(tokenizer_pool_size, int) and tokenizer_pool_size >= 0):
            raise RequestError(f"tokenizer_pool_size must be an integer >= 0, got {tokenizer_pool_size!r}")
        self._closed = False
        self._busy = threading.Lock()  # one generate (and so chat) at a time: the engine is not thread-safe
        # open streams' outputs that another call's steps produced, kept until their stream reads them
        self._stream_outputs: dict[str, list[RequestOutput]] = {}
        self.engine = Engine(artifact, device=device, launch=launch, **options)
        # > 0: generate() tokenizes its text prompts on this many threads (fast tokenizers release the GIL)
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_pool_size) if tokenizer_pool_size else None

    def close(self) -> None:
        """Stop the worker ranks and destroy the process groups (idempotent; nothing on one rank)."""
        self._closed = True
        engine = getattr(self, "engine", None)  # absent if __init__ failed
        if engine is not None:
            engine.close()
        pool = getattr(self, "_tokenizer_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The artifact's Hugging Face tokenizer (vLLM's accessor; also the `tokenizer` property)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat sample with when given no sampling_params (vLLM's): SamplingParams with
        the model's generation-config defaults (temperature, top_p, top_k, min_p, repetition_penalty,
        max_tokens) under `generation_config` "auto", else SamplingParams()."""
        return SamplingParams(**self.engine.default_sampling_fields)

    def _check_usable(self) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError("this LLM is closed (close() or the end of its `with` block); create a new one")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm=False,
        priority: Sequence[int] | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the prompts' order. A prompt is text, a list of token
        ids, or {"prompt": ...} / {"prompt_token_ids": [...]}, with vLLM's "multi_modal_data": {"image": a PIL
        image or a list of them} for a vision model (one placeholder in the prompt per image: LLaVA's <image>, Gemma
        3's <start_of_image>, Mistral 3's / Pixtral's [IMG]), or vLLM's {"prompt_embeds": a [num_tokens, hidden_size] tensor} on an LLM started
        with enable_prompt_embeds=True (its outputs' prompt_token_ids are None); any of these dicts may carry vLLM's "cache_salt" (a string: the
        prompt's prefix-cache blocks are shared only with prompts of the same salt). If handling a request failed (its
        logits processor raised, ...) it ends alone, the others run to the end, and RequestFailedError
        is raised with every output (`.outputs`, the failed ones with `error` set).
        Not thread-safe: a second concurrent call raises RuntimeError; `use_tqdm` may be a tqdm-like factory.
        `lora_request` (vLLM's): a LoRARequest for every prompt, or a list of one (or None) per prompt, on an LLM
        started with enable_lora=True (runtime/lora.py)."""
        with self._exclusive("generate"):
            return self._generate(prompts, sampling_params, use_tqdm, priority, lora_request)

    @contextlib.contextmanager
    def _exclusive(self, method: str):
        """One generate / embed at a time (the engine is not thread-safe): a second, from another thread, raises."""
        self._check_usable()
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"LLM.{method} is already running on this LLM (another thread); an LLM is not "
                               "thread-safe: serialize the calls or use one LLM per thread")
        try:
            yield
        finally:
            self._busy.release()

    def _generate(self, prompts, sampling_params, use_tqdm, priority, lora_request=None) -> list[RequestOutput]:
        prompts = self._pretokenize(_as_prompt_list(prompts))
        # Only the final outputs are returned: no output is built for the steps before (as vLLM's LLM)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _with_output_kind(_as_params_list(sampling_params, len(prompts)), RequestOutputKind.FINAL_ONLY)
        return self._run(prompts, params, use_tqdm, priority, lora_request)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              *, truncate_prompt_tokens: int | None = None, use_tqdm=False, lora_request=None,
              priority: Sequence[int] | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: one EmbeddingRequestOutput per prompt, in order (`outputs.embedding`), on an LLM
        started with runner="pooling" (runtime/pooling.py). Prompts as generate's; `truncate_prompt_tokens`
        keeps each prompt's last k tokens (it sets that field of every PoolingParams)."""
        return self._pool("embed", prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, priority)

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
                 truncate_prompt_tokens: int | None = None, use_tqdm=False, lora_request=None,
                 priority: Sequence[int] | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify: one ClassificationRequestOutput per prompt, in order (`outputs.probs`), on a
        sequence classifier's artifact (a *ForSequenceClassification checkpoint; runtime/pooling.py)."""
        return self._pool("classify", prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, priority)

    def reward(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm=False, lora_request=None) -> list[PoolingRequestOutput]:
        """vLLM's LLM.reward: a classifier's (a reward model's) output at every prompt token (`.outputs.data`,
        [num_prompt_tokens, num_labels] float32): LLM.encode's pooling_task "token_classify"."""
        return self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           lora_request=lora_request, pooling_task="token_classify")

    def _pool(self, task: str, prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, priority) -> list:
        """Run `task` (a REQUEST_TASKS name; a token task on the engine of its base task) on every prompt."""
        base = task.removeprefix("token_")
        with self._exclusive(task):
            pooler = self.engine.pooler
            if pooler is None or pooler.task != base:
                need = ("an embedding model; start the LLM with runner='pooling' (llmc run --runner pooling)"
                        if base == "embed" else
                        "a sequence classifier (an artifact built from a *ForSequenceClassification checkpoint)")
                what = ("generates text" if pooler is None else
                        "is a sequence classifier (LLM.classify)" if pooler.task == "classify" else
                        "is an embedding model (LLM.embed)")
                method = f"encode(pooling_task={task!r})" if task != base else f"{task}()"
                raise RequestError(f"LLM.{method} is only supported for {need}; this one {what}")
            prompts = self._pretokenize(_as_prompt_list(prompts))
            params = _as_params_list(pooling_params or PoolingParams(), len(prompts), PoolingParams)
            if truncate_prompt_tokens is not None:
                params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
            if task != base:
                params = [dataclasses.replace(p, task=task) for p in params]
            return self._run(prompts, params, use_tqdm, priority, lora_request)

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm=False, lora_request=None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's LLM.encode: the pooled output of each prompt (`.outputs.data`, a float32 tensor): pooling_task
        "embed" (what `embed` returns) or "classify" (what `classify` returns), which must be the model's, or its
        token-level form, "token_embed" / "token_classify" (one row per prompt token); None: the model's."""
        if pooling_task not in (None, *REQUEST_TASKS):
            raise RequestError(f"pooling_task {pooling_task!r}: an llmc pooling engine runs {', '.join(REQUEST_TASKS)}",
                               param="pooling_task")
        task = pooling_task or (self.engine.pooler.task if self.engine.pooler is not None else "embed")
        outputs = self._pool(task, prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, None)
        if task not in TASKS:
            return outputs
        return [PoolingRequestOutput(o.request_id, PoolingOutput(
                    o.outputs.data if task == "embed" else torch.tensor(o.outputs.probs)), o.prompt_token_ids)
                for o in outputs]

    def score(self, data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType], *,
              truncate_prompt_tokens: int | None = None, use_tqdm=False, lora_request=None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: one ScoringRequestOutput per (data_1, data_2) pair (`.outputs.score`), one data_1
        against every data_2 or two lists of one length in pairs, in order. On an embedding model, the cosine
        similarity of the two texts' embeddings; on a cross-encoder (a classifier of one label), its activated
        output for the two texts encoded as one pair (runtime/pooling.py)."""
        first, second = _as_prompt_list(data_1), _as_prompt_list(data_2)
        pairs = score_pairs(len(first), len(second), ("data_1", "data_2"))
        pooler = self.engine.pooler
        if pooler is not None and pooler.task == "classify":
            check_cross_encoder(self.engine.manifest.model)
            if truncate_prompt_tokens is not None:
                raise RequestError(f"truncate_prompt_tokens: {CROSS_ENCODER_TRUNCATION}", param="truncate_prompt_tokens")
            encoded = [{"prompt_token_ids": encode_pair(self.tokenizer, _pair_text(first[i], "data_1"),
                                                         _pair_text(second[j], "data_2"))} for i, j in pairs]
            return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.probs[0]), o.prompt_token_ids)
                    for o in self.classify(encoded, use_tqdm=use_tqdm, lora_request=lora_request)]
        embedded = self.embed(first + second, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                              lora_request=lora_request)
        a, b = embedded[: len(first)], embedded[len(first):]
        return [ScoringRequestOutput(f"{a[i].request_id}+{b[j].request_id}",
                                     ScoringOutput(cosine_similarity(a[i].outputs.data, b[j].outputs.data)),
                                     a[i].prompt_token_ids + b[j].prompt_token_ids) for i, j in pairs]

    def _run(self, prompts: list, params: list, use_tqdm, priority, lora_request) -> list:
        """Queue one request per prompt (all or none) and step until they finish; their final outputs."""
        loras = _lora_requests(lora_request, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise RequestError(f"got {len(priority)} priorities for {len(prompts)} prompts; give one per prompt")
        ids: list[str] = []
        vision = self.engine.vision
        try:  # all or none
            if vision is not None:  # the prompts' images encoded in batches, not one request at a time
                vision.prefetch([image for prompt in prompts if isinstance(prompt, dict) and "multi_modal_data" in prompt
                                 for image in images_of(prompt["multi_modal_data"])])
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                ids.append(self._add(prompt, p, priority[i] if priority else 0, loras[i]))
            finished = self._run_to_completion(ids, use_tqdm)
        except BaseException:  # a bad request, or an interrupt (KeyboardInterrupt) while running: abort ours
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            if vision is not None:
                vision.clear_prefetched()
        return self._check_failures([finished[i] for i in ids])

    def _pretokenize(self, prompts: list) -> list:
        """Text prompts as {"prompt", "prompt_token_ids"}, tokenized on the pool (unchanged without one)."""
        if self._tokenizer_pool is None:
            return prompts
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(self._tokenizer_pool.map(self.tokenizer.encode, texts))
        return [{"prompt": p, "prompt_token_ids": next(encoded)} if isinstance(p, str) else p for p in prompts]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, lora_request=None) -> list[RequestOutput]:
        """Generate replies to conversations, rendered with the artifact's chat template (or `chat_template`);
        vLLM's keywords: add_generation_prompt, continue_final_message, chat_template_kwargs (the template's
        extra variables, e.g. {"enable_thinking": False} for Qwen3), tools (OpenAI's tool definitions
        {"type": "function", "function": {...}}, rendered by the template; the replies are text, as vLLM's
        LLM.chat returns them: read calls out of it yourself). `lora_request`: as generate's. For a vision model,
        content parts {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} or
        {"type": "image_pil", "image_pil": PIL image} are rendered as the template's image placeholders, and for
        Qwen2-VL, Qwen2.5-VL and Qwen3-VL {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}
        as its video placeholders (decoded with PyAV, runtime/video_io.py; runtime/multimodal.chat_images)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = {"chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message, "chat_template_kwargs": chat_template_kwargs,
                   "tools": checked_tools(tools) or None}
        prompts = [self._chat_prompt(c, options) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _chat_prompt(self, messages: list[dict], options: dict) -> dict:
        """A conversation rendered with the chat template: {"prompt_token_ids"}, and its images if any."""
        if has_image_parts(messages):  # (a text model refuses them before any image is read)
            self.engine.check_takes_images("messages")
        messages, images, videos = chat_images(messages, self.engine.chat_videos())
        prompt = {"prompt_token_ids": apply_chat_template(self.tokenizer, messages, **options)}
        media = {**({"image": images} if images else {}), **({"video": videos} if videos else {})}
        return {**prompt, "multi_modal_data": media} if media else prompt

    def stream(self, prompt: str | None, sampling_params: SamplingParams, messages: list[dict] | None = None,
               lora_request=None) -> Iterator[str]:
        """Queue one completion now (so a bad request fails here) and return an iterator of its text deltas.
        `lora_request`: its run-time LoRA adapter, as generate's."""
        self._check_usable()
        if isinstance(sampling_params, SamplingParams) and (sampling_params.best_of or sampling_params.n) > sampling_params.n:
            raise RequestError("LLM.stream takes no best_of > n: the best sequences are known only at the end; "
                               "use generate")
        [sampling_params] = _with_output_kind([sampling_params], RequestOutputKind.DELTA)
        if messages is not None:
            request_id = self._add(self._chat_prompt(messages, {}), sampling_params, 0, lora_request)
        else:
            request_id = self._add(prompt, sampling_params, 0, lora_request)
        self._stream_outputs[request_id] = []
        return _TextStream(self.engine, request_id, self._deltas(request_id), self._stream_outputs)

    def _deltas(self, request_id: str) -> Iterator[str]:
        """The text deltas; a generator closed (or dropped) before the end aborts its request. Outputs the
        steps make for other open streams (several read in turns, or a generate() meanwhile) are kept for them."""
        finished, queue = False, self._stream_outputs[request_id]
        try:
            while not finished:
                if not queue:
                    if not self.engine.has_unfinished_requests():
                        break
                    queue.extend(self._step_keeping_streams(lambda other: other == request_id))
                    continue
                output = queue.pop(0)
                finished = output.finished
                if output.error is not None:
                    raise RequestFailedError(output.error, [output])
                for completion in output.outputs:  # DELTA: the sequences that progressed
                    if completion.index == 0 and completion.text:
                        yield completion.text
        finally:
            self._stream_outputs.pop(request_id, None)
            if not finished:
                self.engine.abort_request(request_id)

    def _step_keeping_streams(self, is_mine) -> list[RequestOutput]:
        """One engine step: the outputs `is_mine(request_id)` claims; those of other open streams are
        kept for their streams (dropping them lost the streams' text)."""
        mine = []
        for output in self.engine.step():
            if is_mine(output.request_id):
                mine.append(output)
            elif output.request_id in self._stream_outputs:
                self._stream_outputs[output.request_id].append(output)
        return mine

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request=None) -> list[BeamSearchOutput]:
        """vLLM's beam search: one BeamSearchOutput per prompt, its best `beam_width` beams first
        (runtime/beam_search.py: how it runs and how beams share KV through the prefix cache)."""
        self._check_usable()
        if lora_request is not None:
            raise RequestError("lora_request: beam search does not run with a LoRA adapter; use generate",
                               param="lora_request")
        token_lists = []
        for prompt in _as_prompt_list(prompts):
            for key, what in (("multi_modal_data", "images"), ("prompt_embeds", "a prompt given as embeddings")):
                if isinstance(prompt, dict) and prompt.get(key) is not None:
                    raise RequestError(f"{key}: beam search does not run with {what}; use generate", param=key)
            if isinstance(prompt, dict):
                prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt.get("prompt")
            token_lists.append(self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt))
        return beam_search(self, token_lists, params)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: forget every cached prefix block; True when done, False while requests (an open stream's) hold
        blocks. `reset_running_requests` (vLLM's preemption of the running ones first) is not supported."""
        self._check_usable()
        if reset_running_requests:
            raise RequestError("reset_running_requests: not supported; reset the prefix cache when no request runs "
                               "(close open streams first)", param="reset_running_requests")
        return self.engine.reset_prefix_cache()

    def stats(self) -> dict:
        return self.engine.stats()

    def _add(self, prompt: PromptType, params: SamplingParams, priority: int, lora_request=None) -> str:
        add = functools.partial(self.engine.add_request, priority=priority, lora_request=lora_request)
        if isinstance(prompt, str):
            return add(prompt, params)
        if isinstance(prompt, dict):
            if "multi_modal_data" in prompt:  # a vision model's images (runtime/multimodal.py)
                add = functools.partial(add, multi_modal_data=prompt["multi_modal_data"])
            if "cache_salt" in prompt:  # vLLM's: its prefix-cache blocks match only the same salt's
                add = functools.partial(add, cache_salt=prompt["cache_salt"])
            if "prompt_embeds" in prompt:  # vLLM's EmbedsPrompt (enable_prompt_embeds; runtime/prompt_embeds.py)
                token_ids = prompt.get("prompt_token_ids")
                return add(prompt.get("prompt"), params, None if token_ids is None else list(token_ids),
                           prompt_embeds=prompt["prompt_embeds"])
            if "prompt_token_ids" in prompt:
                return add(prompt.get("prompt"), params, list(prompt["prompt_token_ids"]))
            if "prompt" in prompt:
                return add(prompt["prompt"], params)
            raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return add(None, params, prompt)
        raise RequestError(f"a prompt must be text, a list of token ids or a dict, got {type(prompt).__name__}")

    def _run_to_completion(self, request_ids: list[str], use_tqdm) -> dict[str, RequestOutput]:
        """Step until these requests finish (an open stream's request runs along, its outputs kept for it)."""
        finished: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        progress = use_tqdm if callable(use_tqdm) else tqdm  # vLLM: a callable is the progress bar's factory
        with progress(total=len(request_ids), desc="requests", disable=not use_tqdm) as bar:
            while pending and self.engine.has_unfinished_requests():
                for output in self._step_keeping_streams(pending.__contains__):
                    if output.finished:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(1)
        return finished

    def _check_failures(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Raise RequestFailedError (holding every output) if a request failed; else the outputs."""
        errors = [o.error for o in outputs if o.error is not None]
        if errors:
            more = f" (and {len(errors) - 1} more failed request(s))" if len(errors) > 1 else ""
            raise RequestFailedError(errors[0] + more, outputs)
        return outputs


class _TextStream:
    """`LLM.stream`'s iterator: closing it, or dropping it, aborts its request (started or not)."""

    def __init__(self, engine: Engine, request_id: str, deltas: Iterator[str], kept: dict[str, list]):
        self._engine = engine
        self.request_id = request_id
        self._deltas = deltas
        self._kept = kept  # LLM._stream_outputs: this stream's entry goes when it closes, even unstarted

    def __iter__(self) -> _TextStream:
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()
        self._kept.pop(self.request_id, None)
        self._engine.abort_request(self.request_id)  # a no-op once it finished

    def __del__(self) -> None:
        self.close()


def _pair_text(prompt, what: str) -> str:
    """A cross-encoder's input text (the pair is tokenized together: token-id prompts cannot be joined)."""
    if not isinstance(prompt, str):
        raise RequestError(f"{what}: a cross-encoder scores texts, encoded as one pair; give text, not token ids",
                           param=what)
    return prompt


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _with_output_kind(params: list, kind: RequestOutputKind) -> list:
    """The params with output_kind `kind` (copies; one per distinct object)."""
    copies: dict[int, SamplingParams] = {}
    for p in params:
        if isinstance(p, SamplingParams) and id(p) not in copies:
            copies[id(p)] = p if p.output_kind is kind else p.replace(output_kind=kind)
    return [copies.get(id(p), p) for p in params]


def _as_params_list(params, num_prompts: int, kind: type = SamplingParams) -> list:
    """`params` (one `kind` for every prompt, or one per prompt) as a list of one per prompt."""
    name = "sampling_params" if kind is SamplingParams else "pooling_params"
    if isinstance(params, kind):
        return [params] * num_prompts
    if isinstance(params, (str, bytes, dict)):
        raise RequestError(f"{name} must be a {kind.__name__} or a list of them, got {type(params).__name__}")
    params = list(params)
    if not all(isinstance(p, kind) for p in params):
        raise RequestError(f"{name} must be a {kind.__name__} or a list of them, got a list holding "
                           f"{next(type(p).__name__ for p in params if not isinstance(p, kind))}")
    if len(params) != num_prompts:
        raise RequestError(f"got {len(params)} {name} for {num_prompts} prompts; give one or one per prompt")
    return params
