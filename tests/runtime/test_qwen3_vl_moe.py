"""Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration): a tiny random float32 checkpoint (dense Qwen3-VL's tower of
tests/runtime/test_qwen3_vl.py, deepstack mergers after tower layers 0 and 1; a Qwen3-MoE text model of 3 layers,
layers 0 and 1 sparse with 4 experts top-2 of width 96, layer 2 dense by mlp_only_layers) built and run against
transformers' own Qwen3VLMoeForConditionalGeneration.generate: greedy tokens and their logprobs for an image prompt, a
two-image prompt and a text prompt in one batch, chunked prefill ending inside an image, a video beside an image,
chat image_url parts; the
published on-disk layout of the fused experts (transposed from what transformers 5's save_pretrained writes) building
the same artifact, also where one tensor's shape fits both layouts; W4 builds against transformers holding their
dequantized weights; what is refused."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError
from llmc.runtime import artifact as art
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import build_float32
from tests.runtime.test_llava import image
from tests.runtime.test_qwen2_vl import PROMPT, TALL, TWO, WIDE, hf_generate, qwen_vl_tokenizer, save_qwen_vl
from tests.runtime.test_qwen3_vl import SECTION
from tests.runtime.vision_oracle import (check_chat_image_parts, check_chunked_image_prefill, check_output,
                                         hf_greedy_with_logprobs)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
EXPERTS, WIDTH, HIDDEN = 4, 96, 64


def make_qwen3_vl_moe_checkpoint(path, seed: int = 0, **text_changes):
    """A tiny random float32 Qwen3-VL-MoE as transformers 5's save_pretrained writes it, with the reference tokenizer
    plus the vision tokens, the PIL image processor's files (patch 8, merge 2, temporal patch 2) and a chat
    template."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    tokenizer, (start, end, pad, video) = qwen_vl_tokenizer(path)
    text = dict(vocab_size=4160, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=WIDTH,
                num_experts=EXPERTS, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[2],
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTION,
                                 "mrope_interleaved": True}) | text_changes
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=8, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1])
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, vision_start_token_id=start,
                              vision_end_token_id=end, image_token_id=pad, video_token_id=video,
                              tie_word_embeddings=False)
    model = Qwen3VLMoeForConditionalGeneration(config).eval()
    return save_qwen_vl(model, tokenizer, path, seed, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def published_layout(checkpoint, path):
    """`checkpoint` copied to `path` as Qwen/Qwen3-VL-30B-A3B-Instruct's files are written: its fused experts in
    transformers 4.57's bmm layout (gate_up_proj [E, hidden, 2 * width], down_proj [E, width, hidden]), and its
    config.json's form (text_config's rope_scaling and rope_theta, num_experts, norm_topk_prob true; the tower's
    model_type qwen3_vl_moe)."""
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    rope = text.pop("rope_parameters")
    text.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, num_experts=text.pop("num_local_experts"),
                norm_topk_prob=True)
    config["vision_config"]["model_type"] = "qwen3_vl_moe"
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")
    save_file({name: t.transpose(1, 2).contiguous() if ".mlp.experts." in name else t
               for name, t in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen3_vl_moe_checkpoint(tmp_path_factory.mktemp("qwen3_vl_moe") / "hf")


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    return build_float32(checkpoint, tmp_path_factory.mktemp("qwen3-vl-moe-art") / "a", target={"device": "cpu"})


def load_hf(checkpoint):
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLMoeForConditionalGeneration

    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(str(checkpoint)), AutoImageProcessor.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


def test_build_reads_the_language_model_as_qwen3_moe(artifact, checkpoint):
    """The language model is Qwen3MoeForCausalLM's (layers 0 and 1 sparse, layer 2 dense, renormalised top-2), its
    experts the slices of the fused tensors (gate the first moe_intermediate_size rows of transformers' gate_up_proj,
    up the rest); the vision section is dense Qwen3-VL's."""
    manifest = art.read_manifest(artifact)
    model = manifest.model
    assert (model.architecture, model.family, model.qk_norm) == ("Qwen3MoeForCausalLM", "qwen3_moe", True)
    assert (model.moe_layers, model.num_experts, model.num_experts_per_tok, model.moe_intermediate_size,
            model.norm_topk_prob) == ([0, 1], EXPERTS, 2, WIDTH, True)
    assert manifest.vision.architecture == "Qwen3VLForConditionalGeneration" and manifest.vision.mrope_interleaved
    ours = load_file(artifact / "rank-00/weights.safetensors")
    theirs = load_file(checkpoint / "model.safetensors")
    hf_layer = "model.language_model.layers.1.mlp."
    assert torch.equal(ours["layers.1.moe.experts.gate_up.weight"], theirs[hf_layer + "experts.gate_up_proj"])
    assert torch.equal(ours["layers.1.moe.experts.down.weight"], theirs[hf_layer + "experts.down_proj"])
    assert torch.equal(ours["layers.1.moe.gate.weight"], theirs[hf_layer + "gate.weight"])
    assert "layers.2.mlp.gate_up.weight" in ours and "layers.2.moe.gate.weight" not in ours


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_with_images_and_text_in_one_batch_matches_transformers(artifact, hf, device):
    """An image prompt, a prompt with two images of different sizes and a text-only prompt in one batch: transformers'
    prompt ids, greedy tokens and their logprobs (the image tokens routed through the experts with their deepstack
    rows added after decoder layers 0 and 1; on CUDA through the fused MoE kernel)."""
    atol = 2e-4 if device == "cpu" else 2e-3
    first, second = image(1, size=WIDE), image(2, size=TALL)
    plain_ids = hf[1]("User:Hello there.")["input_ids"]
    expected = [hf_generate(hf, PROMPT, [first]), hf_generate(hf, TWO, [first, second]),
                hf_generate(hf, plain_ids, None)]
    llm = LLM(artifact, device=device, max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64, block_size=8,
              gpu_memory_utilization=0.3)
    outputs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": first}},
                            {"prompt": TWO, "multi_modal_data": {"image": [first, second]}},
                            {"prompt_token_ids": plain_ids}], GREEDY)
    for output, want in zip(outputs, expected, strict=True):
        check_output(output, want, atol)
    if device == "cpu":  # (its logprobs at the CPU's tolerance)
        check_chat_image_parts(llm, GREEDY, second, "Describe it.", hf_generate(hf, PROMPT, [second]))


