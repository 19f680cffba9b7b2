"""The MTP head: GLM-4.5's, DeepSeek-V3's or GLM-4.7-Flash's multi-token-prediction layer (art.MtpSpec,
compiler/mtp.py) run as a draft head (vLLM's speculative method mtp), by the EAGLE machinery (runtime/spec_eagle.py:
absorb, fill, the one-layer KV cache indexed by the model's block tables).

NOTE (definition): the DeepSeek-V3 paper's MTP module, which GLM-4.5 follows (transformers'
Glm4MoeMultiTokenPredictorLayer, vLLM's deepseek_mtp and glm4_moe_mtp). One step at position p reads a hidden state h_p
and the token t_{p+1}:
  x = eh_proj(cat(enorm(embed(t_{p+1})), hnorm(h_p)))        (embed: the layer's own embed_tokens, else the model's)
  out = decoder_layer(x)                                      (the model's own layer kind, with the MoE and its own KV
                                                               cache: GLM-4.5's GQA with q/k/v biases, the permuted
                                                               partial rotary and q/k norms; DeepSeek-V3's MLA with a
                                                               one-layer latent cache of kv_lora_rank + qk_rope_head_dim
                                                               per token, W_UK / W_UV split from its kv_b at load)
  logits of t_{p+2} = head(shared_head.norm(out))             (head: shared_head.head, else the model's lm_head)
h_p is the model's final hidden state after its final norm (what its lm_head reads: transformers' last_hidden_state,
vLLM's) for the first draft, and the head's own `out` (before shared_head.norm) for later drafts: the same layer applied
again, as vLLM runs a one-layer MTP for k > 1. As vLLM does, the embedding of a row at position 0 is zeroed (such a row
is never a draft's: it only fills the head's KV cache). Drafts are the argmax; verification keeps the outputs
distributed exactly as without speculation, whatever the head proposes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from llmc.errors import ConfigError
from llmc.kernels.norm import rms_norm
from llmc.quant.formats import DenseFormat, make_format
from llmc.runtime import artifact as art
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.layers.linear import Linear
from llmc.runtime.models.decoder import DecoderLayer
from llmc.runtime.parallel.layout import kv_cache_shapes


def mtp_model_config(model: ModelConfig, mtp: art.MtpSpec) -> ModelConfig:
    """The model's config grown by the MTP layer (index num_layers, MoE where the checkpoint's is): what the MTP
    head's decoder layer is built from, by the compiler and the runtime alike."""
    moe_layers = [*model.moe_layers, mtp.layer_index] if mtp.is_moe else list(model.moe_layers)
    return dataclasses.replace(model, num_layers=mtp.layer_index + 1, moe_layers=moe_layers)


def mtp_module_formats(config: ModelConfig, mtp: art.MtpSpec) -> dict[str, dict]:
    """Every linear of the MTP layer in the dense format of the model dtype (it is never quantized)."""
    dense = DenseFormat(getattr(torch, config.dtype)).spec()
    return {f"layers.{mtp.layer_index}.{name}": dense for name in config.layer_linears(mtp.layer_index)}


@dataclass(frozen=True)
class MtpHeadConfig:
    """What spec_eagle.py reads of a head's config, for the MTP head."""

    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    latent_dim: int | None = None  # MLA's cache width per token (kv_lora_rank + qk_rope_head_dim); None: K and V
    method: str = "mtp"

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def reads_final_hidden(self) -> bool:
        """The MTP layer reads the model's final hidden states (after its final norm)."""
        return True

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """The head's one-layer cache per token: MLA's latent, else K and V of its heads."""
        if self.latent_dim is not None:
            return self.latent_dim * itemsize
        return 2 * self.num_kv_heads * self.head_dim * itemsize


def read_mtp_head(manifest: art.Manifest, name: str = "speculative method mtp") -> MtpHeadConfig:
    """The MTP head's config; a one-line ConfigError where the artifact holds no MTP layer."""
    if manifest.mtp is None:
        family = manifest.model.family
        what = ("llmc builds GLM-4.5's (Glm4MoeForCausalLM), DeepSeek-V3's (DeepseekV3ForCausalLM) and "
                "GLM-4.7-Flash's (Glm4MoeLiteForCausalLM) only"
                if family not in ("glm4_moe", "deepseek_v3", "glm4_moe_lite") else
                "it was built by quantization.method import: its checkpoint has none, or one in integers (GPTQ, "
                "AWQ, int8), which is not built; build from a dense or FP8 checkpoint"
                if manifest.quant.method == "import" else
                "its checkpoint has none, or it was built before llmc kept it (artifact format 1.26 for GLM-4.5, 1.28 "
                "for DeepSeek-V3): rebuild it")
        raise ConfigError(f"{name}: this artifact ({manifest.model.architecture}) holds no multi-token-prediction "
                          f"layer ({what}); use method ngram, or another speculative method")
    model = manifest.model
    return MtpHeadConfig(num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, hidden_size=model.hidden_size,
                         vocab_size=model.vocab_size,
                         latent_dim=model.kv_lora_rank + model.qk_rope_head_dim if model.is_mla else None)


