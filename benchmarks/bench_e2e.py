"""End-to-end speed of built artifacts: decode latency, throughput, cold start (issue 5, part 7).

    source benchmarks/gpu_env.sh && R=$PWD && cd /tmp && python $R/benchmarks/bench_e2e.py \\
        /tmp/bench/w4a16=w4a16 /tmp/bench/fp8=fp8 --parts decode,throughput,cold --json $OUT/e2e.json

Each ARTIFACT[=LABEL[@KEY=VALUE,...]] is loaded once (with those engine options, e.g.
`/tmp/bf16=bf16-sync@async_scheduling=false` for the synchronous engine; the cold part passes them as
`llmc run` flags) with `LLM` (decode, then throughput), then closed before its cold
start. The JSON (and a markdown table, printed and stored under "table") is rewritten after every part,
so a run cut short keeps what it measured; --budget S skips parts once S seconds have passed.

  decode      batch 1: a prompt of --decode-prompt random token ids, --decode-tokens new tokens (greedy,
              ignore_eos), after a warm-up; the median of --repeats runs (a new prompt each). ms/token is
              over the decode steps (the first token, from the prefill, is TTFT). roofline_fraction =
              (bytes read per token / copy bandwidth) / measured ms/token, where bytes = every tensor of
              the weights file(s) except the embedding table (one row of it is read; per GPU for several
              ranks) + KV bytes per token of context × the mean context of the decode steps, and the copy
              bandwidth is measured in the same run: a 1 GiB device-to-device copy timed with CUDA events,
              read + write bytes counted (as benchmarks/bench_kernels.py does).
  throughput  per --throughput INxOUT:N, N requests of IN random token ids, each generating exactly OUT
              tokens (ignore_eos), all submitted at once to the Engine, which steps until all finish or
              --time-limit s pass (the rest is aborted: "truncated"). After a warm-up, every token is
              stamped with the time its step returned: output tokens/s (tokens generated / elapsed), TTFT
              (first token − submission) and ITL (gaps between a request's consecutive tokens) p50/p90/p99.
  cold        `python -m llmc.cli run ARTIFACT --prompt P --max-tokens 1 --temperature 0` in a subprocess,
              timed from just before it starts: ready_s when the CLI echoes the prompt (engine loaded; it
              echoes right before the first step), first_token_s when the next stdout byte arrives (the
              generated token, or the final newline if it decodes to nothing), exit_s when it exits;
              stderr lines are stamped too ("KV cache: ..." = weights loaded, cache allocated). Run twice:
              with an empty Triton cache (kernels compile in the run), then with the cache it left (a
              restart). The weights are in the OS page cache either way (the artifact was just built).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from llmc.runtime import artifact as art
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import RequestOutputKind, SamplingParams

PARTS = ("decode", "throughput", "cold")
COLD_PROMPT = "The quick brown fox jumps over the lazy dog"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", help="ARTIFACT_DIR[=LABEL[@KEY=VALUE,...]]")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: decode, throughput, cold")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path, default=Path("bench_e2e.json"))
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--throughput", default="128x128:1000,1024x256:200", help="INPUTxOUTPUT:NUM_REQUESTS, ...")
    parser.add_argument("--time-limit", type=float, default=90.0, help="seconds per throughput config")
    parser.add_argument("--output-kind", default="final_only", choices=["final_only", "delta", "cumulative"],
                        help="the throughput requests' output_kind (final_only: as LLM.generate and vLLM's "
                             "throughput benchmark; no TTFT/ITL then); a label's @output_kind=... wins")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: from gpu_memory_utilization")
    parser.add_argument("--cold-prompt", default=COLD_PROMPT)
    parser.add_argument("--cold-timeout", type=float, default=180.0)
    parser.add_argument("--cold-runs", type=int, default=2, choices=[1, 2], help="1: only the run with an empty Triton cache")
    parser.add_argument("--budget", type=float, default=None, help="skip parts that start after this many seconds")
    args = parser.parse_args(argv)
    if unknown := set(args.parts.split(",")) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    return args


def parse_throughput(spec: str) -> list[tuple[int, int, int]]:
    """'128x128:1000,1024x256:200' → [(128, 128, 1000), (1024, 256, 200)]."""
    configs = []
    for item in spec.split(","):
        sizes, num = item.split(":")
        inp, out = sizes.split("x")
        configs.append((int(inp), int(out), int(num)))
    return configs


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(1000 * pick(0.50), 2), "p90": round(1000 * pick(0.90), 2), "p99": round(1000 * pick(0.99), 2)}


# ---- bandwidth and bytes -------------------------------------------------------------------------


def copy_bandwidth_GBps(device: torch.device) -> float:
    """Device-to-device copy of 1 GiB (64 MiB on a CPU): (read + write bytes) / median time."""
    num_bytes = 2**30 if device.type == "cuda" else 2**26
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    if device.type == "cuda":
        from llmc.kernels.timing import median_time_ms

        ms = median_time_ms(lambda: dst.copy_(src), None, num_reps=10, use_graph=False)
    else:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(1000 * (time.perf_counter() - start))
        ms = statistics.median(times)
    del src, dst
    release_memory(device)
    return 2 * num_bytes / ms / 1e6


def weight_bytes_per_token(artifact: Path, manifest: art.Manifest) -> int:
    """Bytes of weights one decode step reads on one GPU: every tensor but the embedding table (unless
    tied to lm_head), summed over the ranks' files, divided by the number of ranks."""
    total = 0
    for rank in range(manifest.parallel.world_size):
        header = art.read_safetensors_header(artifact / art.rank_weights_path(rank))
        for name, info in header.items():
            if name == "embed.weight" and not manifest.model.tie_word_embeddings:
                continue
            total += info["data_offsets"][1] - info["data_offsets"][0]
    return total // manifest.parallel.world_size


