"""Qwen3-VL (Qwen3VLForConditionalGeneration, dense): a tiny random float32 checkpoint (a vision transformer of 8 px
patches merged 2 x 2, so 16 px a token, learned position embeddings on a 4 x 4 grid interpolated to each image's,
deepstack mergers after tower layers 0 and 1, so decoder layers 0 and 1 take their rows; a Qwen3 text model, q/k
RMSNorm per head, whose M-RoPE interleaves mrope_section [4, 2, 2] over its 8 rotary frequencies) built and run
against transformers' own Qwen3VLForConditionalGeneration.generate: the prompt ids (<|image_pad|> expanded to an
image's merged patches, as Qwen3VLProcessor writes them), the greedy tokens and their logprobs with one image, two
images of different sizes in one prompt, an image prompt beside a text prompt in one batch, chunked prefill ending
inside an image, a prefix-cache hit inside an image; the positions against transformers' get_rope_index; the
interleaved rotary columns against Qwen3VLTextRotaryEmbedding; what is refused.

Qwen3VLProcessor needs torchvision (its video processor), which this machine's torch has no build of: the checkpoint
carries the PIL image processor's files (Qwen2VLImageProcessorPil, the class transformers maps qwen3_vl to without
torchvision) and the reference prompt ids follow Qwen3VLProcessor.replace_image_token's layout (image_grid_thw's
product / merge_size² tokens an image), as tests/runtime/test_qwen2_vl.py's `expand` writes them."""

import json
import shutil

import numpy as np
import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, RequestError
from llmc.runtime import artifact as art
from llmc.runtime.llm import LLM
from llmc.runtime.mrope import column_components
from llmc.runtime.multimodal import mrope_positions
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import build_float32
from tests.runtime.test_llava import image
from tests.runtime.test_qwen2_vl import (END, PAD, PROMPT, START, TALL, TWO, WIDE, assert_same_build,
                                         check_generate_with_images, check_preemption_recomputes, hf_generate, hf_inputs, qwen_vl_tokenizer,
                                         save_qwen_vl)
from tests.runtime.vision_oracle import check_chat_image_parts, check_chunked_image_prefill, check_output

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
SECTION = [4, 2, 2]  # interleaved over 8 frequencies: height 1, 4; width 2, 5; temporal 0, 3, 6, 7


def make_qwen3_vl_checkpoint(path, seed: int = 0, **config_changes):
    """A tiny random float32 Qwen3-VL with the reference tokenizer plus the vision tokens, the PIL image processor's
    files (patch 8, merge 2, temporal patch 2) and a chat template."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer, (start, end, pad, video) = qwen_vl_tokenizer(path)
    text = dict(vocab_size=4160, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=0,
                eos_token_id=1, pad_token_id=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTION,
                                 "mrope_interleaved": True})
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=8,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, vision_start_token_id=start,
                           vision_end_token_id=end, image_token_id=pad, video_token_id=video,
                           tie_word_embeddings=False, **config_changes)
    model = Qwen3VLForConditionalGeneration(config).eval()
    return save_qwen_vl(model, tokenizer, path, seed, image_mean=[0.5] * 3, image_std=[0.5] * 3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3_vl") / "hf")


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    return build_float32(checkpoint, tmp_path_factory.mktemp("qwen3-vl-art") / "a", target={"device": "cpu"})


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(str(checkpoint)), AutoImageProcessor.from_pretrained(str(checkpoint))


def test_build_records_the_vision_side(artifact, checkpoint):
    manifest = art.read_manifest(artifact)
    config = json.loads((checkpoint / "config.json").read_text())
    assert manifest.format_version == art.FORMAT_VERSION == "1.47"
    assert manifest.model.architecture == "Qwen3ForCausalLM" and manifest.model.qk_norm
    assert not manifest.model.attention_bias
    vision = manifest.vision
    assert vision.architecture == "Qwen3VLForConditionalGeneration"
    assert (vision.image_token_index, vision.video_token_index, vision.spatial_merge_size, vision.mrope_section,
            vision.mrope_interleaved) == (config["image_token_id"], config["video_token_id"], 2, SECTION, True)
    from safetensors.torch import load_file

    names = load_file(artifact / art.VISION_WEIGHTS).keys()
    assert {"vision_tower.merger.linear_fc1.weight", "vision_tower.deepstack_merger_list.1.linear_fc2.weight",
            "vision_tower.pos_embed.weight"} <= set(names)
    assert all(n.startswith("vision_tower.") for n in names)


def test_interleaved_columns_equal_transformers(hf):
    """Each rotary frequency reads the position Qwen3VLTextRotaryEmbedding gives it (positions 100 + c for component
    c, so a cos row tells which one a column read)."""
    rotary = hf[0].model.language_model.rotary_emb
    positions = torch.tensor([100, 200, 300]).view(3, 1, 1)
    cos, _ = rotary(torch.zeros(1, dtype=torch.float32), positions)
    inv = rotary.inv_freq
    read = [min(range(3), key=lambda c: abs(float(torch.cos((100 * (c + 1)) * inv[j])) - float(cos[0, 0, j])))
            for j in range(len(inv))]
    components = column_components(SECTION, interleaved=True)
    assert components.tolist() == read + read and read == [0, 1, 2, 0, 1, 2, 0, 0]


def test_mrope_positions_equal_transformers(hf):
    """Two images (3 x 4 and 2 x 6 tokens) between text: our positions and delta are get_rope_index's."""
    inputs = hf_inputs(hf, TWO, [image(1, size=WIDE), image(2, size=TALL)])
    ids = inputs["input_ids"][0].tolist()
    want, delta = hf[0].model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                             inputs["image_grid_thw"])
    pad = hf[0].config.image_token_id
    starts = [i for i, t in enumerate(ids) if t == pad and ids[i - 1] != pad]
    ours, our_delta = mrope_positions(len(ids), [(s, r, c) for s, (r, c) in zip(starts, [(3, 4), (2, 6)])])
    assert np.array_equal(ours, want[:, 0].numpy()) and our_delta == int(delta) < 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_with_images_matches_transformers(artifact, hf, device):
    """One image, an image of another size, both in one prompt, a text-only prompt in the same batch, and the
    already-expanded ids: transformers' prompt ids, greedy tokens and their logprobs (deepstack rows added after
    decoder layers 0 and 1; without them the replies differ: test_deepstack_matters)."""
    check_generate_with_images(artifact, hf, device)


