"""The greedy argmax kernels against torch.argmax (the first of equal maxima)."""

import pytest
import torch

from llmc.kernels.sampling import argmax_rows


@pytest.mark.parametrize("vocab", [100, 4096, 9000])  # under one chunk, exactly one, a partial third
def test_argmax_rows_match_torch(elementwise_case, vocab) -> None:
    from llmc.kernels import sampling_triton

    device, dtype = elementwise_case
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    last = vocab - 1
    logits[1, [7, last // 2, last]] = 50.0  # ties in different chunks: the first wins
    logits[2, [last - 1, last]] = 60.0  # ties in the last chunk's tail
    logits[3] = float("-inf")  # nothing finite: column 0, as torch
    logits[4, :] = 1.0  # all equal: column 0
    logits[5, last] = float("inf")
    logits = logits.to(device)
    got = sampling_triton.argmax_rows(logits)
    assert got.dtype == torch.int64 and got.device == logits.device
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits).tolist() == got.tolist()  # the public function: the kernels on CUDA, torch else


def test_argmax_rows_reads_strided_rows_and_nan(device) -> None:
    from llmc.kernels import sampling_triton

    rows = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)).to(device)
    rows[0, 4321] = float("nan")  # a NaN counts as the largest, as in torch.argmax
    rows[1, 17] = rows[1, 4099] = rows[1].max() + 1
    padded = torch.zeros(3, 5008, device=device)
    padded[:, :5000] = rows
    view = padded[:, :5000]  # rows 5008 apart
    assert sampling_triton.argmax_rows(view).tolist() == rows.argmax(dim=-1).tolist() == [4321, 17, int(rows[2].argmax())]
