"""Session 42: why a tiny Qwen2-MoE FP8 build scores 8% apart on the GPU and the CPU (call 3): the same FP8 build of
tiny dense Qwen2 (attention biases) and of tiny Qwen2-MoE, perplexity on the CPU, on the GPU, and on the GPU with the
MoE's fused kernel off (its per-expert torch loop), each layer's output compared GPU against CPU."""

import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[3]))  # for tests.conftest, after the package
from llmc.runtime.llm import LLM  # noqa: E402
from llmc.runtime.models import moe  # noqa: E402
from tests.conftest import make_hf_checkpoint  # noqa: E402
from tests.runtime.hf_oracle import build_float32  # noqa: E402


def layer_outputs(llm, token_ids):
    outs = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, (o[0] if isinstance(o, tuple) else o).float().cpu()))
             for i, layer in llm.engine.runner.model.layers.items()]
    logits = llm.engine.score(token_ids).cpu().float()
    for h in hooks:
        h.remove()
    return logits, outs


def ppl(logits, ids, start):
    return math.exp(torch.nn.functional.cross_entropy(logits[start - 1:-1], torch.tensor(ids[start:])).item())


def zero_biases(ckpt):
    """The checkpoint with its attention biases set to 0 (in place)."""
    from safetensors.torch import load_file, save_file

    for path in ckpt.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({k: torch.zeros_like(v) if k.endswith("_proj.bias") else v for k, v in tensors.items()}, path,
                  metadata={"format": "pt"})


root = Path(tempfile.mkdtemp())
for arg in sys.argv[1:]:  # FAMILY[:nobias][:float]
    family, *variants = arg.split(":")
    ckpt = make_hf_checkpoint(root / arg.replace(":", "_"), family)
    if "nobias" in variants:
        zero_biases(ckpt)
    quant = {"method": "none"} if "float" in variants else {"method": "fp8", "report": False}
    art_gpu = build_float32(ckpt, root / f"{arg}_gpu".replace(":", "_"), quantization=quant)
    art_cpu = build_float32(ckpt, root / f"{arg}_cpu".replace(":", "_"), target={"device": "cpu"}, quantization=quant)
    ids = list(range(100, 160))
    with LLM(art_cpu, device="cpu", max_num_batched_tokens=32) as llm:
        cpu_logits, cpu_outs = layer_outputs(llm, ids)
    runs = {"gpu": None, "gpu-unfused": lambda *a, **k: None}
    for name, patch in runs.items():
        original = moe.fused_expert_weights
        if patch is not None:
            moe.fused_expert_weights = patch
        try:
            with LLM(art_gpu, device="cuda", max_num_batched_tokens=32, gpu_memory_utilization=0.3, enforce_eager=True) as llm:
                logits, outs = layer_outputs(llm, ids)
        finally:
            moe.fused_expert_weights = original
        diffs = {i: f"{(outs[i] - cpu_outs[i]).abs().max().item():.3g}" for i in sorted(outs, key=int)}
        print(f"{arg} {name}: ppl gpu {ppl(logits, ids, 30):.4f} cpu {ppl(cpu_logits, ids, 30):.4f}; "
              f"logits max diff {(logits - cpu_logits).abs().max().item():.3g}; per layer max diff {diffs}", flush=True)
