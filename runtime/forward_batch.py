"""`ForwardBatch`: everything one model forward needs besides the token ids, passed explicitly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from llmc.kernels.attention import PrefillIndex


@dataclass
class ForwardBatch:
    """Metadata of one step over a flat batch of tokens from several sequences (prefill chunks and decodes).

    Sequences are concatenated in scheduling order; sequence i owns query tokens
    [sum(query_lens[:i]), sum(query_lens[:i+1])). Tensors are on the model's device; query_lens and
    max_context_len stay on the host (the prefill kernel plans its grid from them).
    """

    positions: Tensor  # [num_tokens] int64 rotary position of each token: its index in its sequence (Qwen2-VL: + the
    # request's rope_delta after its prompt), or its row of rope_table where the step has one
    slot_mapping: Tensor  # [num_tokens] int64 KV-cache slot each token's K/V is written to
    block_tables: Tensor  # [num_seqs, max_num_blocks] int32 block ids, rows padded with block 0 (never read)
    context_lens: Tensor  # [num_seqs] int32 tokens in the cache after this step, per sequence
    query_lens: list[int]  # [num_seqs] on the host: tokens computed this step, per sequence
    max_context_len: int  # on the host: at least every context_lens entry (a CUDA graph's: max_model_len)
    logits_indices: Tensor  # [num_logits] int64 flat token indices whose logits are needed
    # Tensors the kernels derive from the host fields in the first layer and reuse in the others
    # (paged attention's per-sequence indices of a prefill step): made once per step, not per layer.
    kernel_cache: dict = field(default_factory=dict, repr=False, compare=False)
    # A CUDA graph of mixed steps (runtime/mixed_graphs.py): the attention reads its sequences from
    # these device tensors, not from query_lens (which then only says how many tokens were captured).
    prefill_index: PrefillIndex | None = None
    # A vision model's image tokens in this step (runtime/multimodal.step_image_rows): (flat token indices [n],
    # embedding rows [n, hidden_size]) written over those tokens' embeddings; None: none. Such steps run eagerly.
    image_rows: tuple[Tensor, Tensor] | None = None
    # Qwen3-VL's deepstack rows of this step's image tokens (runtime/multimodal.step_deepstack_rows): (flat token
    # indices [n], rows [levels, n, hidden_size]), level k added to those tokens' hidden states after decoder layer k
    # (DecoderModel.run_layers); None: none. Such steps run eagerly.
    deepstack_rows: tuple[Tensor, Tensor] | None = None
    # [num_tokens] int32: the last key position each query may attend to, where a step holds tokens of an image
    # attended both ways (Gemma 3: runtime/multimodal.step_key_limits); None: causal (each query's own position)
    key_limits: Tensor | None = None
    # [num_tokens, rotary_dims] float32: the step's own rotary rows (M-RoPE, runtime/mrope.step_rope), read at
    # positions 0..num_tokens-1 in place of the model's table; None: the model's. Such steps run eagerly.
    rope_table: Tensor | None = None
    # context_lens on the host where the step's builder had them (runtime/step_inputs.py): DeepSeek's expanded
    # attention on CUDA sizes its sequences' keys by them (kernels/mla_attention.py); None: read from the device there
    host_context_lens: Sequence[int] | None = None
    # [num_seqs] int64: each sequence's state slot (its persistent-batch row) in a hybrid model's Gated DeltaNet states
    # (runtime/models/gated_deltanet.py NOTE (state slots)); None: a model without them, or a forward keeping no state
    state_slots: Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token (decodes, or one-token prefill chunks): the attention
        reads no host value then, and a captured CUDA graph can run the step."""
        return all(n == 1 for n in self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]
