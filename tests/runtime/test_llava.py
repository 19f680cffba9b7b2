"""LLaVA (LlavaForConditionalGeneration): a tiny random checkpoint built float32 and run with images, against
transformers' own LlavaForConditionalGeneration.generate; the chat API's image parts; what is refused."""

import base64
import io
import json
import shutil

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, ConfigError, RecipeError, RequestError
from llmc.runtime import artifact as art
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import (BIAS_STD, EMBED_STD, LINEAR_STD, LM_HEAD_STD, NORM_JITTER, REF_MODEL_DIR,
                            TOKENIZER_FILES)
from tests.runtime.hf_oracle import build_float32

IMAGE_TOKEN = "<image>"
PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
# image 32 px in patches of 8: 16 patches (+ CLS, dropped by strategy "default") = 16 image tokens per image
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'].upper() }}: {% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}"
                 "{% endif %}{% endfor %}{% endif %} {% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _randomise_(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(".bias"):
                p.copy_(BIAS_STD * noise)
            elif "norm" in name:
                p.copy_(1.0 + NORM_JITTER * noise)
            elif "embed_tokens" in name:
                p.copy_(EMBED_STD * noise)
            elif "lm_head" in name:
                p.copy_(LM_HEAD_STD * noise)
            else:  # linears, the patch convolution, class and position embeddings, the projector
                p.copy_(LINEAR_STD * noise)


def make_llava_checkpoint(path, text_type: str = "llama", seed: int = 0, **config_changes):
    """A tiny random float32 LlavaForConditionalGeneration (CLIP tower: 32 px images, 8 px patches) with the
    reference tokenizer plus an <image> token, a CLIPImageProcessor and a chat template (LlavaProcessor's files)."""
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, Qwen2Config)

    path.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(REF_MODEL_DIR / name, path / name)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_index = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = {"llama": LlamaConfig, "qwen2": Qwen2Config}[text_type](
        vocab_size=4160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
        pad_token_id=4, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_index,
                         **config_changes)
    model = LlavaForConditionalGeneration(config).eval()
    _randomise_(model, seed)
    model.save_pretrained(path)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy=config.vision_feature_select_strategy,
        image_token=IMAGE_TOKEN, num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return path


def image(seed: int, size=(40, 36)):
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=gen) * 255).to(torch.uint8).numpy()
    return Image.fromarray(pixels)


def data_url(picture) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava") / "hf")


@pytest.fixture(scope="module")
def artifact(llava, tmp_path_factory):
    return build_float32(llava, tmp_path_factory.mktemp("llava-art") / "a", target={"device": "cpu"})


@pytest.fixture(scope="module")
def hf_llava(llava):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(llava), dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    return model, AutoProcessor.from_pretrained(str(llava))


def hf_generate(hf_llava, prompt: str, images, max_tokens: int = GREEDY.max_tokens) -> tuple[list[int], list[int]]:
    """(the processor's prompt ids, transformers' greedy tokens)."""
    model, processor = hf_llava
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()


def test_build_records_the_vision_side(artifact, llava):
    manifest = art.read_manifest(artifact)
    config = json.loads((llava / "config.json").read_text())
    assert manifest.format_version == art.FORMAT_VERSION
    assert manifest.model.architecture == "LlamaForCausalLM"
    assert manifest.vision.architecture == "LlavaForConditionalGeneration"
    assert manifest.vision.image_token_index == config["image_token_index"]
    assert (manifest.vision.vision_feature_layer, manifest.vision.vision_feature_select_strategy) == (-2, "default")
    assert manifest.vision.vision_config["patch_size"] == 8
    assert art.VISION_WEIGHTS in manifest.files
    assert {"tokenizer/processor_config.json", "tokenizer/chat_template.jinja"} <= set(manifest.files)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_with_images_matches_transformers(artifact, hf_llava, device):
    """Greedy tokens with an image equal transformers', with the image's 16 tokens split across prefill chunks
    (8 tokens a step), beside a prompt without images and one with two images; two different images with the
    same text give different replies (no prefix-cache mix-up: the second image's prompt is queued after the first
    prompt's blocks are cached)."""
    first, second = image(1), image(2, size=(64, 48))
    two = "USER: <image>\n<image>\nCompare. ASSISTANT:"
    cases = [(PROMPT, [first]), (PROMPT, [second]), (two, [first, second]), ("USER: Hello there. ASSISTANT:", None)]
    expected = [hf_generate(hf_llava, p, imgs) if imgs else None for p, imgs in cases]
    llm = LLM(artifact, device=device, max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=64, block_size=8,
              gpu_memory_utilization=0.3)
    prompts = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in cases]
    outputs = llm.generate(prompts, GREEDY)
    for (prompt_ids, tokens), output in zip(expected[:3], outputs[:3]):
        assert output.prompt_token_ids == prompt_ids
        assert output.outputs[0].token_ids == tokens
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids
    # the same image again, now from a warm prefix cache, and the other image after it: still each its own
    again = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": second}},
                          {"prompt": PROMPT, "multi_modal_data": {"image": first}}], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [expected[1][1], expected[0][1]]
    assert llm.stats()["prefix_cache_hits"] > 0


