"""The engine: requests in, one scheduled step at a time, outputs back.

`Engine.step()` reads as the data flow of DESIGN §5: schedule → run the model → sample →
update the scheduler → detokenize and check stops → outputs.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from pathlib import Path

import torch

from llmc.errors import ConfigError, RequestError, WorkerError
from llmc.kernels import to_device
from llmc.runtime import artifact as art
from llmc.runtime.layers.rotary import check_rotary_device
from llmc.runtime.loader import compute_dtype
from llmc.runtime.lora import LoRARequest, check_lora_artifact
from llmc.runtime.onnx_model import is_onnx
from llmc.runtime.options import generation_defaults, resolve_device, resolve_options
from llmc.runtime.multimodal import ChatVideos, ImageInputs, VisionEncoder, images_of, takes_videos, videos_of
from llmc.runtime.video_io import DEFAULT_NUM_FRAMES
from llmc.runtime.prompt_embeds import NOT_ENABLED, check_prompt_embeds, prompt_rows
from llmc.runtime.outputs import RequestOutput
from llmc.runtime.parallel.driver import make_model_runner
from llmc.runtime.parallel.launcher import LaunchConfig
from llmc.runtime.pooling import Pooler, PoolingGroup, PoolingParams, PoolingState, pooling_problem, pooling_task
from llmc.runtime.request import Request
from llmc.runtime.request_state import RequestGroup, SequenceState
from llmc.runtime.beam_group import BeamGroup, BeamState, advance_beam_groups, check_beam_width
from llmc.runtime.beam_scheduler import BeamScheduler
from llmc.runtime.batch_sampler import NO_TOKEN, BatchSampler, HostTokens, unpack_logprobs
from llmc.runtime.engine_multistep import can_multi_step, multi_step
from llmc.runtime.engine_spec import speculative_step
from llmc.runtime.engine_faults import (RequestFault, check_engine_invariants, fail_request, guard_processors,
                                        invariant_checks_enabled, reset_engine)
from llmc.runtime.sampling_params import RequestOutputKind, SamplingParams
from llmc.runtime.scheduler import ScheduledBatch, SchedulerConfig
from llmc.runtime.spec_decode import NgramProposer, SpecDecodeStats
from llmc.runtime.spec_draft import DraftModelProposer, draft_memory_reserve, read_draft_manifest
from llmc.runtime.mtp_head import read_mtp_head
from llmc.runtime.spec_eagle import EagleProposer, eagle_memory_reserve, read_eagle_head
from llmc.runtime.stats import StatsLogger
from llmc.runtime.structured_output import GrammarCache, fill_bitmasks, sequence_constraints
from llmc.runtime.step_inputs import InFlight, PendingTokens
from llmc.runtime.tokenizer import encode_text, load_chat_template, load_tokenizer

logger = logging.getLogger("llmc")


def check_cache_salt(cache_salt: object, params: SamplingParams | PoolingParams) -> None:
    """vLLM's rule: a cache_salt is a non-empty string (its words); not with beam search here (its beams are
    scheduled apart from the request's salt)."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise RequestError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    if getattr(params, "use_beam_search", False):
        raise RequestError("cache_salt: use_beam_search does not run with a cache salt; drop one of them",
                           param="cache_salt")


