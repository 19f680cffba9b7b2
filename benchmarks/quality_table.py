"""The quantization quality table: ours (RTN, GPTQ, AWQ, FP8) vs the peer (llm-compressor) on ref-llama-12m.

Protocol (as shared/peer/README.md): calibrate on wikitext2-valid.txt (128 windows x 512 tokens),
measure perplexity on heldout.txt with `llmc eval --seq-len 512` (float32 compute, on the CPU).
Builds use the GPU when one is present. Writes a markdown table and JSON.

    python benchmarks/quality_table.py --out /tmp/quality [--only gptq-w4-g128 ...] [--jobs 4]

--calib-seed S draws the 128 calibration windows at random (seed S) instead of taking the first ones,
to see how much a setting's perplexity depends on its calibration sample; --set KEY=VALUE adds a
quantization field to every quantized setting (e.g. --set float_targets=false).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# The peer's perplexities, from shared/peer/README.md (llm-compressor 0.14, same protocol).
PEER = {
    "none": 49.67, "rtn-w4-g128-sym": 50.31, "gptq-w4-g128-sym": 50.23, "awq-w4-g128-asym": 50.38,
    "rtn-w3-g128-sym": 54.10, "gptq-w3-g128-sym": 52.37, "awq-w3-g128-asym": 52.60,
    "rtn-w4-pc-sym": 50.65, "gptq-w4-pc-sym": 50.19, "fp8-dynamic": 49.77, "rtn-w8-pc-sym": 49.68,
}


def settings() -> dict[str, dict]:
    table = {"none": {"method": "none"}, "fp8-dynamic": {"method": "fp8"},
             "rtn-w8-pc-sym": {"method": "rtn", "bits": 8, "group_size": -1}}
    # GPTQ is compared symmetric (as the peer ran it), AWQ asymmetric (likewise) and symmetric, each with our
    # RTN beside it.
    for bits, group, label in ((4, 128, "w4-g128"), (3, 128, "w3-g128"), (4, -1, "w4-pc")):
        for method, symmetric in (("rtn", True), ("gptq", True), ("awq", True), ("rtn", False), ("awq", False)):
            extra = {"act_order": True} if method == "gptq" else {}
            name = f"{method}-{label}-{'sym' if symmetric else 'asym'}"
            table[name] = {"method": method, "bits": bits, "group_size": group, "symmetric": symmetric, **extra}
    return table


def build_and_eval(name: str, quant: dict, out: Path, calib: Path, heldout: Path, num_samples: int,
                   calib_seed: int | None = None, env: dict | None = None) -> dict:
    artifact = out / name
    calibration = {"data": str(calib), "num_samples": num_samples, "seq_len": 512}
    if calib_seed is not None:
        calibration |= {"shuffle": True, "seed": calib_seed}
    recipe = {
        "model": str(REPO / "checkpoints" / "ref-llama-12m"), "output": str(artifact), "target": {"device": "cpu"},
        "quantization": {**quant, "calibration": calibration},
    }
    if quant["method"] in ("none",):
        recipe["quantization"] = {"method": "none"}
    recipe_path = out / f"{name}.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "llmc.cli", "build", "-q", str(recipe_path)], check=True, stdout=subprocess.DEVNULL,
                   env=env)
    build_seconds = time.perf_counter() - start
    manifest = json.loads((artifact / "manifest.json").read_text())
    result = subprocess.run(
        [sys.executable, "-m", "llmc.cli", "eval", str(artifact), "--data", str(heldout), "--seq-len", "512",
         "--device", "cpu", "--json"], check=True, capture_output=True, text=True, env=env,
    )
    report = manifest["quant"]["report"]
    return {
        "setting": name, "perplexity": json.loads(result.stdout)["perplexity"], "peer": PEER.get(name),
        "build_seconds": round(build_seconds, 1), "peak_memory_gib": report.get("peak_memory_gib"),
        "weight_bytes": sum(manifest["plan"]["weight_bytes_per_rank"]),
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| setting | ours | peer (llm-compressor) | build s | peak memory GiB | weights MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        peer = f"{r['peer']:.2f}" if r["peer"] is not None else "—"
        lines.append(f"| {r['setting']} | {r['perplexity']:.2f} | {peer} | {r['build_seconds']} | "
                     f"{r['peak_memory_gib']} | {r['weight_bytes'] / 2**20:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calib", type=Path, default=SHARED / "data" / "wikitext2-valid.txt")
    parser.add_argument("--heldout", type=Path, default=SHARED / "data" / "heldout.txt")
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--only", nargs="*", help="settings to run (default: all)")
    parser.add_argument("--calib-seed", type=int, help="draw the calibration windows at random with this seed")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a quantization field for every quantized setting (value parsed as YAML)")
    parser.add_argument("--jobs", type=int, default=1, help="settings built and measured at once")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}
    chosen = {k: v if v["method"] == "none" else v | extra
              for k, v in settings().items() if not args.only or k in args.only}
    # Each job's evaluation gets its share of the cores (torch would otherwise take them all per process).
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}

    done, lock = [], threading.Lock()

    def run(item):
        name, quant = item
        row = build_and_eval(name, quant, args.out, args.calib, args.heldout, args.num_samples, args.calib_seed, env)
        print(f"{name}: {row['perplexity']:.3f} (peer {row['peer']})", flush=True)
        with lock:  # every finished row is on disk, should a later one fail or time out
            done.append(row)
            (args.out / "quality.json").write_text(json.dumps(done, indent=2))
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(run, chosen.items()))  # in the table's order
    (args.out / "quality.json").write_text(json.dumps(rows, indent=2))
    table = markdown(rows)
    (args.out / "quality.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
