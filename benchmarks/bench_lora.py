"""What run-time LoRA (runtime/lora.py) costs: decode with adapters against the same artifact without, in one run.

    source benchmarks/gpu_env.sh && python -P benchmarks/bench_lora.py ARTIFACT --adapters 4 --rank 16 \\
        --batch-sizes 1 64 --json $OUT/lora.json

Writes --adapters random PEFT adapters of rank --rank on every q/k/v/o/gate/up/down projection of the artifact's
model (their values do not change the speed), then for each batch size B opens three engines in turn:
  none      enable_lora off;
  slots     enable_lora on (max_loras = --adapters), every request on the base model (the slots' sums still run);
  adapters  enable_lora on, the B requests spread round-robin over the adapters;
  with --compare-torch also slots-torch / adapters-torch: the same on the torch path (three ops dense over the
  slots, what CUDA ran before kernels/lora_triton.py), in the same process.
Each asks B requests at once (--prompt-tokens random ids, greedy, ignore_eos), once for --tokens new tokens and once
for half as many; reported: ms per decode step = (the first wall - the second) / (tokens - tokens // 2), the
prefill and the first steps cancelling out, median of --repeats, and the ratio to `none` of the same batch size,
measured in the same process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from unittest import mock

sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks.bench_spec_draft import make_prompts, release, timed  # noqa: E402
from llmc.runtime import artifact as art  # noqa: E402
from llmc.runtime.llm import LLM  # noqa: E402
from llmc.runtime import lora as lora_module  # noqa: E402
from llmc.runtime.lora import LoRARequest  # noqa: E402
from llmc.runtime.models import spec_for_architecture  # noqa: E402
from llmc.runtime.models.spec import hf_member_rows  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-file", help="text whose tokens the prompts are cut from (default: random ids)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None)
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE engine option (JSON value)")
    parser.add_argument("--compare-torch", action="store_true",
                        help="also the torch path on CUDA (three ops dense over the slots, what ran before the Triton "
                             "kernels): modes slots-torch and adapters-torch")
    parser.add_argument("--json")
    return parser.parse_args(argv)


def write_adapter(folder: Path, model: art.ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder on every decoder projection, random factors (normal, 0.01)."""
    spec = spec_for_architecture(model.architecture)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for index in range(model.num_layers):
        for linear in spec.layer_linears:
            in_features = {"attn.o": model.num_heads * model.head_dim, "mlp.down": model.intermediate_size}.get(
                linear.name, model.hidden_size)
            for member, rows in zip(linear.hf_members, hf_member_rows(linear, model)):
                name = f"base_model.model.{spec.hf_layer_prefix}{index}.{member}"
                tensors[f"{name}.lora_A.weight"] = 0.01 * torch.randn(rank, in_features, generator=gen)
                tensors[f"{name}.lora_B.weight"] = 0.01 * torch.randn(rows, rank, generator=gen)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = sorted({m.split(".")[-1] for linear in spec.layer_linears for m in linear.hf_members})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none",
        "task_type": "CAUSAL_LM"}))
    return folder


def measure(args, options: dict, batch: int, loras: list, torch_path: bool = False) -> dict:
    # no prefix cache: the longer run would find the shorter one's prompt blocks cached and skip its prefill
    with mock.patch.object(lora_module, "is_triton_installed", lambda: False) if torch_path else contextlib.nullcontext():
        llm = LLM(args.artifact, device=args.device, disable_log_stats=True, enable_prefix_caching=False, **options)
    try:
        def run(prompts, max_tokens):
            requests = [loras[i % len(loras)] if loras else None for i in range(len(prompts))]
            return timed(llm, prompts, max_tokens, lora_request=requests)

        run(make_prompts(llm, args, batch, seed=-1), 8)  # warm-up
        steps, half = [], args.tokens // 2
        for repeat in range(args.repeats):
            prompts = make_prompts(llm, args, batch, seed=repeat)
            shorter, whole = run(prompts, half), run(prompts, args.tokens)
            steps.append(1000 * (whole - shorter) / (args.tokens - half))
    finally:
        release(llm)
    return {"ms_per_step": statistics.median(steps), "runs": steps}


def main(argv=None) -> None:
    args = parse_args(argv)
    base_options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    model = art.read_manifest(Path(args.artifact)).model
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    results = {"device": device, "artifact": args.artifact, "adapters": args.adapters, "rank": args.rank, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", model, args.rank, i)))
                 for i in range(args.adapters)]
        lora_options = {"enable_lora": True, "max_loras": args.adapters, "max_lora_rank": args.rank}
        modes = [("none", {}, []), ("slots", lora_options, []), ("adapters", lora_options, loras)]
        if args.compare_torch:
            modes += [("slots-torch", lora_options, []), ("adapters-torch", lora_options, loras)]
        for batch in args.batch_sizes:
            base = None
            for mode, options, used in modes:
                row = {"batch": batch, "mode": mode, **measure(args, dict(base_options, max_num_seqs=batch, **options),
                                                              batch, used, torch_path=mode.endswith("-torch"))}
                base = base or row
                row["ratio"] = row["ms_per_step"] / base["ms_per_step"]
                results["rows"].append(row)
                print(f"B={batch} {mode}: {row['ms_per_step']:.3f} ms/step, x{row['ratio']:.3f} of none", flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
