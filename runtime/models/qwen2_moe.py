"""Qwen2-MoE (Qwen2MoeForCausalLM, model_type qwen2_moe: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): the Qwen2 decoder (q/k/v
biases, by qkv_bias) whose MLP is a top-k mixture of experts (renormalised by `norm_topk_prob`) in the layers that
`decoder_sparse_step` and `mlp_only_layers` choose, as Qwen3-MoE, plus a shared expert every token runs
(`mlp.shared_expert`), its output times sigmoid(x · `mlp.shared_expert_gate`) (runtime/models/moe.py)."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, ModelSpec, MoeSpec, shared_expert_linears

SPEC = ModelSpec(
    family="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    layer_linears=LLAMA_LINEARS + shared_expert_linears(("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
                                                        "mlp.shared_expert.down_proj"),
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
    moe=MoeSpec(router="mlp.gate", expert_prefix="mlp.experts.{}.", gate="gate_proj", up="up_proj", down="down_proj",
                shared_gate="mlp.shared_expert_gate"),
)
