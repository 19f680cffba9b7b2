"""`ForwardBatch`: everything one model forward needs besides the token ids, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class ForwardBatch:
    """Metadata of one step over a flat batch of tokens from several sequences (prefill chunks and decodes).

    Sequences are concatenated in scheduling order; sequence i owns query tokens
    [sum(query_lens[:i]), sum(query_lens[:i+1])).
    """

    positions: Tensor  # [num_tokens] int64 position of each token in its sequence
    slot_mapping: Tensor  # [num_tokens] int64 KV-cache slot each token's K/V is written to
    block_tables: Tensor  # [num_seqs, max_num_blocks] int32 block ids, rows padded with block 0 (never read)
    context_lens: list[int]  # [num_seqs] tokens in the cache after this step, per sequence
    query_lens: list[int]  # [num_seqs] tokens computed this step, per sequence
    logits_indices: Tensor  # [num_logits] int64 flat token indices whose logits are needed

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]