def test_deepstack_matters(artifact, hf, monkeypatch):
    """Without the deepstack additions the logprobs are not transformers' (so the test above checks them)."""
    import llmc.runtime.model_runner as model_runner

    picture = image(3, size=WIDE)
    _, _, want = hf_generate(hf, PROMPT, [picture])
    monkeypatch.setattr(model_runner, "step_deepstack_rows", lambda batch: None)
    [output] = LLM(artifact, device="cpu", max_num_batched_tokens=64).generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": picture}}, GREEDY)
    ours = [step[t].logprob for step, t in zip(output.outputs[0].logprobs, output.outputs[0].token_ids)]
    assert max(abs(a - b) for a, b in zip(ours, want)) > 1e-2


def test_chunked_prefill_ends_inside_an_image(artifact, hf, monkeypatch):
    """8 tokens a step: the images (12 tokens each) are split across chunks, each chunk's image tokens taking their
    own deepstack rows, and the replies are transformers'."""
    pictures = [image(4, size=WIDE), image(5, size=TALL)]
    expected = [hf_generate(hf, TWO, pictures), hf_generate(hf, PROMPT, pictures[1:])]
    check_chunked_image_prefill(artifact, monkeypatch, GREEDY,
                                [{"prompt": TWO, "multi_modal_data": {"image": pictures}},
                                 {"prompt": PROMPT, "multi_modal_data": {"image": pictures[1]}}], expected)


def test_a_prefix_cache_hit_that_ends_inside_an_image(artifact, hf):
    """The first prompt's cached blocks end inside its image; the second (the first plus text) computes the image's
    rest, with its deepstack rows, at their M-RoPE positions, as transformers does; the same text with another image
    shares no block."""
    tokenizer = hf[1]
    head = tokenizer("User: the picture:" + START)["input_ids"]
    picture = image(6, size=WIDE)
    pad, end = tokenizer.convert_tokens_to_ids([PAD, END])
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    [first] = llm.generate({"prompt_token_ids": head + [pad, end], "multi_modal_data": {"image": picture}}, GREEDY)
    positions = [i for i, t in enumerate(first.prompt_token_ids) if t == pad]
    assert positions[0] < 16 <= positions[-1] and len(first.prompt_token_ids) < 24
    second_ids = head + [pad, end] + tokenizer("Describe it.", add_special_tokens=False)["input_ids"]
    [second] = llm.generate({"prompt_token_ids": second_ids, "multi_modal_data": {"image": picture}}, GREEDY)
    assert second.num_cached_tokens == 16
    check_output(second, hf_generate(hf, second.prompt_token_ids, [picture]))
    other = image(7, size=WIDE)
    [third] = llm.generate({"prompt_token_ids": second_ids, "multi_modal_data": {"image": other}}, GREEDY)
    assert third.num_cached_tokens == 0
    check_output(third, hf_generate(hf, third.prompt_token_ids, [other]))


def test_preemption_recomputes_with_the_deepstack_rows(artifact, hf):
    """A KV cache of 64 tokens for three prompts of 22 tokens and 16 generated: requests are preempted and recomputed
    (their image tokens taking their deepstack rows again), and the greedy tokens stay transformers'."""
    check_preemption_recomputes(artifact, hf, (11, 12, 13), 16)


