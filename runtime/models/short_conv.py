"""LFM2's gated short convolution (its "conv" layers) in the attention's place: in_proj gives B, C and x (hidden wide
each, in that order); out = out_proj(C * conv(B * x)), conv the depthwise causal conv of short_conv_kernel taps
(conv_L_cache) with no bias and no activation. A request's conv state [hidden, kernel - 1] (the last kernel - 1 rows
of B * x; in the model dtype unless runtime.mamba_cache_dtype says otherwise) is kept in slots as the Gated DeltaNet's states are (runtime/models/gated_deltanet.py
NOTE (state slots)); the conv is Mamba-2's (runtime/models/mamba2.py: causal_conv over a prefill piece, conv_step for a
step's decodes; on CUDA kernels/recurrent.causal_conv over the whole step)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmc.kernels import recurrent
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.layers.linear import Linear
from llmc.runtime.models.gated_deltanet import StateSlots, _weight, bound_or_scratch, state_steps
from llmc.runtime.models.mamba2 import causal_conv, conv_step


class ShortConv(StateSlots, nn.Module):
    """An LFM2 conv layer: forward(x, batch, cos_sin) as Attention's (the rotary table unread); in_proj and out_proj
    are attn.conv_in / attn.conv_out (quantizable), the conv's weight [hidden, kernel] dense. Its conv state [slots,
    hidden, kernel - 1] is bound by the model runner (`bind_states`); a forward without batch.state_slots (the memory
    profile, calibration) runs every sequence from zero state and keeps nothing."""

    STATE_KIND = "short-conv"
    STATE_NAMES = ("conv_state",)

    def __init__(self, config, formats: dict, index: int, dtype: torch.dtype):
        super().__init__()
        prefix = f"layers.{index}.attn."
        self.hidden, self.kernel = config.hidden_size, config.short_conv_kernel
        self.has_rope, self.is_local_rope = True, False  # (the model's table is passed, unread)
        self.conv_in = Linear(self.hidden, 3 * self.hidden, formats[prefix + "conv_in"], False, dtype)
        self.conv_out = Linear(self.hidden, self.hidden, formats[prefix + "conv_out"], False, dtype)
        self.conv = _weight((self.hidden, self.kernel), dtype)
        self.conv_state: Tensor | None = None  # [slots, hidden, kernel - 1] (bind_states)

    def state_shapes(self) -> tuple[tuple[int, ...]]:
        """One slot's (conv state,) shape: a short conv keeps no recurrent state."""
        return ((self.hidden, self.kernel - 1),)

    def forward(self, x: Tensor, batch: ForwardBatch, cos_sin: Tensor | None = None) -> Tensor:
        b, c, h = self.conv_in(x).split(self.hidden, dim=-1)
        bx = b * h
        slots = batch.state_slots
        if recurrent.can_use_triton(x):  # every sequence of the step in one Triton kernel
            state = bound_or_scratch(self.conv_state, batch, self.state_shapes()[0], bx.dtype, bx.device)
            conv = recurrent.causal_conv(bx, self.conv.weight, None, state, state_steps(batch), False, torch.float32)
        elif batch.is_decode and slots is not None:  # (a one-token prompt starts from zero state)
            conv = conv_step(self.conv_state, slots, batch.context_lens == 1, bx, self.conv.weight)
        else:
            conv = self._prefill(bx, batch, slots)
        return self.conv_out((c.float() * conv).to(x.dtype))

    def _prefill(self, bx: Tensor, batch: ForwardBatch, slots: Tensor | None) -> Tensor:
        """Sequence by sequence (a decode among them one row): the conv over its rows after its conv state (zeros
        where the piece starts the sequence), the state after them written back to its slot."""
        context_lens = batch.host_context_lens
        if context_lens is None:
            context_lens = batch.context_lens.tolist()
        weight, outputs, offset = self.conv.weight.float(), [], 0
        for i, length in enumerate(batch.query_lens):
            rows = slice(offset, offset + length)
            offset += length
            if slots is None or int(context_lens[i]) == length:
                state = bx.new_zeros(self.hidden, self.kernel - 1, dtype=torch.float32)
            else:
                state = self.conv_state[slots[i]].float()
            out, state = causal_conv(bx[rows].float(), weight, None, state, silu=False)
            if slots is not None:
                self.conv_state[slots[i]] = state.to(self.conv_state.dtype)
            outputs.append(out)
        return torch.cat(outputs)
