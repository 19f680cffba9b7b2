"""DeepSeek's multi-head latent attention (MLA: DeepSeek-V2, V3; transformers' DeepseekV2/V3Attention) over the latent
KV cache of vLLM's MLA backend (kernels/mla_attention.py).

q: attn.q (q_proj), or attn.q_a → attn.q_a_norm → attn.q_b under a q_lora_rank; per head qk_nope_head_dim dims
without the rotary, then qk_rope_head_dim with it. attn.kv_a (kv_a_proj_with_mqa): the compressed kv (kv_lora_rank)
→ attn.kv_a_norm: c_kv; and one rope key k_pe every head shares. The rope parts are rotated here, in torch (the
interleaved pairs of DeepSeek-V2 and of V3's rope_interleave taken apart into rotate-half's halves first, for q and k
alike, which leaves q·k as it was). The cache holds [c_kv, k_pe] per token and layer: kv_lora_rank + qk_rope_head_dim
values (576 for V2 / V3), one FP8 scale where it is FP8. attn.kv_b (kv_b_proj) holds each head's k_nope and v rows
(W_UK, W_UV): attention runs absorbed (q_nope · W_UK against c_kv, the output's latent · W_UV^T) or, for sequences
of many queries in a step (on CUDA and on a CPU, each device by its rule), expanded (kv_b over the context's latents
chunk by chunk, each chunk attended and the chunks merged by their log-sum-exps); W_UK and W_UV are kv_b's weights
dequantized once at load (`absorb_kv_b`), exactly the weights kv_b multiplies by. The scale is qk_head_dim^-0.5 (times YaRN's
mscale_all_dim term squared: ModelConfig.softmax_scale, compiler/hf_checkpoint._deepseek_fields). Mistral 4's query
temperature (ModelConfig.query_temperature_*) multiplies the whole q, after the rotary, as decoder.Attention's. Under
tensor parallelism a rank holds its heads (q / q_b and kv_b rows: its W_UK / W_UV, o's columns) and the whole
low-rank q_a, kv_a and their norms, so every rank caches the whole latent; o's partial sums are all-reduced, as
decoder.Attention's.

kv_b's activations: a w8a8 kv_b (FP8) rounds its input in the expanded form; the absorbed form multiplies the cached
latents by the dequantized weights unrounded (as vLLM's MLA decode does).
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmc.kernels.mla_attention import mla_attention, write_latent_cache
from llmc.kernels.rotary import apply_rotary
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.layers.linear import Linear
from llmc.runtime.layers.norm import RMSNorm
from llmc.runtime.layers.rotary import query_temperature
from llmc.runtime.parallel.layout import RankLayout, whole_model_layout

# transformers' q_a_layernorm and kv_a_layernorm: DeepseekV2/V3RMSNorm's default eps, not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


class MLAttention(torch.nn.Module):
    """decoder.Attention's interface (forward; project / attend / output for the piecewise graphs), for MLA."""

    def __init__(self, config: ModelConfig, formats: dict, index: int, dtype: torch.dtype,
                 layout: RankLayout | None = None, tp_group=None):
        super().__init__()
        prefix = f"layers.{index}.attn."
        layout = layout or whole_model_layout(config)
        self.num_heads, self.num_kv_heads = layout.num_heads, 1  # (one latent per token, every head's)
        self.head_dim, self.scale = config.head_dim, config.attention_scale
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank, self.is_rope_interleaved = config.kv_lora_rank, config.mla_rope_interleave
        self.temperature = config.query_temperature_of(index)  # (Mistral 4's; beta, floor, offset) None: q not scaled
        self.sliding_window, self.is_local_rope, self.softcap, self.has_rope = None, False, None, True
        h, q_size = config.hidden_size, self.num_heads * self.head_dim
        self.has_q_lora = bool(config.q_lora_rank)
        if self.has_q_lora:
            self.q_a = Linear(h, config.q_lora_rank, formats[prefix + "q_a"], False, dtype)
            self.q_a_norm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b = Linear(config.q_lora_rank, q_size, formats[prefix + "q_b"], False, dtype)
        else:
            self.q = Linear(h, q_size, formats[prefix + "q"], False, dtype)
        self.kv_a = Linear(h, self.kv_lora_rank + self.rope_dim, formats[prefix + "kv_a"], False, dtype)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), formats[prefix + "kv_b"],
                           False, dtype)
        self.o = Linear(self.num_heads * self.v_dim, h, formats[prefix + "o"], False, dtype)
        self.has_qk_norm = self.is_qk_norm_full_width = False
        self.tp_size, self.tp_group = layout.tp_size, tp_group
        self.kv_cache: tuple[Tensor] | None = None  # (the latent cache [num_blocks, block_size, latent_dim],)
        self.k_scale, self.v_scale = 1.0, 1.0  # an FP8 cache's one scale: k_scale (v_scale is not read)
        self.w_uk: Tensor | None = None  # absorb_kv_b's
        self.w_uv: Tensor | None = None
        # the form of every step (kernels/mla_attention.FORMS), on any device; None: by each sequence's queries and
        # context (the calibration runner's: "expanded", so that kv_b sees its inputs)
        self.form: str | None = None

    def absorb_kv_b(self) -> None:
        """Once, after the weights load (DecoderModel.prepare_loaded_weights): W_UK [num_heads, qk_nope, kv_lora_rank]
        and W_UV [num_heads, v_head_dim, kv_lora_rank], kv_b's rows of this rank's heads dequantized from its format
        into the compute dtype (the absorbed form's weights)."""
        fmt, params = self.kv_b.fmt, self.kv_b.params()
        dequantize = getattr(fmt, "dequantize", None)  # (the dense format's weight is the weight)
        weight = params["weight"] if dequantize is None else dequantize(params, self.kv_lora_rank)
        w_uk, w_uv = weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank).split(
            [self.nope_dim, self.v_dim], dim=1)
        self.w_uk, self.w_uv = w_uk.to(fmt.dtype).contiguous(), w_uv.to(fmt.dtype).contiguous()

    def forward(self, x: Tensor, batch: ForwardBatch, cos_sin: Tensor) -> Tensor:
        q = self.project(x, batch.positions, batch.slot_mapping, cos_sin)
        return self.output(self.attend(q, batch))

    def project(self, x: Tensor, positions: Tensor, slot_mapping: Tensor, cos_sin: Tensor,
                q_out: Tensor | None = None) -> Tensor:
        """q [num_tokens, num_heads, qk_nope + qk_rope] with its rope part rotated (into q_out, when given); the
        tokens' [c_kv, k_pe] written to the latent cache."""
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.has_q_lora else self.q(x)
        q_nope, q_pe = q.view(-1, self.num_heads, self.head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = apply_rotary(self.deinterleave(q_pe), self.deinterleave(k_pe.unsqueeze(1)), positions, cos_sin)
        write_latent_cache(self.kv_a_norm(latent.contiguous()), k_pe.squeeze(1), self.kv_cache[0], slot_mapping,
                           self.k_scale)
        q = torch.cat((q_nope, q_pe), dim=-1)
        if self.temperature is not None:  # the whole q (both parts) at each token's position, as transformers'
            q = q * query_temperature(positions, *self.temperature).to(q.dtype)[:, None, None]
        return q if q_out is None else q_out.copy_(q)

    def deinterleave(self, x: Tensor) -> Tensor:
        """Interleaved rope pairs (x0, x1), (x2, x3), ... as rotate-half's halves (x0, x2, ..., x1, x3, ...)."""
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.is_rope_interleaved else x

    def expand(self, c_kv: Tensor) -> tuple[Tensor, Tensor]:
        """The expanded form's keys and values of cached latents c_kv [n, kv_lora_rank]: kv_b's k_nope [n, num_heads,
        qk_nope] and v [n, num_heads, v_head_dim]."""
        kv = self.kv_b(c_kv).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        return kv.split([self.nope_dim, self.v_dim], dim=-1)

    def attend(self, q: Tensor, batch: ForwardBatch, out: Tensor | None = None) -> Tensor:
        """q (project's) → [num_tokens, num_heads, v_head_dim] (into out's first v_head_dim dims, when given)."""
        if batch.key_limits is not None:  # (a vision model's steps only: DeepSeek has none)
            raise ValueError("latent attention reads no key_limits")
        return mla_attention(q, self.kv_cache[0], self.w_uk, self.w_uv, batch.block_tables, batch.context_lens,
                             batch.query_lens, self.scale, kv_scale=self.k_scale,
                             max_context_len=batch.max_context_len, expand=self.expand,
                             form=self.form, index_cache=batch.kernel_cache, prefill_index=batch.prefill_index,
                             out=out, host_context_lens=batch.host_context_lens)

    def output(self, attn: Tensor) -> Tensor:
        """attn [num_tokens, num_heads, >= v_head_dim] → o of its first v_head_dim dims per head [num_tokens, hidden]
        (all-reduced under TP: this rank's heads' partial sum)."""
        out = self.o(attn[..., : self.v_dim].flatten(1))
        return out if self.tp_group is None else self.tp_group.all_reduce(out)
