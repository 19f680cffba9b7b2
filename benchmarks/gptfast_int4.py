"""gpt-fast-style int4 batch-1 decode (torch.compile + tinygemm): the reference issue 13 compares
llmc's W4A16 decode with, measured on the same checkpoint and machine.

    source benchmarks/gpu_env.sh && python benchmarks/gptfast_int4.py /tmp/ckpt8b --json $OUT/gptfast.json

What gpt-fast's int4 mode does, written here from its description (no code copied): every nn.Linear
of the model, the output head included, becomes an int4 weight in torch's tinygemm layout
(`aten._convert_weight_to_int4pack`, group 128, asymmetric: per group a bf16 scale and zero with
w = (level − 8)·scale + zero, levels 0..15), run by `aten._weight_int4pack_mm`; the embedding stays
bf16; q/k/v are one fused linear; the KV cache is static ([1, kv_heads, max_len, head_dim]) and
attention is `scaled_dot_product_attention` over the whole cache with a position mask; the one-token
decode step is `torch.compile(mode="reduce-overhead", fullgraph=True)` (Inductor + CUDA graphs) with
greedy argmax inside the compiled step. Positions use plain RoPE with the checkpoint's theta (llama3's
frequency scaling changes the values, not the cost). Random weights: only the speed is meaningful.

Prints ms/token: the median over --repeats runs of --decode-tokens steps after a --prompt-len prefill
(the prefill runs eagerly and is not timed), and the time torch.compile took.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

GROUP = 128


def int4_pack(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] bf16 → (tinygemm weight, scales_and_zeros [K / GROUP, N, 2] bf16)."""
    n, k = w.shape
    groups = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    levels = ((groups - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale  # w = (level - 8) * scale + zero
    packed = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)
    weight = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
    scales_and_zeros = torch.stack([scale.squeeze(-1).t(), zero.squeeze(-1).t()], dim=-1)
    return weight, scales_and_zeros.to(torch.bfloat16).contiguous()


class Int4Linear(nn.Module):
    def __init__(self, w: Tensor):
        super().__init__()
        weight, scales_and_zeros = int4_pack(w)
        self.register_buffer("weight", weight)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.out_features = w.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, x.shape[-1]), self.weight, GROUP, self.scales_and_zeros)
        return y.reshape(*x.shape[:-1], self.out_features)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, heads, hd] with cos/sin [T, hd / 2] (rotate-half convention, as HF Llama)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, :, None], sin[None, :, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, tensors: dict[str, Tensor], cfg: dict, max_len: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.eps = cfg["rms_norm_eps"]
        self.wqkv = Int4Linear(torch.cat([tensors["self_attn.q_proj"], tensors["self_attn.k_proj"], tensors["self_attn.v_proj"]]))
        self.wo = Int4Linear(tensors["self_attn.o_proj"])
        self.w1, self.w3, self.w2 = (Int4Linear(tensors[f"mlp.{p}_proj"]) for p in ("gate", "up", "down"))
        self.register_buffer("attn_norm", tensors["input_layernorm"])
        self.register_buffer("mlp_norm", tensors["post_attention_layernorm"])
        device = self.attn_norm.device
        self.register_buffer("k_cache", torch.zeros(1, self.kv_heads, max_len, self.hd, dtype=torch.bfloat16, device=device))
        self.register_buffer("v_cache", torch.zeros_like(self.k_cache))

    def forward(self, x: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        b, t, _ = x.shape
        qkv = self.wqkv(rms_norm(x, self.attn_norm, self.eps))
        q, k, v = qkv.split([self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], dim=-1)
        q = rotate(q.view(b, t, self.heads, self.hd), cos, sin).transpose(1, 2)
        k = rotate(k.view(b, t, self.kv_heads, self.hd), cos, sin).transpose(1, 2)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v.view(b, t, self.kv_heads, self.hd).transpose(1, 2))
        attn = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, t, -1))
        h = rms_norm(x, self.mlp_norm, self.eps)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    def __init__(self, ckpt: Path, max_len: int, device: str):
        super().__init__()
        cfg = json.loads((ckpt / "config.json").read_text())
        self.eps = cfg["rms_norm_eps"]
        layers: dict[int, dict[str, Tensor]] = {}
        top: dict[str, Tensor] = {}
        for shard in sorted(ckpt.glob("*.safetensors")):
            with safe_open(shard, framework="pt", device=device) as f:
                for name in f.keys():
                    key = name.removesuffix(".weight")
                    if key.startswith("model.layers."):
                        index, _, rest = key.removeprefix("model.layers.").partition(".")
                        layers.setdefault(int(index), {})[rest] = f.get_tensor(name)
                    else:
                        top[key] = f.get_tensor(name)
        self.register_buffer("embed", top["model.embed_tokens"])
        self.register_buffer("norm", top["model.norm"])
        self.output = Int4Linear(top["lm_head"])
        blocks = []
        for index in sorted(layers):
            blocks.append(Block(layers.pop(index), cfg, max_len))  # the bf16 layer is freed after packing
        self.blocks = nn.ModuleList(blocks)
        hd = cfg["head_dim"]
        inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, device=device).float() / hd)
        angles = torch.outer(torch.arange(max_len, device=device).float(), inv_freq)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril())

    def forward(self, ids: Tensor, pos: Tensor) -> Tensor:
        """ids [1, T], pos [T] → the greedy next token after the last position [1]."""
        x = F.embedding(ids, self.embed)
        cos, sin, mask = self.cos[pos], self.sin[pos], self.causal[pos][None, None]
        for block in self.blocks:
            x = block(x, pos, cos, sin, mask)
        logits = self.output(rms_norm(x[:, -1], self.norm, self.eps))
        return logits.argmax(dim=-1)


def decode_run(model: Model, step, prompt: Tensor, num_tokens: int) -> float:
    """Prefill `prompt` eagerly, then `num_tokens` compiled one-token steps; seconds per step."""
    length = prompt.shape[1]
    token = model(prompt, torch.arange(length, device=prompt.device))
    pos = torch.tensor([length], device=prompt.device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(num_tokens):
        token = step(token.view(1, 1), pos).clone()
        pos += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.perf_counter()
    max_len = args.prompt_len + args.decode_tokens + 8
    with torch.no_grad():
        model = Model(args.checkpoint, max_len, "cuda")
        load_s = time.perf_counter() - start
        vocab = model.embed.shape[0]
        step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        start = time.perf_counter()
        decode_run(model, step, torch.randint(0, vocab, (1, args.prompt_len), device="cuda"), 4)  # compile + record
        compile_s = time.perf_counter() - start
        runs = [decode_run(model, step, torch.randint(0, vocab, (1, args.prompt_len), device="cuda"), args.decode_tokens)
                for _ in range(args.repeats)]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ms_per_token": round(1000 * statistics.median(runs), 3),
              "runs_ms": [round(1000 * r, 3) for r in runs], "load_and_quantize_s": round(load_s, 1),
              "compile_s": round(compile_s, 1), "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens,
              "int4_linears_GB": round(sum(b.numel() * b.element_size() for m in model.modules()
                                           if isinstance(m, Int4Linear) for b in m.buffers()) / 1e9, 3)}
    print(json.dumps(result), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
