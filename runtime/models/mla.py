"""DeepSeek's multi-head latent attention (MLA: DeepSeek-V2, V3; transformers' DeepseekV2/V3Attention), in the
expanded form that runs on the paged KV cache and attention kernels every other family uses.

q: attn.q (q_proj), or attn.q_a → attn.q_a_norm → attn.q_b under a q_lora_rank; per head qk_nope_head_dim dims
without the rotary, then qk_rope_head_dim with it. attn.kv_a (kv_a_proj_with_mqa): the compressed kv (kv_lora_rank)
→ attn.kv_a_norm → attn.kv_b (kv_b_proj): per head k_nope and v; and one rope key k_pe every head shares. The rope
parts are rotated here, in torch (the interleaved pairs of DeepSeek-V2 and of V3's rope_interleave taken apart into
rotate-half's halves first, for q and k alike, which leaves q·k as it was), then each head's K is [k_nope, k_pe] and
its V is v zero-padded to K's head_dim: the cache holds num_heads K and V heads of head_dim per token, and the output
is sliced back to v_head_dim before o. The scale is qk_head_dim^-0.5 (times YaRN's mscale_all_dim term squared:
ModelConfig.softmax_scale, compiler/hf_checkpoint._deepseek_fields). Under tensor parallelism a rank holds its heads
(q / q_b and kv_b rows, o's columns) and the whole low-rank q_a, kv_a and their norms; o's partial sums are
all-reduced, as decoder.Attention's.

What it costs: 2 * num_heads * head_dim values per token and layer (DeepSeek-V3: 2 * 128 * 192 = 49152), where the
latent cache of vLLM's MLA backend keeps kv_lora_rank + qk_rope_head_dim (576): about 85x more KV memory, so far
fewer tokens fit. The latent (absorbed) cache is not built.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmc.kernels.attention import paged_attention, write_kv_cache
from llmc.kernels.rotary import apply_rotary
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.layers.linear import Linear
from llmc.runtime.layers.norm import RMSNorm
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
        self.num_heads = self.num_kv_heads = layout.num_heads
        self.head_dim, self.scale = config.head_dim, config.attention_scale
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank, self.is_rope_interleaved = config.kv_lora_rank, config.mla_rope_interleave
        self.sliding_window, self.is_local_rope, self.softcap = None, False, None
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
        self.kv_cache: tuple[Tensor, Tensor] | None = None
        self.k_scale, self.v_scale = 1.0, 1.0

    def forward(self, x: Tensor, batch: ForwardBatch, cos_sin: Tensor) -> Tensor:
        q = self.project(x, batch.positions, batch.slot_mapping, cos_sin)
        k_cache, v_cache = self.kv_cache
        out = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.query_lens, self.scale,
                              None, batch.max_context_len, self.k_scale, self.v_scale, batch.kernel_cache,
                              prefill_index=batch.prefill_index, key_limits=batch.key_limits)
        return self.output(out)

    def project(self, x: Tensor, positions: Tensor, slot_mapping: Tensor, cos_sin: Tensor,
                q_out: Tensor | None = None) -> Tensor:
        """The heads with their rope parts rotated, K and V written to the cache: q [num_tokens, num_heads,
        head_dim] (into q_out, when given)."""
        q, k, v = self.rotated_heads(x, positions, cos_sin)
        k_cache, v_cache = self.kv_cache
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping, self.k_scale, self.v_scale)
        return q if q_out is None else q_out.copy_(q)

    def rotated_heads(self, x: Tensor, positions: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [num_tokens, hidden] → q, K, V [num_tokens, num_heads, head_dim] (V zero-padded past v_head_dim)."""
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.has_q_lora else self.q(x)
        q_nope, q_pe = q.view(-1, self.num_heads, self.head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b(self.kv_a_norm(latent.contiguous())).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_pe, k_pe = apply_rotary(self.deinterleave(q_pe), self.deinterleave(k_pe.unsqueeze(1)), positions, cos_sin)
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe.expand(-1, self.num_heads, -1)), dim=-1)
        v = torch.nn.functional.pad(v, (0, self.head_dim - self.v_dim))
        return q, k, v

    def deinterleave(self, x: Tensor) -> Tensor:
        """Interleaved rope pairs (x0, x1), (x2, x3), ... as rotate-half's halves (x0, x2, ..., x1, x3, ...)."""
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.is_rope_interleaved else x

    def attend(self, q: Tensor, batch: ForwardBatch, out: Tensor | None = None) -> Tensor:
        k_cache, v_cache = self.kv_cache
        return paged_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.query_lens,
                               self.scale, None, batch.max_context_len, self.k_scale, self.v_scale,
                               batch.kernel_cache, out=out, key_limits=batch.key_limits)

    def output(self, attn: Tensor) -> Tensor:
        """attn [num_tokens, num_heads, head_dim] → o of its first v_head_dim dims per head [num_tokens, hidden]
        (all-reduced under TP: this rank's heads' partial sum)."""
        out = self.o(attn[..., : self.v_dim].flatten(1))
        return out if self.tp_group is None else self.tp_group.all_reduce(out)