def test_chat_with_an_image_part_equals_the_offline_form(artifact, hf):
    picture = image(8, size=TALL)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    check_chat_image_parts(llm, GREEDY, picture, "Describe it.", hf_generate(hf, PROMPT, [picture]))


def test_too_many_images_are_refused(artifact, hf):
    """(Videos: tests/runtime/test_qwen3_vl_video.py.)"""
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64, limit_mm_per_prompt={"image": 1})
    with pytest.raises(RequestError, match="At most 1 image\\(s\\) may be provided in one prompt"):
        llm.generate({"prompt": TWO, "multi_modal_data": {"image": [image(1), image(2)]}}, GREEDY)
    with pytest.raises(RequestError, match="use_beam_search does not run with images"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image(1)}},
                     SamplingParams(use_beam_search=True, n=2, max_tokens=4))
    from llmc.errors import ConfigError

    with pytest.raises(ConfigError, match="speculative method draft_model: .*M-RoPE"):
        LLM(artifact, device="cpu", speculative_config={"method": "draft_model", "model": str(artifact),
                                                        "num_speculative_tokens": 2})


def test_checkpoints_that_are_not_run_are_refused_by_name(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    cases = [
        (config | {"vision_config": {**vision, "deepstack_visual_indexes": [0, 3]}},
         "deepstack_visual_indexes \\[0, 3\\]: expected distinct tower layers in 0..2"),
        (config | {"vision_config": {**vision, "depth": 5, "deepstack_visual_indexes": [0, 1, 2, 3]}},
         "no more of them than the language model's 3 decoder layers"),
        (config | {"text_config": {**text, "rope_parameters": {**text["rope_parameters"], "mrope_interleaved": False}}},
         "mrope_interleaved False is not what Qwen3-VL runs"),
        (config | {"text_config": {**text, "rope_parameters": {**text["rope_parameters"], "mrope_section": [4, 2, 1]}}},
         "mrope_section \\[4, 2, 1\\]: expected 3 counts"),
    ]
    for number, (changed_config, message) in enumerate(cases):
        changed = tmp_path / f"c{number}"
        shutil.copytree(checkpoint, changed)
        (changed / "config.json").write_text(json.dumps(changed_config))
        with pytest.raises(CheckpointError, match=message):
            build(recipe_from_dict({"model": str(changed), "output": str(tmp_path / "x"), "dtype": "float32"}),
                  show_progress=False)


def test_prompt_ids_equal_qwen3_vl_processors(checkpoint, hf):
    """Where torchvision is installed: transformers' Qwen3VLProcessor writes the prompt ids `hf_inputs` writes."""
    pytest.importorskip("torchvision")
    from transformers import Qwen3VLProcessor

    processor = Qwen3VLProcessor.from_pretrained(str(checkpoint))
    pictures = [image(1, size=WIDE), image(2, size=TALL)]
    ids = processor(text=TWO, images=pictures, return_tensors="pt")["input_ids"][0].tolist()
    assert ids == hf_inputs(hf, TWO, pictures)["input_ids"][0].tolist()


@pytest.mark.slow  # three builds
def test_other_layouts_and_a_quantized_build(checkpoint, artifact, tmp_path):
    """The published config.json (text_config's rope_scaling and rope_theta, the tower's model_type qwen3_vl) and the
    older names (visual.*, model.*) build the same artifact as save_pretrained's; an RTN build quantizes the language
    model's linears only (the tower and its deepstack mergers exact) and still runs with images."""
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "hf"
    shutil.copytree(checkpoint, renamed)
    config = json.loads((renamed / "config.json").read_text())
    rope = config["text_config"].pop("rope_parameters")
    config["text_config"].update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    config["vision_config"]["model_type"] = "qwen3_vl"
    (renamed / "config.json").write_text(json.dumps(config))
    tensors = load_file(renamed / "model.safetensors")
    new = {}
    for name, t in tensors.items():
        if name.startswith("model.visual."):
            new[name.removeprefix("model.")] = t
        elif name.startswith("model.language_model."):
            new["model." + name.removeprefix("model.language_model.")] = t
        else:
            new[name] = t
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    assert_same_build(artifact, build_float32(renamed, tmp_path / "a", target={"device": "cpu"}))
    quantized = build_float32(checkpoint, tmp_path / "q", target={"device": "cpu"},
                              quantization={"method": "rtn", "group_size": 32})
    assert art.read_manifest(quantized).quant.modules["layers.0.attn.qkv"]["format"] != "dense"
    vision = load_file(quantized / art.VISION_WEIGHTS)
    source = load_file(checkpoint / "model.safetensors")
    for name in ("merger.linear_fc1.weight", "deepstack_merger_list.0.linear_fc2.weight"):
        assert torch.equal(vision["vision_tower." + name], source["model.visual." + name])
    [output] = LLM(quantized, device="cpu").generate({"prompt": PROMPT, "multi_modal_data": {"image": image(1)}},
                                                     GREEDY)
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens
