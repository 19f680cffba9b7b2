"""The decoder-only transformer every supported family is built from (Llama, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 2, Gemma 3, Granite, OLMo 2, GLM-4, Cohere, Cohere 2, and the mixture-of-experts Mixtral, Qwen3-MoE and gpt-oss,
whose MoE layers use runtime/models/moe.py).

Families differ only in data (ModelSpec) and config flags (attention_bias, qk_norm; Gemma's hidden_act,
query_pre_attn_scalar, embed_scale, sandwich_norms, Gemma 3's local rope table and Gemma 2's logit
soft-capping; OLMo 2's pre_norms false and qk_norm_full_width; GLM-4's rotary_interleaved; Cohere's layer_norm and
parallel_block, Cohere 2's rope_on_full_layers false; gpt-oss's attention_sinks and o_bias; SmolLM3's nope_layers;
Ministral 3's query temperature; Nemotron-H's no_mlp_layers / no_mixer_layers and relu2 MLP, Apertus's xielu;
Falcon-H1's mamba_with_attention), so one module serves them all. Buffers are named exactly as the artifact's tensors
(`layers.3.attn.qkv.weight`), so loading is a strict comparison of names, shapes and dtypes.

Under tensor/pipeline parallelism the same module is built with a `RankLayout`: only the rank's
layers (keeping their global names), heads, MLP columns and vocabulary rows; `tp_group` all-reduces
the row-parallel outputs (o, down) and the vocab-parallel embedding (o's bias, gpt-oss's, is held by tensor
rank 0 alone, so the all-reduce adds it once). Without a layout it is the whole model and no collective runs.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from llmc.kernels.activation import act_and_mul, act_and_mul_fp8
from llmc.kernels.attention import paged_attention, rotate_and_write_kv, rotate_write_and_attend
from llmc.quant.formats import takes_fp8_activations
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.layers.linear import Linear
from llmc.runtime.layers.norm import RMSNorm
from llmc.runtime.layers.rotary import cos_sin_cache, query_temperature
from llmc.runtime.models import spec_for_family
from llmc.runtime.models.gated_deltanet import GatedDeltaNet
from llmc.runtime.models.mamba2 import Mamba2
from llmc.runtime.models.mla import MLAttention
from llmc.runtime.models.moe import ExpertLinears, MoE
from llmc.runtime.models.short_conv import ShortConv
from llmc.runtime.parallel.layout import RankLayout, holds_row_bias, whole_model_layout

logger = logging.getLogger("llmc")


def available_memory_bytes() -> int | None:
    """The host memory the kernel says is available (MemAvailable), or None where it cannot say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, formats: dict, index: int, dtype: torch.dtype,
                 layout: RankLayout | None = None, tp_group=None):
        super().__init__()
        prefix = f"layers.{index}.attn."
        layout = layout or whole_model_layout(config)
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.window_of(index)
        self.attention_chunk_size = config.chunk_of(index)  # Llama 4's chunked local attention (None: not in chunks)
        self.is_local_rope = config.uses_local_rope(index)
        self.has_rope = config.rotates(index)  # False: SmolLM3's NoPE layers, rotated by the identity table
        self.softcap = config.attn_logit_softcapping  # None: scores uncapped (every kernel as without it)
        self.temperature = config.query_temperature_of(index)  # (beta, floor, offset); None: q not scaled
        self.l2_norm_eps = config.rms_norm_eps if index in config.qk_l2_norm_layers else None  # Llama 4's q/k norm
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Qwen3.5: each head's q then its output gate's rows (attn_output_gate); `heads` keeps the gate for `output`
        self.has_output_gate = config.attn_output_gate
        self.output_gate: Tensor | None = None
        q_rows = 2 * q_size if self.has_output_gate else q_size
        self.split_sizes = [q_rows, kv_size, kv_size]
        self.qkv = Linear(config.hidden_size, q_rows + 2 * kv_size, formats[prefix + "qkv"], config.attention_bias,
                          dtype)
        # o's bias (gpt-oss): on tensor rank 0 alone, added once by the all-reduce of the ranks' partial sums
        self.o = Linear(q_size, config.hidden_size, formats[prefix + "o"], config.o_bias and holds_row_bias(layout),
                        dtype)
        self.has_sinks = config.attention_sinks  # gpt-oss: one learned logit per (this rank's) head, float32
        if config.attention_sinks:
            self.sinks = nn.Module()
            self.sinks.register_buffer("weight", torch.empty(self.num_heads, dtype=torch.float32, device="meta"))
        self.has_qk_norm = config.qk_norm
        # OLMo 2: q_norm / k_norm over the whole projection (this rank's heads' share of it under TP), not per head
        self.is_qk_norm_full_width = config.qk_norm_full_width
        if config.qk_norm:
            q_width, k_width = (q_size, kv_size) if config.qk_norm_full_width else (self.head_dim, self.head_dim)
            self.q_norm = RMSNorm(q_width, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(k_width, config.rms_norm_eps, dtype)
        self.tp_size = layout.tp_size
        self.kv_cache: tuple[Tensor, Tensor] | None = None  # bound by the model runner after allocation
        self.k_scale, self.v_scale = 1.0, 1.0  # an FP8 cache's dequantization scales (bound with it)
        self.tp_group = tp_group  # all-reduces o's partial sums; None on a single rank

    def forward(self, x: Tensor, batch: ForwardBatch, cos_sin: Tensor) -> Tensor:
        q, k, v = self.heads(x, batch.positions)
        k_cache, v_cache = self.kv_cache
        out = rotate_write_and_attend(
            q, k, v, batch.positions, cos_sin, k_cache, v_cache, batch.slot_mapping, batch.block_tables,
            batch.context_lens, batch.query_lens, self.scale, self.sliding_window, batch.max_context_len,
            self.k_scale, self.v_scale, batch.kernel_cache, batch.prefill_index, self.softcap, batch.key_limits,
            self.sink_logits(), self.attention_chunk_size,
        )  # [num_tokens, num_heads, head_dim]
        return self.output(out)

    def heads(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [num_tokens, hidden_size] → q [num_tokens, num_heads, head_dim], k and v [num_tokens,
        num_kv_heads, head_dim] (views of qkv's output; q and k normed where the model has qk_norm; q times the
        layer's query temperature at each token's position where it has one)."""
        q, k, v = self.qkv(x).split(self.split_sizes, dim=-1)
        if self.has_output_gate:
            q, gate = q.unflatten(-1, (self.num_heads, 2 * self.head_dim)).split(self.head_dim, dim=-1)
            q, self.output_gate = q.flatten(1), gate.flatten(1)
        if self.is_qk_norm_full_width:  # OLMo 2: before the split into heads (contiguous outputs)
            q, k = self.full_width_norm(q, self.q_norm), self.full_width_norm(k, self.k_norm)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm and not self.is_qk_norm_full_width:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.l2_norm_eps is not None:  # (after the rotary in transformers: a rotation keeps each head's norm)
            q, k = l2_norm(q, self.l2_norm_eps), l2_norm(k, self.l2_norm_eps)
        if self.temperature is not None:  # before the rotary, which is linear in q: the same as after it
            q = q * query_temperature(positions, *self.temperature).to(q.dtype)[:, None, None]
        return q, k, v

    def full_width_norm(self, x: Tensor, norm: RMSNorm) -> Tensor:
        """OLMo 2's q/k norm: x [num_tokens, width] normed over its whole width (the RMSNorm kernel) on one rank.
        Under tensor parallelism x is this rank's heads' columns and the variance is over every head's: the ranks
        all-reduce their sums of squares (float32). Every rank holds as many columns, and replicated KV heads
        (tensor > num_kv_heads) are held by as many ranks each, so the sum over ranks divided by tp_size * width is
        the mean over the distinct columns. Computed as rms_norm computes it (float32, rounded, times the weight)."""
        if self.tp_group is None:
            return norm(x)
        x_f32 = x.float()
        sum_sq = self.tp_group.all_reduce(x_f32.pow(2).sum(dim=-1, keepdim=True))
        variance = sum_sq / (self.tp_size * x.shape[-1])
        return (x_f32 * torch.rsqrt(variance + norm.eps)).to(x.dtype) * norm.weight

    # The forward in three parts, for the piecewise CUDA graphs (runtime/piecewise_graphs.py): `project`
    # and `output` read no host value of the step and are captured; `attend` runs between the graphs.
    def project(self, x: Tensor, positions: Tensor, slot_mapping: Tensor, cos_sin: Tensor,
                q_out: Tensor | None = None) -> Tensor:
        """The heads, the rotary embedding, and this step's keys and values written to the cache: the
        rotated q [num_tokens, num_heads, head_dim] (written into q_out, when given)."""
        q, k, v = self.heads(x, positions)
        k_cache, v_cache = self.kv_cache
        return rotate_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                                   self.k_scale, self.v_scale, q_out)

    def attend(self, q: Tensor, batch: ForwardBatch, out: Tensor | None = None) -> Tensor:
        """Paged attention of the rotated q over the cache (into `out` when given)."""
        k_cache, v_cache = self.kv_cache
        return paged_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.query_lens,
                               self.scale, self.sliding_window, batch.max_context_len, self.k_scale, self.v_scale,
                               batch.kernel_cache, out=out, softcap=self.softcap, key_limits=batch.key_limits,
                               sinks=self.sink_logits(), attention_chunk_size=self.attention_chunk_size)

    def sink_logits(self) -> Tensor | None:
        """gpt-oss's attention sinks [num_heads] float32 (None: the model has none)."""
        return self.sinks.weight if self.has_sinks else None

    def output(self, attn: Tensor) -> Tensor:
        """attn [num_tokens, num_heads, head_dim] → o's output [num_tokens, hidden_size] (all-reduced under TP)."""
        attn = attn.flatten(1)
        if self.has_output_gate:  # (eager only: hybrid models run without CUDA graphs)
            attn, self.output_gate = attn * torch.sigmoid(self.output_gate), None
        out = self.o(attn)  # this rank's partial sum under TP
        return out if self.tp_group is None else self.tp_group.all_reduce(out)


class AttentionAndMamba2(Attention):
    """Falcon-H1's mixer: the attention and a Mamba-2 mixer (runtime/models/mamba2.py) on the same normed input, their
    outputs summed (each one's multipliers folded into its linears at build: hf_checkpoint.multiplier_fold). An
    Attention (its KV cache, rotary and kernels as any layer's) holding the Mamba2, whose tensors it registers as its
    own (layers.{i}.attn.mamba_in, attn.conv, ...: the names of a Mamba-2 layer's); the state slots are the Mamba2's."""

    STATE_KIND = Mamba2.STATE_KIND

    def __init__(self, config: ModelConfig, formats: dict, index: int, dtype: torch.dtype):
        super().__init__(config, formats, index, dtype)
        mamba = Mamba2(config, formats, index, dtype)
        object.__setattr__(self, "mamba", mamba)  # (not a submodule: its tensors are this module's, below)
        for name, child in mamba.named_children():
            self.add_module(name, child)

    def forward(self, x: Tensor, batch: ForwardBatch, cos_sin: Tensor) -> Tensor:
        return super().forward(x, batch, cos_sin) + self.mamba(x, batch)

    @property
    def conv_state(self) -> Tensor | None:
        return self.mamba.conv_state

    def states(self) -> tuple[Tensor, Tensor]:
        return self.mamba.states()

    def bind_states(self, num_slots: int, device: torch.device, dtypes: tuple[torch.dtype, torch.dtype]) -> None:
        self.mamba.bind_states(num_slots, device, dtypes)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, formats: dict, prefix: str, dtype: torch.dtype,
                 layout: RankLayout | None = None, tp_group=None):
        super().__init__()
        size = (layout or whole_model_layout(config)).intermediate_size
        self.act, self.is_gated = config.hidden_act, config.gated_mlp
        if not self.is_gated:  # Nemotron-H, Arcee (relu2), Apertus (xielu): down(act(up(x))), no gate
            self.up = Linear(config.hidden_size, size, formats[prefix + "up"], False, dtype)
        else:
            self.gate_up = Linear(config.hidden_size, 2 * size, formats[prefix + "gate_up"], False, dtype)
        if self.act == "xielu":  # Apertus: the layer's alpha_p, alpha_n, beta, eps as its checkpoint holds them
            self.xielu = nn.Module()
            self.xielu.register_buffer("weight", torch.empty(4, dtype=torch.float32, device="meta"))
        self.down = Linear(size, config.hidden_size, formats[prefix + "down"], False, dtype)
        self.tp_group = tp_group
        self.is_gate_up_interleaved = False
        # (without gate: a w8a8-fp8 down quantizes its input itself)
        self.fp8_down_input = self.is_gated and takes_fp8_activations(formats[prefix + "down"])

    def interleave_gate_up(self) -> None:
        """After the weights load: where gate_up's format can (W4A16 in the gpu layout), its rows are
        put in the order in which its GEMV makes SiLU(gate) · up in its own epilogue. That epilogue is
        SiLU only: a GELU model (Gemma) keeps its rows and runs act_and_mul after the GEMM."""
        self.is_gate_up_interleaved = self.act == "silu" and self.gate_up.interleave_gate_up()

    def forward(self, x: Tensor) -> Tensor:
        if self.act == "relu2":
            h = torch.relu(self.up(x)).square()
        elif self.act == "xielu":
            h = xielu(self.up(x), self.xielu.weight)
        elif self.is_gate_up_interleaved:
            h = self.gate_up.silu_mul(x)
        else:  # quantized in the same kernel where down is w8a8-fp8
            h = (act_and_mul_fp8 if self.fp8_down_input else act_and_mul)(self.gate_up(x), self.act)
        out = self.down(h)  # [num_tokens, hidden_size], partial under TP
        return out if self.tp_group is None else self.tp_group.all_reduce(out)


def xielu(x: Tensor, params: Tensor) -> Tensor:
    """transformers' XIELUActivation (its Python form) on `x`, with `params` the checkpoint's [alpha_p, alpha_n, beta,
    eps] (alpha_p, alpha_n before their softplus) cast to x's dtype, as the model's own parameters are:
    x > 0: softplus(alpha_p) x² + beta x; else (expm1(min(x, eps)) - x)(beta + softplus(alpha_n)) + beta x."""
    alpha_p, alpha_n, beta, eps = params.to(x.dtype).unbind()
    alpha_p, alpha_n = nn.functional.softplus(alpha_p), beta + nn.functional.softplus(alpha_n)
    return torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(torch.minimum(x, eps)) - x) * alpha_n + beta * x)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, formats: dict, index: int, dtype: torch.dtype,
                 layout: RankLayout | None = None, tp_group=None):
        super().__init__()
        self.is_moe = config.is_moe_layer(index)
        # OLMo 2 (pre_norms false): no input_norm / post_attn_norm; the attention and the MLP read the residual stream
        # (a w8a8-fp8 qkv / gate_up then quantizes its input itself); OLMo Hybrid's DeltaNet layers have them
        # nonetheless (pre_norm_layers)
        self.has_pre_norms = config.has_pre_norms(index)
        self.is_mla = config.is_mla  # DeepSeek (runtime/models/mla.py): its q and kv_a linears quantize their input
        if self.has_pre_norms:
            # a w8a8-fp8 qkv / gate_up takes its input quantized by the norm's kernel (the MoE's router needs it
            # unquantized; Cohere's LayerNorm leaves it to the linears)
            self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, fp8_output=not self.is_mla
                                      and config.holds_kv(index) and not config.is_state_layer(index)
                                      and takes_fp8_activations(formats[f"layers.{index}.attn.qkv"]),
                                      centered=config.layer_norm)
        # Nemotron-H's single-mixer layers: the attention or Mamba-2 mixer alone (no MLP), or the MLP alone (no attn,
        # no KV cache); either reads input_norm's output, and its output joins the residual stream at the next norm
        self.has_mixer, self.has_mlp = config.has_mixer(index), config.has_mlp(index)
        self.holds_kv = config.holds_kv(index)
        # Qwen3.5's linear-attention layers: a Gated DeltaNet in the attention's place (no KV cache); Granite 4.0's
        # Mamba-2 layers: a Mamba-2 mixer there; LFM2's conv layers: a gated short conv there (the same: a per-request
        # state in slots, gated_deltanet NOTE); Falcon-H1's: the attention and a Mamba-2 mixer, summed
        self.is_state_layer = config.is_state_layer(index)
        if not self.has_mixer:
            self.attn = None
        elif self.is_state_layer and self.holds_kv:
            self.attn = AttentionAndMamba2(config, formats, index, dtype)
        elif config.is_linear_attention_layer(index):
            self.attn = GatedDeltaNet(config, formats, index, dtype)
        elif config.is_mamba_layer(index):
            self.attn = Mamba2(config, formats, index, dtype)
        elif config.is_short_conv_layer(index):
            self.attn = ShortConv(config, formats, index, dtype)
        else:
            self.attn = (MLAttention if self.is_mla else Attention)(config, formats, index, dtype, layout, tp_group)
        # Cohere: the MLP reads input_norm's output too (parallel_norm_in); no post_attn_norm
        self.is_parallel = config.parallel_block
        if self.has_pre_norms and not config.parallel_block and self.has_mixer and self.has_mlp:
            self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, fp8_output=not self.is_moe
                                          and takes_fp8_activations(
                                              formats[f"layers.{index}.mlp.{'gate_up' if config.gated_mlp else 'up'}"]))
        if self.has_mlp and self.is_moe:  # mixture of experts (runtime/models/moe.py)
            self.moe = MoE(config, formats, f"layers.{index}.moe.", dtype, layout, tp_group)
        elif self.has_mlp:
            self.mlp = MLP(config, formats, f"layers.{index}.mlp.", dtype, layout, tp_group)
        self.has_sandwich_norms = config.has_sandwich_norms(index)
        if self.has_sandwich_norms:  # Gemma: the attention's and the MLP's outputs normed before the residual add
            self.attn_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.mlp_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x: Tensor, residual: Tensor | None, batch: ForwardBatch, cos_sin: Tensor):
        x, residual = self.norm_in(x, residual)
        if not self.has_mlp:  # (Nemotron-H: the mixer alone; the next norm adds its output)
            return self.attn(x, batch, cos_sin), residual
        if not self.has_mixer:  # (the MLP or MoE alone, on input_norm's output)
            return (self.moe if self.is_moe else self.mlp)(x), residual
        return self.feed_forward(self.attn(x, batch, cos_sin), residual)

    def norm_in(self, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        """The input norm: (normed x, the residual stream with x added). Without pre-norms (OLMo 2) the attention
        reads the residual stream itself: (it, it)."""
        if not self.has_pre_norms:
            residual = x if residual is None else x + residual
            return residual, residual
        if self.is_parallel:
            return self.parallel_norm_in(x, residual)
        if residual is None:
            return self.input_norm(x), x
        return self.input_norm(x, residual)

    def parallel_norm_in(self, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        """Cohere's parallel block: the MLP runs here, on the input norm's output, and its output joins the residual
        stream at once; feed_forward then passes the attention's output on (the next norm adds it), so each layer
        adds attn(norm(x)) + mlp(norm(x)) to x, and the CUDA graphs' pieces split the layer as any other's."""
        x, residual = (self.input_norm(x), x) if residual is None else self.input_norm(x, residual)
        return x, residual + self.mlp(x)

    def feed_forward(self, attn_out: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """After the attention: (the MLP's or MoE's output, the residual stream); with sandwich norms both
        outputs are normed before they join the residual stream (the next norm adds them). Without pre-norms
        (OLMo 2) the MLP reads the residual stream itself."""
        if self.is_parallel:  # (the MLP ran in parallel_norm_in)
            return attn_out, residual
        if self.has_sandwich_norms:
            attn_out = self.attn_out_norm(attn_out)
        if self.has_pre_norms:
            x, residual = self.post_attn_norm(attn_out, residual)
        else:
            x = residual = attn_out + residual
        out = self.moe(x) if self.is_moe else self.mlp(x)
        return (self.mlp_out_norm(out) if self.has_sandwich_norms else out), residual


class DecoderModel(nn.Module):
    """embed → layers → norm → lm_head (a sequence classifier's: score). `formats` maps each linear's runtime name to its LinearFormat.

    With a `layout`, only that rank's share (see runtime/parallel/layout.py); `layers` is keyed by
    the global layer index, so tensor names stay `layers.{i}.…` on every rank.
    """

    def __init__(self, config: ModelConfig, formats: dict, max_positions: int,
                 layout: RankLayout | None = None, tp_group=None):
        super().__init__()
        dtype = getattr(torch, config.dtype)
        self.config = config
        self.layout = layout or whole_model_layout(config)
        self.tp_group = tp_group
        if self.layout.has_embed:
            self.embed = nn.Module()
            self.embed.register_buffer("weight", torch.empty(self.layout.vocab_size, config.hidden_size, dtype=dtype, device="meta"))
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(config, formats, i, dtype, layout, tp_group) for i in self.layout.layers}
        )
        self.is_tied = config.tie_word_embeddings and not config.is_classifier
        if self.layout.has_head:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, centered=config.layer_norm)
            if config.is_classifier:  # a sequence classifier's head, dense (never quantized): `classify`
                self.score = nn.Module()
                self.score.register_buffer("weight", torch.empty(config.num_labels, config.hidden_size, dtype=dtype,
                                                                 device="meta"))
            elif not self.is_tied:
                self.lm_head = Linear(config.hidden_size, self.layout.vocab_size, formats["lm_head"], False, dtype)
        rope, local_rope = rope_tables(config, max_positions)
        self.register_buffer("cos_sin", rope, persistent=False)
        self.register_buffer("cos_sin_local", local_rope, persistent=False)  # None: one table (not Gemma 3)
        # SmolLM3's NoPE layers' table, cos 1 and sin 0 (None: every layer rotates)
        self.register_buffer("cos_sin_none", nope_table(config, max_positions), persistent=False)
        # the embedding's multiplier (Gemma: sqrt(hidden_size), rounded to the artifact's dtype when it was built,
        # as transformers rounds it to the weights' dtype: exact in every compute dtype this artifact runs in)
        self.embed_scale = config.embed_scale
        # rows given in place of embeddings (transformers' inputs_embeds) are scaled where the family's forward scales
        # them (Granite), not where the scale is the embedding module's (Gemma: rows given are final)
        self.input_embeds_scale = config.embed_scale if spec_for_family(config.family).scales_input_embeds else None
        self.final_softcap = config.final_logit_softcapping  # Gemma 2: logits capped (None: not)
        # EAGLE-3 speculation (runtime/spec_eagle.py): the layers whose input (the residual stream entering them) a
        # forward keeps in aux_hidden [num_tokens, len(ids) * hidden_size], concatenated in this order; () keeps none
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden: Tensor | None = None
        self.keeps_final_hidden = False  # EAGLE-1: aux_hidden is the final norm's output [num_tokens, hidden_size]

    def forward(self, input_ids: Tensor, batch: ForwardBatch) -> Tensor:
        """input_ids [num_tokens] → final hidden states [num_tokens, hidden_size] (normed)."""
        x = self.embed_tokens(input_ids)
        if batch.image_rows is not None:  # image tokens take their images' rows (runtime/multimodal.py), and a
            indices, rows = batch.image_rows  # prompt given as embeddings its rows (runtime/prompt_embeds.py)
            x = x.index_copy(0, indices, self.input_rows(rows, x.dtype))
        x, residual = self.run_layers(x, None, batch)
        out = self.final_norm(x, residual)
        if self.keeps_final_hidden:
            self.aux_hidden = out
        return out

    def input_rows(self, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows given in place of token embeddings as the first layer takes them: times the embedding scale where the
        family's forward scales given embeddings (input_embeds_scale), in `dtype`."""
        return (rows if self.input_embeds_scale is None else rows * self.input_embeds_scale).to(dtype)

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """input_ids [num_tokens] → [num_tokens, hidden_size]. Vocab-parallel: each rank looks up the
        ids in its rows, zeros the others, and the all-reduce sums the one non-zero row per token."""
        if self.tp_group is None:
            x = self.embed.weight[input_ids]
        else:
            local = input_ids - self.layout.vocab_start
            is_mine = (local >= 0) & (local < self.layout.vocab_size)  # [num_tokens]
            x = self.embed.weight[local.clamp(0, self.layout.vocab_size - 1)]
            x = self.tp_group.all_reduce(x.masked_fill(~is_mine.unsqueeze(-1), 0))
        return x if self.embed_scale is None else x * self.embed_scale

    def run_layers(self, x: Tensor, residual: Tensor | None, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
        """This rank's decoder layers: (x, residual) in, (x, residual) out, [num_tokens, hidden_size] each. A step
        with its own rotary rows (batch.rope_table: M-RoPE, runtime/mrope.py) rotates by them in every layer; one with
        deepstack rows (batch.deepstack_rows: Qwen3-VL) adds level k to its image tokens' hidden states after layer k
        (to the layer's output, which the next norm adds to the residual: transformers' _deepstack_process)."""
        step_rope, keep, kept = batch.rope_table, self.aux_layer_ids, {}
        deepstack = batch.deepstack_rows
        for index, layer in self.layers.items():
            if keep and int(index) in keep:  # (an EAGLE-3 head's inputs: runtime/spec_eagle.py)
                kept[int(index)] = x if residual is None else x + residual
            x, residual = layer(x, residual, batch, self.rope_of(layer) if step_rope is None else step_rope)
            if deepstack is not None and int(index) < deepstack[1].shape[0]:
                x = x.index_add(0, deepstack[0], deepstack[1][int(index)].to(x.dtype))
        if keep:
            self.aux_hidden = torch.cat([kept[i] for i in keep], dim=-1)
        return x, residual

    def keep_hidden(self, layer_ids: tuple[int, ...], final: bool) -> None:
        """What every forward keeps in aux_hidden from now on (an EAGLE head's inputs, runtime/spec_eagle.py): the
        inputs of `layer_ids` (EAGLE-3), or the final hidden states (`final`, EAGLE-1). Set before any CUDA graph is
        captured: the graphs copy what is kept to a static buffer of aux_width() columns."""
        self.aux_layer_ids, self.keeps_final_hidden = tuple(layer_ids), final

    def aux_width(self) -> int:
        """Columns of aux_hidden (0: a forward keeps nothing)."""
        hidden = self.config.hidden_size
        return len(self.aux_layer_ids) * hidden if self.aux_layer_ids else hidden if self.keeps_final_hidden else 0

    def rope_of(self, layer: DecoderLayer) -> Tensor:
        """The rotary table `layer` reads (Gemma 3's sliding layers have their own, SmolLM3's NoPE layers the
        identity)."""
        return layer_table(layer, self.cos_sin, self.cos_sin_local, self.cos_sin_none)

    def final_norm(self, x: Tensor, residual: Tensor) -> Tensor:
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: Tensor, dtype: torch.dtype | None = torch.float32) -> Tensor:
        """hidden [num_logits, hidden_size] → logits [num_logits, vocab_size] (this rank's vocabulary
        rows under tensor parallelism) in `dtype`; None: the head's own (bf16/fp16 on a GPU), for a
        step's sampler, which reads them as they are for a plain argmax and copies them to float32
        otherwise (the same values: the conversion is exact).

        A model with final_logit_softcapping (Gemma 2) caps every logit, cap * tanh(logit / cap), in float32
        (transformers computes it in the head's dtype; in bf16 the tanh would round logits near the cap
        into ties), so its logits are float32 for dtype None. Elementwise: under tensor parallelism each
        rank caps its own vocabulary rows."""
        if self.config.is_classifier:  # (what profiles and warm-ups run; a classifier's steps pool: runtime/pooling.py)
            return self.classify(hidden, dtype)
        logits = (torch.nn.functional.linear(hidden, self.embed.weight) if self.is_tied else self.lm_head(hidden))
        if self.final_softcap is not None:
            cap = self.final_softcap
            logits = torch.tanh(logits.float() / cap) * cap
        return logits if dtype is None else logits.to(dtype)

    def classify(self, hidden: Tensor, dtype: torch.dtype | None = torch.float32) -> Tensor:
        """A sequence classifier's logits [n, num_labels] of pooled hidden states [n, hidden_size]: transformers'
        `score` (no bias, no soft cap), in the weights' dtype as transformers computes it, then `dtype`."""
        logits = torch.nn.functional.linear(hidden.to(self.score.weight.dtype), self.score.weight)
        return logits if dtype is None else logits.to(dtype)

    def prepare_loaded_weights(self, keep_gate_up_order: bool = False) -> None:
        """Once, after every weight has loaded: the layouts the kernels want that the artifact does not
        store (MLP.interleave_gate_up); act order's gathers gone where the identity (Linear.drop_identity_perm) or done by
        the norm before qkv and gate_up (RMSNorm.take_linear_perm); on a CPU, int and FP8 weights dequantized once (Linear.dequantize_once); the
        FP8 formats' note that a device without FP8 matmuls runs their reference path (Fp8Format.note_device); what a
        format derives from its tensors for this device (Linear.derive_params); MLA's W_UK / W_UV from kv_b
        (MLAttention.absorb_kv_b).
        keep_gate_up_order: gate_up's rows stay as stored (run-time LoRA adds to them: runtime/lora.py)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.drop_identity_perm()  # first: a norm takes no identity perm below
                if hasattr(module.fmt, "note_device"):
                    module.fmt.note_device(module.params())
                module.derive_params()
        for layer in self.layers.values():
            if layer.is_mla:
                layer.attn.absorb_kv_b()
            # (OLMo 2's qkv and gate_up read the residual stream, Cohere's both read input_norm: they gather it
            # themselves)
            if layer.has_pre_norms and not layer.is_parallel:
                # (MLA's q and kv_a, a Gated DeltaNet's in_qkvz and in_ba both read the input norm's output: they gather
                # it themselves)
                if not layer.is_mla and layer.holds_kv and not layer.is_state_layer:  # (Falcon-H1's: mamba_in too)
                    layer.input_norm.take_linear_perm(layer.attn.qkv)  # the norms' outputs feed qkv and gate_up only
                if not layer.is_moe and layer.has_mixer and layer.has_mlp:
                    layer.post_attn_norm.take_linear_perm(layer.mlp.gate_up if layer.mlp.is_gated else layer.mlp.up)
            if not layer.is_moe and layer.has_mlp and layer.mlp.is_gated and not keep_gate_up_order:
                layer.mlp.interleave_gate_up()
        int_modules = [m for m in self.modules() if isinstance(m, (Linear, ExpertLinears)) and m.dense_bytes()]
        dense_bytes = sum(m.dense_bytes() for m in int_modules)
        if not dense_bytes:
            return
        available = available_memory_bytes()
        if available is not None and dense_bytes > available // 2:
            logger.info("int and FP8 weights stay packed on the CPU and are dequantized in every forward (several times "
                        "slower): a %s copy would take %.1f GiB of the %.1f GiB available; an onnx-cpu build keeps "
                        "them packed and fast", self.config.dtype, dense_bytes / 2**30, available / 2**30)
            return
        for module in int_modules:
            module.dequantize_once()
        logger.info("int and FP8 weights dequantized once for the CPU: %.1f MiB in %s (an onnx-cpu build keeps them "
                    "packed)", dense_bytes / 2**20, self.config.dtype)

    def state_layers(self) -> list[GatedDeltaNet | Mamba2 | ShortConv]:
        """This rank's layers with a per-request state (Qwen3.5's Gated DeltaNets, Granite 4.0's Mamba-2 mixers, LFM2's
        short convs), in layer order; [] for any other model."""
        return [layer.attn for layer in self.layers.values() if layer.is_state_layer]

    def bind_states(self, num_slots: int, device: torch.device, dtypes: tuple[str, str]) -> int:
        """Allocate every stateful layer's own state tensors (each kind its own: bind_states) for `num_slots` request
        slots (gated_deltanet NOTE (state slots)), conv states in dtypes[0] and recurrent states in dtypes[1]
        (artifact.state_dtypes); returns their bytes."""
        torch_dtypes = tuple(getattr(torch, name) for name in dtypes)
        for attn in self.state_layers():
            attn.bind_states(num_slots, device, torch_dtypes)
        return num_slots * self.state_bytes_per_slot()

    def state_bytes_per_slot(self) -> int:
        """One request slot's bytes of the bound states."""
        return sum(state[0].nbytes for attn in self.state_layers() for state in attn.states())

    def kv_attentions(self) -> list[nn.Module]:
        """This rank's attention modules that hold a KV cache, in layer order: every layer's but the state layers' and
        the MLPs alone (Nemotron-H's)."""
        return [layer.attn for layer in self.layers.values() if layer.holds_kv]

    def bind_kv_caches(self, kv_caches: list[tuple[Tensor, Tensor]],
                       scales: list[tuple[float, float]] | None = None) -> None:
        """One (K, V) per layer of this rank, in layer order (MLA: (latent,)), with its (k_scale, v_scale) for an
        FP8 cache (None: 1.0; MLA reads k_scale)."""
        scales = scales or [(1.0, 1.0)] * len(kv_caches)
        for attn, kv_cache, (k_scale, v_scale) in zip(self.kv_attentions(), kv_caches, scales, strict=True):
            attn.kv_cache = kv_cache
            attn.k_scale, attn.v_scale = k_scale, v_scale


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """Each head of x [num_tokens, heads, head_dim] times rsqrt(mean(head^2) + eps), in float32, back in x's dtype
    (Llama 4's weightless q/k norm, transformers' Llama4TextL2Norm: ModelConfig.qk_l2_norm_layers)."""
    x_f32 = x.float()
    return (x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(config: ModelConfig, max_positions: int) -> tuple[Tensor, Tensor | None]:
    """(the global rotary table, the sliding layers' own or None), [max_positions, rotary_dims] float32 each
    (rotary_dims: head_dim, or fewer under a partial_rotary_factor; the rotation passes the rest of a head), as wide
    as ModelConfig.rotary_table_dims (GLM-4: the whole head, its pass-through pairs rotated by 0)."""
    width = config.rotary_table_dims
    table = cos_sin_cache(config.rotary_dims, max_positions, config.rope_theta, config.rope_scaling, width)
    if not config.rope_on_full_layers:  # Cohere 2's full-attention layers: rotated by 0 (cos 1, sin 0)
        table = identity_table(max_positions, width)
    if config.rope_local_theta is None:
        return table, None
    return table, cos_sin_cache(config.rotary_dims, max_positions, config.rope_local_theta, config.rope_local_scaling,
                                width)


def identity_table(max_positions: int, width: int) -> Tensor:
    """[max_positions, width] float32 of cos 1, sin 0: rotating by it leaves q and k exactly as they are
    (x * 1 - y * 0 is x in every kernel's float32 rotation), so a layer without rotary runs every rotary path."""
    return torch.cat((torch.ones(max_positions, width // 2), torch.zeros(max_positions, width // 2)), dim=-1)


def nope_table(config: ModelConfig, max_positions: int) -> Tensor | None:
    """SmolLM3's NoPE layers' table (identity_table, as wide as the rope's), or None where every layer rotates.
    One table beside the rope's: max_positions x head_dim float32 (32 MiB at SmolLM3-3B's 65536 positions)."""
    return identity_table(max_positions, config.rotary_table_dims) if config.nope_layers else None


def layer_table(layer: DecoderLayer, table: Tensor, local: Tensor | None, nope: Tensor | None) -> Tensor:
    """The rotary table `layer` reads of the model's: `nope` for a NoPE layer (SmolLM3), `local` for a sliding layer
    of a model with its own local rope (Gemma 3, OLMo 3, Cohere 2), else `table` (also for an MLP alone: unread)."""
    if layer.attn is None:
        return table
    if not layer.attn.has_rope:
        return nope
    return local if layer.attn.is_local_rope else table
