"""benchmarks/memory_check.py, graphs_check.py and graphs_check_parallel.py measure on a GPU; here only that they parse and refuse a CPU."""

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("name", ["memory_check", "graphs_check", "graphs_check_parallel"])
def test_gpu_checks_parse_and_need_a_gpu(capsys, name, load_benchmark):
    bench = load_benchmark(name)
    assert bench.parse_args(["--artifact", "x", "--json", "out.json"]).artifact == "x"
    assert bench.main(["--artifact", "x"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_memory_check_passes_only_the_options_given(load_benchmark):
    bench = load_benchmark("memory_check")
    args = bench.parse_args(["--gpu-memory-utilization", "0.5", "--enforce-eager"])
    assert bench.overrides(args) == {"gpu_memory_utilization": 0.5, "enforce_eager": True}
