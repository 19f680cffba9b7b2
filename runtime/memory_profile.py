"""The GPU memory plan, measured at start: memory.plan_kv fed with what this GPU reports.

NOTE (profile): before the KV cache exists, one forward runs the step with the most work the
scheduler can make — max_num_batched_tokens prompt tokens, as sequences of at most max_model_len,
then the float32 logits of min(max_num_seqs, tokens) rows and their softmax (the sampler's
probabilities) — and torch's peak allocation above what was allocated before it is the activation
peak. Its attention needs a KV cache to write and read: one temporary (K, V) pair of the step's
blocks, shared by every layer, suffices, since a layer writes all its keys before it reads any
and a fresh prefill reads only what this step wrote (no slot is read before it is written, so no
garbage reaches the softmax). Then "other" is what the device has in use outside torch's allocator
(torch.cuda.mem_get_info, less torch's reserved memory, after emptying its cache): the CUDA
context, kernel modules, NCCL, other processes. Tensors this process holds for another engine are
not counted: gpu_memory_utilization is a share per engine, as vLLM's.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable

import torch
from torch import Tensor

from llmc.errors import ConfigError
from llmc.runtime import artifact as art
from llmc.runtime import memory
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.models.decoder import DecoderModel
from llmc.runtime.parallel.layout import kv_cache_shapes

logger = logging.getLogger("llmc")
ProfileStep = Callable[[Tensor, ForwardBatch], Tensor]  # (input_ids, batch) -> what the step's sampler reads


def measure_kv_plan(model: DecoderModel, options: art.RuntimeDefaults, device: torch.device, weight_bytes: int,
                    kv_bytes_per_token: int, graph_bytes: int, step: ProfileStep | None = None,
                    state_bytes: int = 0) -> memory.MemoryEstimate:
    """The KV cache this GPU has room for, after a profiling forward (one rank, before its KV cache
    is allocated; the model's layers are left bound to nothing). `step`: the profiled work (default
    run_profile_step; a parallel rank passes its stage's part, which all-reduces with its tensor
    ranks: every rank profiles at once, in lockstep). state_bytes: a hybrid's bound states, apart from weight_bytes."""
    num_tokens = options.max_num_batched_tokens
    activation_bytes = profile_activation_bytes(model, options, device, step)
    logger.info("profiled one forward of %d tokens: activation peak %.1f MiB", num_tokens, activation_bytes / memory.MIB)
    # NOTE (expanded MLA): the profiled prompts are fresh, so DeepSeek's expanded form expanded at most their own keys;
    # a step after a long cached context expands a whole chunk of it (mla_attention.expand_chunk_keys): held back
    # beside the profile (counting the profiled prompt's own expansion twice, at most one chunk's)
    expanded = memory.mla_expanded_bytes(model.config, num_tokens, options.max_model_len,
                                         model.kv_attentions()[0].num_heads)
    if expanded:
        logger.info("held back %.1f MiB for the expanded latent attention's chunk of a long context",
                    expanded / memory.MIB)
    return gpu_kv_plan(options, device, weight_bytes, activation_bytes + expanded, kv_bytes_per_token, graph_bytes,
                       state_bytes)


