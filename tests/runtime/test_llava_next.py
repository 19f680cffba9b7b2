"""LLaVA-NeXT (LlavaNextForConditionalGeneration, anyres tiling): a tiny random checkpoint (CLIP tower of 32 px
images in 8 px patches, image_grid_pinpoints 32 x 64 and 64 x 64: 3 or 5 tiles) built float32 and run with images of different
aspect ratios against transformers' own LlavaNextForConditionalGeneration.generate and LlavaNextProcessor (its PIL
image processor: this machine's torch has no torchvision): the prompt ids (<image> expanded to each image's count),
greedy tokens and their logprobs, chunked prefill across an image, the chat form, and what is refused."""

import json
import shutil

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, RecipeError, RequestError
from llmc.runtime import artifact as art
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import REF_MODEL_DIR, TOKENIZER_FILES
from tests.runtime.hf_oracle import build_float32
from tests.runtime.test_llava import CHAT_TEMPLATE, IMAGE_TOKEN, _randomise_, image
from tests.runtime.vision_oracle import (check_chat_image_parts, check_image_requests, check_output,
                                         hf_greedy_with_logprobs, record_chunks)

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
TWO = "USER: <image>\n<image>\nCompare. ASSISTANT:"
PINPOINTS = [[32, 64], [64, 64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
# Rows per image: 16 for the base image, then the tiles' patches unpadded, each row of them ended by image_newline.
# image(1), 40 x 36 px (width x height): 64 x 64 px, 2 x 2 tiles, 8 x 8 patches (the padding under one patch row):
# 16 + 8 x 9 = 88. WIDE: 32 x 64 px, 1 x 2 tiles, 4 x 8 patches: 16 + 4 x 9 = 52. TALL: 2 x 2 tiles, 8 x 8 patches
# unpadded to 8 x 2: 16 + 8 x 3 = 40. So a batch of both holds 5 and 3 tiles (the processor pads it to 5 each).
WIDE, TALL = (64, 24), (20, 70)


def make_llava_next_checkpoint(path, seed: int = 0, processor_changes: dict | None = None, **config_changes):
    """A tiny random float32 LlavaNextForConditionalGeneration (Llama text model) with the reference tokenizer plus
    <image>, LlavaNextProcessor's files (the PIL image processor) and a chat template."""
    from transformers import (AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaNextConfig,
                              LlavaNextForConditionalGeneration, LlavaNextProcessor)
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    path.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(REF_MODEL_DIR / name, path / name)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    text = LlamaConfig(vocab_size=4160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                       bos_token_id=0, eos_token_id=1, pad_token_id=4, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_grid_pinpoints=PINPOINTS,
                             image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), **config_changes)
    model = LlavaNextForConditionalGeneration(config).eval()
    _randomise_(model, seed)  # image_newline too (0.02-scale noise, as the linears)
    model.save_pretrained(path)
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                 image_grid_pinpoints=PINPOINTS)
    LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                       vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                       num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    if processor_changes:
        processor = json.loads((path / "processor_config.json").read_text())
        (path / "processor_config.json").write_text(json.dumps(_merged(processor, processor_changes)))
    return path


def _merged(base: dict, changes: dict) -> dict:
    return {**base, **{k: _merged(base.get(k, {}), v) if isinstance(v, dict) else v for k, v in changes.items()}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_llava_next_checkpoint(tmp_path_factory.mktemp("llava-next") / "hf")


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    return build_float32(checkpoint, tmp_path_factory.mktemp("llava-next-art") / "a", target={"device": "cpu"})


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    model = LlavaNextForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    return model, AutoProcessor.from_pretrained(str(checkpoint))


def hf_generate(hf, prompt, images, max_tokens: int = GREEDY.max_tokens):
    """(LlavaNextProcessor's prompt ids, transformers' greedy tokens, each one's logprob); token ids without images
    as they are."""
    model, processor = hf
    if isinstance(prompt, str):
        inputs = dict(processor(text=prompt, images=images, return_tensors="pt"))
    else:
        ids = torch.tensor([prompt])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return hf_greedy_with_logprobs(model, inputs, max_tokens)


def test_build_records_the_vision_side(artifact, checkpoint):
    from safetensors.torch import load_file

    manifest = art.read_manifest(artifact)
    config = json.loads((checkpoint / "config.json").read_text())
    assert manifest.format_version == art.FORMAT_VERSION == "1.47"
    assert manifest.model.architecture == "LlamaForCausalLM"
    vision = manifest.vision
    assert vision.architecture == "LlavaNextForConditionalGeneration" and not vision.bidirectional_image_attention
    assert (vision.image_token_index, vision.vision_feature_layer, vision.vision_feature_select_strategy) == \
        (config["image_token_index"], -2, "default")
    assert vision.image_grid_pinpoints == PINPOINTS and vision.vision_config["model_type"] == "clip_vision_model"
    tensors, source = load_file(artifact / art.VISION_WEIGHTS), load_file(checkpoint / "model.safetensors")
    assert torch.equal(tensors["image_newline"], source["image_newline"])
    assert {"tokenizer/processor_config.json", "tokenizer/chat_template.jinja"} <= set(manifest.files)
    # a format 1.17 vision section (no image_grid_pinpoints) still reads
    data = json.loads((artifact / art.MANIFEST_NAME).read_text())
    data["format_version"] = "1.17"
    data["vision"] = {"architecture": "LlavaForConditionalGeneration", "vision_config": {}, "image_token_index": 7,
                      "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
                      "projector_hidden_act": "gelu", "text_hidden_size": 64}
    assert art.Manifest.from_dict(data).vision.image_grid_pinpoints is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_with_images_matches_transformers(artifact, hf, device):
    """One image (a bare <image>, expanded to its 88 rows), an image of another aspect (52 rows), both in one
    prompt (5 and 3 tiles), the processor's already-expanded ids, and a prompt without images: LlavaNextProcessor's prompt ids,
    transformers' greedy tokens and their logprobs."""
    atol = 2e-4 if device == "cpu" else 2e-3
    first, second = image(1), image(2, size=WIDE)
    expected = [hf_generate(hf, PROMPT, [first]), hf_generate(hf, PROMPT, [second]),
                hf_generate(hf, TWO, [first, second])]
    image_id = art.read_manifest(artifact).vision.image_token_index
    assert [ids.count(image_id) for ids, _, _ in expected] == [88, 52, 140]
    plain_ids = hf[1].tokenizer("USER: Hello there. ASSISTANT:")["input_ids"]
    expected.append(hf_generate(hf, plain_ids, None))
    llm = LLM(artifact, device=device, max_num_batched_tokens=128, max_num_seqs=4, num_kv_blocks=64, block_size=8,
              gpu_memory_utilization=0.3)
    check_image_requests(llm, GREEDY, expected, PROMPT, TWO, plain_ids, first, second, atol)


def test_image_token_counts_equal_the_processors(artifact, hf):
    """For images of several sizes and aspects, our rows per image equal LlavaNextProcessor's count of <image>
    tokens (_get_num_multimodal_tokens), and the prompt ids its expansion."""
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=128)
    processor, vision = hf[1], llm.engine.vision
    sizes = [(40, 36), WIDE, TALL, (32, 32), (100, 30), (33, 97)]
    pictures = [image(10 + i, size=size) for i, size in enumerate(sizes)]
    rows, _ = vision.encode(pictures)
    counts = processor._get_num_multimodal_tokens(image_sizes=[(p.height, p.width) for p in pictures])
    assert [r.shape[0] for r in rows] == counts["num_image_tokens"]
    ids, _ = vision.prompt_inputs(processor.tokenizer(PROMPT)["input_ids"], [pictures[4]])
    assert ids == processor(text=PROMPT, images=[pictures[4]])["input_ids"][0]


def test_chunked_prefill_splits_an_image(artifact, hf, monkeypatch):
    """16 tokens a step: the images (40 and 52 rows) are split across chunks, and the replies are transformers'."""
    pictures = [image(3, size=TALL), image(4, size=WIDE)]
    expected = [hf_generate(hf, TWO, pictures), hf_generate(hf, PROMPT, pictures[1:])]
    chunks = record_chunks(monkeypatch)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=16, max_num_seqs=2, num_kv_blocks=64, block_size=8)
    outputs = llm.generate([{"prompt": TWO, "multi_modal_data": {"image": pictures}},
                            {"prompt": PROMPT, "multi_modal_data": {"image": pictures[1]}}], GREEDY)
    for output, want in zip(outputs, expected):
        check_output(output, want)
    assert [(start, n) for request, start, n in chunks
            if request.images and request.images.positions[0] < start + n <= request.images.positions[-1]]


def test_chat_with_an_image_part_equals_the_offline_form(artifact, hf):
    picture = image(6, size=TALL)
    expected = hf_generate(hf, PROMPT, [picture])
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=128)
    check_chat_image_parts(llm, GREEDY, picture, "What is this?", expected)


