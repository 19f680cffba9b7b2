"""EXAONE 4.0 (Exaone4ForCausalLM, model_type exaone4: LGAI-EXAONE/EXAONE-4.0-*): OLMo 2's norm placement (no norm
before the attention or the MLP; their outputs normed before the residual add: post_attention_layernorm,
post_feedforward_layernorm, ModelConfig.pre_norms false) with Qwen3's per-head q_norm / k_norm (before the rotary).
With a sliding_window, `layer_types` says which layers attend within it (Exaone4Config's default: three sliding, then
one full) and, as transformers' Exaone4Attention, only the sliding layers rotate q and k: the full layers are NoPE
(ModelConfig.nope_layers, SmolLM3's identity table). Without a sliding_window (EXAONE-4.0-1.2B) every layer is full
and rotates."""

from llmc.runtime.models.olmo2 import OLMO2_NORMS
from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, QK_NORMS, ModelSpec

SPEC = ModelSpec(
    family="exaone4",
    architectures=("Exaone4ForCausalLM",),
    model_types=("exaone4",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=OLMO2_NORMS,
    qk_norms=QK_NORMS,
    global_tensors=LLAMA_GLOBALS,
)