def test_a_video_beside_an_image_matches_transformers(artifact, hf, monkeypatch):
    """Qwen3-VL's videos run the same (the vision section is dense Qwen3-VL's): a 5-frame video with vLLM's metadata
    beside an image, 8 tokens a step (chunks ending inside the video), against transformers' generate with
    pixel_values_videos (tests/runtime/test_qwen3_vl_video.py's reference, timestamps and all)."""
    from tests.runtime.test_qwen2_vl_video import frames
    from tests.runtime.test_qwen3_vl_video import BOTH, METADATA, hf_video_inputs

    picture, clip = image(6, size=WIDE), frames(8, count=5, height=48)
    inputs = hf_video_inputs(hf, BOTH, [picture], [(clip, METADATA["fps"], METADATA["frames_indices"])])
    expected = hf_greedy_with_logprobs(hf[0], inputs, GREEDY.max_tokens)
    check_chunked_image_prefill(artifact, monkeypatch, GREEDY,
                                [{"prompt": BOTH, "multi_modal_data": {"image": picture, "video": (clip, METADATA)}}],
                                [expected])


def test_chunked_prefill_ends_inside_an_image(artifact, hf, monkeypatch):
    """8 tokens a step: the images (12 tokens each) are split across chunks, and the replies are transformers'."""
    pictures = [image(4, size=WIDE), image(5, size=TALL)]
    expected = [hf_generate(hf, TWO, pictures), hf_generate(hf, PROMPT, pictures[1:])]
    check_chunked_image_prefill(artifact, monkeypatch, GREEDY,
                                [{"prompt": TWO, "multi_modal_data": {"image": pictures}},
                                 {"prompt": PROMPT, "multi_modal_data": {"image": pictures[1]}}], expected)


