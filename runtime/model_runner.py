"""ModelRunner: owns the model, its KV cache and its CUDA graphs; turns a ScheduledBatch into logits.

It is the only runtime part that runs the model: it builds the step's inputs in its persistent
buffers (runtime/step_inputs.py: one host-to-device copy per step), runs the model (replaying a
captured graph for decode steps) and returns the logits of the rows that sample a token, without
waiting for the device.

Start on a GPU, in order: load the weights, measure the memory plan (runtime/memory_profile.py:
a profiling forward, then what is left for the KV cache), refuse if one max_model_len sequence
does not fit, allocate the KV cache (one extra block: the graphs' scratch block), capture the
decode graphs (runtime/cuda_graphs.py) and the piecewise graphs of other steps
(runtime/piecewise_graphs.py) or the whole-forward graphs of other steps (runtime/mixed_graphs.py),
as compilation_config.cudagraph_mode says.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import Tensor

from llmc.errors import ConfigError
from llmc.kernels import device_num_sms
from llmc.runtime import artifact as art
from llmc.runtime import memory
from llmc.runtime.cuda_graphs import CudaGraphs, can_use_graphs, compile_mixed_step, graph_batch_sizes
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.kv_cache import copy_blocks, kv_cache_config
from llmc.runtime.loader import build_model, compute_dtype
from llmc.runtime.lora import LoraManager, LoraSlots
from llmc.runtime.memory_profile import measure_kv_plan
from llmc.runtime.mixed_graphs import MixedGraphs
from llmc.runtime.mrope import column_components, step_rope
from llmc.runtime.multimodal import step_deepstack_rows, step_image_rows, step_key_limits
from llmc.runtime.offload import WeightOffloader
from llmc.runtime.parallel.layout import RankLayout, kv_bytes_per_token, kv_cache_shapes, kv_layers, whole_model_layout
from llmc.runtime.piecewise_graphs import PiecewiseGraphs
from llmc.runtime.runner import StepLogits
from llmc.runtime.scheduler import ScheduledBatch
from llmc.runtime.step_inputs import PendingTokens, StepBuffers

logger = logging.getLogger("llmc")


class ModelRunner:
    """The single-rank `Runner` (runtime/runner.py)."""

    can_overlap = True  # its steps only enqueue device work: the engine may schedule ahead
    def __init__(self, artifact_dir: Path, manifest: art.Manifest, options: art.RuntimeDefaults, device: torch.device,
                 reserve: tuple[int, int] = (0, 0), keep_hidden: tuple[tuple[int, ...], bool] | None = None):
        """reserve: (bytes, KV bytes per token) the measured GPU plan leaves for a draft model's runner,
        which shares this cache's block count (runtime/spec_draft.py); on a CPU, cpu_kv_cache_gib holds
        both caches (its bytes per token). keep_hidden: (layer ids, final) an EAGLE head reads
        (DecoderModel.keep_hidden), set before the graphs are captured so that they keep them too."""
        self.device = device
        self.block_size = options.block_size
        # its prefill steps may carry image rows (runtime/multimodal.py) or a prompt's embeddings (runtime/prompt_embeds.py)
        self.takes_images = manifest.vision is not None or options.enable_prompt_embeds
        # Qwen2-VL's M-RoPE: each rotary column's position component (runtime/mrope.py); None: 1-D positions
        section = manifest.vision.mrope_section if manifest.vision is not None else None
        self.rope_components = column_components(section, manifest.vision.mrope_interleaved) if section else None
        allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.model = build_model(artifact_dir, manifest, device, max_positions=options.max_model_len,
                                 keep_gate_up_order=options.enable_lora)
        if keep_hidden is not None:
            self.model.keep_hidden(*keep_hidden)
        # a hybrid model's per-request states (Gated DeltaNet or Mamba-2 layers; runtime/models/gated_deltanet.py NOTE
        # (state slots)): one slot per persistent-batch row and a scratch slot (`score`), allocated before the memory
        # plan, which counts them as it counts the weights, before the KV blocks
        self.is_hybrid = manifest.model.is_hybrid
        self.state_bytes = 0
        if self.is_hybrid:
            dtypes = art.state_dtypes(options, self.model.config.dtype)  # (auto: the compute dtype)
            self.state_bytes = self.model.bind_states(options.max_num_seqs + 1, device, dtypes)
            kinds = " and ".join(dict.fromkeys(attn.STATE_KIND for attn in self.model.state_layers()))
            logger.info("%s states (conv %s, recurrent %s): %d slots (max_num_seqs + 1) of %.2f MiB, %.1f MiB in all, "
                        "before the KV cache; CUDA graphs of decode steps only (prefill and mixed steps run eagerly)",
                        kinds, *dtypes, options.max_num_seqs + 1, self.model.state_bytes_per_slot() / 2**20,
                        self.state_bytes / 2**20)
        self.lora: LoraManager | None = None  # run-time LoRA (runtime/lora.py): before the profile and the graphs
        if options.enable_lora:  # (the engine has refused the artifacts it cannot run on: check_lora_artifact)
            slots = LoraSlots(self.model, options.max_loras, options.max_lora_rank, options.max_num_batched_tokens,
                              device)
            self.lora = LoraManager(manifest, slots, options.max_cpu_loras)
        self.offloader = None
        if options.cpu_offload_gb:
            self.offloader = WeightOffloader(self.model, int(options.cpu_offload_gb * memory.GIB), device)
            logger.info("%s", self.offloader.describe())
        layout = whole_model_layout(manifest.model)
        self.kv_config = kv_cache_config(manifest, options, compute_dtype(manifest, device))
        modes = options.graph_modes
        can_capture = can_use_graphs(device, options.enforce_eager)
        graph_sizes, piece_sizes = planned_graph_sizes(manifest, options, device)
        if self.is_hybrid:  # decode graphs only: a DeltaNet's prefill chunk reads the step's host values
            piece_sizes = []
        if can_capture and (modes.has_piecewise or modes.has_full_mixed) and self.offloader is not None:
            logger.info("cpu_offload_gb: prefill and mixed steps run eagerly (no CUDA graphs of them)")
        if piece_sizes and not all(layer.moe.runs_fused() for layer in self.model.layers.values() if layer.is_moe):
            # captured, their experts would all run on every token of up to 512 (MoE._forward_every_expert)
            logger.info("MoE experts in a format the fused kernel does not read: prefill and mixed steps run eagerly "
                        "(no CUDA graphs of them)")
            piece_sizes = []
        graph_allowance, piece_allowance = graph_allowances(self.model.config, graph_sizes, piece_sizes, options, device)
        # measured on a GPU, unless num_kv_blocks fixes the cache
        self.memory_plan = self._measure_memory(manifest, layout, options, allocated_before, graph_allowance, reserve)
        num_blocks = (self.memory_plan.num_kv_blocks if self.memory_plan is not None
                      else local_num_kv_blocks(manifest, layout, options, device, reserve[1], self.state_bytes))
        self.num_blocks = check_num_kv_blocks(num_blocks, options, device, self.memory_plan)
        # the scheduler hands out blocks 0..num_blocks-1; block num_blocks is the graphs' scratch block
        num_allocated = self.num_blocks + (1 if graph_sizes or piece_sizes else 0)
        self.kv_caches = allocate_kv_caches(manifest, layout, num_allocated, options.block_size, device,
                                            self.kv_config.dtype)
        self.model.bind_kv_caches(self.kv_caches, self.kv_config.layer_scales(kv_layers(manifest.model, layout)))
        self.buffers = StepBuffers(options.max_num_seqs, options.max_num_batched_tokens,
                                   -(-options.max_model_len // options.block_size), options.block_size, device)
        self.graphs: CudaGraphs | None = None
        self.pieces: PiecewiseGraphs | MixedGraphs | None = None  # graphs of prefill and mixed steps
        if graph_sizes:
            specialize = self.lora is not None and modes.cudagraph_specialize_lora
            self.graphs = CudaGraphs(self.model, graph_sizes, options.max_model_len, options.block_size,
                                     scratch_block=self.num_blocks, device=device,
                                     lora_slots=self.lora.slots if specialize else None,
                                     scratch_state_slot=self.scratch_state_slot)
            self.graphs.log_capture(graph_allowance - piece_allowance)
        if piece_sizes:
            if modes.has_full_mixed:
                self.pieces = MixedGraphs(self.model, piece_sizes, options.max_num_seqs, options.max_model_len,
                                          options.block_size, self.num_blocks, device)
            else:
                self.pieces = PiecewiseGraphs(self.model, piece_sizes, self.num_blocks * options.block_size, device,
                                              takes_rows=self.takes_images)
            self.pieces.capture(*((self.graphs.pool, self.graphs.capture_stream) if self.graphs else ()))
            self.pieces.log_capture(piece_allowance)
        # NOTE (verify graphs): a speculative engine's verify steps (k + 1 rows per request) replay whole-forward
        # graphs, attention included, beside the piecewise graphs of prefills: between piecewise graphs each layer's
        # attention is launched from Python, ~0.1-0.2 ms of host time apiece, which set an EAGLE step's pace on an 8B
        # model (RESULTS.md session 46; vLLM's uniform-decode full graphs)
        self.verify_graphs: MixedGraphs | None = None
        self.max_verify_rows = 0
        verify_sizes = memory.verify_graph_sizes(options, piece_sizes) if isinstance(self.pieces, PiecewiseGraphs) else []
        if verify_sizes:
            self.max_verify_rows = options.speculative.num_speculative_tokens + 1
            self.verify_graphs = MixedGraphs(self.model, verify_sizes, options.max_num_seqs, options.max_model_len,
                                             options.block_size, self.num_blocks, device)
            self.verify_graphs.capture(*((self.graphs.pool, self.graphs.capture_stream) if self.graphs else ()))
            self.verify_graphs.log_capture(piece_allowance)
        if graph_sizes or piece_sizes:
            compile_mixed_step(self.model, self.num_blocks, options.block_size, options.max_model_len, device,
                               self.pieces if isinstance(self.pieces, PiecewiseGraphs) else None,
                               has_decode_graphs=bool(graph_sizes))

    def _measure_memory(self, manifest: art.Manifest, layout: RankLayout, options: art.RuntimeDefaults,
                        allocated_before: int, graph_allowance: int,
                        reserve: tuple[int, int]) -> memory.MemoryEstimate | None:
        if self.device.type != "cuda" or options.num_kv_blocks is not None:
            return None
        weight_bytes = torch.cuda.memory_allocated(self.device) - allocated_before - self.state_bytes
        return measure_kv_plan(self.model, options, self.device, weight_bytes + reserve[0],
                               _kv_bytes_per_token(manifest, layout, self.device, options) + reserve[1], graph_allowance,
                               state_bytes=self.state_bytes)

    def close(self) -> None:
        """Nothing to release on a single rank (a parallel runner stops its workers here)."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (src, dst) block's K/V copied, queued before the step that writes dst."""
        copy_blocks(self.kv_caches, pairs)

    def _map_lora_tokens(self, batch: ScheduledBatch) -> None:
        """Each token of the step to its request's adapter slot (runtime/lora.py), loading adapters into slots."""
        slot_of = self.lora.slots_for({s.request.lora_int_id for s in batch.requests if s.request.lora_int_id is not None})
        token_slots = []
        for scheduled in batch.requests:
            token_slots += [slot_of.get(scheduled.request.lora_int_id, -1)] * scheduled.num_new_tokens
        self.lora.slots.set_mapping(token_slots)

    def score(self, token_ids: list[int], block_ids: list[int], chunk_size: int) -> Tensor:
        if self.lora is not None:  # the base model's scores: no adapter on any token
            self.lora.slots.set_mapping([-1] * self.lora.slots.max_tokens)
        return score_in_chunks(self.forward_logits, token_ids, block_ids, chunk_size, self.block_size, self.device,
                               self.scratch_state_slot)

    @property
    def scratch_state_slot(self) -> int | None:
        """A hybrid model's state slot that no request holds (`score`'s); None for other models."""
        return self.model.state_layers()[0].conv_state.shape[0] - 1 if self.is_hybrid else None

    def _put_state_slots(self, batch: ScheduledBatch, forward_batch: ForwardBatch) -> None:
        """A hybrid model's step: each sequence's state slot, its persistent-batch row (gated_deltanet NOTE)."""
        if self.is_hybrid:
            forward_batch.state_slots = torch.tensor([s.request.batch_row for s in batch.requests], device=self.device)

    def forward_logits(self, input_ids: Tensor, forward_batch: ForwardBatch,
                       dtype: torch.dtype | None = torch.float32) -> Tensor:
        """One forward pass: logits [num_logits, vocab_size] at forward_batch.logits_indices, in
        `dtype` (None: the model's; DecoderModel.compute_logits)."""
        hidden = self.forward_hidden(input_ids, forward_batch)
        return self.model.compute_logits(hidden[forward_batch.logits_indices], dtype)

    def forward_hidden(self, input_ids: Tensor, forward_batch: ForwardBatch) -> Tensor:
        """One forward pass: the final norm's outputs [num_tokens, hidden_size] (a graph's output buffer,
        valid until the next forward). A step with image rows runs eagerly but where the piecewise graphs take
        them (PiecewiseGraphs NOTE (rows)); a step with its own rotary rows (M-RoPE) or deepstack rows runs eagerly."""
        if forward_batch.rope_table is not None or forward_batch.deepstack_rows is not None:
            return self.model(input_ids, forward_batch)
        if forward_batch.image_rows is not None:
            if getattr(self.pieces, "takes_rows", False) and self.pieces.can_run(forward_batch):
                return self.pieces.run(input_ids, forward_batch)
            return self.model(input_ids, forward_batch)
        if self.graphs is not None and self.graphs.can_run(forward_batch):
            return self.graphs.run(input_ids, forward_batch)  # [num_tokens = num_seqs, hidden_size]
        if (self.verify_graphs is not None and max(forward_batch.query_lens) <= self.max_verify_rows
                and self.verify_graphs.can_run(forward_batch)):  # NOTE (verify graphs)
            return self.verify_graphs.run(input_ids, forward_batch)
        if self.pieces is not None and self.pieces.can_run(forward_batch):
            return self.pieces.run(input_ids, forward_batch)
        return self.model(input_ids, forward_batch)

    def classify(self, vectors: Tensor) -> Tensor:
        """A sequence classifier's logits of pooled hidden states (DecoderModel.classify; runtime/pooling.py)."""
        return self.model.classify(vectors)

    @torch.inference_mode()
    def pool_hidden(self, batch: ScheduledBatch) -> Tensor:
        """A pooling step's forward (runtime/pooling.py): the final hidden states [num_tokens, hidden_size]
        of its tokens, in batch order."""
        inputs = self.buffers.build(batch)
        self._put_state_slots(batch, inputs.forward_batch)
        if self.takes_images:
            self._put_images(batch, inputs.forward_batch)
        if self.lora is not None:
            self._map_lora_tokens(batch)
        return self.forward_hidden(inputs.input_ids, inputs.forward_batch)

    def _put_images(self, batch: ScheduledBatch, forward_batch: ForwardBatch) -> None:
        """A vision model's step: its image tokens' rows, and where its images attend both ways (Gemma 3), the
        queries' key limits (runtime/multimodal.py), Qwen3-VL's deepstack rows; None in a step without image tokens.
        M-RoPE (Qwen2-VL, Qwen3-VL): the step's own rotary rows where it needs them (runtime/mrope.step_rope)."""
        forward_batch.image_rows = step_image_rows(batch)
        if forward_batch.image_rows is not None:
            forward_batch.key_limits = step_key_limits(batch, forward_batch.positions)
            forward_batch.deepstack_rows = step_deepstack_rows(batch)
        if self.rope_components is not None:
            rope = step_rope(batch, self.model.cos_sin, self.rope_components)
            if rope is not None:
                forward_batch.positions, forward_batch.rope_table = rope

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, pending: PendingTokens | None = None) -> StepLogits:
        """Run one step's forward (launched, not waited for, on a GPU). `pending`: the previous
        step's sampled tokens on the device, for decode rows whose last token is still pending."""
        inputs = self.buffers.build(batch, pending)
        self._put_state_slots(batch, inputs.forward_batch)
        if self.takes_images:
            self._put_images(batch, inputs.forward_batch)
        if self.lora is not None:
            self._map_lora_tokens(batch)
        logits = self.forward_logits(inputs.input_ids, inputs.forward_batch, None)  # [num_rows, vocab_size]
        return StepLogits.split(logits, inputs)


