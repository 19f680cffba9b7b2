"""The decoder-only transformer every supported family is built from (Llama, Mistral, Qwen2, Qwen3).

Families differ only in data (ModelSpec) and config flags (attention_bias, qk_norm), so one module
serves them all. Buffers are named exactly as the artifact's tensors (`layers.3.attn.qkv.weight`),
so loading is a strict comparison of names, shapes and dtypes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmc.kernels.activation import silu_and_mul
from llmc.kernels.attention import paged_attention, write_kv_cache
from llmc.kernels.rotary import apply_rotary
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.layers.linear import Linear
from llmc.runtime.layers.norm import RMSNorm
from llmc.runtime.layers.rotary import cos_sin_cache


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, formats: dict, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_window
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv = Linear(config.hidden_size, q_size + 2 * kv_size, formats[prefix + "qkv"], config.attention_bias, dtype)
        self.o = Linear(q_size, config.hidden_size, formats[prefix + "o"], False, dtype)
        self.has_qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.kv_cache: tuple[Tensor, Tensor] | None = None  # bound by the model runner after allocation

    def forward(self, x: Tensor, batch: ForwardBatch, cos_sin: Tensor) -> Tensor:
        q, k, v = self.qkv(x).split(self.split_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, batch.positions, cos_sin)
        k_cache, v_cache = self.kv_cache
        write_kv_cache(k, v, k_cache, v_cache, batch.slot_mapping)
        out = paged_attention(
            q, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.query_lens,
            self.scale, self.sliding_window,
        )  # [num_tokens, num_heads, head_dim]
        return self.o(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, formats: dict, prefix: str, dtype: torch.dtype):
        super().__init__()
        size = config.intermediate_size
        self.gate_up = Linear(config.hidden_size, 2 * size, formats[prefix + "gate_up"], False, dtype)
        self.down = Linear(size, config.hidden_size, formats[prefix + "down"], False, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(silu_and_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, formats: dict, index: int, dtype: torch.dtype):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = Attention(config, formats, f"layers.{index}.attn.", dtype)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, formats, f"layers.{index}.mlp.", dtype)

    def forward(self, x: Tensor, residual: Tensor | None, batch: ForwardBatch, cos_sin: Tensor):
        if residual is None:
            residual, x = x, self.input_norm(x)
        else:
            x, residual = self.input_norm(x, residual)
        x = self.attn(x, batch, cos_sin)
        x, residual = self.post_attn_norm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """embed → layers → norm → lm_head. `formats` maps each linear's runtime name to its LinearFormat."""

    def __init__(self, config: ModelConfig, formats: dict, max_positions: int):
        super().__init__()
        dtype = getattr(torch, config.dtype)
        self.config = config
        self.embed = nn.Module()
        self.embed.register_buffer("weight", torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device="meta"))
        self.layers = nn.ModuleList(DecoderLayer(config, formats, i, dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.is_tied = config.tie_word_embeddings
        if not self.is_tied:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, formats["lm_head"], False, dtype)
        rope = cos_sin_cache(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.register_buffer("cos_sin", rope, persistent=False)

    def forward(self, input_ids: Tensor, batch: ForwardBatch) -> Tensor:
        """input_ids [num_tokens] → final hidden states [num_tokens, hidden_size] (normed)."""
        x = self.embed.weight[input_ids]  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch, self.cos_sin)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [num_logits, hidden_size] → logits [num_logits, vocab_size] float32."""
        if self.is_tied:
            return torch.nn.functional.linear(hidden, self.embed.weight).float()
        return self.lm_head(hidden).float()

    def bind_kv_caches(self, kv_caches: list[tuple[Tensor, Tensor]]) -> None:
        for layer, kv_cache in zip(self.layers, kv_caches):
            layer.attn.kv_cache = kv_cache
