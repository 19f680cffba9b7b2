"""MiniMax-M2 (MiniMaxM2ForCausalLM, model_type minimax_m2: MiniMaxAI/MiniMax-M2, M2.1): the Llama decoder (pre-norms,
GQA, no biases) with OLMo 2's q/k norms (FlexOlmo's attention: RMSNorms over the whole q and k projections, all heads
together, ModelConfig.qk_norm_full_width), GLM-4.5's partial rotary (rotate-half over the leading `rotary_dim` of each
head, the legacy key transformers turns into partial_rotary_factor), and a mixture of experts in every layer stored as
Mixtral's (block_sparse_moe.gate, experts.{e}.w1 / w3 / w2) whose router is DeepSeek-V3's without groups: sigmoid
scores in float32, the top-k chosen with e_score_correction_bias (block_sparse_moe.e_score_correction_bias, beside the
gate), weighted by the scores without it, always renormalised (moe.deepseek_route, on a float32 router as vLLM keeps
it); no shared expert, no scaling.

The build permutes each q/k head's rows as GLM-4.5's (hf_checkpoint.rotary_fold), the whole-width q/k norms' weights
with them: the RMS over all heads is a sum over the same elements in another order, so the norm commutes with the
permutation. The checkpoint's multi-token-prediction modules (num_mtp_modules) are not built (the build says so)."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, QK_NORMS, ModelSpec, MoeSpec

SPEC = ModelSpec(
    family="minimax_m2",
    architectures=("MiniMaxM2ForCausalLM",),
    model_types=("minimax_m2",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms=QK_NORMS,
    global_tensors=LLAMA_GLOBALS,
    moe=MoeSpec(router="block_sparse_moe.gate", expert_prefix="block_sparse_moe.experts.{}.", gate="w1", up="w3",
                down="w2", score_bias="block_sparse_moe.e_score_correction_bias"),
)
