"""Peak resident memory of `llmc build` against the checkpoint's depth (RESULTS.md session 35, part 4).

    python benchmarks/build_memory.py --work /tmp/buildmem --layers 2 32 --methods none rtn [--json OUT]

Writes random bf16 Llama checkpoints of hidden 1024 (intermediate 2816, 16 heads, 4 KV heads, vocab 4096,
200 MB shards, this repo's ref-llama-12m tokenizer) with the given numbers of layers, builds each with
each method (`target.device: cpu`; gptq and awq: 4 bits, group 128, data/calibration.txt, --samples windows
of --seq-len tokens, 16 of 256 by default) in a child process with OMP_NUM_THREADS=1, and reports its peak RSS (VmHWM) and the peaks of its
anonymous and file-backed resident memory, polled from /proc every 50 ms. (Not `wait4`'s ru_maxrss: Linux
keeps it across the child's exec, so it counts the pages of this process, which made the checkpoints.) The README's claim:
a build holds about one layer plus the calibration activations, so the peak should not grow with depth.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUANT = {
    "none": "{method: none}",
    "rtn": "{method: rtn, bits: 4, group_size: 128}",
    "gptq": "{method: gptq, bits: 4, group_size: 128, calibration: {data: DATA, num_samples: SAMPLES, seq_len: SEQ_LEN}}",
    "awq": "{method: awq, bits: 4, group_size: 128, calibration: {data: DATA, num_samples: SAMPLES, seq_len: SEQ_LEN}}",
}


def make_checkpoint(out: Path, num_layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file():
        return out
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=num_layers, num_attention_heads=16,
                         num_key_value_heads=4, head_dim=64, vocab_size=4096, max_position_embeddings=2048,
                         bos_token_id=0, eos_token_id=1, pad_token_id=4, tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(num_layers)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, max_shard_size="200MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(REPO / "checkpoints" / "ref-llama-12m" / name, out)
    return out


def measure_build(checkpoint: Path, method: str, work: Path, samples: int = 16, seq_len: int = 256,
                  extra_env: dict | None = None) -> dict:
    recipe = work / f"{checkpoint.name}-{method}.yaml"
    quant = (QUANT[method].replace("DATA", str(REPO / "data" / "calibration.txt"))
             .replace("SAMPLES", str(samples)).replace("SEQ_LEN", str(seq_len)))
    recipe.write_text(f"model: {checkpoint}\noutput: {work / 'out' / f'{checkpoint.name}-{method}'}\n"
                      f"quantization: {quant}\nruntime: {{max_model_len: 2048}}\ntarget: {{device: cpu}}\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(extra_env or {})}
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "llmc.cli", "build", "-q", str(recipe)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peaks = {"VmHWM": 0, "RssAnon": 0, "RssFile": 0}
    while True:
        pid, status = os.waitpid(child.pid, os.WNOHANG)
        if pid == child.pid:
            break
        try:
            for line in open(f"/proc/{child.pid}/status"):
                key, _, value = line.partition(":")
                if key in peaks:
                    peaks[key] = max(peaks[key], int(value.split()[0]))
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    size = sum(p.stat().st_size for p in checkpoint.iterdir())
    calibration = {"samples": samples, "seq_len": seq_len} if method in ("gptq", "awq") else {}
    return {"layers": int(checkpoint.name.removeprefix("L")), "checkpoint_MiB": round(size / 2**20), "method": method,
            **calibration, **({"env": extra_env} if extra_env else {}),
            "exit_code": os.waitstatus_to_exitcode(status), "wall_s": round(time.perf_counter() - start, 1),
            "peak_rss_MiB": round(peaks["VmHWM"] / 1024), "anon_peak_MiB": round(peaks["RssAnon"] / 1024),
            "file_peak_MiB": round(peaks["RssFile"] / 1024), "stderr_tail": child.stderr.read().decode()[-300:]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="checkpoints, recipes and artifacts go here")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--methods", nargs="+", default=["none", "rtn"], choices=sorted(QUANT))
    parser.add_argument("--samples", type=int, default=16, help="gptq/awq calibration windows (default 16)")
    parser.add_argument("--seq-len", type=int, default=256, help="gptq/awq calibration window length (default 256)")
    parser.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra environment for the build (e.g. MALLOC_ARENA_MAX=1)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for num_layers in args.layers:
        checkpoint = make_checkpoint(args.work / f"L{num_layers}", num_layers)
        for method in args.methods:
            extra_env = dict(item.split("=", 1) for item in args.env)
            rows.append(measure_build(checkpoint, method, args.work, args.samples, args.seq_len, extra_env))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "stderr_tail"}), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
