"""A hybrid model's 16-bit states (runtime.mamba_cache_dtype / mamba_ssm_cache_dtype, artifact.state_dtypes) in each
state layer kind (Gated DeltaNet, Mamba-2, short conv), on the torch path (the CPU's) and on the Triton kernels
(interpreted): a step of a decode, a continuing piece and a fresh piece computes in float32 from the stored 16-bit
states, so its outputs are the float32 states' outputs from the same stored values, and each state it leaves is the
float32 states' rounded once (the model-level check against transformers: test_qwen3_5.py)."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from llmc.kernels import recurrent
from llmc.quant.formats import DenseFormat
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.models.gated_deltanet import GatedDeltaNet
from llmc.runtime.models.mamba2 import Mamba2
from llmc.runtime.models.short_conv import ShortConv

LAYERS = {
    "deltanet": (GatedDeltaNet, dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                     linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                     rms_norm_eps=1e-6, linear_norm_eps=None, linear_allow_neg_eigval=False)),
    "mamba2": (Mamba2, dict(hidden_size=32, mamba_num_heads=4, mamba_head_dim=8, mamba_n_groups=2, mamba_d_state=8,
                            mamba_conv_dim=4 * 8 + 2 * 2 * 8, mamba_conv_kernel=4, mamba_chunk_size=4,
                            rms_norm_eps=1e-5, mamba_conv_bias=True, mamba_rms_norm=True)),
    "short_conv": (ShortConv, dict(hidden_size=32, short_conv_kernel=3)),
}
QUERY_LENS, CONTEXT_LENS, SLOTS = [1, 5, 3], [9, 12, 3], [2, 0, 1]  # a decode, a continuing piece, a fresh piece


def _layer(kind: str):
    cls, values = LAYERS[kind]
    layer = cls(SimpleNamespace(**values), defaultdict(lambda: DenseFormat(torch.float32)), 0, torch.float32)
    layer = layer.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    for name, buffer in layer.named_buffers():
        if name.endswith("A_log"):
            buffer.uniform_(0.0, 1.5, generator=generator)
        elif name.endswith(("norm.weight", "D.weight")):
            buffer.fill_(1.0)
        else:
            buffer.normal_(0.0, 0.3, generator=generator)
    return layer


def _batch() -> ForwardBatch:
    tokens = sum(QUERY_LENS)
    return ForwardBatch(
        positions=torch.zeros(tokens, dtype=torch.int64), slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        block_tables=torch.zeros(3, 1, dtype=torch.int32), context_lens=torch.tensor(CONTEXT_LENS, dtype=torch.int32),
        query_lens=list(QUERY_LENS), max_context_len=max(CONTEXT_LENS),
        logits_indices=torch.zeros(1, dtype=torch.int64), host_context_lens=list(CONTEXT_LENS), state_slots=torch.tensor(SLOTS))


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_a_16_bit_state_is_read_into_float32_and_rounded_once_per_step(kind, path, dtype, monkeypatch):
    monkeypatch.setattr(recurrent, "can_use_triton", lambda *tensors: path == "triton")
    layer = _layer(kind)
    x = torch.randn(sum(QUERY_LENS), 32, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    layer.bind_states(4, torch.device("cpu"), (torch.float32, torch.float32))
    start = [torch.randn(state.shape, generator=generator).to(dtype) for state in layer.states()]
    results = []
    for state_dtype in (torch.float32, dtype):
        layer.bind_states(4, torch.device("cpu"), (state_dtype, state_dtype))
        for state, values in zip(layer.states(), start, strict=True):
            state.copy_(values)
        out = layer(x, _batch())
        results.append((out, [state.clone() for state in layer.states()]))
    (want, float32_states), (got, states) = results
    assert all(state.dtype == dtype for state in states)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # Triton's interpreter truncates float32 to bfloat16 where a GPU and torch round to nearest: one unit apart
    one_unit = path == "triton" and dtype == torch.bfloat16
    for state, float32_state in zip(states, float32_states, strict=True):
        rounded = float32_state.to(dtype)
        if one_unit:
            torch.testing.assert_close(state.float(), rounded.float(), atol=1e-6, rtol=2.0 ** -7)
        else:
            torch.testing.assert_close(state, rounded, atol=0, rtol=0)
