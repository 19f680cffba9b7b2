"""Prompts given as embeddings (vLLM's `enable_prompt_embeds` and EmbedsPrompt, {"prompt_embeds": tensor}).

A prompt of embeddings [num_tokens, hidden_size] is what transformers' `inputs_embeds` is: the rows the model's
embedding lookup would give (for Granite, before its embedding_multiplier, which the forward applies to them as
transformers' does: ModelSpec.scales_input_embeds). The engine runs it as a prompt of `num_tokens` placeholder tokens
whose rows the forward overwrites, by the path a vision model's image rows take (runtime/multimodal.ImageInputs,
`step_image_rows`): every position of the prompt is a row. Its token ids are unknown, so what reads a prompt's ids
reads none: repetition penalties, logits processors and the detokenizer's context start from the output
(`Request.known_prompt_token_ids`), and prompt logprobs, echo and beam search are refused by name. The prefix cache
keys its blocks by the rows' digest (the root of the block-hash chain), so identical embeddings share blocks and
nothing else does.
"""

from __future__ import annotations

import base64
import hashlib
import io

import torch
from torch import Tensor

from llmc.errors import RequestError
from llmc.runtime.multimodal import ImageInputs

PLACEHOLDER_TOKEN_ID = 0  # the prompt's token ids as the scheduler counts them; the forward never reads them
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NOT_ENABLED = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."  # vLLM's words


def check_prompt_embeds(embeds: object, hidden_size: int, where: str = "prompt_embeds") -> Tensor:
    """`embeds` as a dense [num_tokens, hidden_size] tensor (a leading batch dimension of 1 dropped, as vLLM drops
    it); RequestError naming `where` for anything else."""
    if not isinstance(embeds, Tensor):
        raise RequestError(f"{where}: expected a torch.Tensor [num_tokens, hidden_size], got {type(embeds).__name__}",
                           param="prompt_embeds")
    if embeds.layout != torch.strided:
        embeds = embeds.to_dense()
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2:
        raise RequestError(f"{where}: expected a 2-D tensor [num_tokens, hidden_size], got shape {list(embeds.shape)}",
                           param="prompt_embeds")
    if embeds.dtype not in FLOAT_DTYPES:
        raise RequestError(f"{where}: expected float32, bfloat16 or float16 values, got {embeds.dtype}",
                           param="prompt_embeds")
    if embeds.shape[0] == 0:
        raise RequestError(f"{where}: the prompt is empty; give at least one row", param="prompt_embeds")
    if embeds.shape[1] != hidden_size:
        raise RequestError(f"{where}: rows of {embeds.shape[1]} values, but this model's hidden_size is {hidden_size}",
                           param="prompt_embeds")
    return embeds


def decode_prompt_embeds(data: object, where: str = "prompt_embeds") -> Tensor:
    """The server's form: base64 of `torch.save(tensor)` bytes (vLLM's), read with torch.load(weights_only=True),
    sparse tensors checked for valid indices before they are made dense."""
    if not isinstance(data, str):
        raise RequestError(f"{where}: expected a base64 string of torch.save(tensor) bytes, got {type(data).__name__}",
                           param="prompt_embeds")
    try:
        raw = base64.b64decode(data, validate=True)
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
            if isinstance(tensor, Tensor) and tensor.layout != torch.strided:
                tensor = tensor.to_dense()
    except Exception as e:  # noqa: BLE001 - base64's and torch.load's own types (struct.error, UnpicklingError, ...)
        raise RequestError(f"{where}: not a base64 torch.save of a tensor ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else ''})", param="prompt_embeds") from None
    return tensor


def prompt_rows(embeds: Tensor, device: torch.device, dtype: torch.dtype) -> tuple[list[int], ImageInputs]:
    """(the placeholder prompt, its rows as the forward takes them): every position a row, in `dtype` on `device`;
    the digest covers the values as given and their shape. Rows that are not finite in `dtype` (inf, NaN, or beyond
    its range) are refused, checked on `device` (on a GPU far cheaper than on the host: session 42)."""
    values = embeds.detach().contiguous().cpu()
    digest = hashlib.sha256(b"prompt_embeds\x00" + str((values.dtype, tuple(values.shape))).encode())
    digest.update(memoryview(values.view(torch.uint8).numpy()))  # the bytes as they are, not copied
    rows = values.to(device=device, dtype=dtype)
    if not bool(torch.isfinite(rows).all()):
        raise RequestError(f"prompt_embeds: holds inf or NaN values, or values beyond {dtype}'s range",
                           param="prompt_embeds")
    num_tokens = values.shape[0]
    return [PLACEHOLDER_TOKEN_ID] * num_tokens, ImageInputs(list(range(num_tokens)), rows, digest.digest())
