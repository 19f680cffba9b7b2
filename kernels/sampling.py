"""Greedy sampling's argmax over the vocabulary.

Shapes: logits [num_rows, vocab_size] → int64 [num_rows], each row's index of its largest entry,
the first of equal ones (torch.argmax's rule). On CUDA two Triton kernels (sampling_triton.py:
every row cut into chunks read by programs of their own, then one program per row picks among the
chunks' winners): torch's argmax reads a 128K-entry row with one thread block (26.5 µs per step
at batch 1 on an H200, benchmarks/RESULTS.md session 17). Elsewhere torch's argmax.
"""

from __future__ import annotations

from torch import Tensor

from . import can_use_triton


def argmax_rows(logits: Tensor) -> Tensor:
    """A NaN counts as larger than every number (as in torch.argmax) and ties with +inf (unlike it:
    the first of them wins)."""
    if can_use_triton(logits) and logits.dim() == 2 and logits.shape[0] > 0 and logits.stride(-1) == 1:
        from . import sampling_triton  # triton loads on the first CUDA call only

        return sampling_triton.argmax_rows(logits)
    return logits.argmax(dim=-1)
