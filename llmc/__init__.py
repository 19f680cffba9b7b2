"""llmc: a quantization-focused deployment compiler and runtime for LLMs.

Public names are handed out lazily so that `import llmc.runtime` never loads the compiler.
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("llmc.runtime.llm", "LLM"),
    "SamplingParams": ("llmc.runtime.sampling_params", "SamplingParams"),
    "RequestOutput": ("llmc.runtime.outputs", "RequestOutput"),
    "RequestOutputKind": ("llmc.runtime.sampling_params", "RequestOutputKind"),
    "BeamSearchParams": ("llmc.runtime.beam_search", "BeamSearchParams"),
    "GuidedDecodingParams": ("llmc.runtime.structured_output", "GuidedDecodingParams"),
    "StructuredOutputsParams": ("llmc.runtime.structured_output", "StructuredOutputsParams"),
    "CompletionOutput": ("llmc.runtime.outputs", "CompletionOutput"),
    "LoRARequest": ("llmc.runtime.lora", "LoRARequest"),
    "PoolingParams": ("llmc.runtime.pooling", "PoolingParams"),
    "EmbeddingRequestOutput": ("llmc.runtime.pooling", "EmbeddingRequestOutput"),
    "ScoringRequestOutput": ("llmc.runtime.pooling", "ScoringRequestOutput"),
    "PoolingRequestOutput": ("llmc.runtime.pooling", "PoolingRequestOutput"),
    "build": ("llmc.compiler.build", "build"),
    "LlmcError": ("llmc.errors", "LlmcError"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'llmc' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    return getattr(import_module(module_name), attr)
