"""Model families. `spec_for_architecture` finds the ModelSpec for an HF `architectures` entry."""

from llmc.runtime.models import gemma2, gemma3, granite, llama, mixtral, phi3, qwen2, qwen3, qwen3_moe
from llmc.runtime.models.spec import ModelSpec

SPECS: tuple[ModelSpec, ...] = (llama.SPEC, qwen2.SPEC, qwen3.SPEC, phi3.SPEC, mixtral.SPEC, qwen3_moe.SPEC, gemma2.SPEC,
                                gemma3.SPEC, granite.SPEC)


def spec_for_family(family: str) -> ModelSpec:
    return next(spec for spec in SPECS if spec.family == family)


def spec_for_architecture(architecture: str) -> ModelSpec | None:
    return next((spec for spec in SPECS if architecture in spec.architectures), None)


def supported_architectures() -> list[str]:
    return [arch for spec in SPECS for arch in spec.architectures]


def context_rope_scaling(family: str, rope_scaling: dict | None) -> dict | None:
    """The rope scaling that stretches max_position_embeddings into the model's context (rotary.model_context):
    the config's, or None where the family's max_position_embeddings already is that context (Gemma 3, as vLLM)."""
    return rope_scaling if spec_for_family(family).rope_scaling_extends_context else None