class Engine:
    """`launch`: where the ranks of a tensor/pipeline-parallel artifact run (default: all on this
    host, or the torchrun launch this process belongs to). `chat_template`: vLLM's --chat-template (a
    .jinja file or the template's text), rendered in place of the artifact's. `close()` stops them."""

    def __init__(self, artifact_dir: str | Path, device: str | None = None, launch: LaunchConfig | None = None,
                 chat_template: str | None = None, **options):
        self.artifact_dir = Path(artifact_dir)
        self.manifest = art.read_manifest(self.artifact_dir)
        self.options = resolve_options(self.manifest, options)
        if self.options.enable_lora:
            check_lora_artifact(self.manifest)  # before anything loads
        self.device = resolve_device(device)
        if not is_onnx(self.manifest):  # (an ONNX artifact runs on onnxruntime's CPU EP whatever the device)
            check_rotary_device(self.manifest.model, self.device)
        self.tokenizer = load_tokenizer(self.artifact_dir / art.TOKENIZER_DIR)
        if chat_template is not None:  # vLLM's --chat-template: in place of the artifact's
            self.tokenizer.chat_template = load_chat_template(chat_template)
        # the defaults of the fields a request leaves unset (LLM.get_default_sampling_params, the server)
        self.default_sampling_fields = generation_defaults(self.artifact_dir, self.options.generation_config)
        if self.default_sampling_fields:
            logger.info("default sampling parameters from the model's generation config: %s (generation_config "
                        "'vllm' ignores them)", self.default_sampling_fields)
        vocab_size = self.manifest.model.vocab_size
        self.eos_token_ids = model_eos_first(self.manifest.model.eos_token_ids, self.tokenizer.eos_token_id, vocab_size)
        self.max_logprobs = vocab_size if self.options.max_logprobs == -1 else self.options.max_logprobs
        task = self._check_pooling()
        draft = self._draft_artifact()
        eagle = self._eagle_head()
        if self.options.enable_prompt_embeds:
            self._check_prompt_embeds_engine(draft is not None)
        if draft is not None and self.manifest.vision is not None and self.manifest.vision.mrope_section:
            raise ConfigError(f"speculative method draft_model: {self.manifest.vision.architecture}'s M-RoPE positions "
                              "are not given to a draft model; use method ngram, or no speculative decoding")
        if self.options.limit_mm_per_prompt is not None and self.manifest.vision is None:
            raise ConfigError(f"limit_mm_per_prompt: this model ({self.manifest.model.architecture}) takes no images"
                              f"{_text_only(self.manifest)}; drop limit_mm_per_prompt")
        limits = self.options.limit_mm_per_prompt
        if limits is not None and limits.video and not takes_videos(self.manifest.vision):
            raise ConfigError(f"limit_mm_per_prompt.video: this model ({self.manifest.vision.architecture}) takes no "
                              "videos (Qwen2-VL, Qwen2.5-VL and Qwen3-VL do); set it to 0 or drop it")
        video_io = self._video_io()
        if video_io is not None and not takes_videos(self.manifest.vision):
            architecture = (self.manifest.vision or self.manifest.model).architecture
            raise ConfigError(f"media_io_kwargs.video: this model ({architecture}) takes no videos (Qwen2-VL, "
                              "Qwen2.5-VL and Qwen3-VL do); drop it")
        if video_io is not None and video_io.num_frames == 0:
            raise ConfigError("media_io_kwargs.video.num_frames: 0 keeps no frame; give a count, or -1 for every frame")
        # the draft's share of the memory: of the measured plan on a GPU, of cpu_kv_cache_gib on a CPU
        reserve = draft_memory_reserve(*draft, self.options, self.device) if draft is not None else (0, 0)
        if eagle is not None:
            reserve = eagle_memory_reserve(eagle[0], eagle[1], self.manifest, self.options, self.device)
        # a vision model's encoder (runtime/multimodal.py), loaded before the runner sizes the KV cache
        self.vision = (VisionEncoder(self.artifact_dir, self.manifest, self.device, compute_dtype(self.manifest, self.device))
                       if self.manifest.vision is not None else None)
        keep_hidden = None if eagle is None else (eagle[2], eagle[1].reads_final_hidden)  # what the head reads
        self.runner = make_model_runner(self.artifact_dir, self.manifest, self.options, self.device, launch, reserve,
                                        keep_hidden)
        self.device = getattr(self.runner, "device", self.device)  # a parallel driver pins its GPU
        self.scheduler = BeamScheduler(SchedulerConfig(
            max_num_seqs=self.options.max_num_seqs,
            max_num_batched_tokens=self.options.max_num_batched_tokens,
            max_model_len=self.options.max_model_len,
            block_size=self.options.block_size,
            num_blocks=self.runner.num_blocks,
            enable_prefix_caching=self.options.enable_prefix_caching,
            policy=self.options.scheduling_policy,
            max_loras=self.options.max_loras,
            long_prefill_token_threshold=self.options.long_prefill_token_threshold,
            recompute_last_cached_block=eagle is not None,
        ))
        self.sampler = BatchSampler(self.options.max_num_seqs, self.manifest.model.vocab_size, self.device,
                                    self.eos_token_ids, seed=self.options.seed)
        self._free_rows = list(reversed(range(self.options.max_num_seqs)))  # rows of the persistent batch
        self._can_overlap = self.options.async_scheduling and self.runner.can_overlap
        self._in_flight: InFlight | None = None  # the launched step whose tokens are not resolved yet
        speculative = self.options.speculative
        self.proposer = None
        if draft is not None:
            self.proposer = DraftModelProposer(speculative, *draft, self.options, self.device, self.runner.num_blocks)
        elif eagle is not None:
            self.proposer = EagleProposer(speculative, *eagle, self.runner, self.options, self.device)
        elif speculative is not None:
            self.proposer = NgramProposer(speculative)
        # runner pooling: an embedding model or a classifier (runtime/pooling.py); its requests are prompts, never sampled
        self.pooler = (Pooler.for_engine(self.options.pooler_config, self.artifact_dir / art.TOKENIZER_DIR,
                                         self.manifest.model, task,
                                         self.runner.classify if task == "classify" else None)
                       if task is not None else None)
        self.spec_generator = torch.Generator(self.device).manual_seed(self.options.seed)
        self.spec_stats = SpecDecodeStats()
        self.stats_logger = StatsLogger(self.options.log_stats_interval, enabled=not self.options.disable_log_stats)
        self.groups: dict[str, RequestGroup] = {}
        self.sequences: dict[str, SequenceState | BeamState] = {}
        self._beam_group_ids: set[str] = set()  # use_beam_search requests: their steps run synchronously
        self.grammars = GrammarCache(self.tokenizer, self.manifest.model.vocab_size, self.eos_token_ids)
        self._ids = itertools.count()
        self._outputs: list[RequestOutput] = []  # the current step's outputs so far
        self._check_invariants = invariant_checks_enabled()
        self.num_resets = 0  # steps that failed as a whole (the engine failed every request and reset)
        freeze_gc_heap()
        self._holds_gc_freeze = True

    def _check_pooling(self) -> str | None:
        """The pooling task this engine runs (embed, classify; None: it generates), refusing what does not run
        with it."""
        model = self.manifest.model
        problem = pooling_problem(self.options, self.manifest.parallel.world_size, model)
        if problem is not None:
            raise ConfigError(problem)
        return pooling_task(self.options, model)

    def _check_prompt_embeds_engine(self, has_draft: bool) -> None:
        """enable_prompt_embeds runs on the torch runtime, on one rank, without a draft model (whose embeddings
        differ); refused by name elsewhere."""
        where = ("an onnx-cpu artifact" if is_onnx(self.manifest) else
                 "a tensor/pipeline-parallel artifact" if self.manifest.parallel.world_size != 1 else
                 "speculative method draft_model (the draft embeds token ids)" if has_draft else None)
        if where is not None:
            raise ConfigError(f"enable_prompt_embeds does not run with {where}; drop enable_prompt_embeds, or use a "
                              "single-rank torch artifact" + (" with method ngram" if has_draft else ""))

    def _draft_artifact(self) -> tuple[Path, art.Manifest] | None:
        """The draft model's folder and manifest under speculative method draft_model (checked), else None."""
        speculative = self.options.speculative
        if speculative is None or speculative.method != "draft_model":
            return None
        if self.options.enable_lora:
            raise ConfigError("speculative method draft_model does not run with enable_lora (the draft has no "
                              "adapters); use method ngram, or drop one of them")
        if is_onnx(self.manifest) or self.manifest.parallel.world_size != 1:
            where = "an onnx-cpu artifact" if is_onnx(self.manifest) else "a tensor/pipeline-parallel artifact"
            raise ConfigError(f"speculative method draft_model does not run on {where}; use method ngram, or a "
                              "single-rank torch artifact")
        return read_draft_manifest(speculative, self.artifact_dir, self.manifest, self.options)

    def _eagle_head(self) -> tuple | None:
        """The EAGLE head's folder, config and the model's layers it reads under speculative method eagle3 or eagle
        (checked against the model and the engine's options); under method mtp the artifact's folder, its MTP
        layer's config and no layers (it reads the final hidden states: runtime/mtp_head.py); else None."""
        speculative = self.options.speculative
        if speculative is None or speculative.method not in ("eagle3", "eagle", "mtp"):
            return None
        method = speculative.method
        where = ("an onnx-cpu artifact" if is_onnx(self.manifest) else
                 "a tensor/pipeline-parallel artifact" if self.manifest.parallel.world_size != 1 else
                 "a vision model (its image rows are not the head's inputs)" if self.manifest.vision is not None else
                 "enable_prompt_embeds (the head embeds token ids)" if self.options.enable_prompt_embeds else
                 "enable_lora (the head has no adapters)" if self.options.enable_lora else None)
        if where is not None:
            raise ConfigError(f"speculative method {method} does not run with {where}; use method ngram, or drop one of them")
        if method == "mtp":
            return self.artifact_dir, read_mtp_head(self.manifest), ()
        return read_eagle_head(speculative, self.manifest, self.options)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt: str | None, params: SamplingParams | PoolingParams,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    multi_modal_data: dict | None = None, prompt_embeds: torch.Tensor | None = None,
                    cache_salt: str | None = None) -> str:
        """Queue a request (text or token ids); returns its id. `arrival_time` is on time.monotonic()'s clock.
        `lora_request`: the run-time LoRA adapter its tokens go through (enable_lora; runtime/lora.py).
        `multi_modal_data` (vLLM's): {"image": a PIL image or a list of them}, one placeholder (LLaVA's <image>,
        Gemma 3's <start_of_image>, Pixtral's [IMG], Qwen2-VL's <|image_pad|>) in the prompt per image, for a vision model (runtime/multimodal.py).
        `prompt_embeds` (vLLM's EmbedsPrompt): the prompt as embeddings [num_tokens, hidden_size], in place of
        text or ids, on an engine started with enable_prompt_embeds (runtime/prompt_embeds.py).
        `cache_salt` (vLLM's): a string salting the request's prefix-cache hashes, so that its cached blocks serve only
        requests with the same salt (one tenant's prompts cannot be probed by another's timing).
        PoolingParams (vLLM's): an embedding request, on an engine started with runner pooling."""
        if (self.pooler is not None) != isinstance(params, PoolingParams):
            raise RequestError(("this model runs as an embedding model (runner pooling): it does not generate text; "
                                "ask for embeddings (LLM.embed, /v1/embeddings), or start it with runner generate")
                               if self.pooler is not None and self.pooler.task == "embed" else
                               ("this model is a sequence classifier: it does not generate text; ask for class "
                                "probabilities (LLM.classify, /classify) or scores (LLM.score, /score)")
                               if self.pooler is not None else
                               "PoolingParams: embeddings need an engine started with runner pooling (llmc run "
                               "--runner pooling, LLM(..., runner='pooling')); this one generates text")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if priority != 0 and self.options.scheduling_policy != "priority":  # vLLM refuses it too
            raise RequestError(f"priority {priority}: priority scheduling is not enabled (scheduling_policy is "
                               f"{self.options.scheduling_policy!r}); leave priority at 0, or start the engine with "
                               "scheduling_policy 'priority' (llmc run --scheduling-policy priority)", param="priority")
        if request_id in self.groups:
            raise RequestError(f"request_id {request_id!r} is already in use")
        embeds = None
        if prompt_embeds is not None:
            prompt_embeds, prompt_token_ids, embeds = self._embeds_prompt(prompt, prompt_token_ids, prompt_embeds,
                                                                          multi_modal_data, params)
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("give a prompt or prompt_token_ids")
            try:
                prompt_token_ids = encode_text(self.tokenizer, prompt, keep=self._prompt_tokens_kept(params))
            except Exception as e:  # noqa: BLE001 - the tokenizer's own types (a lone surrogate, ...)
                raise RequestError(f"the prompt cannot be tokenized ({type(e).__name__}: {e}); send valid text") from None
        lora_int_id = self._check_lora(lora_request, params)
        check_cache_salt(cache_salt, params)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if embeds is None:
            prompt_token_ids, images = self._encode_images(list(prompt_token_ids), multi_modal_data, params)
        else:
            images = embeds
        if self.pooler is not None:  # a prompt of up to max_model_len tokens, computed and never sampled
            self.pooler.check(params)
            prompt_token_ids = self._check_prompt(prompt_token_ids, params, generates=False)
            group = PoolingGroup(request_id, prompt, prompt_token_ids, params, arrival_time)
        else:
            params = self._check_logprob_counts(params)
            prompt_token_ids = self._check_prompt(prompt_token_ids, params)
            params.check_vocab(self.manifest.model.vocab_size)
            if params.guided_decoding is not None:
                self.grammars.compile(params.guided_decoding)  # an invalid grammar fails here, once
            group = (BeamGroup if params.use_beam_search else RequestGroup)(request_id, prompt, prompt_token_ids,
                                                                             params, arrival_time)
            if embeds is not None:
                group.prompt_embeds = prompt_embeds
        self.groups[request_id] = group
        try:  # all or none: a failure part-way is undone through the abort path
            if isinstance(group, BeamGroup):
                self._beam_group_ids.add(request_id)
                group.start(self, priority)
            elif isinstance(group, PoolingGroup):
                self._add_pooling(group, priority, lora_int_id, images, cache_salt)
            else:
                self._add_sequences(group, priority, lora_int_id, images, cache_salt)
        except BaseException:
            self.abort_request(request_id)
            raise
        return request_id

    def _encode_images(self, prompt_token_ids: list[int], multi_modal_data: dict | None,
                       params: SamplingParams | PoolingParams) -> tuple[list[int], ImageInputs | None]:
        """The prompt with its images' placeholders expanded and the images encoded (runtime/multimodal.py); as it
        is, and None, without images."""
        images = [] if multi_modal_data is None else images_of(multi_modal_data)
        takes_video = self.vision is not None and self.vision.takes_videos
        metadata = self.vision is not None and self.vision.is_qwen3  # (frames, metadata) pairs: timestamps
        videos = [] if multi_modal_data is None else videos_of(multi_modal_data, takes_video, metadata=metadata)
        limits = self.options.limit_mm_per_prompt
        if limits is not None and limits.image is not None and len(images) > limits.image:
            raise RequestError(f"At most {limits.image} image(s) may be provided in one prompt.",  # vLLM's words
                               param="multi_modal_data")
        if limits is not None and limits.video is not None and len(videos) > limits.video:
            raise RequestError(f"At most {limits.video} video(s) may be provided in one prompt.",  # vLLM's words
                               param="multi_modal_data")
        if not images and not videos:
            if self.vision is not None:
                self.vision.check_no_placeholders(prompt_token_ids)
            return prompt_token_ids, None
        self.check_takes_images("multi_modal_data")
        if getattr(params, "use_beam_search", False):
            raise RequestError("multi_modal_data: use_beam_search does not run with images; drop one of them",
                               param="multi_modal_data")
        if params.truncate_prompt_tokens is not None:
            raise RequestError("truncate_prompt_tokens: a prompt with images is not truncated (it could cut an "
                               "image's tokens); drop truncate_prompt_tokens", param="truncate_prompt_tokens")
        prompt_token_ids, inputs = self.vision.prompt_inputs(prompt_token_ids, images, videos)
        budget = self.scheduler.config.max_chunk_tokens
        name = "max_num_batched_tokens" if budget == self.options.max_num_batched_tokens else "long_prefill_token_threshold"
        if any(hi - lo > budget for lo, hi in inputs.spans):  # an image is prefilled in one chunk (scheduler)
            raise RequestError(f"an image of {max(hi - lo for lo, hi in inputs.spans)} tokens is more than "
                               f"{name} ({budget}): its tokens attend to each other and are prefilled "
                               f"in one step; raise {name}", param="multi_modal_data")
        return prompt_token_ids, inputs

    def _embeds_prompt(self, prompt, prompt_token_ids, prompt_embeds, multi_modal_data,
                       params: SamplingParams | PoolingParams) -> tuple[torch.Tensor, list[int], ImageInputs]:
        """A prompt given as embeddings: (the embeddings checked, its placeholder token ids, its rows), its last
        truncate_prompt_tokens rows kept; refused where the engine does not take them or the request reads the
        prompt's token ids."""
        if not self.options.enable_prompt_embeds:
            raise RequestError(NOT_ENABLED, param="prompt_embeds")
        if prompt is not None or prompt_token_ids is not None or multi_modal_data is not None:
            raise RequestError("prompt_embeds: give the prompt once, as embeddings, without prompt, prompt_token_ids "
                               "or multi_modal_data", param="prompt_embeds")
        if self.pooler is not None:
            raise RequestError("prompt_embeds: a pooling model (runner pooling) takes text or token ids",
                               param="prompt_embeds")
        for name, asked in (("prompt_logprobs", params.prompt_logprobs is not None),
                            ("use_beam_search", params.use_beam_search)):
            if asked:
                raise RequestError(f"{name}: a prompt given as embeddings has no token ids to score or extend; drop "
                                   f"{name}", param=name)
        embeds = check_prompt_embeds(prompt_embeds, self.manifest.model.hidden_size)
        keep = self._prompt_tokens_kept(params)
        if keep is not None:
            embeds = embeds[-keep:]
        return embeds, *prompt_rows(embeds, self.device, compute_dtype(self.manifest, self.device))

    def chat_videos(self) -> ChatVideos | None:
        """How a chat's video_url parts are read for this model (runtime/multimodal.chat_images); None: it takes
        no video."""
        if self.vision is None or not self.vision.takes_videos:
            return None
        video_io = self._video_io()
        return ChatVideos(video_io.num_frames if video_io is not None else DEFAULT_NUM_FRAMES, self.vision.is_qwen3)

    def _video_io(self):
        """vLLM's media_io_kwargs' video part (how a chat's video_url parts are sampled), or None."""
        return self.options.media_io_kwargs.video if self.options.media_io_kwargs is not None else None

    def check_takes_images(self, param: str) -> None:
        """RequestError naming `param` unless this is a vision model."""
        if self.vision is None:
            raise RequestError(f"{param}: this model ({self.manifest.model.architecture}) takes no images"
                               f"{_text_only(self.manifest)}; send text only, or serve a vision model (LlavaForConditionalGeneration, "
                               "LlavaNextForConditionalGeneration, Gemma3ForConditionalGeneration, "
                               "Mistral3ForConditionalGeneration, Qwen2VLForConditionalGeneration, "
                               "Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration)", param=param)

    def _check_lora(self, lora_request: LoRARequest | None, params: SamplingParams) -> int | None:
        """The adapter's id, its files read and checked (once per id); None without one."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise RequestError(f"lora_request: expected a LoRARequest (llmc.LoRARequest), got {type(lora_request).__name__}",
                               param="lora_request")
        if getattr(self.runner, "lora", None) is None:
            raise RequestError("lora_request: run-time LoRA is off; start the engine with enable_lora (llmc run "
                               "--enable-lora), or merge the adapter at build time (recipe `adapter`)", param="lora_request")
        if getattr(params, "use_beam_search", False):
            raise RequestError("lora_request: use_beam_search does not run with a LoRA adapter; drop one of them",
                               param="lora_request")
        self.runner.lora.read(lora_request)
        return lora_request.lora_int_id

    def _add_pooling(self, group: PoolingGroup, priority: int, lora_int_id: int | None,
                     images: ImageInputs | None = None, cache_salt: str | None = None) -> None:
        """An embedding request's one scheduler Request (`pooling`: its prompt computed, nothing sampled)."""
        mode = self.pooler.mode_of(group.params)
        request = Request(request_id=f"{group.request_id}#0", prompt_token_ids=group.prompt_token_ids, max_tokens=0,
                          arrival_time=group.arrival_time, priority=priority, pooling=True,
                          skip_prefix_cache=not self.pooler.reads_cached_prefix(mode), lora_int_id=lora_int_id,
                          images=images, cache_salt=cache_salt)
        state = PoolingState(request, group.request_id, self.pooler.task_of(group.params), mode)
        group.sequences.append(state)
        self.sequences[request.request_id] = state
        self.scheduler.add_request(request)

    def _add_sequences(self, group: RequestGroup, priority: int, lora_int_id: int | None = None,
                       images: ImageInputs | None = None, cache_salt: str | None = None) -> None:
        room = self.options.max_model_len - len(group.prompt_token_ids)
        for index, child_params in enumerate(group.child_params()):
            guard_processors(child_params, group.request_id)
            max_tokens = room if child_params.max_tokens is None else min(child_params.max_tokens, room)
            request = Request(
                request_id=f"{group.request_id}#{index}", prompt_token_ids=group.prompt_token_ids,
                max_tokens=max_tokens, arrival_time=group.arrival_time, priority=priority,
                sampling_params=child_params, skip_prefix_cache=child_params.prompt_logprobs is not None,
                lora_int_id=lora_int_id, images=images, prompt_is_embeds=group.prompt_embeds is not None,
                cache_salt=cache_salt,
            )
            state = SequenceState(request, index, child_params, self.tokenizer,
                                  self.eos_token_ids, self.options.max_model_len, group.request_id,
                                  self.options.stream_interval)
            state.banned_token_ids, state.constraints = sequence_constraints(child_params, self.grammars)
            group.sequences.append(state)
            self.sequences[request.request_id] = state
            self.scheduler.add_request(request)

    def _check_logprob_counts(self, params: SamplingParams) -> SamplingParams:
        """vLLM's max_logprobs: logprobs / prompt_logprobs (-1: the whole vocabulary) and a beam search's
        2 × beam width logprobs per step at most; returns the params with -1 made the vocabulary size."""
        vocab_size = self.manifest.model.vocab_size
        whole = {name: vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
        for name in ("logprobs", "prompt_logprobs"):
            value = whole.get(name, getattr(params, name))
            if value is not None and value > self.max_logprobs:
                asked = f"-1 (the whole vocabulary, {vocab_size})" if name in whole else str(value)
                raise RequestError(f"SamplingParams.{name} {asked} is more than max_logprobs ({self.max_logprobs}); "
                                   "ask for fewer, or start the engine with a larger max_logprobs (-1: no limit)")
        if params.use_beam_search:
            if self.manifest.model.is_hybrid:  # (forked beams would need their states copied)
                raise RequestError(f"use_beam_search: not supported for {self.manifest.model.architecture} (a hybrid "
                                   "model: a beam's recurrent state is not forked); sample instead")
            check_beam_width("SamplingParams.n", params.n, self.max_logprobs)
        return params.replace(**whole) if whole else params

    def _prompt_tokens_kept(self, params: SamplingParams) -> int | None:
        """truncate_prompt_tokens, -1 being the model's max_model_len (vLLM's)."""
        keep = params.truncate_prompt_tokens
        return self.options.max_model_len if keep == -1 else keep

    def _check_prompt(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                      generates: bool = True) -> list[int]:
        """The prompt truncate_prompt_tokens leaves, refused if empty, out of the vocabulary, or too long: one that
        generates needs room for a token after it (below max_model_len), an embedding's may fill the context."""
        keep = self._prompt_tokens_kept(params)
        if keep is not None:  # a token-id prompt (a text one is cut as it is tokenized: encode_text)
            prompt_token_ids = prompt_token_ids[-keep:]
        if not prompt_token_ids:
            raise RequestError("the prompt is empty; give at least one token")
        self._check_token_ids(prompt_token_ids, "prompt")
        room = 1 if generates else 0  # the token generated after the prompt
        if len(prompt_token_ids) > self.options.max_model_len - room:
            raise RequestError(
                f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is {self.options.max_model_len}; "
                "shorten the prompt or raise max_model_len"
            )
        return prompt_token_ids

    def abort_request(self, request_id: str) -> None:
        """End a request (the id add_request returned) wherever it is: the one abort path. Its
        sequences leave the scheduler (KV blocks and prefix-cache references freed), the engine's
        maps and their persistent-batch rows; a token of it still in flight is dropped when it lands."""
        group = self.groups.pop(request_id, None)
        self._beam_group_ids.discard(request_id)
        for state in group.sequences if group else []:
            self.scheduler.abort_request(state.request.request_id)
            self.sequences.pop(state.request.request_id, None)
            self._release_rows([state.request])

    def _fail(self, group_id: str, error: BaseException) -> list[RequestOutput]:
        return fail_request(self, group_id, error)

    def has_unfinished_requests(self) -> bool:
        """Requests to schedule, or a step whose tokens are still on the device."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def close(self) -> None:
        """Stop the worker ranks of a parallel engine and destroy its process groups (idempotent); let
        the garbage collector see the frozen heap again once no other engine of the process is open, so that what
        the engines held can be freed (release_gc_heap)."""
        self.runner.close()
        if getattr(self, "proposer", None) is not None:
            self.proposer.close()
        if getattr(self, "_holds_gc_freeze", False):
            self._holds_gc_freeze = False
            release_gc_heap()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of the requests that progressed.

        NOTE (overlapped scheduling): with async_scheduling (the default, on a runner that can
        overlap) a step launches step N's forward and sampling on the device, records its sampled
        tokens as pending in the scheduler, and only then waits for step N-1's tokens, resolves them
        (detokenize, stops, outputs) and returns step N-1's outputs: the host's work for N-1 and the
        scheduling of N+1 run while the device computes N. A request that stops at N-1 has also
        computed one token at N; that token is dropped. Steps that must see every token on the host
        before they run (n-gram speculation, logits processors) or right after (prompt logprobs)
        resolve what is in flight first, and the step itself, synchronously.
        """
        self._outputs = []
        try:
            self._step()
        except RequestFault as fault:  # raised before the step's tokens were recorded: the rest re-run
            self._outputs += self._fail(fault.group_id, fault)
            # The re-run must not reuse the staging buffer of a step still in flight: land that step first.
            self._outputs += self._resolve(self._take_in_flight())
        except WorkerError:  # a rank is gone: the caller stops serving
            raise
        except Exception as e:  # noqa: BLE001 - not one request's fault: fail all, reset, go on
            self._outputs += reset_engine(self, e)
        outputs, self._outputs = self._outputs, []
        if self._check_invariants:
            check_engine_invariants(self)
        return outputs

    def _step(self) -> None:
        outputs = self._outputs
        if self._in_flight is not None and (self.sampler.has_processors or self.sampler.has_constraints
                                            or self._beam_group_ids):
            # processors read the histories; grammar matchers and bad words advance by the tokens;
            # beams' next tokens are chosen on the host
            outputs += self._resolve(self._take_in_flight())
        batch = self.scheduler.schedule()
        self._release_rows(batch.preempted)
        if batch.is_empty:
            outputs += self._resolve(self._take_in_flight())
            return
        self._assign_rows(batch)
        if self.pooler is not None:
            outputs += self._pooling_step(batch)
            return
        if self.proposer is not None:
            outputs += speculative_step(self, batch)
            return
        if self.options.num_scheduler_steps > 1 and can_multi_step(self, batch):
            outputs += multi_step(self, batch, self.options.num_scheduler_steps)
            return
        launched = self._launch(batch)
        self._release_rows(self.scheduler.advance(batch))
        if not self._can_overlap or launched.prompt_logits:
            outputs += self._resolve(self._take_in_flight())
            outputs += self._resolve(launched)
            return
        previous, self._in_flight = self._in_flight, launched
        outputs += self._resolve(previous)

    def _pooling_step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """A step of embedding requests, synchronous: forward, pool, and the embeddings of the prompts it
        completed (runtime/pooling.py)."""
        for request in batch.preempted:  # their prompts are computed again from the first token
            self.sequences[request.request_id].restart()
        num_prefill = self._mark_scheduled(batch)
        hidden = self.runner.pool_hidden(batch)
        states = [self.sequences[s.request.request_id] for s in batch.requests]
        done = self.pooler.accumulate(hidden, batch, states)
        self._release_rows(self.scheduler.complete_prompts(batch))
        outputs = []
        embeddings = self.pooler.finish(done, [self.groups[s.group_id].params for s in done])
        for state, embedding in zip(done, embeddings):
            group = self.groups[state.group_id]
            outputs.append(group.output(embedding, state.task))
            self._release(group)
        self.stats_logger.record(num_prefill, 0, self.stats)
        return outputs

    def _take_in_flight(self) -> InFlight | None:
        in_flight, self._in_flight = self._in_flight, None
        return in_flight

    def _launch(self, batch: ScheduledBatch) -> InFlight:
        """Forward and sample on the device; start copying the tokens to the host."""
        in_flight = self._in_flight
        pending = None if in_flight is None else PendingTokens(in_flight.sampled.token_ids, in_flight.index)
        num_prefill = self._mark_scheduled(batch)  # before the forward: queue time ends where compute starts
        if batch.blocks_to_copy:  # copy-on-write of blocks that forked beams share (runtime/beam_scheduler.py)
            self.runner.copy_blocks(batch.blocks_to_copy)
        step = self.runner.execute(batch, pending)
        sampled_requests = [s.request for s in batch.requests if s.is_last_chunk]
        processors = []
        if self.sampler.has_processors:
            processors = [(i, r.batch_row, r.known_prompt_token_ids, r.output_token_ids)
                          for i, r in enumerate(sampled_requests) if r.sampling_params.logits_processors]
        grammar = bad_words = None
        if self.sampler.has_constraints and sampled_requests:  # none when the step is prompt chunks only
            constraints = [self.sequences[r.request_id].constraints for r in sampled_requests]
            masks = fill_bitmasks(constraints, self.sampler.vocab_size, self.grammars.batch_matcher())
            grammar, bad_words = (None if m is None else to_device(m, self.device) for m in masks)
        sampled = self.sampler.sample(step.logits, step.sample_rows, processors, grammar, bad_words)
        return InFlight(sampled, HostTokens(sampled, self.device), sampled_requests,
                        {r.request_id: i for i, r in enumerate(sampled_requests)}, step.prompt_logits, num_prefill)

    def _mark_scheduled(self, batch: ScheduledBatch) -> int:
        """Note the first step of requests scheduled for the first time; return the prompt tokens
        the step computes (statistics). A request's first step is never a decode."""
        num_prefill, now = 0, None
        for scheduled in batch.requests:
            if not _is_decode(scheduled):
                num_prefill += scheduled.num_new_tokens - len(scheduled.draft_token_ids)
                now = time.monotonic() if now is None else now
                self.groups[self.sequences[scheduled.request.request_id].group_id].mark_scheduled(now)
        return num_prefill

    def _record_prompt_logprobs(self, prompt_logits: dict[str, tuple[int, torch.Tensor]]) -> list[RequestOutput]:
        """Record each request's prompt logprobs; returns the outputs of requests that failed to."""
        failed: list[RequestOutput] = []
        for request_id, (first_position, rows) in prompt_logits.items():
            if request_id in self.sequences:
                state = self.sequences[request_id]
                failed += self._guarded(state, state.record_prompt_logprobs, first_position, rows)
        return failed

    def _resolve(self, step: InFlight | None) -> list[RequestOutput]:
        """Step `step`'s tokens reached the host: append them, detokenize, check stops, build outputs."""
        if step is None:
            return []
        failed = self._record_prompt_logprobs(step.prompt_logits)
        token_ids, logprob_rows = step.host.wait()
        states, num_generated = [], 0
        for i, request in enumerate(step.requests):
            state = self.sequences.get(request.request_id)
            if state is None or state.is_finished:  # aborted, or stopped by its previous token
                continue
            if token_ids[i] != NO_TOKEN:
                self.scheduler.resolve(request, [token_ids[i]])
                num_generated += 1
            logprobs = logprob_rows[i] if logprob_rows is not None else None
            errors = self._guarded(state, self._record_token, state, token_ids[i], logprobs)
            failed += errors
            if not errors:
                states.append(state)
        self.stats_logger.record(step.num_prefill, num_generated, self.stats)
        if self._beam_group_ids:
            failed += advance_beam_groups(self, states)
        return failed + self._collect_outputs(states)

    def _record_token(self, state: SequenceState, token_id: int, logprob_row: list[float] | None) -> None:
        if token_id == NO_TOKEN:  # its constraints allowed no token: it ends here
            self._check_stop(state, [], no_token_allowed=True)
            return
        if logprob_row is not None and state.logprobs is not None:
            state.record_logprobs(token_id, unpack_logprobs(logprob_row, state.params.logprobs))
        self._check_stop(state, [token_id])

    def _guarded(self, state: SequenceState, fn, *args) -> list[RequestOutput]:
        """Run fn(*args) for one sequence; if it raises, its request fails alone: [its error output]."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - detokenization, stops, logprobs: this request's fault
            return self._fail(state.group_id, e)
        return []

    # ---- persistent batch rows ----------------------------------------------------------------

    def _assign_rows(self, batch: ScheduledBatch) -> None:
        """A row for every scheduled request that has none (admitted or re-admitted this step)."""
        for scheduled in batch.requests:
            request = scheduled.request
            if request.batch_row is None:
                request.batch_row = self._free_rows.pop()
                if request.pooling:  # a row for its block table; nothing to sample
                    continue
                state = self.sequences[request.request_id]
                try:
                    self.sampler.add(request.batch_row, request.sampling_params, request.known_prompt_token_ids,
                                     request.output_token_ids, state.banned_token_ids, state.constraints is not None)
                except Exception as e:  # noqa: BLE001 - its sampling parameters: this request's fault
                    raise RequestFault(state.group_id, e) from e

    def _release_rows(self, requests) -> None:
        for request in requests:
            if request.batch_row is not None:
                self.sampler.remove(request.batch_row)
                self._free_rows.append(request.batch_row)
                request.batch_row = None

    def _check_stop(self, state: SequenceState, new_tokens: list[int], no_token_allowed: bool = False) -> None:
        """Detokenize the new tokens; finish the sequence on eos, a stop token or a stop string, or
        (`no_token_allowed`: its constraints left nothing to sample after them) with "stop"."""
        request = state.request
        if state.constraints is not None:
            state.constraints.accept(new_tokens)
        state.add_tokens(new_tokens)
        if no_token_allowed:
            state.detokenizer.finish("stop")
        if state.finish_status is not None:
            if not request.is_finished:
                self.scheduler.finish_request(request.request_id, state.finish_status)
            self._release_rows([request])

    def _collect_outputs(self, states: list[SequenceState]) -> list[RequestOutput]:
        # a final-only request says nothing until it finishes, and only a sequence that finished this
        # step can finish it (beam groups finish by their search: always asked)
        group_ids = dict.fromkeys(state.group_id for state in states if state.is_finished or
                                  state.params.output_kind is not RequestOutputKind.FINAL_ONLY
                                  or state.group_id in self._beam_group_ids)
        outputs = []
        for group_id in group_ids:
            group = self.groups.get(group_id)
            if group is None:  # failed this step (another of its sequences)
                continue
            try:
                output = group.output()
            except Exception as e:  # noqa: BLE001 - building its output failed: this request's fault
                outputs += self._fail(group_id, e)
                continue
            if output is not None:  # None: nothing this step for its output_kind
                outputs.append(output)
            if group.is_finished:
                self._release(group)
        return outputs

    def _release(self, group: RequestGroup) -> None:
        del self.groups[group.request_id]
        self._beam_group_ids.discard(group.request_id)
        for state in group.sequences:
            self.sequences.pop(state.request.request_id, None)

    def _check_token_ids(self, token_ids: list[int], what: str) -> None:
        vocab_size = self.manifest.model.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"{what}: token id {bad} is out of this model's vocabulary [0, {vocab_size})")

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [len(token_ids), vocab_size] float32 at every position of one sequence (perplexity,
        distribution comparisons). Needs an idle engine: it borrows blocks from the pool."""
        if self.has_unfinished_requests():  # a step in flight counts: its outputs are not delivered yet
            raise RequestError("score() needs an idle engine; finish or abort running requests first")
        if not 0 < len(token_ids) <= self.options.max_model_len:
            raise RequestError(f"score() takes 1 to max_model_len ({self.options.max_model_len}) tokens, got {len(token_ids)}")
        self._check_token_ids(token_ids, "score()")
        pool = self.scheduler.block_pool
        blocks = pool.allocate(-(-len(token_ids) // self.options.block_size))
        try:
            return self.runner.score(token_ids, [b.block_id for b in blocks], self.options.max_num_batched_tokens)
        finally:
            pool.free(blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache: after new weights, or to drop one tenant's prefixes);
        False, with nothing changed, while requests hold blocks."""
        return self.scheduler.block_pool.reset_prefix_cache()

    def stats(self) -> dict:
        """Counters for logs and metrics (the names vLLM exports, without its prefix)."""
        stats = self.scheduler.stats()
        queries = stats["prefix_cache_queries"]
        return {
            **stats,
            "prefix_cache_hit_rate": stats["prefix_cache_hits"] / queries if queries else 0.0,
            "num_spec_proposed": self.spec_stats.num_proposed,
            "num_spec_accepted": self.spec_stats.num_accepted,
            "spec_acceptance_rate": self.spec_stats.acceptance_rate,
            "num_prompt_tokens": self.stats_logger.num_prompt_tokens,
            "num_generation_tokens": self.stats_logger.num_generation_tokens,
        }


def model_eos_first(eos_token_ids: list[int], tokenizer_eos: int | None, vocab_size: int) -> list[int]:
    """The ids that end a sequence, the model's own eos first: vLLM's eos is the tokenizer's (a fine-tune
    often sets it, e.g. ChatML's <|im_end|>, where config.json names the base model's), and the other end
    tokens (config.json's, the generation config's) act as stop token ids, so a stop on one of them
    reports its id as stop_reason (`detokenizer.check_stop`)."""
    first = [tokenizer_eos] if tokenizer_eos is not None and 0 <= tokenizer_eos < vocab_size else []
    return list(dict.fromkeys([*first, *eos_token_ids]))


def freeze_gc_heap() -> None:
    """Move every object alive once the engine is loaded (modules, the model, kernels, libraries: about
    a million objects on a GPU) to the collector's permanent generation, after collecting the garbage
    of the load. A full collection scans every tracked object, so without this each one paused the
    serving loop for 0.25-0.9 s on an H100 host, stalling the GPU (benchmarks/RESULTS.md, issue 12);
    vLLM and SGLang freeze the heap after start-up too. Objects made later (requests) are still
    collected. Process-wide: the last open engine's `close` unfreezes (release_gc_heap), not the first
    (another engine of the process still serves)."""
    global _ENGINES_FREEZING
    _ENGINES_FREEZING += 1
    gc.collect()
    gc.freeze()


_ENGINES_FREEZING = 0  # engines of this process open since they froze the heap


def release_gc_heap() -> None:
    """One engine closed: once none is left open, the collector sees the frozen heap again, so that what
    the engines held can be freed."""
    global _ENGINES_FREEZING
    _ENGINES_FREEZING = max(0, _ENGINES_FREEZING - 1)
    if _ENGINES_FREEZING == 0:
        gc.unfreeze()


def _is_decode(scheduled) -> bool:
    """One real token after generated ones (with or without drafts): a decode, not a prefill."""
    return scheduled.request.num_output_tokens > 0 and scheduled.num_new_tokens - len(scheduled.draft_token_ids) == 1


def _text_only(manifest: art.Manifest) -> str:
    """Why a multimodal checkpoint's artifact takes no images (Llama 4's and Qwen3.5's are built as their language
    models), or ""."""
    if manifest.model.architecture == "Llama4ForConditionalGeneration":
        return " (llmc builds Llama 4's language model only: its vision tower is not built)"
    if manifest.model.architecture in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        return " (llmc builds Qwen3.5's language model only: its vision tower is not built)"
    return ""
