#!/usr/bin/env bash
# Llama-3-8B-shaped end-to-end benchmarks on a fresh GPU machine, one stage per call (each < 600 s).
#
#   bash benchmarks/bench_8b.sh STAGE [OUT_DIR]        (from the repository root; OUT_DIR defaults to $OUT)
#
# Every stage makes the random-weight checkpoint (benchmarks/make_checkpoint.py), builds what it needs
# with `llmc build` (recipes written under $WORK/recipes), runs its benchmark, and leaves in OUT_DIR:
# bench_8b-STAGE.log (timestamped progress and build summaries) and the benchmark's JSON + markdown.
#   w4    RTN W4A16 (g128, symmetric; no calibration): decode latency, cold start, then throughput
#         128/128 while time is left              → e2e-w4-{decode,cold,throughput}.json, e2e-w4.md
#   fp8   FP8 W8A8 (dynamic): decode, throughput 128/128 and 1024/256 → e2e-fp8-decode_throughput.json, e2e-fp8.md
#   bf16  unquantized: the same as fp8                  → e2e-bf16-decode_throughput.json, e2e-bf16.md
#   overlap-bf16, overlap-fp8   the engine step (issue 12): benchmarks/profile_step.py at batch 1, 64, 256
#         with async_scheduling on and off, then decode + throughput 128/128 of both engines in one run
#                                      → profile-Q-{async,sync}.json, e2e-overlap-Q.json
#   w4-vs  gpt-fast-style int4 decode (benchmarks/gptfast_int4.py), then W4A16 and bf16 artifacts: decode and
#         throughput 128/128 of both, one run               → gptfast-int4.json, e2e-w4-vs.json
#   w4-head  gpt-fast-style int4 decode, then W4A16 with the bf16 output head (the default, lm_head ignored)
#         and with it int4 too (ignore: [], as gpt-fast does): batch-1 decode of both, one run
#                                                            → gptfast-int4.json, e2e-w4-head.json
#   decode-profile  W4A16 and FP8 artifacts: the 25 longest kernels of a decode step at batch 1 and 256,
#         then batch-1 decode of both                → kprofile-{w4a16,fp8}.json, e2e-decode-profile.json
#   prefill-host  W4A16, bf16 and FP8 W8A8: one request at a time, TTFT against the eager prefill step's kernel
#         time, and the host functions by time (benchmarks/prefill_host.py)      → prefill-host.json
#   kprofile-bf16, kprofile-fp8   the decode step's 30 longest kernels at batch 64 and 256 (profile_step
#         --top-kernels), then throughput 128/128 at max_num_seqs 256 and 1024 → kprofile-Q.json, e2e-kprofile-Q.json
#   tprofile  bf16 and FP8 W8A8: throughput 128/128 x 1000 step by step and kernel by kernel
#         (benchmarks/profile_throughput.py --kernels), FP8 also with an FP8 KV cache → tprofile.json;
#         TPROFILE_RUNS="fp8 fp8=fp8-kv@kv_cache_dtype=fp8" picks the runs (ARTIFACT[=LABEL[@OPTIONS]]),
#         TPROFILE_ARGS replaces --kernels
#   moe   Qwen3-30B-A3B-shaped (make_checkpoint.py --arch qwen3-moe, 12 of its 48 layers): bf16 and RTN
#         W4A16 (g128, symmetric, gpu layout) built side by side, then decode + throughput 128/128 of
#         each while time is left (one bench_e2e run)    → e2e-moe.json (its markdown under "table")
#   glm4-moe  GLM-4.5-Air-shaped (make_checkpoint.py --arch glm4-moe, 4 of its 46 layers; CKPT_ARGS="--layers N"):
#         bf16 and RTN W4A16 side by side, then decode + throughput 128/128 of each     → e2e-glm4-moe.json
#   moe-fp8  the same checkpoint built bf16, FP8 per channel and FP8 in 128 x 128 blocks; one bench_e2e run of the
#         three (decode, 128/128 throughput)                     → e2e-moe-fp8.json
#   moe-kernels  benchmarks/bench_moe.py: fused MoE kernel vs per-expert loops per layer (bf16, W4A16,
#         FP8; Mixtral-8x7B and Qwen3-30B-A3B expert shapes); no checkpoint → moe-kernels.{json,txt};
#         MOE_SWEEP=1 adds the tile sweep (bench_moe.py --sweep) while time is left → moe-sweep.{json,txt}
#   tp, tp-bf16   (2 GPUs) W4A16 (tp) or bf16 (tp-bf16) at tensor 1 and 2, overlapped with CUDA graphs on
#         every rank: greedy agreement, batch-1 and batch-128 decode latency, throughput 128/128 (1000
#         requests), NCCL all-reduce time per step (benchmarks/bench_parallel.py) → parallel[-bf16].json, .md
# WORK (default /tmp/llmc-bench8b) holds the checkpoint (16 GB) and artifacts; it is removed at the end.
# For a dry run on a CPU: CKPT_ARGS="--tiny" E2E_ARGS="--device cpu ..." PARALLEL_ARGS="--device cpu ..."
set -euo pipefail
stage=${1:?usage: bench_8b.sh w4|w4-vs|w4-head|decode-profile|prefill-host|fp8|bf16|moe|glm4-moe|moe-fp8|moe-kernels|tp|tp-bf16|overlap-bf16|overlap-fp8|kprofile-bf16|kprofile-fp8|tprofile [OUT_DIR]}
out=${2:-${OUT:?give OUT_DIR or set OUT}}
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/benchmarks/gpu_env.sh"
work=${WORK:-/tmp/llmc-bench8b}
limit=${STAGE_LIMIT_S:-570}  # the benchmarks stop starting new parts after this many seconds of the stage
mkdir -p "$out" "$work/recipes"
cd "$work"  # not the repository root: its ./llmc folder would shadow the package
log="$out/bench_8b-$stage.log"
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$log" >&2; }
left() { echo $((limit - SECONDS)); }

