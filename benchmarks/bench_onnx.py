"""Edge benchmark, one run on one machine: llmc's ONNX W4 artifact, llmc's torch CPU path on the same
build, and onnxruntime-genai's own int4 build of the same checkpoint.

    python benchmarks/bench_onnx.py [--model checkpoints/ref-llama-12m] [--repeats 3] [--genai-dir DIR] [--only BUILD ...]
        [--threads N] [--no-ppl] [--num-scheduler-steps K] [--no-genai]

Measures, per engine, in a fresh process each time (so peak memory is that engine's alone):
batch-1 decode tokens/s (64 new tokens after a 32-token prompt, best of 5), prompt tokens/s (a 512-token
prefill, best of 3), peak RSS, file size, and perplexity on data/heldout.txt (512-token windows,
GPTQ-paper protocol; genai's model is scored by onnxruntime on the same windows).

llmc builds (LLMC_BUILDS): GPTQ W4 symmetric, every linear including lm_head (as genai's int4 does),
calibrated on data/calibration.txt, at group 128 (llmc's default) and 32 (genai's block size), with
float32 MatMulNBits compute (target.int4_accuracy_level 1, llmc's default) and int8 (4, genai's
default), and the torch CPU path on the g128 build; besides, llmc-onnx-int8 (method int8, W8A8 int8 RTN, lm_head
too: MatMulInteger), llmc-onnx-f32 (unquantized, float32 MatMul) and llmc-onnx-rtn-g32-acc4 (the g32-acc4 graph
with RTN levels: its speed without GPTQ's calibration time). onnxruntime-genai (skipped with --no-genai) is imported from --genai-dir (installed there
with `pip install --target DIR onnxruntime-genai onnx_ir`), its model built with
`python -m onnxruntime_genai.models.builder -i MODEL -o OUT -p int4 -e cpu`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HELDOUT = REPO / "data" / "heldout.txt"
DECODE_PROMPT, DECODE_TOKENS, DECODE_TRIES, PREFILL_TOKENS, PPL_SEQ_LEN, PPL_WINDOWS = 32, 64, 5, 512, 512, 16


def _dir_bytes(path: Path, names: list[str]) -> int:
    return sum((path / n).stat().st_size for n in names)


# llmc builds: name -> (target.device, group_size, target.int4_accuracy_level or None[, quantization method])
LLMC_BUILDS = {
    "llmc-onnx-g128": ("onnx-cpu", 128, None),  # the recipe's defaults (float32 compute)
    "llmc-onnx-g32-acc4": ("onnx-cpu", 32, 4),  # genai's int4 defaults: 32-column blocks, int8 compute
    "llmc-torch-g128": ("cpu", 128, None),
    "llmc-torch-g32": ("cpu", 32, None),  # the torch path on the g32 build (the levels of llmc-onnx-g32*)
    "llmc-onnx-g32": ("onnx-cpu", 32, None),
    "llmc-onnx-g128-acc4": ("onnx-cpu", 128, 4),
    "llmc-onnx-int8": ("onnx-cpu", -1, None, "int8"),  # W8A8 int8 (RTN), lm_head too: MatMulInteger
    "llmc-onnx-f32": ("onnx-cpu", -1, None, "none"),  # unquantized: float32 MatMul
    "llmc-onnx-rtn-g32-acc4": ("onnx-cpu", 32, 4, "rtn"),  # llmc-onnx-g32-acc4's graph, RTN levels (no calibration)
}


def _recipe(args, out: Path, device: str, group_size: int, accuracy_level: int | None, method: str = "gptq") -> dict:
    target = {"device": device} | ({"int4_accuracy_level": accuracy_level} if accuracy_level else {})
    if method != "gptq":
        quantization = {"method": method} | ({"ignore": [], "report": False} if method != "none" else {}) | (
            {"bits": 4, "group_size": group_size} if method == "rtn" else {})
        return {"model": args.model, "output": str(out), "dtype": "float32", "quantization": quantization,
                "runtime": {"max_model_len": 2048}, "target": target}
    return {"model": args.model, "output": str(out), "dtype": "float32",
            "quantization": {"method": "gptq", "bits": 4, "group_size": group_size, "ignore": [], "report": False,
                             "calibration": {"data": str(REPO / "data" / "calibration.txt"),
                                             "num_samples": 32, "seq_len": 512}},
            "runtime": {"max_model_len": 2048}, "target": target}


def build_all(args) -> dict[str, Path]:
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    work = Path(args.work)
    builds = {name: spec for name, spec in LLMC_BUILDS.items() if not args.only or name in args.only}
    paths = {name: work / name for name in builds} | ({} if args.no_genai else {"genai": work / "genai-int4"})
    for name, spec in builds.items():
        if not (paths[name] / "manifest.json").is_file():
            build(recipe_from_dict(_recipe(args, paths[name], *spec)), show_progress=False)
    if not args.no_genai and not (paths["genai"] / "model.onnx").is_file():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", args.model, "-o",
                        str(paths["genai"]), "-p", "int4", "-e", "cpu", "-c", str(work / "genai-cache")],
                       check=True, env={**os.environ, "PYTHONPATH": args.genai_dir}, stdout=subprocess.DEVNULL)
    return paths


def file_sizes(paths: dict[str, Path]) -> dict[str, int]:
    sizes = {"genai": _dir_bytes(paths["genai"], ["model.onnx", "model.onnx.data"])} if "genai" in paths else {}
    for name, (device, *_) in LLMC_BUILDS.items():
        if name in paths:
                sizes[name] = (_dir_bytes(paths[name] / "onnx", ["model.onnx", "model.onnx.data"]) if device == "onnx-cpu"
                           else _dir_bytes(paths[name] / "rank-00", ["weights.safetensors"]))
    return sizes


# ---- workers: one engine per process ---------------------------------------------------------


def _llmc_worker(path: str, token_ids: list[int], measure_ppl: bool, num_scheduler_steps: int = 1) -> dict:
    from llmc.runtime.evaluate import evaluate, perplexity_windows
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    options = {"num_scheduler_steps": num_scheduler_steps} if "onnx" in Path(path).name else {}
    llm = LLM(path, device="cpu", max_num_seqs=1, max_model_len=2048, max_num_batched_tokens=PREFILL_TOKENS,
              disable_log_stats=True, **options)
    run = lambda ids, n: llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))  # noqa: E731
    run(token_ids[:16], 4)  # warm up
    prefill = min(_timed(lambda: run(token_ids[:PREFILL_TOKENS], 1)) for _ in range(3))
    decode = _decode_seconds(lambda n: run(token_ids[:DECODE_PROMPT], n))
    result = {"decode_tps": DECODE_TOKENS / decode, "prompt_tps": PREFILL_TOKENS / prefill}
    if measure_ppl:
        windows = perplexity_windows(llm.tokenizer, HELDOUT, PPL_SEQ_LEN, PPL_WINDOWS)
        result["perplexity"] = evaluate(llm.engine, windows)["perplexity"]
    return result


def _genai_worker(path: str, token_ids: list[int], measure_ppl: bool) -> dict:
    import onnxruntime_genai as og

    model = og.Model(path)

    def run(ids, n):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + n, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        for _ in range(n - 1):  # append_tokens computed the first token's logits
            generator.generate_next_token()

    run(token_ids[:16], 4)
    prefill = min(_timed(lambda: run(token_ids[:PREFILL_TOKENS], 1)) for _ in range(3))
    decode = _decode_seconds(lambda n: run(token_ids[:DECODE_PROMPT], n))
    result = {"decode_tps": DECODE_TOKENS / decode, "prompt_tps": PREFILL_TOKENS / prefill}
    if measure_ppl:
        result["perplexity"] = _genai_perplexity(Path(path) / "model.onnx", token_ids)
    return result


def _genai_perplexity(model_path: Path, token_ids: list[int]) -> float:
    """The same windows as llmc's evaluate, scored by one onnxruntime forward each (empty past)."""
    import math

    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    losses = []
    for w in range(min(PPL_WINDOWS, len(token_ids) // PPL_SEQ_LEN)):
        window = np.array([token_ids[w * PPL_SEQ_LEN: (w + 1) * PPL_SEQ_LEN]], np.int64)
        feeds = {"input_ids": window, "attention_mask": np.ones_like(window)}
        for i in session.get_inputs():
            if i.name.startswith("past_key_values"):
                feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3] if isinstance(i.shape[3], int) else 64), np.float32)
        logits = session.run(["logits"], feeds)[0][0, :-1].astype(np.float64)  # [seq_len - 1, vocab]
        logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
        losses.append(-logprobs[np.arange(len(logits)), window[0, 1:]].mean())
    return math.exp(sum(losses) / len(losses))


