"""Why the block build's GPU test saw other greedy tokens (call 4): the same tiny Llama (hidden 256) built float32
dense, FP8 per channel and FP8 in blocks; each artifact's logits on CUDA against the CPU's (cosine min / mean) and the
first greedy tokens of two prompts on each. Run twice: with programmatic dependent launch and with LLMC_PDL=0.
`--bf16`: a hidden-512 model built in bf16 instead (call 8: what a bf16 build's GPU logits are against the CPU's,
dense and FP8 alike, through the Triton kernel (chunks of 16) and cuBLAS (one chunk))."""
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[3]))
from tests.conftest import hf_encode, make_hf_checkpoint  # noqa: E402
from tests.runtime.hf_oracle import build_float32  # noqa: E402

from llmc.runtime.llm import LLM  # noqa: E402
from llmc.runtime.sampling_params import SamplingParams  # noqa: E402

BF16 = "--bf16" in sys.argv
work = Path("/tmp/s43diag" + ("-bf16" if BF16 else ""))
ck = work / "ck"
if not ck.exists():
    size = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4) if BF16 else dict(
        hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
    make_hf_checkpoint(ck, "llama", **size)
ids = hf_encode(ck, "Once upon a time, in a land far away, there lived") + list(range(100, 188 if BF16 else 140))
prompts = [{"prompt_token_ids": hf_encode(ck, p)} for p in ("The quick brown fox", "Once upon a time")]
greedy = SamplingParams(temperature=0, max_tokens=8)
for name, quant in (("dense", {"method": "none"}), ("fp8", {"method": "fp8", "report": False}),
                    ("fp8block", {"method": "fp8", "weights": "block", "report": False})):
    out = work / name
    if not out.exists():
        build_float32(ck, out, quantization=quant, **({"dtype": "bfloat16"} if BF16 else {}))
    with LLM(out, device="cpu") as llm:
        cpu = llm.engine.score(ids).float()
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    results = {}
    for label, kw in (("chunks of 16", dict(max_num_batched_tokens=16)), ("one chunk", dict(max_num_batched_tokens=256)),
                      ("eager", dict(max_num_batched_tokens=16, enforce_eager=True))):
        with LLM(out, device="cuda", gpu_memory_utilization=0.2, max_num_seqs=3, **kw) as llm:
            gpu = llm.engine.score(ids).float().cpu()
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        cos = torch.nn.functional.cosine_similarity(gpu, cpu, dim=-1)
        top = (gpu.argmax(-1) == cpu.argmax(-1)).float().mean().item()
        print(f"{name:8s} {label:12s} cos min {cos.min():.5f} mean {cos.mean():.5f}  argmax agree {top:.3f}  "
              f"greedy equal {got == want}  cpu {want[0][:5]} gpu {got[0][:5]}", flush=True)
