"""Tensor/pipeline sharding at build time: each rank's file holds exactly its slice of the HF tensors;
splits that cannot work are refused naming what to change."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.compiler.shard import balance_stages
from llmc.errors import RecipeError
from llmc.runtime.artifact import read_manifest, read_safetensors_header

HEAD_DIM = 64  # ref-llama-12m: 6 heads, 2 KV heads, hidden 384, intermediate 1024, 6 layers, vocab 4096


def _build(model: Path, out: Path, tensor: int = 1, pipeline: int = 1, **extra) -> Path:
    recipe = {"model": str(model), "output": str(out), "dtype": "float32", "runtime": {"max_model_len": 256},
              "parallel": {"tensor": tensor, "pipeline": pipeline}, **extra}
    build(recipe_from_dict(recipe), show_progress=False)
    return out


def _hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors |= {name: f.get_tensor(name).float() for name in f.keys()}
    return tensors


def _expected_rank_tensors(hf: dict, tp: int, tensor: int, layers: list[int], *, num_heads: int, num_kv_heads: int,
                           head_dim: int, first: bool, last: bool, vocab_rows: int) -> dict[str, torch.Tensor]:
    """A rank's tensors by slicing the HF checkpoint directly (independently of compiler/shard.py)."""
    heads, inter = num_heads // tensor, hf["model.layers.0.mlp.gate_proj.weight"].shape[0] // tensor
    kv_heads = max(1, num_kv_heads // tensor)
    kv_first = tp * kv_heads if num_kv_heads >= tensor else tp // (tensor // num_kv_heads)
    q_rows = slice(tp * heads * head_dim, (tp + 1) * heads * head_dim)
    kv_rows = slice(kv_first * head_dim, (kv_first + kv_heads) * head_dim)
    i_rows = slice(tp * inter, (tp + 1) * inter)
    out = {}
    for i in layers:
        p = f"model.layers.{i}."
        out[f"layers.{i}.attn.qkv.weight"] = torch.cat([hf[p + "self_attn.q_proj.weight"][q_rows],
                                                        hf[p + "self_attn.k_proj.weight"][kv_rows],
                                                        hf[p + "self_attn.v_proj.weight"][kv_rows]])
        out[f"layers.{i}.attn.o.weight"] = hf[p + "self_attn.o_proj.weight"][:, q_rows]
        out[f"layers.{i}.mlp.gate_up.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"][i_rows],
                                                           hf[p + "mlp.up_proj.weight"][i_rows]])
        out[f"layers.{i}.mlp.down.weight"] = hf[p + "mlp.down_proj.weight"][:, i_rows]
        out[f"layers.{i}.input_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[f"layers.{i}.post_attn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
    vocab = slice(tp * vocab_rows, (tp + 1) * vocab_rows)
    if first:
        out["embed.weight"] = hf["model.embed_tokens.weight"][vocab]
    if last:
        out["norm.weight"] = hf["model.norm.weight"]
        out["lm_head.weight"] = hf["lm_head.weight"][vocab]
    return out


def test_each_rank_file_holds_exactly_its_shard(ref_model_dir, tmp_path):
    artifact = _build(ref_model_dir, tmp_path / "t2p2", tensor=2, pipeline=2)
    manifest = read_manifest(artifact)
    plan = manifest.parallel
    assert (plan.tensor, plan.pipeline, plan.stage_layers) == (2, 2, [[0, 1, 2], [3, 4, 5]])
    assert (plan.num_heads_per_rank, plan.num_kv_heads_per_rank, plan.intermediate_size_per_rank,
            plan.vocab_size_per_rank) == (3, 1, 512, 2048)
    hf = _hf_tensors(ref_model_dir)
    total_bytes = 0
    for rank in range(4):
        stage, tp = divmod(rank, 2)
        path = artifact / f"rank-{rank:02d}" / "weights.safetensors"
        got = load_file(path)
        want = _expected_rank_tensors(hf, tp, 2, plan.stage_layers[stage], num_heads=6, num_kv_heads=2,
                                      head_dim=HEAD_DIM, first=stage == 0, last=stage == 1, vocab_rows=2048)
        assert sorted(got) == sorted(want), rank
        for name, tensor in want.items():
            assert got[name].shape == tensor.shape, (rank, name)
            assert torch.equal(got[name], tensor), (rank, name)
        data_bytes = sum(end - start for start, end in (e["data_offsets"] for e in read_safetensors_header(path).values()))
        assert data_bytes == sum(t.numel() * 4 for t in want.values())
        assert manifest.plan.weight_bytes_per_rank[rank] == path.stat().st_size
        total_bytes += data_bytes
    # Everything once, except the norms, which each tensor rank of a stage holds whole.
    norm_bytes = sum(t.numel() * 4 for name, t in hf.items() if "norm" in name)
    assert total_bytes == sum(t.numel() * 4 for t in hf.values()) + norm_bytes


def test_kv_heads_are_replicated_when_tensor_exceeds_them_and_vocab_is_padded(hf_checkpoint_factory, tmp_path):
    # 4 heads, 2 KV heads, vocab 4099: tensor 4 gives each rank one query head and a copy of the KV
    # head it reads, and 1025 vocabulary rows (the last rank's last 1 row is zero padding).
    checkpoint = hf_checkpoint_factory(tmp_path / "ckpt", "llama", vocab_size=4099)
    artifact = _build(checkpoint, tmp_path / "t4", tensor=4)
    plan = read_manifest(artifact).parallel
    assert (plan.num_heads_per_rank, plan.num_kv_heads_per_rank, plan.vocab_size_per_rank) == (1, 1, 1025)
    hf = _hf_tensors(checkpoint)
    padded = {name: torch.cat([hf[name], hf[name].new_zeros(1, hf[name].shape[1])])
              for name in ("model.embed_tokens.weight", "lm_head.weight")}
    for rank in range(4):
        got = load_file(artifact / f"rank-{rank:02d}" / "weights.safetensors")
        want = _expected_rank_tensors(hf | padded, rank, 4, [0, 1], num_heads=4, num_kv_heads=2, head_dim=16,
                                      first=True, last=True, vocab_rows=1025)
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (rank, name)


def test_quantized_shards_are_slices_of_the_one_rank_build_on_group_boundaries(ref_model_dir, tmp_path):
    # Quantized whole, split before packing: rank t's packed tensors are exactly the 1-rank build's
    # rows (column-parallel) or its words and groups (row-parallel: 192 columns = 24 int32 words of
    # 8 levels, 6 groups of 32). A cpu target keeps the plain layout (words along the input dimension).
    quant = {"quantization": {"method": "rtn", "bits": 4, "group_size": 32}, "target": {"device": "cpu"}}
    one = load_file(_build(ref_model_dir, tmp_path / "t1", **quant) / "rank-00" / "weights.safetensors")
    artifact = _build(ref_model_dir, tmp_path / "t2", tensor=2, **quant)
    for tp in range(2):
        got = load_file(artifact / f"rank-{tp:02d}" / "weights.safetensors")
        qkv_rows = torch.cat([torch.arange(192 * tp, 192 * (tp + 1)), 384 + torch.arange(64 * tp, 64 * (tp + 1)),
                              512 + torch.arange(64 * tp, 64 * (tp + 1))])
        mlp_rows = torch.cat([torch.arange(512 * tp, 512 * (tp + 1)), 1024 + torch.arange(512 * tp, 512 * (tp + 1))])
        for i in range(6):
            p = f"layers.{i}."
            for param in ("qweight", "scales"):
                assert torch.equal(got[p + f"attn.qkv.{param}"], one[p + f"attn.qkv.{param}"][qkv_rows])
                assert torch.equal(got[p + f"mlp.gate_up.{param}"], one[p + f"mlp.gate_up.{param}"][mlp_rows])
            assert torch.equal(got[p + "attn.o.qweight"], one[p + "attn.o.qweight"][:, 24 * tp : 24 * (tp + 1)])
            assert torch.equal(got[p + "attn.o.scales"], one[p + "attn.o.scales"][:, 6 * tp : 6 * (tp + 1)])
            assert torch.equal(got[p + "mlp.down.qweight"], one[p + "mlp.down.qweight"][:, 64 * tp : 64 * (tp + 1)])
            assert torch.equal(got[p + "mlp.down.scales"], one[p + "mlp.down.scales"][:, 16 * tp : 16 * (tp + 1)])


def test_cuda_target_packs_4_bit_weights_in_the_gpu_layout_with_the_same_levels(ref_model_dir, tmp_path):
    # The Triton W4A16 GEMM reads the "gpu" layout: a cuda-target build must emit it (else the GPU
    # dequantizes every weight at every step), with the same levels and scales as the cpu-target build,
    # per rank too (each rank packs its own slice).
    from llmc.kernels.w4a16_gemm import unpack_w4a16_from_gpu
    from llmc.quant.packing import unpack_words

    quant = {"quantization": {"method": "rtn", "bits": 4, "group_size": 32}}
    plain = load_file(_build(ref_model_dir, tmp_path / "cpu", target={"device": "cpu"}, **quant) / "rank-00" / "weights.safetensors")
    artifact = _build(ref_model_dir, tmp_path / "cuda", tensor=2, target={"device": "cuda"}, **quant)
    modules = read_manifest(artifact).quant.modules
    assert modules["layers.0.mlp.down"]["layout"] == "gpu" and modules["lm_head"]["format"] == "dense"
    for tp in range(2):
        got = load_file(artifact / f"rank-{tp:02d}" / "weights.safetensors")
        for name, in_features, columns in [("attn.o", 384, slice(192 * tp, 192 * (tp + 1))),
                                           ("mlp.down", 1024, slice(512 * tp, 512 * (tp + 1)))]:
            p = f"layers.3.{name}."
            levels, scales, zeros = unpack_w4a16_from_gpu({"qweight": got[p + "qweight"], "scales": got[p + "scales"]},
                                                           in_features // 2)
            want = unpack_words(plain[p + "qweight"], 4, dim=1, size=in_features)[:, columns]
            assert zeros is None and torch.equal(levels, want)
            assert torch.equal(scales, plain[p + "scales"][:, columns.start // 32 : columns.stop // 32])


@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 3, "group_size": 64, "symmetric": False},  # 10 levels per word, zero points
    {"method": "fp8", "weights": "per_tensor"},  # one scale for the whole (fused) weight
    {"method": "fp8", "weights": "per_channel"},
], ids=["w3a16-asym", "fp8-per-tensor", "fp8-per-channel"])
def test_every_format_splits_into_slices_of_the_one_rank_weights(ref_model_dir, tmp_path, quantization):
    from llmc.quant.formats import make_format
    from llmc.quant.reference import dequantize

    def weights(artifact: Path, rank: int, tensor: int) -> dict[str, torch.Tensor]:
        """Dequantized [out, in] weight of every layer linear in a rank's file."""
        manifest = read_manifest(artifact)
        tensors = load_file(artifact / f"rank-{rank:02d}" / "weights.safetensors")
        out = {}
        for module, spec in manifest.quant.modules.items():
            params = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}
            if params and module.startswith("layers."):
                in_features = 384 if module.endswith(("qkv", "gate_up")) else (384 if module.endswith(".o") else 1024) // tensor
                out[module] = dequantize(make_format(spec, torch.float32), params, in_features)
        return out

    one = weights(_build(ref_model_dir, tmp_path / "t1", quantization=quantization), 0, 1)
    artifact = _build(ref_model_dir, tmp_path / "t2", tensor=2, quantization=quantization)
    for tp in range(2):
        got = weights(artifact, tp, 2)
        qkv_rows = torch.cat([torch.arange(192 * tp, 192 * (tp + 1)), 384 + torch.arange(64 * tp, 64 * (tp + 1)),
                              512 + torch.arange(64 * tp, 64 * (tp + 1))])
        mlp_rows = torch.cat([torch.arange(512 * tp, 512 * (tp + 1)), 1024 + torch.arange(512 * tp, 512 * (tp + 1))])
        for i in range(6):
            p = f"layers.{i}."
            assert torch.equal(got[p + "attn.qkv"], one[p + "attn.qkv"][qkv_rows])
            assert torch.equal(got[p + "mlp.gate_up"], one[p + "mlp.gate_up"][mlp_rows])
            assert torch.equal(got[p + "attn.o"], one[p + "attn.o"][:, 192 * tp : 192 * (tp + 1)])
            assert torch.equal(got[p + "mlp.down"], one[p + "mlp.down"][:, 512 * tp : 512 * (tp + 1)])


