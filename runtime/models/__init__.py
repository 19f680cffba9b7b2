"""Model families. `spec_for_architecture` finds the ModelSpec for an HF `architectures` entry."""

from llmc.runtime.models import (apertus, arcee, bamba, cohere, deepseek, dots1, ernie4_5, ernie4_5_moe, exaone4,
                                 falcon_h1, gemma2, gemma3, glm4, glm4_moe, glm4_moe_lite, gpt_oss, granite, granitemoe,
                                 granitemoehybrid, lfm2, llama, llama4, minimax_m2, ministral3, mistral4, mixtral,
                                 nemotron_h, olmo2, olmo3, olmo_hybrid, olmoe, phi3, qwen2, qwen2_moe, qwen3, qwen3_5,
                                 qwen3_5_moe, qwen3_moe, qwen3_next, seed_oss, smollm3)
from llmc.runtime.models.spec import ModelSpec

SPECS: tuple[ModelSpec, ...] = (llama.SPEC, qwen2.SPEC, qwen3.SPEC, phi3.SPEC, mixtral.SPEC, qwen3_moe.SPEC, gemma2.SPEC,
                                gemma3.SPEC, granite.SPEC, olmo2.SPEC, olmo3.SPEC, olmoe.SPEC, granitemoe.SPEC,
                                granitemoe.SHARED_SPEC, qwen2_moe.SPEC, deepseek.V2_SPEC, deepseek.V3_SPEC, glm4.SPEC,
                                cohere.SPEC, cohere.SPEC2, gpt_oss.SPEC, glm4_moe.SPEC, smollm3.SPEC, exaone4.SPEC,
                                seed_oss.SPEC, ernie4_5.SPEC, dots1.SPEC, ernie4_5_moe.SPEC,
                                ministral3.SPEC, llama4.SPEC, minimax_m2.SPEC, qwen3_5.SPEC, qwen3_5_moe.SPEC,
                                qwen3_next.SPEC, granitemoehybrid.SPEC, bamba.SPEC, nemotron_h.SPEC, lfm2.SPEC,
                                lfm2.MOE_SPEC, glm4_moe_lite.SPEC, mistral4.SPEC,
                                olmo_hybrid.SPEC, falcon_h1.SPEC,
                                arcee.SPEC, apertus.SPEC)


def spec_for_family(family: str) -> ModelSpec:
    return next(spec for spec in SPECS if spec.family == family)


# Sequence classifiers (transformers' *ForSequenceClassification: the causal model's decoder, then `score`, a
# [num_labels, hidden_size] linear without bias, read at the last token) → the causal LM whose decoder they share
CLASSIFIER_ARCHITECTURES = {
    **{f"{name}ForSequenceClassification": f"{name}ForCausalLM"
       for name in ("Llama", "Mistral", "Mixtral", "Qwen2", "Qwen3", "Qwen3Moe", "Phi3", "Gemma2", "Olmo2", "Olmo3",
                    "Qwen2Moe", "SmolLM3", "Exaone4", "SeedOss", "Ministral3")},
    "Gemma3TextForSequenceClassification": "Gemma3ForCausalLM",
}


def spec_for_architecture(architecture: str) -> ModelSpec | None:
    architecture = CLASSIFIER_ARCHITECTURES.get(architecture, architecture)
    return next((spec for spec in SPECS if architecture in spec.architectures), None)


def supported_architectures() -> list[str]:
    return [arch for spec in SPECS for arch in spec.architectures] + list(CLASSIFIER_ARCHITECTURES)


def model_context_of(model) -> tuple[int, str]:
    """(the longest context `model`'s positions support, how it comes about): rotary.model_context of its
    max_position_embeddings and rope scaling, unscaled where the family's max_position_embeddings already is that
    context (Gemma 3, as vLLM). `model`: an artifact.ModelConfig."""
    from llmc.runtime.layers.rotary import model_context

    extends = spec_for_family(model.family).rope_scaling_extends_context
    limit, how = model_context(model.max_position_embeddings, model.rope_scaling if extends else None)
    chunk = model.attention_chunk_size
    if chunk is not None and model.attention_chunk_layers is None and chunk < limit:  # a manifest before 1.34
        return chunk, (f"attention_chunk_size {chunk}: this artifact (format before 1.34) does not say which layers "
                       f"attend in chunks; rebuild it to serve {model.architecture} past one chunk")
    return limit, how