def test_requests_with_images_are_checked(artifact, hf):
    tokenizer = hf[1].tokenizer
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=128)
    with pytest.raises(RequestError, match="1 image placeholder\\(s\\) .* for 2 image\\(s\\)"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [image(1), image(2)]}}, GREEDY)
    with pytest.raises(RequestError, match="image placeholders .* but no images"):
        llm.generate(PROMPT, GREEDY)
    wrong = tokenizer("USER:")["input_ids"] + [image_id] * 52  # image(1) takes 88
    with pytest.raises(RequestError, match="placeholder of 52 tokens: this model takes one per image, or 88"):
        llm.generate({"prompt_token_ids": wrong, "multi_modal_data": {"image": image(1)}}, GREEDY)
    with pytest.raises(RequestError, match="multi_modal_data.video: only images"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": [image(1)]}}, GREEDY)


def _recipe(checkpoint, out, **fields):
    return recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32", **fields})


def test_what_is_not_supported_is_refused_by_name(checkpoint, tmp_path):
    with pytest.raises(RecipeError, match="onnx-cpu: vision models .*LlavaNextForConditionalGeneration"):
        build(_recipe(checkpoint, tmp_path / "o", target={"device": "onnx-cpu"}), show_progress=False)
    config = json.loads((checkpoint / "config.json").read_text())
    processor = json.loads((checkpoint / "processor_config.json").read_text())
    cases = [
        (config | {"vision_feature_select_strategy": "full"}, None,
         "vision_feature_select_strategy 'full' is not supported for LLaVA-NeXT"),
        (config | {"vision_feature_layer": [-2, -1]}, None, "a list of layers"),
        (config | {"image_grid_pinpoints": [[32, 48]]}, None,
         "image_grid_pinpoints \\[\\[32, 48\\]\\]: .* a multiple of the vision tower's image_size 32"),
        (config | {"vision_config": {**config["vision_config"], "model_type": "siglip_vision_model"}}, None,
         "vision tower 'siglip_vision_model' is not supported for LLaVA-NeXT"),
        (config | {"text_config": {**config["text_config"], "model_type": "gemma2"}}, None, "model_type 'gemma2'"),
        (config | {"architectures": ["LlavaOnevisionForConditionalGeneration"]}, None, "LLaVA-OneVision"),
        (config | {"architectures": ["LlavaNextVideoForConditionalGeneration"]}, None, "LLaVA-NeXT-Video"),
        (config, _merged(processor, {"image_processor": {"image_grid_pinpoints": [[64, 64]]}}),
         "image_grid_pinpoints \\[\\[64, 64\\]\\] is not the model's"),
        (config, processor | {"patch_size": 16}, "patch_size 16 is not the model's \\(8\\)"),
        (config, processor | {"num_additional_image_tokens": 0}, "num_additional_image_tokens 0 is not the model's"),
    ]
    for number, (changed_config, changed_processor, message) in enumerate(cases):
        changed = tmp_path / f"c{number}"
        shutil.copytree(checkpoint, changed)
        (changed / "config.json").write_text(json.dumps(changed_config))
        if changed_processor is not None:
            (changed / "processor_config.json").write_text(json.dumps(changed_processor))
        with pytest.raises(CheckpointError, match=message):
            build(_recipe(changed, tmp_path / "x"), show_progress=False)


def test_generate_encodes_its_prompts_tiles_in_one_call(artifact):
    """LLM.generate's prefetch runs the tiles (base + 4, base + 2, base + 4) of images of three sizes through one
    tower call; each image's rows and prefix-cache digest are those of encoding its request alone."""
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=128)
    vision, pictures = llm.engine.vision, [image(7), image(8, size=WIDE), image(9, size=TALL)]
    alone = [vision.encode([p]) for p in pictures]
    calls = []
    rows_of = vision._rows
    vision._rows = lambda pixels: calls.append([px.shape[0] for px, _ in pixels]) or rows_of(pixels)
    llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in pictures], GREEDY)
    assert calls == [[5, 3, 5]] and not vision._prefetched
    vision.prefetch(pictures)
    for picture, (rows, digest) in zip(pictures, alone):
        got_rows, got_digest = vision.encode([picture])
        assert got_digest == digest and torch.allclose(got_rows[0], rows[0], atol=1e-5)
    assert len({digest for _, digest in alone}) == 3


def test_quantized_build_and_the_in_memory_weight_layout(checkpoint, artifact, hf, tmp_path):
    """transformers' in-memory names (model.language_model.*, model.vision_tower.*, model.image_newline, lm_head.*)
    build the same artifact as save_pretrained's; a quantized build (rtn, w4 groups of 32) quantizes the language
    model's linears only: the tower, projector and image_newline stay exact, and an image prompt is served (its
    prompt ids the processor's)."""
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "hf"
    shutil.copytree(checkpoint, renamed)
    tensors = load_file(renamed / "model.safetensors")
    new = {}
    for name, tensor in tensors.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith("language_model.lm_head."):
            name = name.removeprefix("language_model.")
        elif not name.startswith("lm_head."):
            name = "model." + name
        new[name] = tensor
    assert "model.image_newline" in new and new.keys().isdisjoint(tensors.keys())
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    other = build_float32(renamed, tmp_path / "a", target={"device": "cpu"})
    for rel in ("rank-00/weights.safetensors", art.VISION_WEIGHTS):
        a, b = load_file(artifact / rel), load_file(other / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    quantized = build_float32(renamed, tmp_path / "q", target={"device": "cpu"},
                              quantization={"method": "rtn", "group_size": 32})
    assert art.read_manifest(quantized).quant.modules["layers.0.attn.qkv"]["format"] != "dense"
    vision = load_file(quantized / art.VISION_WEIGHTS)
    assert vision.keys() == load_file(artifact / art.VISION_WEIGHTS).keys()
    assert torch.equal(vision["image_newline"], hf[0].model.image_newline.detach())
    picture = image(11, size=TALL)
    [output] = LLM(quantized, device="cpu", max_num_batched_tokens=128).generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": picture}}, GREEDY)
    assert output.prompt_token_ids == hf_generate(hf, PROMPT, [picture], 1)[0]
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens
