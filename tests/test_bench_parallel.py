"""benchmarks/bench_parallel.py needs 2 GPUs to measure; here only that it parses and refuses a CPU."""

import torch


def test_bench_parallel_parses_and_needs_gpus(capsys, load_benchmark):
    bench = load_benchmark("bench_parallel")
    args = bench.parse_args(["--tensor", "1,2", "--batch-sizes", "1,4"])
    assert (args.tensor, args.batch_sizes, args.output_tokens) == ("1,2", "1,4", 128)
    if torch.cuda.device_count() < 2:
        assert bench.main(["--tensor", "1,2"]) == 2
        assert "needs 2 CUDA GPUs" in capsys.readouterr().err