def gpu_kv_plan(options: art.RuntimeDefaults, device: torch.device, weight_bytes: int, activation_bytes: int,
                kv_bytes_per_token: int, graph_bytes: int, state_bytes: int = 0) -> memory.MemoryEstimate:
    """memory.plan_kv with this GPU's total and what it has in use outside torch's allocator. A plan whose KV cache
    and graphs do not fit in what is free now is refused in one line (vLLM's start-up check): memory held by tensors
    of this process that are not this engine's (another engine, open or dropped and not yet collected) or by other
    processes leaves less than gpu_memory_utilization asks for."""
    gc.collect()  # engines dropped earlier in this process (reference cycles) give their device memory back first
    torch.cuda.empty_cache()  # what the profile freed goes back to the device, so mem_get_info sees it free
    free, total = torch.cuda.mem_get_info(device)
    other_bytes = max(0, total - free - torch.cuda.memory_reserved(device))
    plan = memory.plan_kv(total, options.gpu_memory_utilization, weight_bytes, other_bytes, activation_bytes,
                          graph_bytes, kv_bytes_per_token, options.block_size, options.max_model_len, state_bytes)
    short = plan.kv_bytes + graph_bytes - free
    if short > 0:
        fits = math.floor((options.gpu_memory_utilization - short / total) * 100) / 100
        raise ConfigError(
            f"gpu_memory_utilization {options.gpu_memory_utilization} leaves {plan.kv_bytes / memory.GIB:.1f} GiB "
            f"for the KV cache but only {free / memory.GIB:.1f} GiB of this GPU's {total / memory.GIB:.1f} GiB are free "
            f"({(total - free) / memory.GIB:.1f} GiB in use: this engine's weights, tensors this process holds for "
            "something else such as another engine (close it), other processes); "
            + (f"lower gpu_memory_utilization to {fits} or less" if fits > 0 else "free the GPU first"))
    return plan


@torch.inference_mode()
def profile_activation_bytes(model: DecoderModel, options: art.RuntimeDefaults, device: torch.device,
                             step: ProfileStep | None = None) -> int:
    """Peak bytes allocated by the profiling step above what was allocated before it."""
    input_ids, batch, num_blocks = profile_batch(options.max_num_batched_tokens, options.max_model_len,
                                                 options.max_num_seqs, options.block_size, device)
    attentions = model.kv_attentions()  # (a hybrid model's state layers hold no KV)
    attn = attentions[0]
    dtype = getattr(torch, model.config.dtype)  # the compute dtype (build_model set it)
    kv_cache = tuple(torch.zeros(shape, dtype=dtype, device=device)
                     for shape in kv_cache_shapes(model.config, attn.num_kv_heads, num_blocks, options.block_size))
    model.bind_kv_caches([kv_cache] * len(attentions))
    try:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        if step is None:
            run_profile_step(model, input_ids, batch)
        else:
            step(input_ids, batch)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    finally:
        model.bind_kv_caches([None] * len(attentions))


def run_profile_step(model: DecoderModel, input_ids: Tensor, batch: ForwardBatch) -> Tensor:
    """The profiled work: the forward, the logits of the sampled rows and their softmax."""
    hidden = model(input_ids, batch)  # [num_tokens, hidden_size]
    logits = model.compute_logits(hidden[batch.logits_indices])  # [num_logit_rows, vocab_size] float32
    return torch.softmax(logits, dim=-1)


def profile_batch(num_tokens: int, max_model_len: int, max_num_seqs: int, block_size: int,
                  device: torch.device) -> tuple[Tensor, ForwardBatch, int]:
    """(token ids [num_tokens], the ForwardBatch prefilling them as fresh sequences of at most
    max_model_len tokens, each in its own run of blocks from block 0, the number of blocks used).
    Its logits rows are the last min(max_num_seqs, num_tokens) tokens."""
    seq_lens = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    first_blocks = [sum(blocks_per_seq[:i]) for i in range(len(seq_lens))]
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for row, (first, n) in enumerate(zip(first_blocks, blocks_per_seq)):
        block_tables[row, :n] = torch.arange(first, first + n, dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in seq_lens])  # [num_tokens]
    slots = torch.cat([first * block_size + torch.arange(n) for first, n in zip(first_blocks, seq_lens)])
    num_logit_rows = min(max_num_seqs, num_tokens)
    batch = ForwardBatch(
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        block_tables=block_tables.to(device),
        context_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_lens=seq_lens,
        max_context_len=max(seq_lens),
        logits_indices=torch.arange(num_tokens - num_logit_rows, num_tokens, device=device),
        host_context_lens=seq_lens,
    )
    return torch.zeros(num_tokens, dtype=torch.long, device=device), batch, sum(blocks_per_seq)
