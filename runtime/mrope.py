"""M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a step's rotary rows where a token's three positions (temporal, height,
width) differ (DESIGN §5, "M-RoPE").

The rotary kernels take one position per token and a table, and rotate by table[position]. M-RoPE rotates each
token's frequencies by one of its three positions: mrope_section[0] frequencies by the temporal one, the next
mrope_section[1] by the height, the rest by the width (in cos's half and in sin's); Qwen3-VL interleaves them
(frequency j: height where j % 3 == 1 and j < 3 * mrope_section[1], width where j % 3 == 2 and j < 3 *
mrope_section[2], temporal otherwise). Row `column` of such a token is therefore the model's own table at that
column's position: table[positions[component(column)], column].

A request's positions are its prompt's (ImageInputs.mrope, computed when its images are expanded) and, after the
prompt, its token index + ImageInputs.rope_delta, three equal. So:
- a step of one token per sequence (decodes: runtime/step_inputs.py's single-token path) rotates at index +
  rope_delta: StepBuffers puts that in the step's positions, and the step runs as any other (CUDA graphs too);
- any other step that holds an M-RoPE request's tokens, and a single-token step whose token lies in such a prompt,
  gets its own table here (`step_rope`): one row per token of the step (every request's, text-only ones at their
  positions), the step's positions become 0..n-1 into it, and the step runs eagerly (runtime/model_runner.py).
Text-only requests in steps without M-RoPE requests keep the model's table and every graph.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from llmc.runtime.step_inputs import is_single_token_step


def column_components(mrope_section: list[int], interleaved: bool = False) -> Tensor:
    """[rotary_dims] int64: the position (0 temporal, 1 height, 2 width) each column of a cos / sin table row reads;
    the cos half and the sin half alike (transformers' Qwen2VLRotaryEmbedding.recomposition_frequencies; interleaved:
    Qwen3VLTextRotaryEmbedding's: height every third frequency from 1 below 3 * mrope_section[1], width every third
    from 2 below 3 * mrope_section[2], temporal the rest)."""
    if interleaved:
        half = np.zeros(sum(mrope_section), dtype=np.int64)
        for component in (1, 2):
            half[component : 3 * mrope_section[component] : 3] = component
    else:
        half = np.repeat(np.arange(3), mrope_section)
    return torch.from_numpy(np.concatenate([half, half]))


def step_rope(batch, table: Tensor, components: Tensor) -> tuple[Tensor, Tensor] | None:
    """(positions 0..n-1, the step's table [n, rotary_dims] float32) of a step that needs its own rows (see the
    module's NOTE), on the table's device; None for a step the shared table rotates right. `table`: the model's
    [max_positions, rotary_dims] (DecoderModel.cos_sin); `components`: column_components of the model's section."""
    single = is_single_token_step(batch)
    if not any(_has_mrope(s.request) and (not single or s.request.num_computed_tokens < s.request.images.mrope.shape[1])
               for s in batch.requests):
        return None
    parts = []
    for scheduled in batch.requests:
        request = scheduled.request
        start, end = request.num_computed_tokens, request.num_computed_tokens + scheduled.num_new_tokens
        if _has_mrope(request):
            parts.append(request.images.rope_positions(start, end))
        else:
            parts.append(np.broadcast_to(np.arange(start, end, dtype=np.int64), (3, end - start)))
    positions = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=1).T))  # [n, 3]
    index = positions[:, components].to(table.device)  # [n, rotary_dims]: each column's position
    rows = table.gather(0, index)
    return torch.arange(rows.shape[0], device=table.device), rows


def _has_mrope(request) -> bool:
    images = request.images
    return images is not None and getattr(images, "mrope", None) is not None