def kv_bytes_per_context_token(runner) -> int:
    """KV bytes one token of context takes on this rank (K and V of every layer, compute dtype)."""
    caches = runner.shard.kv_caches if hasattr(runner, "shard") else runner.kv_caches
    k = caches[0][0]  # [num_blocks, block_size, num_kv_heads, head_dim]
    return 2 * len(caches) * k.shape[2] * k.shape[3] * k.element_size()


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ---- running requests ----------------------------------------------------------------------------


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random ids below the top 256 (special tokens in Llama-3's vocabulary)."""
    rng = random.Random(seed)
    high = max(2, vocab_size - 256)
    return [[rng.randrange(1, high) for _ in range(length)] for _ in range(num)]


def run_requests(engine, prompts: list[list[int]], max_tokens: int | list[int], time_limit: float | None = None,
                 output_kind: str = "delta"):
    """Submit every prompt at once and step until done (or time_limit). Returns (t0, {request id: token
    times}, elapsed, is_truncated); token times are perf_counter() stamps of the step that returned them.
    `max_tokens`: one for all, or one per prompt.
    `output_kind`: the requests' (delta, as a streaming server asks; cumulative; or final_only, as
    LLM.generate asks, when every token is stamped with its request's end)."""
    kind = RequestOutputKind[output_kind.upper()]
    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=kind) for n in lengths]
    start = time.perf_counter()
    stamps = {engine.add_request(None, q, p): [] for p, q in zip(prompts, params)}
    deadline = None if time_limit is None else start + time_limit
    is_truncated = False
    while engine.has_unfinished_requests():
        if deadline is not None and time.perf_counter() > deadline:
            for request_id in list(engine.groups):
                engine.abort_request(request_id)
            is_truncated = True
            break
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            times = stamps[output.request_id]
            num_new = len(output.outputs[0].token_ids) - (0 if kind is RequestOutputKind.DELTA else len(times))
            times.extend([now] * num_new)
    return start, stamps, time.perf_counter() - start, is_truncated