def _peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _decode_seconds(run) -> float:
    """Seconds of DECODE_TOKENS batch-1 decode steps: the best of DECODE_TRIES generations of 1 + DECODE_TOKENS
    tokens minus the best of 1 token (the prompt's prefill). Best-of: other load only ever adds time."""
    first = min(_timed(lambda: run(1)) for _ in range(DECODE_TRIES))
    return min(_timed(lambda: run(DECODE_TOKENS + 1)) for _ in range(DECODE_TRIES)) - first


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def worker_main(kind: str, path: str, ids_file: str, measure_ppl: bool, num_scheduler_steps: int) -> None:
    token_ids = json.loads(Path(ids_file).read_text())
    if kind == "genai":
        result = _genai_worker(path, token_ids, measure_ppl)
    else:
        result = _llmc_worker(path, token_ids, measure_ppl, num_scheduler_steps)
    result["peak_rss_mib"] = _peak_rss_mib()
    print("RESULT " + json.dumps(result))


# ---- driver ----------------------------------------------------------------------------------


def genai_with_threads(path: Path, threads: int) -> Path:
    """A copy of genai's model folder (files linked) whose config sets `threads` intra-op threads:
    genai reads its session options from genai_config.json, not from OMP_NUM_THREADS."""
    out = path.with_name(f"{path.name}-t{threads}")
    out.mkdir(exist_ok=True)
    for f in path.iterdir():
        if f.name != "genai_config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((path / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    (out / "genai_config.json").write_text(json.dumps(config, indent=2))
    return out


