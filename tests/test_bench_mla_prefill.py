"""benchmarks/mla_prefill.py (it times CUDA kernels) on a CPU: its cases are the brief's (whole prompts of each
length and a 512-query chunk after 4096 cached tokens, or after each --cached count), its inputs' kv_b is W_UK's and
W_UV's rows (both forms give one attention through it), its table reads its rows, and without a GPU it says so and
stops."""

import pytest
import torch

from llmc.kernels import mla_attention


def test_the_cases_and_the_inputs(load_benchmark):
    bench = load_benchmark("mla_prefill")
    assert bench.cases([128, 512, 2048, 8192]) == [("prompt 128", 128, 128), ("prompt 512", 512, 512),
                                                  ("prompt 2048", 2048, 2048), ("prompt 8192", 8192, 8192),
                                                  ("chunk 512 after 4096", 4608, 512)]
    assert bench.cases([16384], (100000,)) == [("prompt 16384", 16384, 16384), ("chunk 512 after 100000", 100512, 512)]
    assert bench.HEADS == {"deepseek-v2-lite": 16, "deepseek-v3": 128}
    q, cache, tables, w_uk, w_uv, kv_b = bench.make_inputs(2, 40, 9, torch.Generator().manual_seed(0), device="cpu")
    assert q.shape == (9, 2, 192) and cache.shape == (4, 16, 576) and sorted(tables[0].tolist()) == [1, 2, 3]
    assert torch.equal(kv_b.view(2, 256, 512), torch.cat((w_uk, w_uv), dim=1))  # each head's k_nope rows, then v's
    q, cache, tables, w_uk, w_uv, kv_b = (t.float() if t.is_floating_point() else t for t in (q, cache, tables, w_uk,
                                                                                              w_uv, kv_b))
    expand = bench.expand_of(kv_b, 2)
    out = {form: mla_attention.mla_attention(q, cache, w_uk, w_uv, tables, torch.tensor([40]), [9], bench.SCALE,
                                             expand=expand, form=form) for form in mla_attention.FORMS}
    torch.testing.assert_close(out["expanded"], out["absorbed"], rtol=1e-4, atol=1e-5)


def test_the_table_and_the_arguments(load_benchmark):
    bench = load_benchmark("mla_prefill")
    row = {"shape": "deepseek-v3", "case": "prompt 128", "absorbed_ms": 1.5, "expanded_ms": 0.5,
           "absorbed_over_expanded": 3.0, "rule": "expanded", "relative_difference": 1e-3, "absorbed_peak_mib": 10.0,
           "expanded_peak_mib": 20.0}
    assert "| deepseek-v3 | prompt 128 | 1.500 | 0.500 | 3.00 | expanded | 1.0e-03 | 10 / 20 |" in bench.table([row])
    args = bench.parse_args(["--out", "x.json", "--lengths", "64,256", "--shapes", "deepseek-v3"])
    assert args.lengths == [64, 256] and args.shapes == ["deepseek-v3"] and args.reps == 7 and args.cached == (4096,)
    assert bench.parse_args(["--out", "x.json", "--cached", "4096,100000"]).cached == (4096, 100000)
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--shapes", "deepseek-v4"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU exit")
def test_without_a_gpu_it_stops(load_benchmark, tmp_path, capsys):
    assert load_benchmark("mla_prefill").main(["--out", str(tmp_path / "x.json")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_a_case_runs_both_forms_and_reports_them(load_benchmark, monkeypatch):
    """run_case's plumbing on a CPU (DEVICE "cpu", the CUDA timer and memory counters stood in): both forms through
    mla_attention on the same inputs, their relative difference small (bf16), the rule's pick, a row the table
    prints."""
    import llmc.kernels.mla_attention as mla_attention
    import llmc.kernels.timing as timing

    bench = load_benchmark("mla_prefill")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(mla_attention, "CUDA_EXPAND_MIN_WORK", 0)  # (a 130-token prompt expands by the other bounds)
    monkeypatch.setattr(timing, "median_time_ms", lambda fn, flush, **kwargs: fn() is not None and 1.0)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *args: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 2**20)
    rows = [{"shape": "deepseek-v2-lite", "case": "prompt 130", **bench.run_case(16, 130, 130, 1, None,
                                                                                 torch.Generator().manual_seed(0))},
            {"shape": "deepseek-v3", "case": "chunk", **bench.run_case(128, 40, 8, 1, None,
                                                                       torch.Generator().manual_seed(1))}]
    assert [(r["rule"], r["absorbed_ms"], r["expanded_ms"], r["expanded_peak_mib"]) for r in rows] == [
        ("expanded", 1.0, 1.0, 1.0), ("absorbed", 1.0, 1.0, 1.0)]
    assert all(r["relative_difference"] < 2e-2 for r in rows)
    assert "| deepseek-v3 | chunk | 1.000 | 1.000 | 1.00 | absorbed |" in bench.table(rows)
