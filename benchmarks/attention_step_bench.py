"""The attention part of a decode step on the GPU: for every layer of a Llama-3-8B-shaped model (32
layers, 32 q / 8 kv heads, head_dim 128, 16-token blocks), the rotary embedding and KV-cache write
of the step's q/k/v, then decode attention (with its partition merge), as the model runs them (since
session 20 all of it in the decode kernel, attention.rotate_write_and_attend):
captured in one CUDA graph with max_context_len = the engine's max_model_len, cold L2 before each
replay, median of 25 replays (kernels/timing.py).

    source benchmarks/gpu_env.sh && python benchmarks/attention_step_bench.py [--json OUT.json]

It runs whichever kernels the `llmc` on PYTHONPATH has, so the same script times two trees (before
and after a change) in two processes of one call:
    bash benchmarks/package_dir.sh OLD_TREE /tmp/before
    PYTHONPATH=/tmp/before python benchmarks/attention_step_bench.py --json before.json
Each layer has its own cache, block tables are shuffled, contexts are drawn from [129, 384] (the
128/256 decode benchmark's) and every q/k/v input is random bf16. `--compare-merge` times each batch
twice more, with a split decode's partitions merged by the decode kernel whatever the number of
(sequence, KV head) pairs, and by the second merge kernel whatever it is
(attention.MERGE_IN_KERNEL_MIN_PAIRS decides between them otherwise). `--min-partition-sizes
64,512` times each batch with attention.MIN_PARTITION_SIZE set to each (512: every split partition
holds PARTITION_SIZE keys, the split before session 17).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from llmc.kernels import attention, attention_triton
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 32, 8, 128, 16


def make_layers(num_seqs: int, max_model_len: int, gen: torch.Generator):
    """Per layer: the fused qkv output [num_seqs, (32 + 16) * 128] and its K/V cache; shared: positions,
    slots, block tables, context lengths, the cos/sin table."""
    context_lens = torch.randint(129, 385, (num_seqs,), generator=gen)
    blocks_per_seq = -(-384 // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
    block_tables = torch.zeros(num_seqs, -(-max_model_len // BLOCK_SIZE), dtype=torch.int32)
    block_tables[:, :blocks_per_seq] = order.view(num_seqs, blocks_per_seq)
    positions = context_lens - 1
    slots = block_tables[torch.arange(num_seqs), positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    angles = torch.outer(torch.arange(max_model_len, dtype=torch.float64),
                         500000.0 ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    layers = []
    for _ in range(NUM_LAYERS):
        qkv = torch.randn(num_seqs, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen).to(torch.bfloat16)
        cache = [torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
                 for _ in range(2)]
        layers.append([t.cuda() for t in (qkv, *cache)])
    shared = [t.cuda() for t in (positions, slots, block_tables, context_lens.to(torch.int32), cos_sin)]
    return layers, shared


def attention_step(layers, shared, num_seqs: int, max_model_len: int) -> None:
    positions, slots, block_tables, context_lens, cos_sin = shared
    index_cache: dict = {}
    sizes = [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM]
    for qkv, k_cache, v_cache in layers:
        q, k, v = (t.view(num_seqs, -1, HEAD_DIM) for t in qkv.split(sizes, dim=-1))
        if hasattr(attention, "rotate_write_and_attend"):  # in the decode kernel (session 20)
            attention.rotate_write_and_attend(q, k, v, positions, cos_sin, k_cache, v_cache, slots, block_tables,
                                              context_lens, [1] * num_seqs, HEAD_DIM**-0.5, None, max_model_len,
                                              index_cache=index_cache)
            continue
        if hasattr(attention, "rotate_and_write_kv"):  # one kernel
            q = attention.rotate_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
        else:  # the two kernels before it
            from llmc.kernels.rotary import apply_rotary

            q, k = apply_rotary(q, k, positions, cos_sin)
            attention.write_kv_cache(k, v, k_cache, v_cache, slots)
        attention.paged_attention(q, k_cache, v_cache, block_tables, context_lens, [1] * num_seqs, HEAD_DIM**-0.5,
                                  None, max_model_len, index_cache=index_cache)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--max-model-len", type=int, default=2048, help="bench_e2e's default")
    parser.add_argument("--compare-merge", action="store_true")
    parser.add_argument("--min-partition-sizes", default=None, help="comma-separated attention.MIN_PARTITION_SIZE values")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    flush = make_l2_flush_buffer()
    results = {"device": torch.cuda.get_device_name(), "llmc": attention.__file__, "us_per_step": {}}
    # where the tree keeps it (attention since session 17, attention_triton in session 16, none before)
    merge_home = attention if hasattr(attention, "MERGE_IN_KERNEL_MIN_PAIRS") else attention_triton
    chosen = getattr(merge_home, "MERGE_IN_KERNEL_MIN_PAIRS", None)
    merges = {"": chosen}  # label → MERGE_IN_KERNEL_MIN_PAIRS
    if args.compare_merge:
        merges |= {"merge in the kernel": 1, "second merge kernel": 2**62}
    min_size = getattr(attention, "MIN_PARTITION_SIZE", None)  # None: a tree before session 17
    sizes = {"": min_size}
    if args.min_partition_sizes:
        sizes = {f"min{size}": int(size) for size in args.min_partition_sizes.split(",")}
    for num_seqs in (int(b) for b in args.batch_sizes.split(",")):
        layers, shared = make_layers(num_seqs, args.max_model_len, torch.Generator().manual_seed(num_seqs))
        for (size_label, size), (label, min_pairs) in itertools.product(sizes.items(), merges.items()):
            if min_pairs is not None:
                merge_home.MERGE_IN_KERNEL_MIN_PAIRS = min_pairs
            if size is not None:
                attention.MIN_PARTITION_SIZE = size
            ms = median_time_ms(lambda: attention_step(layers, shared, num_seqs, args.max_model_len), flush)
            label = f"{size_label} {label}".strip()
            results["us_per_step"][f"{num_seqs} {label}".strip()] = round(ms * 1000, 1)
            print(f"{num_seqs:4d} sequences {label:>28}: {ms * 1000:8.1f} µs per step "
                  f"({ms * 1000 / NUM_LAYERS:.2f} per layer)", flush=True)
        if chosen is not None:
            merge_home.MERGE_IN_KERNEL_MIN_PAIRS = chosen
        if min_size is not None:
            attention.MIN_PARTITION_SIZE = min_size
        del layers, shared
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