def test_the_published_layout_builds_the_same_artifact(checkpoint, artifact, tmp_path):
    """The fused experts and config.json as the published checkpoints store them (the experts transposed from
    save_pretrained's): transformers reads them back to its own weights (so this is the layout it converts on load),
    and the build writes the same artifact and manifest as from save_pretrained's."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    published = published_layout(checkpoint, tmp_path / "published")
    stored = load_file(published / "model.safetensors")["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert stored.shape == (EXPERTS, HIDDEN, 2 * WIDTH)
    loaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(published), dtype=torch.float32).state_dict()
    for name, tensor in load_file(checkpoint / "model.safetensors").items():
        assert torch.equal(loaded[name], tensor), name
    other = build_float32(published, tmp_path / "a", target={"device": "cpu"})
    for rel in ("rank-00/weights.safetensors", art.VISION_WEIGHTS):
        a, b = load_file(artifact / rel), load_file(other / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ours, theirs = art.read_manifest(artifact), art.read_manifest(other)
    assert ours.vision == theirs.vision and ours.model == theirs.model



@pytest.mark.parametrize("width", [HIDDEN // 2, HIDDEN], ids=["gate_up-square", "down-square"])
def test_a_layout_one_tensor_cannot_tell_is_told_by_the_other(checkpoint, tmp_path, width):
    """moe_intermediate_size hidden / 2 (gate_up_proj's shape fits both layouts) and hidden (down_proj's does): new
    random experts of that width, written in save_pretrained's layout and transposed as the published files store
    them, build the same artifact; its experts are save_pretrained's tensors (gate the first rows of gate_up).
    (transformers 5 itself, which tells the layouts apart per tensor by shape, would load such a published tensor
    untransposed.)"""
    gen = torch.Generator().manual_seed(width)
    built = []
    for published in (False, True):
        path = tmp_path / f"p{int(published)}"
        shutil.copytree(checkpoint, path)
        config = json.loads((path / "config.json").read_text())
        config["text_config"]["moe_intermediate_size"] = width
        (path / "config.json").write_text(json.dumps(config))
        tensors = load_file(path / "model.safetensors")
        for i in (0, 1):
            gen.manual_seed(width + i)
            layer = f"model.language_model.layers.{i}.mlp.experts."
            experts = {layer + "gate_up_proj": torch.randn(EXPERTS, 2 * width, HIDDEN, generator=gen) * 0.1,
                       layer + "down_proj": torch.randn(EXPERTS, HIDDEN, width, generator=gen) * 0.1}
            tensors |= {n: t.transpose(1, 2).contiguous() if published else t for n, t in experts.items()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        built.append(load_file(build_float32(path, tmp_path / f"a{int(published)}") / "rank-00/weights.safetensors"))
        if not published:
            expected = experts
    assert built[0].keys() == built[1].keys() and all(torch.equal(built[0][k], built[1][k]) for k in built[0])
    assert torch.equal(built[1]["layers.1.moe.experts.gate_up.weight"], expected[layer + "gate_up_proj"])
    assert torch.equal(built[1]["layers.1.moe.experts.down.weight"], expected[layer + "down_proj"])

def dequantized_language_state(artifact) -> dict[str, torch.Tensor]:
    """A W4 artifact's language model as transformers' Qwen3VLMoeForConditionalGeneration state dict (experts stacked
    as it holds them in memory: gate_up_proj [E, 2 * width, hidden], down_proj [E, hidden, width]), every linear
    dequantized by the formats' oracle (quant/reference.py)."""
    from llmc.quant.formats import make_format
    from llmc.quant.reference import dequantize

    manifest = json.loads((artifact / "manifest.json").read_text())
    model, modules = manifest["model"], manifest["quant"]["modules"]
    tensors = load_file(artifact / "rank-00" / "weights.safetensors")

    def weight(name: str, expert: int | None = None) -> torch.Tensor:
        params = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}
        if expert is not None:
            params = {k: v[expert] for k, v in params.items()}
        return dequantize(make_format(modules[name], torch.float32), params).float()

    lm = "model.language_model."
    state = {lm + "embed_tokens.weight": tensors["embed.weight"], "lm_head.weight": tensors["lm_head.weight"],
             lm + "norm.weight": tensors["norm.weight"]}
    q, kv = model["num_heads"] * model["head_dim"], model["num_kv_heads"] * model["head_dim"]
    norms = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm", "moe.gate": "mlp.gate",
             "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
    for i in range(model["num_layers"]):
        hf, ours = f"{lm}layers.{i}.", f"layers.{i}."
        wq, wk, wv = weight(ours + "attn.qkv").split([q, kv, kv])
        state |= {hf + "self_attn.q_proj.weight": wq, hf + "self_attn.k_proj.weight": wk,
                  hf + "self_attn.v_proj.weight": wv, hf + "self_attn.o_proj.weight": weight(ours + "attn.o")}
        state |= {f"{hf}{theirs}.weight": tensors[f"{ours}{name}.weight"] for name, theirs in norms.items()
                  if f"{ours}{name}.weight" in tensors}
        if i in model["moe_layers"]:
            experts = range(model["num_experts"])
            state[hf + "mlp.experts.gate_up_proj"] = torch.stack([weight(ours + "moe.experts.gate_up", e)
                                                                  for e in experts])
            state[hf + "mlp.experts.down_proj"] = torch.stack([weight(ours + "moe.experts.down", e) for e in experts])
        else:
            gate, up = weight(ours + "mlp.gate_up").chunk(2)
            state |= {hf + "mlp.gate_proj.weight": gate, hf + "mlp.up_proj.weight": up,
                      hf + "mlp.down_proj.weight": weight(ours + "mlp.down")}
    return {name: tensor.float() for name, tensor in state.items()}


