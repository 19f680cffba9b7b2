"""Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration): tiny random
float32 checkpoints (a vision transformer of 8 px patches merged 2 x 2, so 16 px a token; Qwen2.5's with window
attention in its first block and full attention in its second; a Qwen2 text model with M-RoPE's mrope_section
[2, 3, 3] over its 8 rotary frequencies) built and run against transformers' own models' generate: the prompt
ids (<|image_pad|> expanded to an image's merged patches, as Qwen2VLProcessor writes them), the greedy tokens
after the images and their logprobs (the text after an image and every generated token rotate at index + the
request's rope delta), two images of different sizes in one prompt, chunked prefill that splits an image, a
prefix-cache hit inside an image, preemption, the chat form, the Triton kernels under TRITON_INTERPRET=1, and
what is refused.

Qwen2VLProcessor needs torchvision (its video processor), which this machine's torch has no build of: the
checkpoints carry the PIL image processor's own files (Qwen2VLImageProcessorPil) and the reference prompt ids
follow Qwen2VLProcessor.replace_image_token's published layout (`expand`: image_grid_thw's product / merge_size²
tokens an image); where torchvision is installed, `test_prompt_ids_equal_qwen2_vl_processors` checks them against
the processor itself. The M-RoPE positions are checked against transformers' Qwen2VLModel.get_rope_index."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, ConfigError, RecipeError, RequestError
from llmc.runtime import artifact as art
from llmc.runtime.llm import LLM
from llmc.runtime.multimodal import mrope_positions
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import REF_MODEL_DIR, REPO_ROOT, TOKENIZER_FILES
from tests.runtime.hf_oracle import build_float32
from tests.runtime.test_llava import _randomise_, image
from tests.runtime.vision_oracle import (check_chat_image_parts, check_chunked_image_prefill, check_image_requests,
                                         check_output, hf_greedy_with_logprobs)

START, END, PAD, VIDEO = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
IMAGE = START + PAD + END
PROMPT = "User:" + IMAGE + "Describe it."
TWO = "First:" + IMAGE + "then" + IMAGE + "Compare them."
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}User:{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                 "{% for c in m['content'] %}{% if c['type'] == 'image' %}" + IMAGE + "{% elif c['type'] == 'video' %}"
                 + START + VIDEO + END + "{% else %}{{ c['text'] }}"
                 "{% endif %}{% endfor %}{% endif %}{% endfor %}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
# (width, height): 64 x 48 px is 4 x 3 tokens of 16 px; 96 x 32, 6 x 2; 40 x 36 resized to 32 x 32: 2 x 2
WIDE, TALL = (64, 48), (96, 32)
FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def make_qwen_vl_checkpoint(path, family: str = "qwen2_vl", seed: int = 0, **config_changes):
    """A tiny random float32 Qwen2-VL (or Qwen2.5-VL) with the reference tokenizer plus the vision tokens, the
    PIL image processor's files (patch 8, merge 2, temporal patch 2) and a chat template."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig
    from transformers import Qwen2VLForConditionalGeneration

    tokenizer, (start, end, pad, video) = qwen_vl_tokenizer(path)
    text = dict(vocab_size=4160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=0,
                eos_token_id=1, pad_token_id=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    tokens = dict(vision_start_token_id=start, vision_end_token_id=end, image_token_id=pad, video_token_id=video,
                  tie_word_embeddings=False)
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2)
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **tokens, **config_changes)
        model = Qwen2VLForConditionalGeneration(config).eval()
    else:  # windows of 32 px (2 x 2 tokens) in block 0, full attention in block 1
        vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=32, fullatt_block_indexes=[1])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens, **config_changes)
        model = Qwen2_5_VLForConditionalGeneration(config).eval()
    return save_qwen_vl(model, tokenizer, path, seed)


def assert_same_build(artifact, other) -> None:
    """Two builds of one model (another weight layout or config form): the same language-model and vision weights
    and the same manifest model and vision sections."""
    from safetensors.torch import load_file

    for rel in ("rank-00/weights.safetensors", art.VISION_WEIGHTS):
        a, b = load_file(artifact / rel), load_file(other / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ours, theirs = art.read_manifest(artifact), art.read_manifest(other)
    assert ours.vision == theirs.vision and ours.model == theirs.model


def qwen_vl_tokenizer(path):
    """`path` (created) with the reference tokenizer's files; the tokenizer plus the vision tokens and the chat
    template, and their ids (vision start, vision end, image pad, video pad)."""
    from transformers import AutoTokenizer

    path.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(REF_MODEL_DIR / name, path / name)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_special_tokens({"additional_special_tokens": [START, END, PAD, VIDEO]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer, tokenizer.convert_tokens_to_ids([START, END, PAD, VIDEO])


def save_qwen_vl(model, tokenizer, path, seed: int, **processor):
    """`model` randomised (seed) and saved to `path` with `tokenizer` and the PIL image processor's files (patch 8,
    merge 2, temporal patch 2, images of 16 to 128 tokens a side; `processor`: other fields); `path`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _randomise_(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, **processor,
                             size={"shortest_edge": 16 * 16, "longest_edge": 128 * 128}).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory):
    return make_qwen_vl_checkpoint(tmp_path_factory.mktemp(family) / "hf", family)


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    return build_float32(checkpoint, tmp_path_factory.mktemp("qwen-vl-art") / "a", target={"device": "cpu"})


@pytest.fixture(scope="module")
def hf(checkpoint, family):
    from transformers import (AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLForConditionalGeneration)

    cls = Qwen2VLForConditionalGeneration if family == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    model = cls.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(str(checkpoint)), AutoImageProcessor.from_pretrained(str(checkpoint))


def expand(prompt: str, grids) -> str:
    """Qwen2VLProcessor's text: each <|image_pad|> repeated t * h * w / merge_size² times for its image's
    image_grid_thw (its replace_image_token)."""
    parts = prompt.split(PAD)
    assert len(parts) == len(grids) + 1
    return parts[0] + "".join(PAD * (int(np.prod(grid)) // 4) + rest for grid, rest in zip(grids, parts[1:]))


def hf_inputs(hf, prompt: str | list[int], images) -> dict:
    """transformers' inputs: the image processor's patches and image_grid_thw, the prompt expanded by them (or token
    ids as they are), mm_token_type_ids 1 at the image tokens (as Qwen2VLProcessor and Qwen3VLProcessor return
    them)."""
    model, tokenizer, image_processor = hf
    inputs, grids = {}, []
    if images:
        pixels = image_processor(images=images, return_tensors="pt")
        inputs = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}
        grids = pixels["image_grid_thw"].tolist()
    ids = tokenizer(expand(prompt, grids))["input_ids"] if isinstance(prompt, str) else prompt
    ids = torch.tensor([ids])
    types = (ids == model.config.image_token_id).int()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types, **inputs}


def hf_generate(hf, prompt, images, max_tokens: int = GREEDY.max_tokens):
    return hf_greedy_with_logprobs(hf[0], hf_inputs(hf, prompt, images), max_tokens)


def test_build_records_the_vision_side(artifact, checkpoint, family):
    manifest = art.read_manifest(artifact)
    config = json.loads((checkpoint / "config.json").read_text())
    assert manifest.format_version == art.FORMAT_VERSION == "1.47"
    assert manifest.model.architecture == "Qwen2ForCausalLM" and manifest.model.attention_bias
    vision = manifest.vision
    assert vision.architecture == config["architectures"][0]
    assert (vision.image_token_index, vision.video_token_index, vision.spatial_merge_size, vision.mrope_section) == \
        (config["image_token_id"], config["video_token_id"], 2, [2, 3, 3])
    assert {art.VISION_WEIGHTS, "tokenizer/preprocessor_config.json"} <= set(manifest.files)
    from safetensors.torch import load_file

    names = load_file(artifact / art.VISION_WEIGHTS).keys()
    assert "vision_tower.merger.mlp.0.weight" in names and all(n.startswith("vision_tower.") for n in names)


def test_mrope_positions_equal_transformers(hf):
    """Two images (3 x 4 and 2 x 6 tokens) between text: our positions and delta are get_rope_index's."""
    inputs = hf_inputs(hf, TWO, [image(1, size=WIDE), image(2, size=TALL)])
    ids = inputs["input_ids"][0].tolist()
    want, delta = hf[0].model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                             inputs["image_grid_thw"])
    pad = hf[0].config.image_token_id
    starts = [i for i, t in enumerate(ids) if t == pad and ids[i - 1] != pad]
    grids = [(3, 4), (2, 6)]
    ours, our_delta = mrope_positions(len(ids), [(s, r, c) for s, (r, c) in zip(starts, grids)])
    assert np.array_equal(ours, want[:, 0].numpy()) and our_delta == int(delta) < 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_with_images_matches_transformers(artifact, hf, device):
    """One image, an image of another size, both in one prompt with text after them, a prompt without images, and
    the already-expanded ids: transformers' prompt ids, greedy tokens and their logprobs."""
    check_generate_with_images(artifact, hf, device)


def check_generate_with_images(artifact, hf, device: str) -> None:
    """`artifact` on `device` against transformers (`hf`: a Qwen-VL model, its tokenizer and image processor): one
    image of 4 x 3 tokens, one of 6 x 2, both in one prompt, a text prompt in the same batch, and the already-expanded
    ids; prompt ids, greedy tokens and their logprobs (2e-4 on a CPU, 2e-3 on CUDA)."""
    atol = 2e-4 if device == "cpu" else 2e-3
    first, second = image(1, size=WIDE), image(2, size=TALL)
    expected = [hf_generate(hf, PROMPT, [first]), hf_generate(hf, PROMPT, [second]),
                hf_generate(hf, TWO, [first, second])]
    pad = hf[0].config.image_token_id
    assert [expected[0][0].count(pad), expected[1][0].count(pad), expected[2][0].count(pad)] == [12, 12, 24]
    plain_ids = hf[1]("User:Hello there.")["input_ids"]
    expected.append(hf_generate(hf, plain_ids, None))
    llm = LLM(artifact, device=device, max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64, block_size=8,
              gpu_memory_utilization=0.3)
    check_image_requests(llm, GREEDY, expected, PROMPT, TWO, plain_ids, first, second, atol)


def test_chunked_prefill_splits_an_image(artifact, hf, monkeypatch):
    """8 tokens a step: the images (12 tokens each) are split across chunks, and the replies are transformers'."""
    pictures = [image(3, size=WIDE), image(4, size=TALL)]
    expected = [hf_generate(hf, TWO, pictures), hf_generate(hf, PROMPT, pictures[1:])]
    check_chunked_image_prefill(artifact, monkeypatch, GREEDY,
                                [{"prompt": TWO, "multi_modal_data": {"image": pictures}},
                                 {"prompt": PROMPT, "multi_modal_data": {"image": pictures[1]}}], expected)


def test_a_prefix_cache_hit_that_ends_inside_an_image(artifact, hf):
    """The first prompt's cached blocks end inside its image; the second prompt, the first plus text, computes the
    image's rest and the text after it at their M-RoPE positions with the cached blocks, as transformers does."""
    tokenizer = hf[1]
    head = tokenizer("User: the picture:" + START)["input_ids"]
    assert len(head) < 16
    picture = image(5, size=WIDE)
    pad, end = tokenizer.convert_tokens_to_ids([PAD, END])
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    [first] = llm.generate({"prompt_token_ids": head + [pad, end], "multi_modal_data": {"image": picture}}, GREEDY)
    positions = [i for i, t in enumerate(first.prompt_token_ids) if t == pad]
    assert positions[0] < 16 <= positions[-1] and len(first.prompt_token_ids) < 24
    second_ids = head + [pad, end] + tokenizer("Describe it.", add_special_tokens=False)["input_ids"]
    hits = llm.stats()["prefix_cache_hits"]
    [second] = llm.generate({"prompt_token_ids": second_ids, "multi_modal_data": {"image": picture}}, GREEDY)
    assert llm.stats()["prefix_cache_hits"] > hits and second.num_cached_tokens == 16
    check_output(second, hf_generate(hf, second.prompt_token_ids, [picture]))


def test_preemption_recomputes_at_the_same_positions(artifact, hf):
    """A KV cache of 64 tokens for three prompts of 22 tokens and 24 generated: requests are preempted and
    recomputed (prompt and generated tokens, at their M-RoPE positions)."""
    check_preemption_recomputes(artifact, hf, (6, 7, 8), 24)


def check_preemption_recomputes(artifact, hf, seeds: tuple[int, int, int], max_tokens: int) -> None:
    """Three image prompts (images of `seeds`: wide, tall, wide) of 22 tokens and max_tokens generated in a KV cache
    of 64 tokens: requests are preempted and recomputed, and the greedy tokens stay transformers'."""
    cases = [image(seeds[0], size=WIDE), image(seeds[1], size=TALL), image(seeds[2], size=WIDE)]
    expected = [hf_generate(hf, PROMPT, [picture], max_tokens=max_tokens)[1] for picture in cases]
    llm = LLM(artifact, device="cpu", max_model_len=64, max_num_batched_tokens=16, max_num_seqs=3, num_kv_blocks=8,
              block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in cases], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats()["num_preemptions"] > 0


def test_chat_with_an_image_part_equals_the_offline_form(artifact, hf):
    picture = image(9, size=TALL)
    expected = hf_generate(hf, PROMPT, [picture])
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    check_chat_image_parts(llm, GREEDY, picture, "Describe it.", expected)


def test_requests_with_images_are_checked(artifact, hf):
    tokenizer = hf[1]
    pad, video = tokenizer.convert_tokens_to_ids([PAD, VIDEO])
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    with pytest.raises(RequestError, match="1 image placeholder\\(s\\) \\(<\\|image_pad\\|>, token id .* for 2 "):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [image(1), image(2)]}}, GREEDY)
    with pytest.raises(RequestError, match="image placeholders .* but no images"):
        llm.generate(PROMPT, GREEDY)
    head = tokenizer("User:" + START)["input_ids"]
    with pytest.raises(RequestError, match="placeholder of 5 tokens: this image takes one <\\|image_pad\\|>, or 12 "
                                           "\\(its 3 x 4 merged patches\\)"):
        llm.generate({"prompt_token_ids": head + [pad] * 5, "multi_modal_data": {"image": image(1, size=WIDE)}},
                     GREEDY)
    for images in (None, {"image": image(1)}):  # videos: test_qwen2_vl_video.py
        with pytest.raises(RequestError, match="video placeholders \\(<\\|video_pad\\|>, token id .* but no videos|"
                                               "1 video placeholder\\(s\\) .* for 0 video\\(s\\)"):
            llm.generate({"prompt_token_ids": head + [pad, video], "multi_modal_data": images}
                         if images else {"prompt_token_ids": head + [video]}, GREEDY)
    with pytest.raises(RequestError, match="use_beam_search does not run with images"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image(1)}},
                     SamplingParams(use_beam_search=True, n=2, max_tokens=4))


