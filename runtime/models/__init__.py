"""Model families. `spec_for_architecture` finds the ModelSpec for an HF `architectures` entry."""

from llmc.runtime.models import llama, mixtral, phi3, qwen2, qwen3, qwen3_moe
from llmc.runtime.models.spec import ModelSpec

SPECS: tuple[ModelSpec, ...] = (llama.SPEC, qwen2.SPEC, qwen3.SPEC, phi3.SPEC, mixtral.SPEC, qwen3_moe.SPEC)


def spec_for_family(family: str) -> ModelSpec:
    return next(spec for spec in SPECS if spec.family == family)


def spec_for_architecture(architecture: str) -> ModelSpec | None:
    return next((spec for spec in SPECS if architecture in spec.architectures), None)


def supported_architectures() -> list[str]:
    return [arch for spec in SPECS for arch in spec.architectures]