def run_worker(args, kind: str, path: Path, ids_file: Path, measure_ppl: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": args.genai_dir} if kind == "genai" else dict(os.environ)
    if args.threads:  # llmc's ONNX runner takes min(cores, OMP_NUM_THREADS) intra-op threads
        env["OMP_NUM_THREADS"] = str(args.threads)
        path = genai_with_threads(path, args.threads) if kind == "genai" else path
    cmd = [sys.executable, "-P", __file__, "--worker", kind, "--path", str(path), "--ids", str(ids_file),
           "--num-scheduler-steps", str(args.num_scheduler_steps)]
    out = subprocess.run(cmd + (["--ppl"] if measure_ppl else []), env=env, check=True, capture_output=True, text=True)
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "checkpoints" / "ref-llama-12m"))
    parser.add_argument("--work", default=str(REPO / "build" / "bench_onnx"))
    parser.add_argument("--genai-dir", default="/tmp/ogenai", help="where onnxruntime-genai is pip-installed (--target)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=list(LLMC_BUILDS), help="these llmc builds (default: all)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of every engine (default: each engine's own, the machine's cores)")
    parser.add_argument("--no-ppl", action="store_true", help="skip perplexity (speed runs)")
    parser.add_argument("--no-genai", action="store_true", help="skip onnxruntime-genai (not installed)")
    parser.add_argument("--num-scheduler-steps", type=int, default=1, help="llmc ONNX engines: decode steps per engine step")
    parser.add_argument("--worker"), parser.add_argument("--path"), parser.add_argument("--ids")
    parser.add_argument("--ppl", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker, args.path, args.ids, args.ppl, args.num_scheduler_steps)
    paths = build_all(args)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(args.model).encode(HELDOUT.read_text())
    ids_file = Path(args.work) / "heldout_ids.json"
    ids_file.write_text(json.dumps(ids))
    runs: dict[str, list[dict]] = {kind: [] for kind in paths}
    for repeat in range(args.repeats):
        for kind, path in paths.items():
            runs[kind].append(run_worker(args, kind, path, ids_file, measure_ppl=repeat == 0 and not args.no_ppl))
    report(runs, file_sizes(paths), args)


def report(runs: dict[str, list[dict]], sizes: dict[str, int], args) -> None:
    print(f"cores {len(os.sched_getaffinity(0))}, threads {args.threads or 'default'}, num_scheduler_steps "
          f"{args.num_scheduler_steps}, repeats {args.repeats} (median [min-max])")
    print(f"{'engine':<22}{'decode tok/s':>26}{'prompt tok/s':>26}{'peak RSS MiB':>16}{'file MiB':>10}{'ppl':>9}")
    for kind, rs in runs.items():
        cell = lambda key: (f"{statistics.median(r[key] for r in rs):.0f} "  # noqa: E731
                            f"[{min(r[key] for r in rs):.0f}-{max(r[key] for r in rs):.0f}]")
        print(f"{kind:<22}{cell('decode_tps'):>26}{cell('prompt_tps'):>26}{statistics.median(r['peak_rss_mib'] for r in rs):>16.0f}"
              f"{sizes[kind] / 2**20:>10.2f}{rs[0].get('perplexity', float('nan')):>9.3f}")
    print(json.dumps({"runs": runs, "file_bytes": sizes}))


if __name__ == "__main__":
    main()