def test_preemption_recomputes_with_the_same_images(artifact, hf_llava):
    """A KV cache of 64 tokens for three prompts of ~41: requests are preempted and recomputed, images and all."""
    cases = [image(3), image(4), image(5)]
    expected = [hf_generate(hf_llava, PROMPT, [picture])[1] for picture in cases]
    llm = LLM(artifact, device="cpu", max_model_len=64, max_num_batched_tokens=16, max_num_seqs=3, num_kv_blocks=8,
              block_size=8)
    outputs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in cases], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats()["num_preemptions"] > 0


def test_chat_with_image_parts_equals_the_offline_form(artifact, hf_llava):
    """The chat template renders this conversation as PROMPT: a data-URL image part and a PIL one give
    transformers' tokens for PROMPT with that image."""
    picture = image(6)
    _, expected = hf_generate(hf_llava, PROMPT, [picture])
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    for part in ({"type": "image_url", "image_url": {"url": data_url(picture)}},
                 {"type": "image_pil", "image_pil": picture}):
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
        [output] = llm.chat(messages, GREEDY)
        assert output.outputs[0].token_ids == expected
    with pytest.raises(RequestError, match="http\\(s\\) image URLs are not fetched"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}])
    with pytest.raises(RequestError, match="not a readable image"):
        llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}])


def test_requests_with_images_are_checked(artifact, ref_artifact_128):
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    with pytest.raises(RequestError, match="1 image placeholder\\(s\\) .* for 2 image\\(s\\)"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [image(1), image(2)]}}, GREEDY)
    with pytest.raises(RequestError, match="image placeholders .* but no images"):
        llm.generate(PROMPT, GREEDY)
    with pytest.raises(RequestError, match="multi_modal_data.video: only images"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": [image(1)]}}, GREEDY)
    with pytest.raises(RequestError, match="truncate_prompt_tokens"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image(1)}},
                     SamplingParams(max_tokens=2, truncate_prompt_tokens=8))
    text_only = LLM(ref_artifact_128, device="cpu")
    with pytest.raises(RequestError, match="takes no images"):
        text_only.generate({"prompt": "Hello", "multi_modal_data": {"image": image(1)}}, GREEDY)
    with pytest.raises(RequestError, match="messages: this model .* takes no images"):
        text_only.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image(1)}]}])


def test_limit_mm_per_prompt(artifact, ref_artifact_128):
    """vLLM's limit_mm_per_prompt: a prompt over the limit refused in vLLM's words (before any image is encoded),
    one within it served; 0 leaves text only; other modalities and text models refuse it by name."""
    two = {"prompt": PROMPT.replace("<image>", "<image> and <image>"), "multi_modal_data": {"image": [image(1), image(2)]}}
    with LLM(artifact, device="cpu", limit_mm_per_prompt={"image": 1}) as llm:
        with pytest.raises(RequestError, match=r"^At most 1 image\(s\) may be provided in one prompt\.$"):
            llm.generate(two, GREEDY)
        assert llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image(1)}}, GREEDY)[0].outputs[0].token_ids
    with LLM(artifact, device="cpu", limit_mm_per_prompt={"image": 0}) as llm, pytest.raises(RequestError, match="At most 0"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image(1)}}, GREEDY)
    with pytest.raises(ConfigError, match="limit_mm_per_prompt.video: this model .* takes no videos"):
        LLM(artifact, device="cpu", limit_mm_per_prompt={"video": 1})
    with pytest.raises(ConfigError, match="limit_mm_per_prompt: this model .* takes no images"):
        LLM(ref_artifact_128, device="cpu", limit_mm_per_prompt={"image": 1})


