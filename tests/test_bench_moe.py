"""benchmarks/bench_moe.py on the CPU (--smoke): every kind's fused path agrees with its per-expert
loop (the script asserts it) and each row reports its times; --sweep times every candidate tile."""

import torch


def test_bench_moe_smoke_reports_every_kind(tmp_path, load_benchmark):
    bench = load_benchmark("bench_moe")
    rows = bench.main(["--smoke", "--json", str(tmp_path / "moe.json")])
    assert {(r["kind"], r["M"]) for r in rows} == {(k, m) for k in bench.KINDS for m in bench.SMOKE_BATCHES}
    assert all(r["fused_us"] > 0 and r["loop_us"] > 0 and r["bf16_loop_us"] > 0 and r["config"]["chosen"] for r in rows)
    assert (tmp_path / "moe.json").exists()
    sweep = bench.main(["--smoke", "--sweep", "--kinds", "w4a16", "--batches", "1"])
    chosen = [r for r in sweep if r["config"]["chosen"]]
    table_choice = bench.MoeConfig(**{k: v for k, v in chosen[0]["config"].items() if k != "chosen"})
    assert len(chosen) == 1 and chosen[0]["loop_us"] > 0 and len(sweep) == len(set(bench.SWEEP) | {table_choice})


def test_bench_moe_w4a16_packing_round_trips_to_rtn_weights(load_benchmark):
    """The benchmark's W4A16 experts are RTN g128 of its bf16 ones (so the rows compare like with like)."""
    from llmc.kernels.w4a16_gemm import dequantize_w4a16

    bench = load_benchmark("bench_moe")
    w = 0.02 * torch.randn(2, 64, 256)
    packed = bench._w4a16(w)
    for e in range(2):
        dequantized = dequantize_w4a16({k: v[e] for k, v in packed.items()}, 256, 128)
        step = w[e].abs().unflatten(1, (-1, 128)).amax(dim=2) / 7.5  # [N, G]
        assert ((dequantized - w[e]).abs().unflatten(1, (-1, 128)) <= step[:, :, None] / 2 + 1e-7).all()


def test_moe_checkpoints_load_in_transformers_and_build(tmp_path, load_benchmark):
    """--arch qwen3-moe / mixtral / deepseek-v2-lite / glm4-moe / ernie4_5-moe / llama4 / minimax-m2 --tiny:
    transformers finds every tensor it expects and no other; `llmc build` ingests the Qwen3-MoE, GLM-4.5, ERNIE 4.5
    MoE and MiniMax-M2 ones with their router settings."""
    import transformers

    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict
    from llmc.runtime.artifact import read_manifest

    make = load_benchmark("make_checkpoint")
    published = make.make_config(None, False, "qwen3-moe")
    assert (published["hidden_size"], published["num_local_experts"], published["num_experts_per_tok"],
            published["moe_intermediate_size"], published["num_hidden_layers"]) == (2048, 128, 8, 768, 12)
    for arch in ("qwen3-moe", "mixtral", "deepseek-v2-lite", "glm4-moe", "ernie4_5-moe", "llama4", "minimax-m2"):
        make.make_checkpoint(tmp_path / arch, tiny=True, device="cpu", arch=arch)
        _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / arch, output_loading_info=True)
        assert not any(info.values()), (arch, info)
    recipe = {"model": str(tmp_path / "qwen3-moe"), "output": str(tmp_path / "bf16"), "runtime": {"max_model_len": 64}}
    build(recipe_from_dict(recipe), show_progress=False)
    model = read_manifest(tmp_path / "bf16").model
    assert (model.num_experts, model.num_experts_per_tok, model.norm_topk_prob, model.moe_layers) == (8, 2, True, [0, 1])
    build(recipe_from_dict({**recipe, "model": str(tmp_path / "glm4-moe"), "output": str(tmp_path / "glm")}),
          show_progress=False)
    model = read_manifest(tmp_path / "glm").model
    assert (model.family, model.num_experts, model.moe_layers, model.router_scoring, model.rotary_dims,
            model.shared_expert_intermediate_size) == ("glm4_moe", 8, [1], "sigmoid", 32, 128)
    build(recipe_from_dict({**recipe, "model": str(tmp_path / "ernie4_5-moe"), "output": str(tmp_path / "ernie")}),
          show_progress=False)
    model = read_manifest(tmp_path / "ernie").model
    assert (model.family, model.num_experts, model.moe_layers, model.router_score_bias, model.rotary_interleaved,
            model.shared_expert_intermediate_size, model.tie_word_embeddings) == ("ernie4_5_moe", 8, [1], True, True,
                                                                                   256, True)
    build(recipe_from_dict({**recipe, "model": str(tmp_path / "minimax-m2"), "output": str(tmp_path / "m2")}),
          show_progress=False)
    model = read_manifest(tmp_path / "m2").model
    assert (model.family, model.num_experts, model.moe_layers, model.router_scoring, model.rotary_dims,
            model.qk_norm_full_width) == ("minimax_m2", 8, [0, 1], "sigmoid", 32, True)