def _recipe(checkpoint, out, **fields):
    return recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32", **fields})


def test_what_is_not_supported_is_refused_by_name(checkpoint, artifact, family, tmp_path):
    name = "Qwen2_5_VLForConditionalGeneration" if family == "qwen2_5_vl" else "Qwen2VLForConditionalGeneration"
    with pytest.raises(RecipeError, match=f"onnx-cpu: vision models .*{name}"):
        build(_recipe(checkpoint, tmp_path / "o", target={"device": "onnx-cpu"}), show_progress=False)
    with pytest.raises(RecipeError, match="parallel: vision models .* one rank"):
        build(_recipe(checkpoint, tmp_path / "t", parallel={"tensor": 2}), show_progress=False)
    with pytest.raises(ConfigError, match="speculative method draft_model: .*M-RoPE"):
        LLM(artifact, device="cpu", speculative_config={"method": "draft_model", "model": str(artifact),
                                                        "num_speculative_tokens": 2})
    config = json.loads((checkpoint / "config.json").read_text())
    processor = json.loads((checkpoint / "preprocessor_config.json").read_text())
    text = config["text_config"]
    cases = [
        (config | {"text_config": {**text, "rope_parameters": {**text["rope_parameters"], "mrope_section": [2, 3, 2]}}},
         None, "mrope_section \\[2, 3, 2\\]: expected 3 counts .* summing to head_dim / 2 = 8"),
        (config | {"text_config": {**text, "rope_parameters": {**text["rope_parameters"], "rope_type": "yarn",
                                                                "factor": 2.0}}},
         None, "rope type 'yarn' is not supported"),
        (config | {"vision_config": {**config["vision_config"], "model_type": "siglip_vision_model"}}, None,
         "vision tower 'siglip_vision_model' is not supported for Qwen2"),
        (config, processor | {"merge_size": 1}, "the image processor's merge_size 1 is not the model's \\(2\\)"),
        (config, processor | {"patch_size": 14}, "the image processor's patch_size 14 is not the model's \\(8\\)"),
    ]
    for number, (changed_config, changed_processor, message) in enumerate(cases):
        changed = tmp_path / f"c{number}"
        shutil.copytree(checkpoint, changed)
        (changed / "config.json").write_text(json.dumps(changed_config))
        if changed_processor is not None:
            (changed / "preprocessor_config.json").write_text(json.dumps(changed_processor))
        with pytest.raises(CheckpointError, match=message):
            build(_recipe(changed, tmp_path / "x"), show_progress=False)


