"""EAGLE draft heads (vLLM's speculative methods eagle3 and eagle): the published checkpoints read and run.

NOTE (format): a head is a Hugging Face folder, config.json (a LlamaConfig with `draft_vocab_size`, optional
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, `norm_before_residual`) and safetensors:
  fc.weight [hidden, 3 * target_hidden]                 over the concatenated aux hidden states of the model
  midlayer.input_layernorm.weight, midlayer.hidden_norm.weight [hidden]
  midlayer.self_attn.{q,k,v}_proj.weight [heads * head_dim, 2 * hidden], o_proj [hidden, heads * head_dim]
  midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight
  norm.weight [hidden], lm_head.weight [draft_vocab_size, hidden]
  d2t [draft_vocab_size] int64 (draft index i is the model's token i + d2t[i]), t2d [vocab_size] bool (unread)
  embed_tokens.weight [vocab_size, hidden], absent in most: then the model's own embedding rows are read.
The model's aux hidden states are its residual stream entering layers 2, n // 2 and n - 3 (the config's
`eagle_aux_hidden_state_layer_ids` instead, where it names them), unnormed, concatenated in that order.

One head step at position p reads the model's (or, for later drafts, its own) hidden state h_p and the token at
p + 1: x = fc(h_p) (its own: h_p as it is); e = embed(token); residual = x (hidden_norm(x) under
norm_before_residual); a = attention(cat(input_layernorm(e), hidden_norm(x))) + residual; out = a +
mlp(post_attention_layernorm(a)); the next token's logits are lm_head(norm(out)) over the draft vocabulary, and
`out` is the hidden state the next draft step reads. Sources: the EAGLE-3 paper (Li et al., 2025) and the
published heads' config.json and tensor names; runtime/spec_eagle.py runs the head in the engine.

NOTE (EAGLE-1, method eagle; the EAGLE paper, Li et al., 2024, and yuhuili/EAGLE-LLaMA3-Instruct-8B's names):
  fc.weight [hidden, 2 * hidden] (fc.bias [hidden] where the config's `bias` is true) over cat(embedding, hidden)
  layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.*, layers.0.post_attention_layernorm.weight: a Llama
  decoder layer without its input norm; no norm, no lm_head: the model's head reads the layer's output.
The hidden state it reads is the model's last (after its final norm, the one its head reads). One step:
x = fc(cat(embed(token), h_p)); a = attention(x) + x; out = a + mlp(post_attention_layernorm(a)); logits: the
model's head at out; `out` is what the next draft step reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from llmc.errors import ConfigError
from llmc.kernels.attention import rotate_write_and_attend
from llmc.kernels.norm import rms_norm
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.layers.rotary import cos_sin_cache

LAYER = "midlayer."  # EAGLE-3's; EAGLE-1's is layers.0.


@dataclass(frozen=True)
class EagleHeadConfig:
    """What the head's config.json says (fields as transformers' LlamaConfig names them, shortened)."""

    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    vocab_size: int
    draft_vocab_size: int
    max_position_embeddings: int
    aux_layer_ids: tuple[int, ...] | None  # None: vLLM's default (2, n // 2, n - 3)
    norm_before_residual: bool
    method: str = "eagle3"  # or "eagle" (EAGLE-1)
    fc_bias: bool = False  # EAGLE-1's fc may have one

    @property
    def layer(self) -> str:
        """The decoder layer's tensor prefix."""
        return LAYER if self.method == "eagle3" else "layers.0."

    @property
    def reads_final_hidden(self) -> bool:
        """Whether the head reads the model's final hidden states (EAGLE-1) rather than aux layers' inputs."""
        return self.method == "eagle"

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * itemsize


