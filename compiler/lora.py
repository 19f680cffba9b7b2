"""PEFT LoRA adapters merged into the base weights as the checkpoint is read (the recipe's `adapter`).

Reading and checking an adapter is runtime/peft.py's (the runtime reads the same files for vLLM's run-time
LoRA). Module W becomes W + scale · B·A, as PEFT's merge computes it; several adapters add their deltas in
order. The sum is taken in float32 and rounded once, to the artifact's dtype, when the layer is packed.
"""

from __future__ import annotations

from llmc.errors import RecipeError
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.models.spec import ModelSpec
from llmc.runtime.peft import (  # noqa: F401 - adapter_key and check_adapter_dir: the recipe's
    Adapter, _load_adapter, _mergeable_linears, adapter_key, check_adapter_dir,
)
from torch import Tensor


class LoraMerge:
    """W + Σ scale·B·A for the modules the adapters change, applied by TensorReader.get."""

    def __init__(self, adapters: list[Adapter]):
        self.adapters = adapters
        self.modules = {name for adapter in adapters for name in adapter.modules}

    def __call__(self, name: str, tensor: Tensor) -> Tensor:
        module = name.removesuffix(".weight")
        if module == name or module not in self.modules:
            return tensor
        merged = tensor.float().clone()
        for adapter in self.adapters:
            factors = adapter.modules.get(module)
            if factors is not None:
                merged += (factors.b @ factors.a) * factors.scale
        return merged


def load_adapters(paths: list[str], reader, spec: ModelSpec, model: ModelConfig, hf_config: dict,
                  method: str) -> LoraMerge | None:
    """Read and check every adapter against the checkpoint (`reader`: its TensorReader) before any work."""
    if not paths:
        return None
    if method == "import" or hf_config.get("quantization_config"):
        what = ("quantization.method import" if method == "import" else "the checkpoint is already quantized "
                f"(config.json's quantization_config, {hf_config['quantization_config'].get('quant_method', '?')})")
        raise RecipeError(f"adapter: {what}: a LoRA delta cannot be merged into packed quantized weights; merge the "
                          "adapter into the float checkpoint and quantize that (method rtn, gptq, awq or fp8)")
    modules = _model_modules(reader)
    linears = _mergeable_linears(spec, model)
    return LoraMerge([_load_adapter(path, adapter_key(i, len(paths)), modules, linears, reader)
                      for i, path in enumerate(paths)])


def _model_modules(reader) -> dict[str, tuple[int, ...]]:
    """Every module of the checkpoint that holds a weight, with the weight's shape."""
    return {name.removesuffix(".weight"): reader.shape(name) for name in reader.names() if name.endswith(".weight")}


