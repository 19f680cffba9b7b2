"""Train a small EAGLE-3 head for checkpoints/ref-llama-12m on its training text, on the CPU, in minutes.

    python -P benchmarks/train_eagle.py --out checkpoints/eagle3-ref-llama-12m --minutes 10 --seed 1

The model (transformers, float32) reads data/calibration.txt (text it was trained on; data/heldout.txt, which it
was not, is where the head is measured) in windows of --window tokens, and as many windows again of its own
continuations: --generate-minutes of sampling (temperature --temperature) after the first --window / 4 tokens of
random windows of that text, as EAGLE-3 trains on the model's own responses (what a head is asked to predict); its residual stream entering layers 2, n // 2 and n - 3 (output_hidden_states[2], [n // 2], [n - 3]) is
what the head reads, and its next-token distribution what the head learns (soft cross-entropy over the draft
vocabulary: the --draft-vocab tokens the model predicts most often on the text). Training-time test, as the
EAGLE-3 paper trains: every window is also run a second step, in which each position reads the head's own first
step output at the position before and attends to the first step's keys before it and its own key, as the head's
second draft does at inference. The head is written in the published format (config.json, model.safetensors with
fc, midlayer.*, norm, lm_head, d2t, t2d; no embed_tokens: the model's are read) in float16. The head here is its
own small torch module (a trainer's, full-sequence): the runtime's (runtime/eagle_head.py) is not imported.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "checkpoints" / "ref-llama-12m"))
    parser.add_argument("--text", nargs="+", default=[str(ROOT / "data" / "calibration.txt")])
    parser.add_argument("--generate-minutes", type=float, default=4.0, help="sampling the model's own continuations")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--out", default=str(ROOT / "checkpoints" / "eagle3-ref-llama-12m"))
    parser.add_argument("--minutes", type=float, default=6.0, help="training wall time (the features come first)")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary embedding of x [..., seq, heads, head_dim] at positions [seq]."""
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * inv[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Head(nn.Module):
    """The EAGLE-3 head's parameters, named as the published checkpoints name them (dots as underscores)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, draft_vocab: int,
                 eps: float, theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps, self.theta = heads, kv_heads, head_dim, eps, theta
        lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc = lin(3 * hidden, hidden)
        self.q, self.k, self.v = lin(2 * hidden, heads * head_dim), lin(2 * hidden, kv_heads * head_dim), lin(2 * hidden, kv_heads * head_dim)
        self.o = lin(heads * head_dim, hidden)
        self.gate, self.up, self.down = lin(hidden, intermediate), lin(hidden, intermediate), lin(intermediate, hidden)
        self.lm_head = lin(hidden, draft_vocab)
        self.norms = nn.ParameterDict({n: nn.Parameter(torch.ones(hidden)) for n in
                                       ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")})

    def rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norms[name]

    def qkv(self, emb, hidden, positions):
        x = torch.cat((self.rms(emb, "input_layernorm"), self.rms(hidden, "hidden_norm")), dim=-1)
        b, s, _ = x.shape
        q = rope(self.q(x).view(b, s, self.heads, self.head_dim), positions, self.theta)
        k = rope(self.k(x).view(b, s, self.kv_heads, self.head_dim), positions, self.theta)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads
        return q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), v.repeat_interleave(rep, 2).transpose(1, 2)

    def finish(self, attn, residual):
        b, _, s, _ = attn.shape
        h = residual + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        y = self.rms(h, "post_attention_layernorm")
        return h + self.down(F.silu(self.gate(y)) * self.up(y))

    def logits(self, out):
        return self.lm_head(self.rms(out, "norm"))

    def two_steps(self, emb, hidden, positions):
        """Step 1 over every position (causal); step 2: position p reads step 1's output at p - 1 (the head's own
        hidden state) and the same token, attending to step 1's keys before p and its own. Returns both outputs."""
        q1, k1, v1 = self.qkv(emb, hidden, positions)
        out1 = self.finish(F.scaled_dot_product_attention(q1, k1, v1, is_causal=True), hidden)
        own = torch.cat((torch.zeros_like(out1[:, :1]), out1[:, :-1]), dim=1)
        q2, k2, v2 = self.qkv(emb, own, positions)
        s = q2.shape[2]
        scale = self.head_dim ** -0.5
        before = (q2 @ k1.transpose(-1, -2)) * scale  # [b, h, s, s]
        before = before.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(-1), float("-inf"))
        self_score = (q2 * k2).sum(-1, keepdim=True) * scale  # [b, h, s, 1]
        weights = torch.softmax(torch.cat((before, self_score), dim=-1), dim=-1)
        attn2 = weights[..., :s] @ v1 + weights[..., s:] * v2
        return out1, self.finish(attn2, own)


def continuations(model, windows: torch.Tensor, window: int, temperature: float, minutes: float) -> torch.Tensor:
    """[c, window] token windows: the first window / 4 tokens of random text windows, then the model's sampled
    continuation, batches of 32 for `minutes`."""
    out, deadline, keep = [], time.time() + minutes * 60, window // 4
    while time.time() < deadline:
        prompts = windows[torch.randint(0, windows.shape[0], (32,)), :keep]
        with torch.no_grad():
            out.append(model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                      temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=window - keep,
                                      min_new_tokens=window - keep, pad_token_id=0))
    return torch.cat(out) if out else windows[:0]