def warm_up(engine, num: int, length: int) -> None:
    """`num` short prompts whose requests end a few at a time, plus a quarter more that join as the
    first ones end, so that the kernels of the batch sizes a measured run passes through are compiled
    before it: pure decode steps of every size and mixed steps of a few hundred tokens (a W4A16
    model's GEMMs at 257-1024 tokens run kernels no decode or full prefill step runs; without these
    steps a cold Triton cache cost ~13% of a 128/128 run, with them ~1%: RESULTS.md, session 12)."""
    for i, prompt in enumerate(random_prompts(num + num // 4, length, engine.manifest.model.vocab_size, seed=7)):
        engine.add_request(None, SamplingParams(temperature=0, max_tokens=1 + i % 40, ignore_eos=True), prompt)
    while engine.has_unfinished_requests():
        engine.step()


def bench_decode(llm: LLM, artifact: Path, args, copy_GBps: float) -> dict:
    engine = llm.engine
    vocab_size, n = engine.manifest.model.vocab_size, args.decode_tokens
    run_requests(engine, random_prompts(1, args.decode_prompt, vocab_size, seed=999), 16)  # warm-up
    runs = []
    for r in range(args.repeats):
        start, stamps, _, _ = run_requests(engine, random_prompts(1, args.decode_prompt, vocab_size, seed=r), n)
        times = next(iter(stamps.values()))
        runs.append({"ttft_ms": 1000 * (times[0] - start), "ms_per_token": 1000 * (times[-1] - times[0]) / (n - 1)})
    best = sorted(runs, key=lambda run: run["ms_per_token"])[len(runs) // 2]  # the median run
    weight_bytes = weight_bytes_per_token(artifact, engine.manifest)
    kv_bytes = kv_bytes_per_context_token(engine.runner) * (args.decode_prompt + n / 2)  # mean context of the steps
    roofline_ms = (weight_bytes + kv_bytes) / (copy_GBps * 1e9) * 1000
    return {
        "prompt_tokens": args.decode_prompt, "new_tokens": n, "repeats": args.repeats,
        "ms_per_token": round(best["ms_per_token"], 3), "tokens_per_s": round(1000 / best["ms_per_token"], 1),
        "ttft_ms": round(best["ttft_ms"], 2), "all_ms_per_token": [round(r["ms_per_token"], 3) for r in runs],
        "weight_bytes_per_token": weight_bytes, "kv_bytes_per_token": int(kv_bytes),
        "copy_GBps": round(copy_GBps, 1), "roofline_ms": round(roofline_ms, 4),
        "roofline_fraction": round(roofline_ms / best["ms_per_token"], 4),
    }


def bench_throughput(llm: LLM, args, remaining, output_kind: str) -> list[dict]:
    """One result per --throughput config; `remaining()` (seconds of budget left) bounds each run too.
    With final_only outputs every token is stamped at its request's end: no TTFT or ITL."""
    engine = llm.engine
    vocab_size, results = engine.manifest.model.vocab_size, []
    max_num_seqs, max_batched = engine.options.max_num_seqs, engine.options.max_num_batched_tokens  # a label's @ options win
    for inp, out, num in parse_throughput(args.throughput):
        if remaining() <= 0:
            break
        warm_up(engine, min(num, max_num_seqs), min(inp, 64))
        time_limit = min(args.time_limit, remaining())
        log(f"  throughput {inp}/{out} x {num} (limit {time_limit:.0f} s)")
        prompts = random_prompts(num, inp, vocab_size, seed=inp + out)
        start, stamps, elapsed, is_truncated = run_requests(engine, prompts, out, time_limit, output_kind)
        num_tokens = sum(len(t) for t in stamps.values())
        ttft = [t[0] - start for t in stamps.values() if t]
        itl = [b - a for t in stamps.values() for a, b in zip(t, t[1:])]
        streamed = output_kind != "final_only"
        results.append({
            "input_tokens": inp, "output_tokens": out, "num_requests": num,
            "num_finished": sum(len(t) == out for t in stamps.values()), "is_truncated": is_truncated,
            "elapsed_s": round(elapsed, 2), "output_tokens_per_s": round(num_tokens / elapsed, 1),
            "total_tokens_per_s": round((num_tokens + inp * len(ttft)) / elapsed, 1),
            "ttft_ms": percentiles(ttft) if streamed else None, "itl_ms": percentiles(itl) if streamed else None,
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_batched, "output_kind": output_kind,
        })
        log(f"  -> {results[-1]['output_tokens_per_s']} output tokens/s, {results[-1]['num_finished']}/{num} finished")
    return results


# ---- cold start ----------------------------------------------------------------------------------


def cold_start(artifact: Path, device: str, prompt: str, triton_cache: Path, timeout: float,
               engine_options: dict | None = None) -> dict:
    """One `llmc run --prompt` process (the artifact's engine options as its flags); see the module
    docstring for what each time means."""
    command = [sys.executable, "-m", "llmc.cli", "run", str(artifact), "--prompt", prompt, "--max-tokens", "1",
               "--temperature", "0", "--device", device, "--disable-log-stats"]
    for key, value in (engine_options or {}).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            command.append(flag if value else "--no-" + flag[2:])
        else:
            command += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache), "PYTHONUNBUFFERED": "1"}
    return time_first_output(command, len(prompt.encode()), env, timeout)


def time_first_output(command: list[str], prompt_bytes: int, env: dict, timeout: float) -> dict:
    """Run `command`, stamping its stdout chunks and stderr lines (seconds since just before it
    started): ready_s once `prompt_bytes` bytes came out, first_token_s at the first byte after them."""
    chunks, lines = [], []
    with tempfile.TemporaryDirectory() as cwd:  # not the repository root: its ./llmc would shadow the package
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env)

        def read_stdout():
            while data := os.read(process.stdout.fileno(), 65536):
                chunks.append((time.perf_counter() - start, data))

        def read_stderr():
            for line in process.stderr:
                lines.append((time.perf_counter() - start, line.decode(errors="replace").rstrip()))

        readers = [threading.Thread(target=read_stdout), threading.Thread(target=read_stderr)]
        for reader in readers:
            reader.start()
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        exit_s = time.perf_counter() - start
        for reader in readers:
            reader.join()
    received, ready_s, first_token_s = 0, None, None
    for t, data in chunks:
        received += len(data)
        if ready_s is None and received >= prompt_bytes:
            ready_s = round(t, 3)
        if first_token_s is None and received > prompt_bytes:
            first_token_s = round(t, 3)
    kv_logged_s = next((round(t, 3) for t, line in lines if "KV cache:" in line), None)
    return {"exit_code": code, "ready_s": ready_s, "first_token_s": first_token_s, "exit_s": round(exit_s, 3),
            "kv_cache_logged_s": kv_logged_s, "stdout": b"".join(d for _, d in chunks).decode(errors="replace")[-200:],
            "stderr": [f"{t:8.3f} {line}" for t, line in lines][-12:]}