@torch.inference_mode()
def score_in_chunks(forward_logits, token_ids: list[int], block_ids: list[int], chunk_size: int, block_size: int,
                    device: torch.device, state_slot: int | None = None) -> Tensor:
    """Logits [len(token_ids), vocab_size] float32 at every position of one sequence, prefilled
    in chunks of chunk_size tokens into the given blocks by `forward_logits(input_ids, batch)` (a hybrid model's
    states in `state_slot`)."""
    block_table = torch.tensor([block_ids], dtype=torch.int32, device=device)
    logits = []
    for start in range(0, len(token_ids), chunk_size):
        end = min(start + chunk_size, len(token_ids))
        positions = torch.arange(start, end, device=device)
        blocks = torch.tensor(block_ids, device=device)[positions // block_size]
        forward_batch = ForwardBatch(
            positions=positions,
            slot_mapping=blocks * block_size + positions % block_size,
            block_tables=block_table,
            context_lens=torch.tensor([end], dtype=torch.int32, device=device),
            query_lens=[end - start],
            max_context_len=end,
            logits_indices=torch.arange(end - start, device=device),
            host_context_lens=[end],
            state_slots=None if state_slot is None else torch.tensor([state_slot], device=device),
        )
        input_ids = torch.tensor(token_ids[start:end], dtype=torch.long, device=device)
        logits.append(forward_logits(input_ids, forward_batch))
    return torch.cat(logits)


# ---- the KV cache of one rank ------------------------------------------------------------------------


def local_num_kv_blocks(manifest: art.Manifest, layout: RankLayout, options: art.RuntimeDefaults, device: torch.device,
                        extra_bytes_per_token: int = 0, state_bytes: int = 0) -> int:
    """KV blocks this rank has room for (its heads of its layers) without a measured plan: num_kv_blocks
    if set, else (on a CPU) cpu_kv_cache_gib. A GPU without num_kv_blocks measures (memory_profile.py),
    parallel ranks too, in lockstep (runtime/parallel/shard_runner.py); ranks then agree on the smallest.
    extra_bytes_per_token: what another cache of the same block count takes per token (a draft model's); state_bytes:
    what a hybrid model's Gated DeltaNet states take of cpu_kv_cache_gib first."""
    if options.num_kv_blocks is not None:
        return options.num_kv_blocks
    if device.type == "cuda":
        raise ValueError("a GPU rank without num_kv_blocks measures its memory plan (measure_kv_plan)")
    bytes_per_token = _kv_bytes_per_token(manifest, layout, device, options) + extra_bytes_per_token
    return max(0, int(options.cpu_kv_cache_gib * memory.GIB) - state_bytes) // (bytes_per_token * options.block_size)


def _kv_bytes_per_token(manifest: art.Manifest, layout: RankLayout, device: torch.device,
                        options: art.RuntimeDefaults) -> int:
    """One byte per element with an FP8 cache, else the compute dtype's size."""
    config = kv_cache_config(manifest, options, compute_dtype(manifest, device), log=False)
    return kv_bytes_per_token(manifest.model, layout, config.dtype.itemsize)


def planned_graph_sizes(manifest: art.Manifest, options: art.RuntimeDefaults,
                        device: torch.device) -> tuple[list[int], list[int]]:
    """(decode graphs' batch sizes, prefill and mixed steps' token counts) a runner with these options captures
    on this device, before what it finds in the loaded model (an MoE the fused kernel cannot read) removes any."""
    if not can_use_graphs(device, options.enforce_eager):
        return [], []
    graph_sizes = (graph_batch_sizes(manifest.plan.cuda_graph_batch_sizes, options.max_num_seqs)
                   if options.graph_modes.has_full_decode else [])
    return graph_sizes, memory.planned_piece_sizes(options)


def graph_allowances(config: art.ModelConfig, graph_sizes: list[int], piece_sizes: list[int],
                     options: art.RuntimeDefaults, device: torch.device) -> tuple[int, int]:
    """(every graph's allowance in bytes, of which the prefill and mixed steps' graphs'); `config` in the
    compute dtype."""
    piece_allowance = memory.prefill_graph_allowance_bytes(config, options, piece_sizes, _num_sms(device))
    decode = memory.graph_allowance_bytes(config, graph_sizes, options.max_model_len, _num_sms(device),
                                          block_size=options.block_size)
    if options.enable_lora and options.graph_modes.cudagraph_specialize_lora:  # each size twice: with LoRA, without
        decode += len(graph_sizes) * config.num_layers * memory.GRAPH_BYTES_PER_GRAPH_LAYER
    return decode + piece_allowance, piece_allowance


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return memory.DEFAULT_NUM_SMS
    return device_num_sms(device)


def check_num_kv_blocks(num_blocks: int, options: art.RuntimeDefaults, device: torch.device,
                        plan: memory.MemoryEstimate | None = None) -> int:
    """`num_blocks`, if one sequence of max_model_len fits; else a ConfigError saying what to change.
    `plan`: the measured GPU plan the blocks come from, for the log and the error."""
    max_seq_blocks = -(-options.max_model_len // options.block_size)
    if num_blocks < max_seq_blocks:
        raise ConfigError(_not_fitting_message(num_blocks, max_seq_blocks, options, device, plan))
    if plan is not None:
        logger.info("memory plan (measured): %s", plan.describe())
    logger.info("KV cache: %d blocks of %d tokens (%.1f sequences of max_model_len %d)",
                num_blocks, options.block_size, num_blocks / max_seq_blocks, options.max_model_len)
    return num_blocks


def _not_fitting_message(num_blocks: int, max_seq_blocks: int, options: art.RuntimeDefaults, device: torch.device,
                         plan: memory.MemoryEstimate | None) -> str:
    held = (f"the KV cache holds {num_blocks * options.block_size} tokens, fewer than max_model_len "
            f"{options.max_model_len} (needs {max_seq_blocks} blocks of {options.block_size})")
    if options.num_kv_blocks is not None:
        return f"{held}; raise num_kv_blocks to {max_seq_blocks} or more, or lower max_model_len"
    if device.type != "cuda":
        return f"{held}; raise cpu_kv_cache_gib, set num_kv_blocks, or lower max_model_len"
    where = f" ({plan.describe()})" if plan is not None else " (on the rank with the least room)"
    knobs = "kv_cache_dtype fp8 (half the KV bytes of 16-bit) or cpu_offload_gb" if options.kv_cache_dtype == "auto" else "cpu_offload_gb"
    return (f"{held}{where}; lower max_model_len or max_num_batched_tokens, raise gpu_memory_utilization, "
            f"set {knobs} (`llmc inspect --gpu-memory-gib N` shows what each buys), or set num_kv_blocks")


def allocate_kv_caches(manifest: art.Manifest, layout: RankLayout, num_blocks: int, block_size: int,
                       device: torch.device, dtype: torch.dtype | None = None) -> list[tuple[Tensor, Tensor]]:
    """(K, V) per layer of the rank, each [num_blocks, block_size, num_kv_heads of the rank, head_dim]
    of `dtype` (KVCacheConfig.dtype; None: the compute dtype); under MLA (the latent cache,) per layer
    (layout.kv_cache_shapes)."""
    shapes = kv_cache_shapes(manifest.model, layout.num_kv_heads, num_blocks, block_size)
    dtype = dtype or compute_dtype(manifest, device)
    try:
        return [tuple(torch.zeros(shape, dtype=dtype, device=device) for shape in shapes)
                for _ in kv_layers(manifest.model, layout)]
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not isinstance(e, (torch.OutOfMemoryError, MemoryError)) and "alloc" not in str(e):
            raise
        size = len(kv_layers(manifest.model, layout)) * sum(math.prod(shape) for shape in shapes) * dtype.itemsize
        knob = "num_kv_blocks" if device.type == "cuda" else "num_kv_blocks or cpu_kv_cache_gib"
        raise ConfigError(f"the KV cache of {num_blocks} blocks ({size / memory.GIB:.1f} GiB) cannot be allocated on "
                          f"{device} (out of memory); lower {knob}") from None