def features(model, windows: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the token windows [w, window], aux hidden states [w, window, 3 * hidden], the model's final normed hidden
    states [w, window, hidden], both float16 to halve their memory)."""
    n = model.config.num_hidden_layers
    layers = (2, n // 2, n - 3)
    aux, final = [], []
    with torch.no_grad():
        for chunk in windows.split(8):
            out = model(chunk, output_hidden_states=True)
            aux.append(torch.cat([out.hidden_states[i] for i in layers], dim=-1).half())
            final.append(out.hidden_states[-1].half())  # after the final norm (transformers' last entry)
    return windows, torch.cat(aux), torch.cat(final)


def save_head(head: Head, draft_ids: torch.Tensor, vocab_size: int, out: Path, dtype: torch.dtype,
              **config_fields) -> None:
    """`head` in the published EAGLE-3 layout in `out`: model.safetensors (fc, midlayer.*, norm, lm_head in `dtype`;
    d2t, t2d of the ascending draft_ids [draft_vocab]; no embed_tokens: the model's are read) and config.json (a
    one-layer LlamaConfig of the head's shapes with draft_vocab_size, plus `config_fields`). Also
    benchmarks/bench_spec_draft.py's random head."""
    from safetensors.torch import save_file

    layer = "midlayer."
    tensors = {
        "fc.weight": head.fc.weight, "norm.weight": head.norms["norm"], "lm_head.weight": head.lm_head.weight,
        layer + "self_attn.q_proj.weight": head.q.weight, layer + "self_attn.k_proj.weight": head.k.weight,
        layer + "self_attn.v_proj.weight": head.v.weight, layer + "self_attn.o_proj.weight": head.o.weight,
        layer + "mlp.gate_proj.weight": head.gate.weight, layer + "mlp.up_proj.weight": head.up.weight,
        layer + "mlp.down_proj.weight": head.down.weight,
        **{f"{layer}{n}.weight": head.norms[n] for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
    }
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in tensors.items()}
    draft_vocab = draft_ids.numel()
    tensors["d2t"] = (draft_ids - torch.arange(draft_vocab)).to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    head_config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": head.fc.weight.shape[0],
        "num_attention_heads": head.heads, "num_key_value_heads": head.kv_heads, "head_dim": head.head_dim,
        "intermediate_size": head.gate.weight.shape[0], "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": head.eps, "rope_theta": head.theta, "vocab_size": vocab_size, "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."), **config_fields,
    }
    (out / "config.json").write_text(json.dumps(head_config, indent=2) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    config = model.config
    ids = torch.tensor([t for name in args.text for t in tokenizer(Path(name).read_text())["input_ids"]])
    start = time.time()
    text_windows = ids[: ids.numel() // args.window * args.window].view(-1, args.window)
    generated = continuations(model, text_windows, args.window, args.temperature, args.generate_minutes)
    print(f"{generated.shape[0]} continuations sampled in {time.time() - start:.0f} s", file=sys.stderr)
    windows, aux, final = features(model, torch.cat((text_windows, generated)), args.window)
    lm_head = model.lm_head.weight.detach()
    with torch.no_grad():
        counts = torch.bincount(torch.cat([(f.float() @ lm_head.T).argmax(-1).flatten() for f in final.split(8)]),
                                minlength=config.vocab_size)
    draft_ids = counts.argsort(descending=True)[: args.draft_vocab].sort().values  # [draft_vocab], ascending
    print(f"features of {windows.numel()} tokens in {time.time() - start:.0f} s; the draft vocabulary covers "
          f"{counts[draft_ids].sum() / counts.sum():.1%} of the model's greedy tokens", file=sys.stderr)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", 10000.0))
    head = Head(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                args.intermediate, args.draft_vocab, config.rms_norm_eps, theta)
    embed = model.model.embed_tokens.weight.detach()
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    positions = torch.arange(args.window - 1)
    deadline, step = time.time() + args.minutes * 60, 0
    total_steps = None
    while time.time() < deadline:
        pick = torch.randint(0, windows.shape[0], (args.batch,))
        tokens, hidden = windows[pick], aux[pick].float()
        # row p: the model's state at p and the token at p + 1; target: the model's distribution at p + 1
        with torch.no_grad():
            target = torch.softmax(final[pick][:, 1:].float() @ lm_head.T, dim=-1)[..., draft_ids]
            target = target / target.sum(-1, keepdim=True).clamp_min(1e-9)
        out1, out2 = head.two_steps(embed[tokens[:, 1:]], head.fc(hidden[:, :-1]), positions)
        loss1 = -(target * F.log_softmax(head.logits(out1), -1)).sum(-1).mean()
        # step 2 at p predicts what step 1 at p predicts (its input token is the same); p = 0 has no own state
        loss2 = -(target[:, 1:] * F.log_softmax(head.logits(out2)[:, 1:], -1)).sum(-1).mean()
        loss = loss1 + 0.7 * loss2
        optimizer.zero_grad()
        loss.backward()
        elapsed = (time.time() - (deadline - args.minutes * 60)) / (args.minutes * 60)
        for group in optimizer.param_groups:  # warm-up, then cosine over the wall time
            group["lr"] = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(elapsed, 1.0)))
        optimizer.step()
        if step % 20 == 0:
            print(f"step {step}: loss {loss1.item():.3f} / {loss2.item():.3f}", file=sys.stderr)
        step += 1
    total_steps = step
    out = Path(args.out)
    save_head(head, draft_ids, config.vocab_size, out, torch.float16,
              max_position_embeddings=config.max_position_embeddings, bos_token_id=config.bos_token_id,
              eos_token_id=config.eos_token_id)
    print(f"{total_steps} steps of {args.batch} x {args.window - 1} rows; wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
