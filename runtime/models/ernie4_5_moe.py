"""ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM, model_type ernie4_5_moe: baidu/ERNIE-4.5-21B-A3B-PT, -300B-A47B-PT): dense
ERNIE 4.5's decoder (runtime/models/ernie4_5.py: interleaved rotary pairs over the whole head, permuted at build into
the rotate-half layout; tied embeddings by default) whose MLP is a mixture of experts in layer i where
(i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <= moe_layer_end_index, a dense MLP
(intermediate_size wide) elsewhere. Its router (float32, as transformers keeps it) takes the softmax of the logits,
chooses the top moe_k by softmax + `mlp.moe_statics.e_score_correction_bias` (moe.gate_bias) and weights them by the
softmax alone, renormalised by max(sum, moe_norm_min) (runtime/models/moe.py `deepseek_route`); moe_num_shared_experts
shared experts (no gate) run as one shared expert of moe_num_shared_experts * moe_intermediate_size."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, ModelSpec, MoeSpec, shared_expert_linears

SPEC = ModelSpec(
    family="ernie4_5_moe",
    architectures=("Ernie4_5_MoeForCausalLM",),
    model_types=("ernie4_5_moe",),
    layer_linears=LLAMA_LINEARS + shared_expert_linears(
        ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), "mlp.shared_experts.down_proj"),
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
    moe=MoeSpec(router="mlp.gate", expert_prefix="mlp.experts.{}.", gate="gate_proj", up="up_proj", down="down_proj",
                score_bias="mlp.moe_statics.e_score_correction_bias"),
)