def _buffer(module: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A meta buffer at dotted `name` (containers made on the way), for loader.load_weights to fill."""
    *path, last = name.split(".")
    for part in path:
        if not hasattr(module, part):
            setattr(module, part, nn.Module())
        module = getattr(module, part)
    module.register_buffer(last, torch.empty(shape, dtype=dtype, device="meta"))


class MtpHead(nn.Module):
    """The MTP layer's weights in the compute dtype, its decoder layer bound to its own one-layer KV cache (MLA: its
    latent cache, of the shape the model's layers have: parallel/layout.kv_cache_shapes). Buffers
    are named as art.MTP_WEIGHTS's tensors, so loading is loader.load_weights' strict comparison. `target`: the
    model (DecoderModel): its embedding, lm_head (compute_logits) and rotary table are read where the layer shares
    them."""

    def __init__(self, artifact_dir: Path, manifest: art.Manifest, config: MtpHeadConfig, target, num_blocks: int,
                 block_size: int, device: torch.device, dtype: torch.dtype):
        from llmc.runtime.loader import load_weights  # (loader imports the model modules this one is beside)

        super().__init__()
        self.config, mtp = config, manifest.mtp
        model = dataclasses.replace(mtp_model_config(manifest.model, mtp), dtype=str(dtype).removeprefix("torch."))
        formats = {key: make_format(spec, dtype) for key, spec in mtp_module_formats(model, mtp).items()}
        hidden, vocab = model.hidden_size, model.vocab_size
        with torch.device("meta"):
            self.layers = nn.ModuleDict({str(mtp.layer_index): DecoderLayer(model, formats, mtp.layer_index, dtype)})
        for key, shape in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)), ("eh_proj.weight", (hidden, 2 * hidden)),
                           ("shared_head.norm.weight", (hidden,))):
            _buffer(self, key, shape, dtype)
        if mtp.has_head:
            _buffer(self, "shared_head.head.weight", (vocab, hidden), dtype)
        if mtp.has_embed:
            _buffer(self, "embed.weight", (vocab, hidden), dtype)
        art.verify_for_load(artifact_dir, manifest, [art.MTP_WEIGHTS])
        load_weights(self, artifact_dir / art.MTP_WEIGHTS, device, stored_dtype=getattr(torch, manifest.model.dtype))
        for module in self.modules():
            if isinstance(module, Linear):
                module.drop_identity_perm()
                module.derive_params()
        self.layer = self.layers[str(mtp.layer_index)]
        if self.layer.is_mla:  # (as DecoderModel.prepare_loaded_weights: W_UK / W_UV of its kv_b)
            self.layer.attn.absorb_kv_b()
        self.eps = model.rms_norm_eps
        self.embed_weight = self.embed.weight if mtp.has_embed else target.embed.weight
        self.target_logits = target.compute_logits
        self.cos_sin = target.rope_of(self.layer)  # the model's table (its rows permuted as the layer's q/k rows)
        shapes = kv_cache_shapes(model, config.num_kv_heads, num_blocks, block_size)  # (K, V), or MLA's (latent,)
        self.kv_cache = tuple(torch.zeros(shape, dtype=dtype, device=device) for shape in shapes)
        self.layer.attn.kv_cache = self.kv_cache
        self.eval()

    def combine(self, states: Tensor) -> Tensor:
        """The model's kept hidden states (its final norm's output) as the head reads them."""
        return states.to(self.embed_weight.dtype)

    def forward(self, input_ids: Tensor, hidden: Tensor, batch: ForwardBatch) -> Tensor:
        """One head step over a flat batch (positions, KV slots and tables as the model's): input_ids [n] (each the
        token after its position), hidden [n, hidden] → the layer's output [n, hidden] (before shared_head.norm)."""
        embedded = self.embed_weight[input_ids].masked_fill((batch.positions == 0).unsqueeze(-1), 0)
        x = torch.cat((rms_norm(embedded, self.enorm.weight, self.eps), rms_norm(hidden, self.hnorm.weight, self.eps)),
                      dim=-1)
        x, residual = self.layer(nn.functional.linear(x, self.eh_proj.weight), None, batch, self.cos_sin)
        return x + residual

    def greedy_tokens(self, out: Tensor) -> Tensor:
        """The argmax token ids [n] of the head's logits at its outputs out [n, hidden]."""
        normed = rms_norm(out, self.shared_head.norm.weight, self.eps)
        if hasattr(self.shared_head, "head"):
            return nn.functional.linear(normed, self.shared_head.head.weight).argmax(dim=-1)
        return self.target_logits(normed).argmax(dim=-1)