make_checkpoint() {  # extra arguments go to make_checkpoint.py (moe: --arch qwen3-moe)
  say "checkpoint: start"
  python "$repo/benchmarks/make_checkpoint.py" --out "$work/ckpt" "$@" ${CKPT_ARGS:-} 2>&1 | tee -a "$log"
  say "checkpoint: done; disk: $(df -h "$work" | tail -1)"
}

# build NAME TENSOR QUANTIZATION_YAML: the artifact in $work/NAME
build() {
  cat > "$work/recipes/${1//\//-}.yaml" <<EOF
model: $work/ckpt
output: $work/$1
dtype: bfloat16
quantization: $3
parallel: {tensor: $2}
runtime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 141}
EOF
  say "build $1: start"
  python -m llmc.cli build "$work/recipes/${1//\//-}.yaml" -q 2>&1 | grep -v '^llmc: build:' | tee -a "$log"
  say "build $1: done; $(du -sh "$work/$1" | cut -f1)"
}

# e2e NAME PARTS [extra bench_e2e flags...]: results in $out/e2e-STAGE-PARTS.json, tables appended to e2e-STAGE.md
e2e() {
  local name=$1 parts=$2 json="$out/e2e-$stage-${2//,/_}.json"
  shift 2
  say "bench_e2e $name $parts: start ($(left) s left)"
  python "$repo/benchmarks/bench_e2e.py" "$work/$name=$name" --parts "$parts" --json "$json" \
    --budget "$(left)" "$@" ${E2E_ARGS:-} 2>&1 | tee -a "$log" >&2 || say "bench_e2e $name $parts: FAILED"
  python - "$json" >> "$out/e2e-$stage.md" <<'EOF' || true
import json, sys
print(json.load(open(sys.argv[1]))["table"] + "\n")
EOF
  say "bench_e2e $name $parts: done"
}

