"""Session 49, call 5: where MiniMax-M2's CUDA run leaves transformers' logits (test_minimax_m2.py::test_on_the_gpu
failed in call 4 by up to 15 while the CPU and Triton-interpreter paths hold 1e-4). The tiny test checkpoint, one
44-token prompt in one prefill step: the logits' error on the CPU, on CUDA eager, on CUDA eager with the fused MoE
kernel off (expert by expert), and on CUDA with graphs; then each layer's attention and MoE outputs on CUDA eager
against the CPU's, to name the first module that differs."""
import sys
import tempfile
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[3]))  # (after the package folder: the tree's ./llmc would shadow it)
from llmc.runtime.llm import LLM  # noqa: E402
from llmc.runtime.models import moe as moe_module  # noqa: E402
from tests.conftest import hf_encode, hf_logits, make_hf_checkpoint  # noqa: E402
from tests.runtime.hf_oracle import build_float32  # noqa: E402
from tests.runtime.test_glm4_moe import _random_score_bias  # noqa: E402

work = Path(tempfile.mkdtemp())
checkpoint = make_hf_checkpoint(work / "ckpt", "minimax_m2")
_random_score_bias(checkpoint, mtp=False)
artifact = build_float32(checkpoint, work / "m2")
ids = hf_encode(checkpoint, "What light through yonder window breaks? It is the east") + list(range(100, 126))
want = hf_logits(checkpoint, ids)


def record(acts, name):
    def hook(module, args, out):  # (returns None: the module's output stands)
        acts.setdefault(name, (out[0] if isinstance(out, tuple) else out).detach().float().cpu().clone())
    return hook


def run(device, hooks=False, **options):
    acts = {}
    with torch.inference_mode(), LLM(artifact, device=device, max_num_seqs=3, max_num_batched_tokens=64,
                                     **options) as llm:
        handles = []
        if hooks:
            for name, module in llm.engine.runner.model.named_modules():
                if name.endswith((".attn", ".moe", ".attn.qkv", ".input_norm", ".post_attn_norm")):
                    handles.append(module.register_forward_hook(record(acts, name)))
        got = llm.engine.score(ids).cpu()
        for handle in handles:
            handle.remove()
    return got, acts


cpu, cpu_acts = run("cpu", hooks=True)
print("cpu: max |logits - transformers|", (cpu - want).abs().max().item(), flush=True)
eager, eager_acts = run("cuda", hooks=True, enforce_eager=True, gpu_memory_utilization=0.2)
print("cuda eager:", (eager - want).abs().max().item(), flush=True)
for name in cpu_acts:
    if name in eager_acts and cpu_acts[name].shape == eager_acts[name].shape:
        print(f"  {name}: {(cpu_acts[name] - eager_acts[name]).abs().max().item():.3g}", flush=True)
    else:
        print(f"  {name}: cpu {tuple(cpu_acts[name].shape)} cuda {eager_acts.get(name, torch.empty(0)).shape}")
fused = moe_module.fused_expert_weights
moe_module.fused_expert_weights = lambda *a: None
unfused, _ = run("cuda", enforce_eager=True, gpu_memory_utilization=0.2)
moe_module.fused_expert_weights = fused
print("cuda eager, MoE expert by expert:", (unfused - want).abs().max().item(), flush=True)
graphs, _ = run("cuda", gpu_memory_utilization=0.2)
print("cuda graphs:", (graphs - want).abs().max().item(), flush=True)
