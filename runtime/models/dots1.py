"""dots.llm1 (Dots1ForCausalLM, model_type dots1: rednote-hilab/dots.llm1.base and .inst): Qwen3's attention (GQA,
per-head q/k RMSNorms before a rotary over the whole head, no biases) under DeepSeek-V3's mixture of experts, as
transformers' models/dots1 composes them (Dots1Attention is Qwen3Attention, Dots1MoE DeepseekV3MoE): dense SiLU MLPs
in the first `first_k_dense_replace` layers, then `n_routed_experts` routed by sigmoid scores chosen with
e_score_correction_bias within the best `topk_group` of `n_group` groups, renormalised where norm_topk_prob, times
routed_scaling_factor (runtime/models/moe.py `deepseek_route`, on a float32 router as transformers keeps it), beside
`n_shared_experts` shared ones run as one shared expert. GLM-4.5's layout (runtime/models/glm4_moe.py) with its q/k
norms always on, no partial rotary and no row permutation; no multi-token-prediction layer."""

from dataclasses import replace

from llmc.runtime.models import glm4_moe

SPEC = replace(glm4_moe.SPEC, family="dots1", architectures=("Dots1ForCausalLM",), model_types=("dots1",))