W4='{method: rtn, bits: 4, group_size: 128, symmetric: true}'
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | paste -sd, - || true)
say "stage $stage on ${gpus:-no GPU}"
case $stage in
  w4)
    make_checkpoint
    build w4a16 1 "$W4"
    e2e w4a16 decode
    e2e w4a16 cold
    e2e w4a16 throughput --throughput 128x128:1000 --time-limit 60
    ;;
  fp8|bf16)
    make_checkpoint
    if [ "$stage" = fp8 ]; then build fp8 1 '{method: fp8}'; else build bf16 1 '{method: none}'; fi
    e2e "$stage" decode,throughput --throughput 128x128:1000,1024x256:200 --time-limit 75
    ;;
  moe)
    make_checkpoint --arch qwen3-moe
    build moe-bf16 1 '{method: none}' & build moe-w4a16 1 "$W4" & wait
    say "bench_e2e moe-bf16, moe-w4a16: start ($(left) s left)"
    python "$repo/benchmarks/bench_e2e.py" "$work/moe-bf16=moe-bf16" "$work/moe-w4a16=moe-w4a16" \
      --parts decode,throughput --throughput 128x128:1000 --time-limit 60 --json "$out/e2e-moe.json" \
      --budget "$(left)" ${E2E_ARGS:-} 2>&1 | tee -a "$log" >&2 || say "bench_e2e moe: FAILED"
    say "bench_e2e moe: done"
    ;;
  glm4-moe)
    make_checkpoint --arch glm4-moe
    # layer 0's dense down_proj has 10944 inputs, no multiple of 128: its own group size (the build's refusal says so)
    build glm4-moe-bf16 1 '{method: none}' &
    build glm4-moe-w4a16 1 "${W4%\}}, overrides: [{match: layers.0.mlp.down, group_size: 64}]}" & wait
    say "bench_e2e glm4-moe-bf16, glm4-moe-w4a16: start ($(left) s left)"
    python "$repo/benchmarks/bench_e2e.py" "$work/glm4-moe-bf16=glm4-moe-bf16" "$work/glm4-moe-w4a16=glm4-moe-w4a16" \
      --parts decode,throughput --throughput 128x128:1000 --time-limit 45 --json "$out/e2e-glm4-moe.json" \
      --budget "$(left)" ${E2E_ARGS:-} 2>&1 | tee -a "$log" >&2 || say "bench_e2e glm4-moe: FAILED"
    say "bench_e2e glm4-moe: done"
    ;;
  moe-fp8)
    make_checkpoint --arch qwen3-moe
    build moe-bf16 1 '{method: none}' & build moe-fp8 1 '{method: fp8}' & build moe-fp8-block 1 '{method: fp8, weights: block}' & wait
    say "bench_e2e moe-bf16, moe-fp8, moe-fp8-block: start ($(left) s left)"
    python "$repo/benchmarks/bench_e2e.py" "$work/moe-bf16=moe-bf16" "$work/moe-fp8=moe-fp8" "$work/moe-fp8-block=moe-fp8-block" \
      --parts decode,throughput --throughput 128x128:1000 --time-limit 60 --json "$out/e2e-moe-fp8.json" \
      --budget "$(left)" ${E2E_ARGS:-} 2>&1 | tee -a "$log" >&2 || say "bench_e2e moe-fp8: FAILED"
    say "bench_e2e moe-fp8: done"
    ;;
  moe-kernels)
    say "bench_moe: start ($(left) s left)"
    timeout "$(left)" python "$repo/benchmarks/bench_moe.py" --json "$out/moe-kernels.json" ${MOE_ARGS:-} 2>&1 \
      | tee -a "$log" | tee "$out/moe-kernels.txt" >&2 || say "bench_moe: FAILED or cut at the time limit"
    if [ -n "${MOE_SWEEP:-}" ]; then
      say "bench_moe --sweep: start ($(left) s left)"
      timeout "$(left)" python "$repo/benchmarks/bench_moe.py" --sweep --json "$out/moe-sweep.json" ${MOE_ARGS:-} 2>&1 \
        | tee -a "$log" | tee "$out/moe-sweep.txt" >&2 || say "bench_moe --sweep: FAILED or cut at the time limit"
    fi
    ;;
  tp|tp-bf16)
    make_checkpoint
    if [ "$stage" = tp ]; then q=rtn-w4; qyaml=$W4; suffix=; else q=none; qyaml='{method: none}'; suffix=-bf16; fi
    # Both builds at once (CPU-bound: serialisation, hashing); bench_parallel reuses what is in --workdir.
    build "tp/tensor1-$q" 1 "$qyaml" & build "tp/tensor2-$q" 2 "$qyaml" & wait
    say "bench_parallel $q: start ($(left) s left)"
    python "$repo/benchmarks/bench_parallel.py" --model "$work/ckpt" --quantization "$q" --workdir "$work/tp" \
      --tensor 1,2 --batch-sizes 1,128 --repeats 2 --throughput-requests 1000 --budget "$(( $(left) - 60 ))" \
      --json "$out/parallel$suffix.json" ${PARALLEL_ARGS:-} 2>&1 \
      | tee -a "$log" \
      | tee "$out/parallel$suffix.md" >&2 || say "bench_parallel: FAILED"
    ;;
  overlap-bf16|overlap-fp8)
    q=${stage#overlap-}
    make_checkpoint
    if [ "$q" = fp8 ]; then build fp8 1 '{method: fp8}'; else build bf16 1 '{method: none}'; fi
    for mode in async sync; do
      say "profile_step $q $mode: start"
      python "$repo/benchmarks/profile_step.py" "$work/$q" --batch-sizes 1,64,256 --json "$out/profile-$q-$mode.json" \
        $([ "$mode" = sync ] && echo --sync) 2>&1 | tee -a "$log" >&2 || say "profile_step $q $mode: FAILED"
    done
    say "bench_e2e $q async vs sync: start ($(left) s left)"
    python "$repo/benchmarks/bench_e2e.py" "$work/$q=$q-async" "$work/$q=$q-sync@async_scheduling=false" \
      --parts decode,throughput --throughput 128x128:1000 --time-limit 60 --json "$out/e2e-$stage.json" \
      --budget "$(left)" 2>&1 | tee -a "$log" >&2 || say "bench_e2e $q: FAILED"
    ;;
  w4-vs)
    make_checkpoint
    say "gpt-fast int4 (torch.compile + tinygemm): start"
    python "$repo/benchmarks/gptfast_int4.py" "$work/ckpt" --json "$out/gptfast-int4.json" 2>&1 | tail -3 | tee -a "$log" >&2 \
      || say "gptfast_int4: FAILED"
    build w4a16 1 "$W4" & build bf16 1 '{method: none}' & wait
    say "bench_e2e w4a16 and bf16: start ($(left) s left)"
    python "$repo/benchmarks/bench_e2e.py" "$work/w4a16=w4a16" "$work/bf16=bf16" --parts decode,throughput \
      --throughput 128x128:1000 --time-limit 60 --json "$out/e2e-w4-vs.json" --budget "$(left)" 2>&1 \
      | tee -a "$log" >&2 || say "bench_e2e w4-vs: FAILED"
    ;;
  w4-head)
    make_checkpoint
    say "gpt-fast int4 (torch.compile + tinygemm): start"
    python "$repo/benchmarks/gptfast_int4.py" "$work/ckpt" --json "$out/gptfast-int4.json" 2>&1 | tail -3 | tee -a "$log" >&2 \
      || say "gptfast_int4: FAILED"
    build w4a16 1 "$W4" & build w4a16-head 1 "${W4%\}}, ignore: []}" & wait
    say "bench_e2e w4a16 and w4a16-head: start ($(left) s left)"
    python "$repo/benchmarks/bench_e2e.py" "$work/w4a16=w4a16" "$work/w4a16-head=w4a16-head" --parts decode \
      --json "$out/e2e-w4-head.json" --budget "$(left)" 2>&1 | tee -a "$log" >&2 || say "bench_e2e w4-head: FAILED"
    ;;
  decode-profile)
    make_checkpoint
    build w4a16 1 "$W4" & build fp8 1 '{method: fp8}' & wait
    for q in w4a16 fp8; do
      say "profile_step $q top kernels: start"
      python "$repo/benchmarks/profile_step.py" "$work/$q" --batch-sizes 1,256 --top-kernels 25 \
        --json "$out/kprofile-$q.json" 2>&1 | tee -a "$log" >&2 || say "profile_step $q: FAILED"
    done
    say "bench_e2e decode: start ($(left) s left)"
    python "$repo/benchmarks/bench_e2e.py" "$work/w4a16=w4a16" "$work/fp8=fp8" --parts decode \
      --json "$out/e2e-decode-profile.json" --budget "$(left)" 2>&1 | tee -a "$log" >&2 || say "bench_e2e: FAILED"
    ;;
  prefill-host)
    make_checkpoint
    build w4a16 1 "$W4" & build fp8 1 '{method: fp8}' & build bf16 1 '{method: none}' & wait
    say "prefill_host: start ($(left) s left)"
    timeout "$(left)" python "$repo/benchmarks/prefill_host.py" "$work/w4a16=w4a16" "$work/bf16=bf16" "$work/fp8=fp8" \
      ${PREFILL_ARGS:-} --json "$out/prefill-host.json" 2>&1 | tee -a "$log" >&2 || say "prefill_host: FAILED"
    ;;
  kprofile-bf16|kprofile-fp8)
    q=${stage#kprofile-}
    make_checkpoint
    if [ "$q" = fp8 ]; then build fp8 1 '{method: fp8}'; else build bf16 1 '{method: none}'; fi
    say "profile_step $q top kernels: start"
    python "$repo/benchmarks/profile_step.py" "$work/$q" --batch-sizes 64,256 --top-kernels 30 \
      --json "$out/kprofile-$q.json" 2>&1 | tee -a "$log" >&2 || say "profile_step $q: FAILED"
    say "bench_e2e $q max_num_seqs 256 vs 1024: start ($(left) s left)"
    python "$repo/benchmarks/bench_e2e.py" "$work/$q=$q-256" "$work/$q=$q-1024@max_num_seqs=1024" \
      --parts throughput --throughput 128x128:1000 --time-limit 60 --json "$out/e2e-$stage.json" \
      --budget "$(left)" 2>&1 | tee -a "$log" >&2 || say "bench_e2e $q: FAILED"
    ;;
  tprofile)
    make_checkpoint
    runs=${TPROFILE_RUNS:-bf16 fp8 fp8=fp8-kvfp8@kv_cache_dtype=fp8}
    case " $runs" in *" bf16"*) build bf16 1 '{method: none}' & ;; esac
    case " $runs" in *" fp8"*) build fp8 1 '{method: fp8}' & ;; esac
    wait
    say "profile_throughput $runs: start ($(left) s left)"
    timeout "$(left)" python "$repo/benchmarks/profile_throughput.py" $(for r in $runs; do echo "$work/$r"; done) \
      ${TPROFILE_ARGS---kernels} --json "$out/tprofile.json" 2>&1 \
      | tee -a "$log" >&2 || say "profile_throughput: FAILED or cut at the time limit"
    ;;
  *) echo "unknown stage $stage: use w4, w4-vs, w4-head, decode-profile, fp8, bf16, moe, moe-kernels, tp, tp-bf16, overlap-bf16, overlap-fp8, kprofile-bf16, kprofile-fp8 or tprofile" >&2; exit 2 ;;
esac
say "stage $stage: done"
[ -n "${KEEP_WORK:-}" ] || rm -rf "$work"  # KEEP_WORK=1 keeps the checkpoint and artifacts