TRITON_SCRIPT = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import llmc.kernels.attention as attention
attention.can_use_triton = lambda *tensors: True  # the rotary, KV-write and attention kernels, interpreted
from llmc.kernels import attention_triton
calls = {"table": 0, "fused": 0}
write, attend = attention_triton.rotate_and_write_kv, attention_triton.paged_attention
def counted_write(q, k, v, positions, table, *args, **kwargs):
    calls["table"] += table.shape[0] == positions.shape[0] and positions.shape[0] > 1  # a step's own rows
    return write(q, k, v, positions, table, *args, **kwargs)
def counted_attend(*args, **kwargs):
    calls["fused"] += kwargs.get("rotary") is not None  # a decode step's fused rotary
    return attend(*args, **kwargs)
attention_triton.rotate_and_write_kv, attention_triton.paged_attention = counted_write, counted_attend
from PIL import Image
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
artifact, prompt, two, paths = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
first, second = [Image.open(p) for p in paths]
llm = LLM(artifact, device="cpu", max_num_batched_tokens=16, max_num_seqs=2, num_kv_blocks=32, block_size=8)
params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
outputs = llm.generate([{"prompt": two, "multi_modal_data": {"image": [first, second]}},
                        {"prompt": prompt, "multi_modal_data": {"image": second}}], params)
