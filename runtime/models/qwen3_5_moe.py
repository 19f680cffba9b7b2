"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text; Qwen3_5MoeForConditionalGeneration's language
model, served as text as Qwen3.5 dense's: runtime/models/qwen3_5.py): Qwen3.5's hybrid decoder (Gated DeltaNet and
gated full-attention layers by `layer_types`) whose MLP is, in every layer, Qwen3-Next's sparse block: a softmax
top-k router always renormalised (transformers' Qwen3VLMoeTextTopKRouter) over SiLU-gated experts, plus a shared
expert every token runs, its output times sigmoid(x · `mlp.shared_expert_gate`), as Qwen2-MoE's
(runtime/models/moe.py).
The experts are read under Qwen2-MoE's per-expert names (what transformers' save_pretrained writes), or as slices of a
layer's fused `mlp.experts.gate_up_proj` / `down_proj` where the checkpoint holds those (either layout:
compiler/vision.qwen3_vl_moe_expert_tensors)."""

from llmc.runtime.models.qwen3_5 import LINEAR_ATTENTION
from llmc.runtime.models.spec import (LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, QK_NORMS, ModelSpec, MoeSpec,
                                      shared_expert_linears)

SPEC = ModelSpec(
    family="qwen3_5_moe",
    architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
    layer_linears=LLAMA_LINEARS + LINEAR_ATTENTION + shared_expert_linears(
        ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), "mlp.shared_expert.down_proj"),
    layer_norms=LLAMA_NORMS,
    qk_norms=QK_NORMS,
    global_tensors=LLAMA_GLOBALS,
    norm_weight_offset=1.0,
    moe=MoeSpec(router="mlp.gate", expert_prefix="mlp.experts.{}.", gate="gate_proj", up="up_proj", down="down_proj",
                shared_gate="mlp.shared_expert_gate"),
)