def bench_cold(artifact: Path, args, engine_options: dict | None = None) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        for name in ("empty triton cache", "warm triton cache")[: args.cold_runs]:
            log(f"  cold start, {name}")
            results.append({"triton_cache": name, **cold_start(artifact, args.device, args.cold_prompt, Path(cache),
                                                               args.cold_timeout, engine_options)})
            log(f"  -> first token at {results[-1]['first_token_s']} s (exit code {results[-1]['exit_code']})")
    return results


# ---- tables and the driver -----------------------------------------------------------------------


def _fmt(p: dict | None) -> str:
    if p is None:  # final_only outputs: not measured
        return "—"
    return "/".join("—" if p[k] is None else f"{p[k]:.1f}" for k in ("p50", "p90", "p99"))


def markdown(results: dict) -> str:
    lines = []
    errors = [f"{label} {part}: {r[part]['error']}" for label, r in results.items() for part in PARTS
              if isinstance(r.get(part), dict) and "error" in r[part]]
    decode = [(label, r["decode"]) for label, r in results.items() if "decode" in r and "error" not in r["decode"]]
    if decode:
        lines += ["| artifact | ms/token | tokens/s | TTFT ms | weights MB/token | KV MB/token | copy GB/s | roofline ms | of roofline |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {label} | {d['ms_per_token']:.2f} | {d['tokens_per_s']:.1f} | {d['ttft_ms']:.1f} | "
                  f"{d['weight_bytes_per_token'] / 1e6:.0f} | {d['kv_bytes_per_token'] / 1e6:.1f} | {d['copy_GBps']:.0f} | "
                  f"{d['roofline_ms']:.3f} | {100 * d['roofline_fraction']:.1f}% |" for label, d in decode]
        lines.append("")
    throughput = [(label, t) for label, r in results.items() if isinstance(r.get("throughput"), list) for t in r["throughput"]]
    if throughput:
        lines += ["| artifact | in/out | requests (finished) | output tokens/s | total tokens/s | TTFT ms p50/p90/p99 | ITL ms p50/p90/p99 | s |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {label} | {t['input_tokens']}/{t['output_tokens']} | {t['num_requests']} ({t['num_finished']}"
                  f"{', truncated' if t['is_truncated'] else ''}) | {t['output_tokens_per_s']:.0f} | {t['total_tokens_per_s']:.0f} | "
                  f"{_fmt(t['ttft_ms'])} | {_fmt(t['itl_ms'])} | {t['elapsed_s']:.1f} |" for label, t in throughput]
        lines.append("")
    cold = [(label, c) for label, r in results.items() if isinstance(r.get("cold"), list) for c in r["cold"]]
    if cold:
        lines += ["| artifact | triton cache | KV cache logged s | engine ready s | first token s | exit s | exit code |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {label} | {c['triton_cache']} | {c['kv_cache_logged_s']} | {c['ready_s']} | {c['first_token_s']} | "
                  f"{c['exit_s']} | {c['exit_code']} |" for label, c in cold]
        lines.append("")
    lines += [f"failed: {e}" for e in errors]
    return "\n".join(lines).rstrip("\n")