def test_a_split_that_cuts_a_quantization_group_is_refused_naming_the_layer(ref_model_dir, tmp_path):
    # o's 384 input features split in two are 192 per rank: not a multiple of 128.
    out = tmp_path / "refused"
    with pytest.raises(RecipeError) as err:
        _build(ref_model_dir, out, tensor=2, quantization={"method": "rtn", "bits": 4, "group_size": 128})
    message = str(err.value)
    assert "layers.0.attn.o" in message and "192" in message and "group_size 128" in message, message
    assert "valid tensor sizes for this model and quantization: 1" in message, message
    assert not out.exists()


@pytest.mark.parametrize(("parallel", "words"), [
    ({"tensor": 4}, ["parallel.tensor", "4 does not divide the model's 6 attention heads", "valid tensor sizes", "1, 2"]),
    ({"pipeline": 7}, ["parallel.pipeline", "7 stages for 6 layers", "at most 6"]),
])
def test_impossible_splits_are_refused(ref_model_dir, tmp_path, parallel, words):
    with pytest.raises(RecipeError) as err:
        _build(ref_model_dir, tmp_path / "refused", **parallel)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_stages_balance_parameter_bytes(ref_model_dir):
    from llmc.compiler import hf_checkpoint as hf

    hf_config = hf.read_hf_config(ref_model_dir)
    config = hf.model_config_from_hf(hf_config, hf.model_spec_for(hf_config, ref_model_dir), "float32")
    layer = [(f"layers.{i}.w", 100) for i in range(6)]
    # A heavy embedding pushes layers to the last stage; a heavy lm_head pulls them to the first.
    assert balance_stages(config, layer + [("embed.weight", 250), ("lm_head.weight", 0)], 2) == [[0, 1], [2, 3, 4, 5]]
    assert balance_stages(config, layer + [("embed.weight", 450), ("lm_head.weight", 0)], 2) == [[0], [1, 2, 3, 4, 5]]
    assert balance_stages(config, layer + [("embed.weight", 0), ("lm_head.weight", 450)], 2) == [[0, 1, 2, 3, 4], [5]]
    assert balance_stages(config, layer + [("embed.weight", 0), ("lm_head.weight", 0)], 3) == [[0, 1], [2, 3], [4, 5]]
    assert balance_stages(config, layer, 6) == [[i] for i in range(6)]