def read_head_config(path: Path, name: str, method: str = "eagle3") -> EagleHeadConfig:
    """The head folder's config.json; a one-line ConfigError (prefixed `name`) where it is missing or is not an
    EAGLE head llmc runs (`method`: eagle3, or eagle for EAGLE-1)."""
    file = path / "config.json"
    what = "EAGLE-3" if method == "eagle3" else "EAGLE"
    if not file.is_file():
        raise ConfigError(f"{name}: no config.json in {path}; give the {what} head's Hugging Face folder")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{name}: {file} is not JSON ({e}); fix the head's config") from None
    missing = [key for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if key not in raw]
    if missing:
        raise ConfigError(f"{name}: {file} has no {', '.join(missing)}; not a head's config (a LlamaConfig)")
    layers = raw.get("num_hidden_layers", 1)
    if layers != 1:
        raise ConfigError(f"{name}: the head has {layers} layers; llmc runs {what} heads of one layer")
    if method == "eagle" and (raw.get("eagle_aux_hidden_state_layer_ids") or raw.get("draft_vocab_size")):
        raise ConfigError(f"{name}: its config is an EAGLE-3 head's (draft_vocab_size, aux layers); use method eagle3")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"{name}: hidden_act {raw['hidden_act']!r}; the head's MLP computes SiLU(gate) * up only")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    theta, scaling = _rope(raw)
    return EagleHeadConfig(
        hidden_size=hidden, target_hidden_size=raw.get("target_hidden_size") or hidden, num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=raw.get("head_dim") or hidden // heads,
        intermediate_size=raw["intermediate_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=theta,
        rope_scaling=scaling, vocab_size=raw["vocab_size"], draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        aux_layer_ids=tuple(aux) if aux else None, norm_before_residual=bool(raw.get("norm_before_residual", False)),
        method=method, fc_bias=bool(raw.get("bias", False)))


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(theta, rope_scaling for rotary.inv_frequencies) from `rope_parameters` or the older rope_theta / rope_scaling."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **params}


def aux_layers(config: EagleHeadConfig, target: ModelConfig, name: str) -> tuple[int, ...]:
    """The model's layers whose input the head reads, checked against the model: a one-line ConfigError where the
    head does not fit it (hidden size, vocabulary, layer ids)."""
    if config.target_hidden_size != target.hidden_size or config.hidden_size != target.hidden_size:
        raise ConfigError(f"{name}: the head reads hidden states of size {config.target_hidden_size} and embeds in "
                          f"{config.hidden_size}, the model's are {target.hidden_size}; use a head trained for this model")
    if config.vocab_size != target.vocab_size:
        raise ConfigError(f"{name}: the head's vocabulary has {config.vocab_size} tokens, the model's "
                          f"{target.vocab_size}; use a head trained for this model")
    if config.method == "eagle":
        return ()
    n = target.num_layers
    ids = config.aux_layer_ids or (2, n // 2, n - 3)
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < n for i in ids):
        raise ConfigError(f"{name}: eagle_aux_hidden_state_layer_ids {list(ids)} must be three layers of the model's "
                          f"{n} (0..{n - 1}); use a head trained for this model")
    return tuple(ids)


def read_head_tensors(path: Path, config: EagleHeadConfig, name: str) -> dict[str, Tensor]:
    """Every tensor of the head's safetensors files, checked for the names and shapes the head needs; a pickle-only
    head (pytorch_model.bin) is refused."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin")) or ["no weights"]
        raise ConfigError(f"{name}: no safetensors in {path} ({', '.join(pickles)}); llmc does not unpickle weights: "
                          "convert the head to safetensors")
    tensors: dict[str, Tensor] = {}
    try:
        for file in files:
            with safe_open(str(file), "pt") as f:
                tensors.update({key: f.get_tensor(key) for key in f.keys()})
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{name}: cannot read {path}: {e}") from None
    tensors = {key.removeprefix("model."): value for key, value in tensors.items()}
    c, layer = config, config.layer
    q, kv, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
    attn_in = 2 * h if c.method == "eagle3" else h
    shapes = {f"{layer}self_attn.q_proj.weight": (q, attn_in), f"{layer}self_attn.k_proj.weight": (kv, attn_in),
              f"{layer}self_attn.v_proj.weight": (kv, attn_in), f"{layer}self_attn.o_proj.weight": (h, q),
              f"{layer}mlp.gate_proj.weight": (c.intermediate_size, h), f"{layer}mlp.up_proj.weight": (c.intermediate_size, h),
              f"{layer}mlp.down_proj.weight": (h, c.intermediate_size), f"{layer}post_attention_layernorm.weight": (h,)}
    if c.method == "eagle3":
        shapes.update({"fc.weight": (h, 3 * c.target_hidden_size), "norm.weight": (h,),
                       "lm_head.weight": (c.draft_vocab_size, h),
                       **{f"{layer}{n}.weight": (h,) for n in ("input_layernorm", "hidden_norm")}})
    else:
        shapes["fc.weight"] = (h, 2 * h)
        if c.fc_bias:
            shapes["fc.bias"] = (h,)
    if c.draft_vocab_size != c.vocab_size:
        shapes["d2t"] = (c.draft_vocab_size,)
    if "embed_tokens.weight" in tensors:
        shapes["embed_tokens.weight"] = (c.vocab_size, h)
    what, names = ("EAGLE-3", "fc, midlayer.*, norm, lm_head, d2t") if c.method == "eagle3" else ("EAGLE", "fc, layers.0.*")
    for key, shape in shapes.items():
        if key not in tensors:
            raise ConfigError(f"{name}: tensor {key} is missing; not an {what} head in the published format ({names})")
        if tuple(tensors[key].shape) != shape:
            raise ConfigError(f"{name}: tensor {key} has shape {list(tensors[key].shape)}, its config.json says "
                              f"{list(shape)}; fix the head's config")
    biases = sorted(key for key in tensors if key.endswith(".bias") and key not in shapes)
    if biases:
        raise ConfigError(f"{name}: tensor {biases[0]}: llmc runs heads whose only bias is EAGLE-1's fc.bias (config "
                          "`bias` true); not this head")
    if c.method == "eagle" and f"{layer}input_layernorm.weight" in tensors:
        raise ConfigError(f"{name}: tensor {layer}input_layernorm.weight: an EAGLE head's layer has no input norm; "
                          "not a head llmc runs")
    return tensors


class EagleHead(nn.Module):
    """The head's weights in the compute dtype, its own one-layer KV cache and its rotary table. `target_logits`: the
    model's head (DecoderModel.compute_logits), which EAGLE-1 drafts read."""

    def __init__(self, config: EagleHeadConfig, tensors: dict[str, Tensor], target_embed: Tensor, target_logits,
                 num_blocks: int, block_size: int, max_positions: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.w = {key: value.to(device=device, dtype=dtype) for key, value in tensors.items()
                  if key not in ("d2t", "t2d")}
        self.embed = self.w.pop("embed_tokens.weight", None)
        if self.embed is None:  # shared with the model (its raw rows: an embedding scale is the model's forward's)
            self.embed = target_embed
        self.target_logits = target_logits
        draft_ids = torch.arange(config.draft_vocab_size, dtype=torch.int64)
        if "d2t" in tensors:
            draft_ids = draft_ids + tensors["d2t"].to(torch.int64)
        if draft_ids.min() < 0 or draft_ids.max() >= config.vocab_size:
            raise ConfigError("speculative.model: the head's d2t maps draft tokens outside the vocabulary; fix the head")
        self.draft_to_target = draft_ids.to(device)  # [draft_vocab_size]
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_cache = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        self.cos_sin = cos_sin_cache(config.head_dim, max_positions, config.rope_theta, config.rope_scaling).to(device)
        self.scale = config.head_dim ** -0.5

    def combine(self, states: Tensor) -> Tensor:
        """The model's kept hidden states → the head's input hidden states [n, hidden]: EAGLE-3's fc over the aux
        layers' [n, 3 * target_hidden]; EAGLE-1's final hidden states as they are."""
        if self.config.method != "eagle3":
            return states.to(self.embed.dtype)
        return nn.functional.linear(states.to(self.w["fc.weight"].dtype), self.w["fc.weight"])

    def forward(self, input_ids: Tensor, hidden: Tensor, batch: ForwardBatch) -> Tensor:
        """One head step over a flat batch (positions, KV slots and tables as the model's): input_ids [n] (each the
        token after its position), hidden [n, hidden] → the head's output hidden states [n, hidden] (pre-norm)."""
        c, w, layer = self.config, self.w, self.config.layer
        eps = c.rms_norm_eps
        embedded = self.embed[input_ids]
        if c.method == "eagle3":
            normed = rms_norm(hidden, w[layer + "hidden_norm.weight"], eps)
            residual = normed if c.norm_before_residual else hidden
            x = torch.cat((rms_norm(embedded, w[layer + "input_layernorm.weight"], eps), normed), dim=-1)
        else:  # EAGLE-1: fc over [embedding, hidden], the layer without its input norm
            x = residual = nn.functional.linear(torch.cat((embedded, hidden), dim=-1), w["fc.weight"], w.get("fc.bias"))
        attn = layer + "self_attn."
        q = nn.functional.linear(x, w[attn + "q_proj.weight"]).view(-1, c.num_heads, c.head_dim)
        k = nn.functional.linear(x, w[attn + "k_proj.weight"]).view(-1, c.num_kv_heads, c.head_dim)
        v = nn.functional.linear(x, w[attn + "v_proj.weight"]).view(-1, c.num_kv_heads, c.head_dim)
        out = rotate_write_and_attend(q, k, v, batch.positions, self.cos_sin, *self.kv_cache, batch.slot_mapping,
                                      batch.block_tables, batch.context_lens, batch.query_lens, self.scale, None,
                                      batch.max_context_len, index_cache=batch.kernel_cache,
                                      prefill_index=batch.prefill_index)
        h = residual + nn.functional.linear(out.flatten(1), w[attn + "o_proj.weight"])
        mlp = layer + "mlp."
        y = rms_norm(h, w[layer + "post_attention_layernorm.weight"], eps)
        gate = nn.functional.silu(nn.functional.linear(y, w[mlp + "gate_proj.weight"]))
        return h + nn.functional.linear(gate * nn.functional.linear(y, w[mlp + "up_proj.weight"]), w[mlp + "down_proj.weight"])

    def greedy_tokens(self, out: Tensor) -> Tensor:
        """The model's token ids [n] of the head's argmax at its output hidden states out [n, hidden]: EAGLE-3's own
        norm and lm_head over its draft vocabulary; EAGLE-1's through the model's head."""
        if self.config.method != "eagle3":
            return self.target_logits(out).argmax(dim=-1)
        logits = nn.functional.linear(rms_norm(out, self.w["norm.weight"], self.config.rms_norm_eps), self.w["lm_head.weight"])
        return self.draft_to_target[logits.argmax(dim=-1)]