def write_report(args, header: dict, results: dict) -> str:
    table = markdown(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {**header, "args": {k: str(v) for k, v in vars(args).items()}, "results": results, "table": table}
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return table


def run_part(name: str, result: dict, fn) -> None:
    """result[name] = fn(), or {"error": ...} if it raised: one part failing must not lose the others."""
    try:
        result[name] = fn()
    except Exception as e:  # noqa: BLE001 - recorded in the report, with the traceback on stderr
        traceback.print_exc()
        result[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}


def parse_engine_options(text: str) -> dict:
    """`key=value,key=value` (values as JSON: false, 3, "x"; bare words as strings) -> LLM keywords."""
    options = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def bench_loaded(artifact: Path, result: dict, args, parts: list[str], remaining, copy_GBps: float, save,
                 engine_options: dict) -> None:
    """The in-process parts (decode, throughput) on one LLM, closed and released afterwards; save()
    writes the report so far."""
    options = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
               "max_model_len": args.max_model_len, "disable_log_stats": True, **engine_options}
    result["engine_options"] = engine_options
    output_kind = options.pop("output_kind", args.output_kind)  # bench_e2e's, not the engine's
    if args.num_kv_blocks is not None:
        options["num_kv_blocks"] = args.num_kv_blocks
    start = time.perf_counter()
    llm = LLM(artifact, device=args.device, **options)
    result["load_s"] = round(time.perf_counter() - start, 2)
    result["num_kv_blocks"] = llm.engine.runner.num_blocks
    if "decode" in parts and remaining() > 0:
        log("  decode")
        run_part("decode", result, lambda: bench_decode(llm, artifact, args, copy_GBps))
        decode = result["decode"]
        log(f"  -> {decode.get('ms_per_token')} ms/token, roofline fraction {decode.get('roofline_fraction')} {decode.get('error', '')}")
        save()
    if "throughput" in parts and remaining() > 0:
        log("  throughput")
        run_part("throughput", result, lambda: bench_throughput(llm, args, remaining, output_kind))
    llm.close()
    del llm
    release_memory(torch.device(args.device))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts, begin = args.parts.split(","), time.perf_counter()
    device = torch.device(args.device)
    header = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    results: dict[str, dict] = {}
    remaining = lambda: float("inf") if args.budget is None else args.budget - (time.perf_counter() - begin)  # noqa: E731
    for item in args.artifacts:
        path, _, label = item.partition("=")
        label, _, engine_options = label.partition("@")
        artifact, label = Path(path), label or Path(path).name
        result = results.setdefault(label, {"artifact": str(artifact)})
        if {"decode", "throughput"} & set(parts) and remaining() > 0:
            if "copy_GBps" not in header:
                header["copy_GBps"] = round(copy_bandwidth_GBps(device), 1)
            log(f"{label}: loading {artifact}")
            bench_loaded(artifact, result, args, parts, remaining, header["copy_GBps"],
                         lambda: write_report(args, header, results), parse_engine_options(engine_options))
            write_report(args, header, results)
        if "cold" in parts and remaining() > 0:
            log(f"{label}: cold start")
            run_part("cold", result, lambda: bench_cold(artifact, args, parse_engine_options(engine_options)))
            write_report(args, header, results)
    print(write_report(args, header, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
