"""Session 45: why the latent-attention kernel's output on an H200 is ~context-length times too large (call 4's
failing GPU test), case by case: the kernel alone against torch, contiguous or strided q, NaN slots, tile sizes."""
import importlib.util
import sys
from pathlib import Path

import os

import torch

DEV = os.environ.get("DEV", "cuda")

from llmc.kernels import mla_attention, mla_attention_triton as mt

spec = importlib.util.spec_from_file_location("t", Path(__file__).parents[3] / "tests/kernels/test_mla_attention.py")
t = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t)


def torch_absorbed(q_lat, q_pe, cache, tables, row_seq, row_limit, scale, rank):
    out = torch.zeros_like(q_lat, dtype=torch.float32)
    bs = cache.shape[1]
    for r in range(q_lat.shape[0]):
        s, n = int(row_seq[r]), int(row_limit[r])
        if n == 0:
            continue
        blocks = tables[s, : -(-n // bs)].long()
        lat = cache[blocks].flatten(0, 1)[:n].float()
        c, k = lat[:, :rank], lat[:, rank:]
        sc = (q_lat[r].float() @ c.T + q_pe[r].float() @ k.T) * scale
        out[r] = torch.softmax(sc, -1) @ c
    return out


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def case(name, context_lens, query_lens, dtype, heads=16, rank=512, rope=64, strided=True, partitions=None,
         nan=True):
    (q, cache, tables, w_uk, w_uv), latents = t.make_step(context_lens, query_lens, heads, 128, rope, 128, rank, 16,
                                                          dtype, DEV)
    if not nan:
        cache = torch.nan_to_num(cache, nan=0.0)
    q_nope, q_pe = q.split([128, rope], -1)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    if not strided:
        q_lat = q_lat.contiguous()
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEV)
    row_seq, row_limit = mla_attention.row_index(query_lens, ctx, q.shape[0], None, None)
    scale = 192 ** -0.5
    got = mt.mla_absorbed_attention(q_lat, q_pe, cache, tables, row_seq, row_limit, scale, 1.0, max(context_lens),
                                    partitions)
    torch.cuda.synchronize() if DEV == "cuda" else None
    want = torch_absorbed(q_lat, q_pe, torch.nan_to_num(cache, nan=0.0), tables, row_seq, row_limit, scale, rank)
    per_row = [round(rel(got[r], want[r]), 4) for r in range(min(4, got.shape[0]))]
    print(f"{name:44s} rel {rel(got, want):.3e}  max|got| {got.float().abs().max():.3g} max|want| "
          f"{want.abs().max():.3g}  first rows {per_row}", flush=True)


for dtype in (torch.float32, torch.bfloat16):
    d = str(dtype).split(".")[1]
    case(f"{d} decode 1 row ctx 5", [5], [1], dtype)
    case(f"{d} decode 1 row ctx 40 no split", [40], [1], dtype, partitions=1)
    case(f"{d} decode 1 row ctx 700 no split", [700], [1], dtype, partitions=1)
    case(f"{d} decode 1 row ctx 700 split 4", [700], [1], dtype, partitions=4)
    case(f"{d} decode ctx 700 no NaN", [700], [1], dtype, partitions=1, nan=False)
    case(f"{d} decode ctx 700 contiguous q", [700], [1], dtype, partitions=1, strided=False)
    case(f"{d} rank 64 rope 16 ctx 100", [100], [1], dtype, rank=64, rope=16, partitions=1)
    case(f"{d} the test's mixed step", [1, 700, 333, 129], [1, 1, 200, 129], dtype)
for bn in (16, 64):
    mt.BLOCK_N = bn
    case(f"bf16 BLOCK_N {bn} ctx 700", [700], [1], torch.bfloat16, partitions=1)
mt.BLOCK_N = 32
