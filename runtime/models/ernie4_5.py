"""ERNIE 4.5 dense (Ernie4_5ForCausalLM, model_type ernie4_5: baidu/ERNIE-4.5-0.3B-*): the Llama decoder whose rotary
embedding rotates interleaved pairs (2i, 2i + 1) of the whole head (transformers' Ernie4_5 apply_rotary_pos_emb,
GLM's style at full width). The build permutes each q/k head's rows into the runtime's rotate-half layout
(hf_checkpoint.rotary_fold, ModelConfig.rotary_interleaved, as GLM-4 and Cohere), so every kernel runs it
as a whole-head rotate-half. Embeddings tied by default (tie_word_embeddings true). use_bias (biases on every linear,
the MLP's too) is refused by name: the runtime's MLP has none; published checkpoints set it false."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, ModelSpec

SPEC = ModelSpec(
    family="ernie4_5",
    architectures=("Ernie4_5ForCausalLM",),
    model_types=("ernie4_5",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
)
