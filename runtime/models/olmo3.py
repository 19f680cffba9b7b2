"""OLMo 3 (Olmo3ForCausalLM, model_type olmo3: allenai/Olmo-3-*): OLMo 2's layout (no pre-norms, the sub-layers'
outputs normed, q/k norms over the whole projections) with sliding-window layers: `layer_types` says which layers
attend within `sliding_window` (Olmo3Config's default: three sliding, then one full). As transformers' Olmo3 model,
the rotary tables are per layer type: a rope scaling (YaRN in the long-context checkpoints) applies to the full
layers only, the sliding layers rotate by the plain rope_theta (ModelConfig.rope_local_theta, Gemma 3's mechanism)."""

from llmc.runtime.models.olmo2 import OLMO2_NORMS
from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, QK_NORMS, ModelSpec

SPEC = ModelSpec(
    family="olmo3",
    architectures=("Olmo3ForCausalLM",),
    model_types=("olmo3",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=OLMO2_NORMS,
    qk_norms=QK_NORMS,
    global_tensors=LLAMA_GLOBALS,
)