print(json.dumps([calls] + [[o.outputs[0].token_ids, [s[t].logprob for s, t in zip(o.outputs[0].logprobs,
                                                                                   o.outputs[0].token_ids)]]
                            for o in outputs]))
"""


def test_the_triton_kernels_rotate_at_the_mrope_positions(artifact, hf, family, tmp_path):
    """The rotary + KV-write kernel (a step's own M-RoPE rows, read at positions 0..n-1) and the decode kernel's
    fused rotary (at index + rope delta) in Triton's interpreter on the CPU: chunks of 16 tokens split the images,
    the replies are transformers'. (Qwen2-VL only: the language model is the same for Qwen2.5-VL.)"""
    if family != "qwen2_vl":
        pytest.skip("the language model's kernels are the same for Qwen2.5-VL")
    pictures = [image(10, size=WIDE), image(11, size=TALL)]
    paths = []
    for number, picture in enumerate(pictures):
        paths.append(str(tmp_path / f"{number}.png"))
        picture.save(paths[-1])
    expected = [hf_generate(hf, TWO, pictures, max_tokens=4), hf_generate(hf, PROMPT, pictures[1:], max_tokens=4)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(artifact), PROMPT, TWO, *paths], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    calls, *got = json.loads(run.stdout.strip().splitlines()[-1])
    assert calls["table"] > 0 and calls["fused"] > 0
    for (tokens, logprobs), (_, want_tokens, want_logprobs) in zip(got, expected):
        assert tokens == want_tokens and logprobs == pytest.approx(want_logprobs, abs=2e-4)


def test_prompt_ids_equal_qwen2_vl_processors(checkpoint, hf):
    """Where torchvision is installed: transformers' Qwen2VLProcessor writes the prompt ids `hf_inputs` writes."""
    pytest.importorskip("torchvision")
    from transformers import Qwen2VLProcessor

    processor = Qwen2VLProcessor.from_pretrained(str(checkpoint))
    pictures = [image(1, size=WIDE), image(2, size=TALL)]
    ids = processor(text=TWO, images=pictures, return_tensors="pt")["input_ids"][0].tolist()
    assert ids == hf_inputs(hf, TWO, pictures)["input_ids"][0].tolist()


@pytest.mark.slow  # three builds
def test_other_layouts_and_a_quantized_build(checkpoint, artifact, family, tmp_path):
    """The published flat config.json (the text model's keys at the top, rope_scaling {type: mrope}) and
    transformers' in-memory names (model.language_model.*, model.visual.*) build the same artifact as
    save_pretrained's; an RTN build quantizes the language model's linears only (the tower exact) and still runs
    with images."""
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "hf"
    shutil.copytree(checkpoint, renamed)
    config = json.loads((renamed / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config["vision_config"].pop("model_type")
    config.update({key: value for key, value in text.items() if key != "model_type"})
    config.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    (renamed / "config.json").write_text(json.dumps(config))
    tensors = load_file(renamed / "model.safetensors")
    new = {}
    for name, t in tensors.items():
        if name.startswith("visual."):
            new["model." + name] = t
        elif name.startswith("model."):
            new["model.language_model." + name.removeprefix("model.")] = t
        else:
            new[name] = t
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    assert_same_build(artifact, build_float32(renamed, tmp_path / "a", target={"device": "cpu"}))
    quantized = build_float32(checkpoint, tmp_path / "q", target={"device": "cpu"},
                              quantization={"method": "rtn", "group_size": 32})
    assert art.read_manifest(quantized).quant.modules["layers.0.attn.qkv"]["format"] != "dense"
    vision = load_file(quantized / art.VISION_WEIGHTS)
    merger = "vision_tower.merger.mlp.0.weight"
    assert torch.equal(vision[merger], load_file(checkpoint / "model.safetensors")["visual.merger.mlp.0.weight"])
    [output] = LLM(quantized, device="cpu").generate({"prompt": PROMPT, "multi_modal_data": {"image": image(1)}},
                                                     GREEDY)
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens


def test_ngram_speculation_verifies_drafts_at_the_mrope_positions(artifact, hf):
    """ngram drafts are verified in steps of several tokens per request (the step's own rotary rows, the tokens
    after the prompt at index + rope delta): the greedy tokens stay transformers'."""
    pictures = [image(12, size=WIDE), image(13, size=TALL)]
    expected = [hf_generate(hf, TWO, pictures, max_tokens=24)[1], hf_generate(hf, PROMPT, pictures[1:], 24)[1]]
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64, num_kv_blocks=64, block_size=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt": TWO, "multi_modal_data": {"image": pictures}},
                            {"prompt": PROMPT, "multi_modal_data": {"image": pictures[1]}}], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats()["num_spec_proposed"] > 0  # (the random model accepts none: each step keeps its first token)


def test_only_steps_with_prompt_tokens_of_an_image_request_get_their_own_rows(artifact, hf, monkeypatch):
    """Decode steps rotate at index + rope delta in the step's positions (no table of their own: CUDA graphs can
    run them), a text-only request's steps never get one, and the replies are transformers'."""
    from llmc.runtime.model_runner import ModelRunner

    steps, forward = [], ModelRunner.forward_hidden

    def recording(self, input_ids, forward_batch):
        steps.append((forward_batch.is_decode, forward_batch.rope_table is not None))
        return forward(self, input_ids, forward_batch)

    monkeypatch.setattr(ModelRunner, "forward_hidden", recording)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    plain_ids = hf[1]("User:Hello there.")["input_ids"]
    [plain] = llm.generate({"prompt_token_ids": plain_ids}, GREEDY)
    assert not any(table for _, table in steps)
    check_output(plain, hf_generate(hf, plain_ids, None))
    steps.clear()
    picture = image(14, size=TALL)
    [output] = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": picture}}, GREEDY)
    check_output(output, hf_generate(hf, PROMPT, [picture]))
    assert steps[0] == (False, True) and steps[1:] == [(True, False)] * (GREEDY.max_tokens - 1)
