"""SmolLM3 (SmolLM3ForCausalLM, model_type smollm3: HuggingFaceTB/SmolLM3-3B): the Llama decoder with NoPE layers:
`no_rope_layers[i] == 0` (SmolLM3Config's default: every no_rope_layer_interval-th layer, 4) means layer i rotates
neither q nor k (ModelConfig.nope_layers: those layers read a table of cos 1, sin 0, so every path that rotates by a
table, the torch one, the Triton KV-write and attention kernels, the CUDA graphs and calibration, runs them
exactly; the onnx-cpu graph runs them as GroupQueryAttention without do_rotary). With use_sliding_window the NoPE
layers are the sliding ones, as SmolLM3Config sets layer_types. The 3B ties its embeddings."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, ModelSpec

SPEC = ModelSpec(
    family="smollm3",
    architectures=("SmolLM3ForCausalLM",),
    model_types=("smollm3",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
)
