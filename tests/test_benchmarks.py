"""The GPU benchmark scripts, exercised on a CPU with tiny sizes: make_checkpoint --tiny → build →
bench_e2e (decode, throughput; the cold-start timer on a stand-in command), bench_parallel's helpers,
bench_8b.sh's syntax. The numbers mean nothing here; the scripts must run and report."""

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.runtime.artifact import read_manifest


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory, load_benchmark):
    root = tmp_path_factory.mktemp("bench")
    result = load_benchmark("make_checkpoint").make_checkpoint(root / "ckpt", tiny=True, device="cpu")
    assert result["config"]["vocab_size"] == 1024 and result["config"]["num_hidden_layers"] == 2
    recipe = {"model": str(root / "ckpt"), "output": str(root / "w4"), "runtime": {"max_model_len": 256},
              "quantization": {"method": "rtn", "bits": 4, "group_size": 128}, "target": {"device": "cuda"}}
    build(recipe_from_dict(recipe), show_progress=False)
    return root


def test_checkpoint_tokenizer_decodes_every_id_and_build_copies_it(tiny_artifact):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_artifact / "w4" / "tokenizer"), local_files_only=True)
    assert len(tokenizer) == 1024
    assert tokenizer.encode("w5 w17 hello") == [768, 5, 17, 0]  # bos 768 (= vocab - 256), unknown words → 0
    assert all(tokenizer.decode([i], skip_special_tokens=False) for i in range(1024))
    manifest = read_manifest(tiny_artifact / "w4")
    assert manifest.model.eos_token_ids == [769, 776, 777] and manifest.model.rope_scaling["rope_type"] == "llama3"
    assert manifest.quant.modules["layers.0.attn.qkv"]["layout"] == "gpu"


def test_bench_e2e_decode_and_throughput_on_cpu(tiny_artifact, load_benchmark):
    bench = load_benchmark("bench_e2e")
    out = tiny_artifact / "e2e.json"
    assert bench.main([f"{tiny_artifact / 'w4'}=tiny", f"{tiny_artifact / 'w4'}=final@output_kind=final_only",
                       "--device", "cpu", "--parts", "decode,throughput", "--output-kind", "delta",
                       "--json", str(out), "--decode-prompt", "8", "--decode-tokens", "4", "--repeats", "1",
                       "--throughput", "8x4:6,16x2:3", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                       "--max-model-len", "64", "--num-kv-blocks", "32"]) == 0
    report = json.loads(out.read_text())
    decode = report["results"]["tiny"]["decode"]
    assert decode["ms_per_token"] > 0 and 0 < decode["roofline_fraction"]
    assert decode["weight_bytes_per_token"] > 0 and decode["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 4 * (8 + 4 / 2)
    first, second = report["results"]["tiny"]["throughput"]
    assert (first["num_requests"], first["num_finished"], first["is_truncated"]) == (6, 6, False)
    assert second["num_finished"] == 3 and first["ttft_ms"]["p50"] > 0 and first["itl_ms"]["p99"] > 0
    assert first["output_kind"] == "delta"
    final = report["results"]["final"]["throughput"][0]  # only final outputs: every token counted, no TTFT/ITL
    assert (final["output_kind"], final["num_finished"], final["ttft_ms"]) == ("final_only", 6, None)
    assert report["results"]["final"]["engine_options"] == {"output_kind": "final_only"}
    assert "| tiny | 8/4 | 6 (6) |" in report["table"]


def test_cold_start_timer_stamps_the_prompt_echo_and_the_first_token(load_benchmark):
    bench = load_benchmark("bench_e2e")
    script = "import sys, time; print('PROMPT', end='', flush=True); time.sleep(0.3); print(' tok', flush=True)"
    result = bench.time_first_output([sys.executable, "-c", script], len("PROMPT"), {}, timeout=30)
    assert result["exit_code"] == 0 and result["stdout"] == "PROMPT tok\n"
    assert result["first_token_s"] - result["ready_s"] >= 0.25


def test_bench_e2e_parses_parts_and_throughput_configs(load_benchmark):
    bench = load_benchmark("bench_e2e")
    assert bench.parse_throughput("128x128:1000,1024x256:200") == [(128, 128, 1000), (1024, 256, 200)]
    assert bench.percentiles([0.001 * i for i in range(1, 101)]) == {"p50": 51.0, "p90": 91.0, "p99": 100.0}
    with pytest.raises(SystemExit):
        bench.parse_args(["a", "--parts", "decode,speed"])
    result = {}
    bench.run_part("decode", result, lambda: 1 / 0)  # a failing part is recorded, the others still run
    assert result["decode"]["error"].startswith("ZeroDivisionError") and "failed: x decode" in bench.markdown({"x": result})


def test_bench_parallel_helpers(load_benchmark):
    bench = load_benchmark("bench_parallel")
    args = bench.parse_args(["--quantization", "rtn-w4", "--workdir", "/tmp/x"])
    assert (args.quantization, args.check_prompts, args.device) == ("rtn-w4", 8, "cuda")
    assert bench.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 7, 6]]) == {
        "identical": 1, "of": 2, "mean_common_prefix": 2.0, "tokens": 3}


def test_bench_8b_script_parses(repo_root):
    assert subprocess.run(["bash", "-n", str(repo_root / "benchmarks" / "bench_8b.sh")]).returncode == 0


@pytest.mark.slow
def test_bench_parallel_runs_tensor_2_on_cpu(tiny_artifact, load_benchmark):
    bench = load_benchmark("bench_parallel")
    out = tiny_artifact / "parallel.json"
    assert bench.main(["--device", "cpu", "--model", str(tiny_artifact / "ckpt"), "--quantization", "rtn-w4",
                       "--workdir", str(tiny_artifact / "tp"), "--batch-sizes", "1,2", "--prompt-tokens", "8",
                       "--output-tokens", "4", "--repeats", "1", "--check-prompts", "2", "--check-tokens", "4",
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tensor_sizes"]["2"]["backend"] == "ProcessGroupGloo"
    assert report["tensor_sizes"]["2"]["agreement"]["identical"] == 2
    assert {(r["tensor"], r["batch_size"]) for r in report["results"]} == {(1, 1), (1, 2), (2, 1), (2, 2)}
