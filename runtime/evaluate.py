"""`llmc eval`: perplexity by the GPTQ-paper protocol, and how far two artifacts' predictions differ.

Protocol: the file is tokenized once (bos first, as the tokenizer adds it), cut into non-overlapping
windows of seq_len tokens (the tail dropped); each window's loss is the mean over its seq_len − 1
next-token predictions; perplexity = exp(mean of the window losses).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm import tqdm

from llmc.errors import RequestError


def check_data_file(path: str | Path) -> None:
    """A one-line error unless `path` is a regular file (what it is instead, when it exists)."""
    path = Path(path)
    if not path.exists():
        raise RequestError(f"--data: file {path} does not exist")
    if not path.is_file():
        raise RequestError(f"--data: {path} is not a regular file; save the text to a file and give its path")


def perplexity_windows(tokenizer, path: str | Path, seq_len: int, max_windows: int | None = None,
                       vocab_size: int | None = None) -> list[list[int]]:
    """The file's token ids in windows of seq_len; `vocab_size`: the model's, which every id must be below
    (a tokenizer that gives larger ids does not belong to the model)."""
    path = Path(path)
    check_data_file(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"--data: {path} is not UTF-8 text (byte {e.start}); give a text file") from None
    if not text.strip():
        raise RequestError(f"--data: {path} is empty; give a text file")
    token_ids = tokenizer.encode(text, verbose=False)
    if vocab_size is not None and token_ids and max(token_ids) >= vocab_size:
        raise RequestError(f"--data: the artifact's tokenizer gives token id {max(token_ids)}, but its model has "
                           f"{vocab_size} embeddings: the tokenizer does not belong to this model")
    num_windows = len(token_ids) // seq_len
    if num_windows == 0:
        raise RequestError(f"--data: {path} has {len(token_ids)} tokens, fewer than one window of --seq-len {seq_len}")
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    return [token_ids[i * seq_len : (i + 1) * seq_len] for i in range(num_windows)]


def evaluate(engine, windows: list[list[int]], reference=None, show_progress: bool = False) -> dict:
    """Perplexity of `engine` on the windows; with `reference` (another engine) also the mean
    KL(reference ‖ engine) and top-1 agreement of their next-token distributions."""
    losses, ref_losses, kls, agreements = [], [], [], []
    for window in tqdm(windows, desc="eval", unit="window", disable=not show_progress):
        logprobs = torch.log_softmax(engine.score(window)[:-1], dim=-1)  # [seq_len - 1, vocab]
        targets = torch.tensor(window[1:], device=logprobs.device)
        losses.append(-logprobs.gather(1, targets[:, None]).mean().item())
        if reference is not None:
            ref = torch.log_softmax(reference.score(window)[:-1], dim=-1).to(logprobs.device)
            ref_losses.append(-ref.gather(1, targets[:, None]).mean().item())
            kls.append((ref.exp() * (ref - logprobs)).sum(dim=-1).mean().item())
            agreements.append((ref.argmax(dim=-1) == logprobs.argmax(dim=-1)).float().mean().item())
    result = {"num_windows": len(windows), "seq_len": len(windows[0]), "perplexity": math.exp(sum(losses) / len(losses))}
    if reference is not None:
        result |= {
            "reference_perplexity": math.exp(sum(ref_losses) / len(ref_losses)),
            "mean_kl_divergence": sum(kls) / len(kls),
            "top1_agreement": sum(agreements) / len(agreements),
        }
    return result