@torch.inference_mode()
@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 4, "group_size": 32},
    {"method": "gptq", "bits": 4, "group_size": 32},
    pytest.param({"method": "awq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),
], ids=["rtn-w4", "gptq-w4", "awq-w4"])
def test_a_w4_build_runs_transformers_on_its_weights(quantization, checkpoint, hf, tmp_path, data_dir):
    """A W4 build from the published layout (every language-model linear and expert quantized; the tower exact):
    with an image, its greedy tokens and logprobs are transformers' holding its dequantized weights (2e-4); each
    dequantized expert is within 0.3 (relative norm of the difference) of the checkpoint's, but not of another
    expert's nor with gate and up swapped; with two experts of layer 1 swapped in transformers' copy (an expert
    mis-mapped), the replies are not the artifact's."""
    from tests.runtime.hf_oracle import build_quantized

    published = published_layout(checkpoint, tmp_path / "published")
    out = build_quantized(published, tmp_path, data_dir, quantization)
    modules = art.read_manifest(out).quant.modules
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in
            ((0, "attn.qkv"), (1, "moe.experts.gate_up"), (1, "moe.experts.down"), (2, "mlp.down"))} == {"w4a16"}
    oracle, tokenizer, processor = load_hf(checkpoint)
    state = dequantized_language_state(out)
    missing, unexpected = oracle.load_state_dict(state, strict=False)
    assert not unexpected and not [n for n in missing if not n.startswith("model.visual.")], (missing, unexpected)
    picture = image(9, size=WIDE)
    want = hf_generate((oracle, tokenizer, processor), PROMPT, [picture])
    [output] = LLM(out, device="cpu", max_num_batched_tokens=64).generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": picture}}, GREEDY)
    check_output(output, want)
    float_want = hf_generate(hf, PROMPT, [picture])
    assert max(abs(a - b) for a, b in zip(want[2], float_want[2])) > 1e-4  # (the weights were quantized)
    source = load_file(checkpoint / "model.safetensors")
    vision = load_file(out / art.VISION_WEIGHTS)
    assert all(torch.equal(vision["vision_tower." + name.removeprefix("model.visual.")], t)
               for name, t in source.items() if name.startswith("model.visual."))
    for i in (0, 1):
        for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            key = f"model.language_model.layers.{i}.{name}"
            ours, theirs = state[key], source[key]
            gate_up_swapped = theirs.roll(theirs.shape[1] // 2, dims=1)
            for e in range(EXPERTS):  # each expert W4-close to its own weights, not to another's or the halves swapped
                error = [float((ours[e] - t).norm() / t.norm()) for t in (theirs[e], theirs[(e + 1) % EXPERTS],
                                                                          gate_up_swapped[e])]
                assert error[0] < 0.3 < min(error[1:] if "gate_up" in name else error[1:2]), (key, e, error)
    for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        key = "model.language_model.layers.1." + name
        state[key] = state[key][[1, 0, 2, 3]]
    oracle.load_state_dict(state, strict=False)
    _, tokens, logprobs = hf_generate((oracle, tokenizer, processor), PROMPT, [picture])
    assert tokens != want[1] or max(abs(a - b) for a, b in zip(logprobs, want[2])) > 1e-2


def test_what_is_not_built_is_refused_by_name(checkpoint, tmp_path):
    """norm_topk_prob false (transformers' router renormalises always), fused experts of neither layout, and
    quantization.method import (the fused experts) are refused, each in one line."""
    config = json.loads((checkpoint / "config.json").read_text())
    narrow = tmp_path / "narrow"
    shutil.copytree(checkpoint, narrow)
    tensors = load_file(narrow / "model.safetensors")
    name = "model.language_model.layers.1.mlp.experts.down_proj"
    tensors[name] = tensors[name][:, :, : WIDTH // 2].contiguous()
    save_file(tensors, narrow / "model.safetensors", metadata={"format": "pt"})
    cases = [
        (config | {"text_config": {**config["text_config"], "norm_topk_prob": False}}, checkpoint, {},
         "norm_topk_prob false: transformers' Qwen3-VL-MoE router renormalises"),
        (config, narrow, {}, "layers.1.mlp.experts.gate_up_proj \\[4, 192, 64\\] and .*down_proj \\[4, 64, 48\\]: "
                             "expected \\[4, 64, 192\\] and \\[4, 96, 64\\] \\(the published layout\\) or"),
        (config, checkpoint, {"quantization": {"method": "import"}},
         "quantization.method import is not supported for Qwen3-VL-MoE"),
    ]
    for number, (changed_config, source, recipe, message) in enumerate(cases):
        changed = tmp_path / f"c{number}"
        shutil.copytree(source, changed)
        (changed / "config.json").write_text(json.dumps(changed_config))
        with pytest.raises(CheckpointError, match=message):
            build(recipe_from_dict({"model": str(changed), "output": str(tmp_path / "x"), "dtype": "float32",
                                    **recipe}), show_progress=False)