def test_both_weight_layouts_build_the_same_artifact(llava, artifact, tmp_path):
    """transformers >= 4.52's in-memory names (model.language_model.*, model.vision_tower.*, lm_head.*, and the
    older nested vision_model.* level) read as save_pretrained's older layout does."""
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "hf"
    shutil.copytree(llava, renamed)
    tensors = load_file(renamed / "model.safetensors")
    new = {}
    for name, tensor in tensors.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith("language_model.lm_head."):
            name = name.removeprefix("language_model.")
        elif name.startswith("vision_tower."):
            name = "model.vision_tower.vision_model." + name.removeprefix("vision_tower.")
        else:
            name = "model." + name
        new[name] = tensor
    assert new.keys().isdisjoint(tensors.keys())
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    other = build_float32(renamed, tmp_path / "a", target={"device": "cpu"})
    for rel in ("rank-00/weights.safetensors", art.VISION_WEIGHTS):
        a, b = load_file(artifact / rel), load_file(other / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _recipe(checkpoint, out, **fields):
    return recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32", **fields})


def test_what_is_not_supported_is_refused_by_name(llava, tmp_path):
    with pytest.raises(RecipeError, match="onnx-cpu: vision models"):
        build(_recipe(llava, tmp_path / "o", target={"device": "onnx-cpu"}), show_progress=False)
    with pytest.raises(RecipeError, match="parallel: vision models .* one rank"):
        build(_recipe(llava, tmp_path / "t", parallel={"tensor": 2}), show_progress=False)
    config = json.loads((llava / "config.json").read_text())
    for change, message in (({"vision_feature_layer": [-2, -1]}, "a list of layers"),
                            ({"image_grid_pinpoints": [[336, 672]]}, "anyres"),
                            ({"architectures": ["LlavaOnevisionForConditionalGeneration"]}, "LLaVA-OneVision"),
                            ({"text_config": {**config["text_config"], "model_type": "gemma2"}}, "model_type 'gemma2'")):
        changed = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(llava, changed)
        (changed / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CheckpointError, match=message):
            build(_recipe(changed, tmp_path / "x"), show_progress=False)


@pytest.mark.slow  # two builds: 3.3 s on 2 cores
def test_qwen2_language_model_and_a_quantized_build(tmp_path):
    """A Qwen2 language model (q/k/v biases) matches transformers too; quantization (rtn, w4 groups of 32) applies
    to the language model's linears only, the vision tower and projector stay dense and exact."""
    from safetensors.torch import load_file
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    checkpoint = make_llava_checkpoint(tmp_path / "hf", text_type="qwen2", seed=3)
    out = build_float32(checkpoint, tmp_path / "a", target={"device": "cpu"})
    model = LlavaForConditionalGeneration.from_pretrained(str(checkpoint), attn_implementation="eager").eval()
    picture = image(8)
    _, expected = hf_generate((model, AutoProcessor.from_pretrained(str(checkpoint))), PROMPT, [picture])
    [output] = LLM(out, device="cpu", max_num_batched_tokens=8).generate(
        {"prompt": PROMPT, "multi_modal_data": {"image": picture}}, GREEDY)
    assert output.outputs[0].token_ids == expected
    quantized = build_float32(checkpoint, tmp_path / "q", target={"device": "cpu"},
                              quantization={"method": "rtn", "group_size": 32})
    manifest = art.read_manifest(quantized)
    assert manifest.quant.modules["layers.0.attn.qkv"]["format"] != "dense"
    vision = load_file(quantized / art.VISION_WEIGHTS)
    assert torch.equal(vision["multi_modal_projector.linear_1.weight"],
                       model.model.multi_modal_projector.linear_1.weight.detach())
    [output] = LLM(quantized, device="cpu").generate({"prompt": PROMPT, "multi_modal_data": {"image": picture}},
                                                     GREEDY)
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens


def test_inspect_and_run_a_vision_artifact(artifact):
    """`llmc inspect --json` reports the vision section; `llmc run --prompt` runs a text prompt on it."""
    from click.testing import CliRunner

    from llmc.cli import cli

    result = CliRunner().invoke(cli, ["inspect", str(artifact), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["vision"]["image_token_index"] == art.read_manifest(artifact).vision.image_token_index
    result = CliRunner().invoke(cli, ["run", str(artifact), "--device", "cpu", "--prompt", "USER: hi ASSISTANT:",
                                       "--max-tokens", "3"])
    assert result.exit_code == 0, result.output


def test_generate_encodes_its_prompts_images_in_batches(artifact):
    """LLM.generate encodes every prompt's images before adding them, one tower call per MAX_ENCODER_BATCH images;
    the rows and the prefix-cache digest are those of encoding each request alone."""
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    vision, pictures = llm.engine.vision, [image(7), image(8), image(9)]
    alone = [vision.encode([p]) for p in pictures]
    calls = []
    rows_of = vision._rows
    vision._rows = lambda pixels: calls.append(len(pixels)) or rows_of(pixels)
    outputs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in pictures], GREEDY)
    assert calls == [3] and not vision._prefetched
    vision.prefetch(pictures)
    for picture, (rows, digest) in zip(pictures, alone):
        got_rows, got_digest = vision.encode([picture])
        assert got_digest == digest and torch.allclose(got_rows[0], rows[0], atol=1e-5)
    assert calls == [3, 3] and len({tuple(o.outputs[0].token_ids) for o in outputs}) == 3
