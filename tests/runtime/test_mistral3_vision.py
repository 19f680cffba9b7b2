"""Mistral 3's vision model (Mistral3ForConditionalGeneration) and LLaVA with a Pixtral tower (pixtral-12b's
layout): tiny random checkpoints (Pixtral tower of 8 px patches, images resized to at most 48 px, a Mistral text
model) built float32 and run with images of different sizes against transformers' own models' generate: the
prompt ids ([IMG] expanded to rows of [IMG] ended by [IMG_BREAK], the last by [IMG_END], as PixtralProcessor
writes them), greedy tokens and their logprobs, chunked prefill that splits an image, a prefix-cache hit inside an
image, the chat form, and what is refused.

PixtralProcessor needs torchvision, which this machine's torch has no build of: the checkpoints carry
PixtralProcessor's files written by hand (its fields, the PIL image processor's own save) and the reference prompt
ids follow PixtralProcessor.replace_image_token's published layout (`expand`); where torchvision is installed,
`test_prompt_ids_equal_pixtral_processors` checks them against the processor itself."""

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
from tests.runtime.vision_oracle import (check_chat_image_parts, check_chunked_image_prefill, check_image_requests,
                                         check_output, hf_greedy_with_logprobs)
from tests.runtime.test_llava import _randomise_, image

IMG, BREAK, END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
PROMPT = "[INST][IMG]Describe it.[/INST]"
TWO = "[INST]First:[IMG]then[IMG]Compare.[/INST]"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[INST]{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}[IMG]{% else %}{{ c['text'] }}"
                 "{% endif %}{% endfor %}{% endif %}[/INST]{% endfor %}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
LONGEST_EDGE = 48
# image(1) is 40 x 36 px: kept, padded up to 48 x 48; SMALL is 64 x 24: scaled to 48 x 18, padded up to 48 x 32
SMALL = (64, 24)


def make_pixtral_checkpoint(path, llava: bool = False, seed: int = 0, processor_changes: dict | None = None,
                            text_config_class: str = "MistralConfig", **config_changes):
    """A tiny random float32 Mistral3ForConditionalGeneration (spatial_merge_size 2: 16 px a row), or with
    `llava` a LlavaForConditionalGeneration with a Pixtral tower (8 px a row), with the reference tokenizer plus
    [IMG], [IMG_BREAK], [IMG_END], PixtralProcessor's files and a chat template. The text model: a Mistral, or a
    Ministral 3 (text_config_class "Ministral3Config", tests/conftest.py's MINISTRAL3_ROPE: its query temperature)."""
    import transformers
    from transformers import (AutoTokenizer, LlavaConfig, LlavaForConditionalGeneration, Mistral3Config,
                              Mistral3ForConditionalGeneration, PixtralVisionConfig)

    from tests.conftest import MINISTRAL3_ROPE
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    path.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(REF_MODEL_DIR / name, path / name)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMG, BREAK, END]})
    tokenizer.chat_template = CHAT_TEMPLATE
    rope = {"rope_parameters": MINISTRAL3_ROPE} if text_config_class == "Ministral3Config" else {}
    text = getattr(transformers, text_config_class)(
        vocab_size=4160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=0,
        eos_token_id=1, pad_token_id=4, sliding_window=None, tie_word_embeddings=False, **rope)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 head_dim=16, patch_size=8, image_size=64)
    image_token_index = tokenizer.convert_tokens_to_ids(IMG)
    if llava:
        config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_index,
                             vision_feature_select_strategy="full", vision_feature_layer=-1, **config_changes)
        model = LlavaForConditionalGeneration(config).eval()
    else:
        config = Mistral3Config(vision_config=vision, text_config=text, image_token_index=image_token_index,
                                spatial_merge_size=2, vision_feature_layer=-1, **config_changes)
        model = Mistral3ForConditionalGeneration(config).eval()
    _randomise_(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    image_processor = PixtralImageProcessorPil(size={"longest_edge": LONGEST_EDGE}, patch_size={"height": 8, "width": 8})
    image_processor.save_pretrained(path)
    processor = {"processor_class": "PixtralProcessor", "patch_size": 8, "spatial_merge_size": 1 if llava else 2,
                 "image_token": IMG, "image_break_token": BREAK, "image_end_token": END, **(processor_changes or {})}
    (path / "processor_config.json").write_text(json.dumps(processor))
    return path


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    return make_pixtral_checkpoint(tmp_path_factory.mktemp("mistral3") / "hf")


@pytest.fixture(scope="module")
def artifact(mistral3, tmp_path_factory):
    return build_float32(mistral3, tmp_path_factory.mktemp("mistral3-art") / "a", target={"device": "cpu"})


def _hf(checkpoint, llava: bool):
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration
    from transformers import Mistral3ForConditionalGeneration

    cls = LlavaForConditionalGeneration if llava else Mistral3ForConditionalGeneration
    model = cls.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager").eval()
    return (model, AutoTokenizer.from_pretrained(str(checkpoint)), AutoImageProcessor.from_pretrained(str(checkpoint)),
            8 if llava else 16)


@pytest.fixture(scope="module")
def hf(mistral3):
    return _hf(mistral3, llava=False)


def expand(prompt: str, sizes, side: int) -> str:
    """PixtralProcessor's text: each [IMG] becomes, for its image's resized (height, width), height / side rows of
    width / side [IMG], each row ended by [IMG_BREAK], the last by [IMG_END] (its replace_image_token)."""
    parts = prompt.split(IMG)
    assert len(parts) == len(sizes) + 1
    out = parts[0]
    for (height, width), rest in zip(sizes, parts[1:]):
        rows = [IMG * (width // side) + BREAK] * (height // side)
        rows[-1] = IMG * (width // side) + END
        out += "".join(rows) + rest
    return out


def hf_inputs(hf, prompt: str | list[int], images) -> dict:
    """transformers' inputs: the image processor asked for patches of patch_size * spatial_merge_size (as
    PixtralProcessor asks it), the prompt expanded by the images' sizes, or token ids as they are."""
    model, tokenizer, image_processor, side = hf
    inputs = {}
    sizes = []
    if images:
        pixels = image_processor(images=images, patch_size={"height": side, "width": side}, return_tensors="pt")
        inputs = {"pixel_values": pixels["pixel_values"], "image_sizes": pixels["image_sizes"]}
        sizes = pixels["image_sizes"].tolist()
    if isinstance(prompt, str):
        ids = tokenizer(expand(prompt, sizes, side))["input_ids"]
    else:
        ids = prompt
    ids = torch.tensor([ids])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **inputs}


def hf_generate(hf, prompt, images, max_tokens: int = GREEDY.max_tokens):
    """(the prompt ids, transformers' greedy tokens, each one's logprob)."""
    inputs = hf_inputs(hf, prompt, images)
    return hf_greedy_with_logprobs(hf[0], inputs, max_tokens)


def _grid(tokenizer, ids: list[int]) -> list[list[str]]:
    """The image tokens of a prompt as text, split at [IMG_BREAK] / [IMG_END]: each image's rows."""
    names = tokenizer.convert_ids_to_tokens(ids)
    rows, row = [], []
    for name in names:
        if name == IMG:
            row.append(name)
        elif name in (BREAK, END):
            rows.append(len(row))
            row = []
            if name == END:
                rows.append(END)
    return rows


def test_build_records_the_vision_side(artifact, mistral3):
    manifest = art.read_manifest(artifact)
    config = json.loads((mistral3 / "config.json").read_text())
    assert manifest.format_version == art.FORMAT_VERSION == "1.47"
    assert manifest.model.architecture == "MistralForCausalLM"
    vision = manifest.vision
    assert vision.architecture == "Mistral3ForConditionalGeneration" and not vision.bidirectional_image_attention
    assert (vision.image_token_index, vision.spatial_merge_size, vision.vision_feature_layer) == \
        (config["image_token_index"], 2, -1)
    assert vision.vision_config["model_type"] == "pixtral" and vision.projector_norm_eps == 1e-5
    assert {art.VISION_WEIGHTS, "tokenizer/processor_config.json", "tokenizer/preprocessor_config.json"} <= \
        set(manifest.files)
    # a format 1.15 vision section (no Mistral 3 fields) still reads
    data = json.loads((artifact / art.MANIFEST_NAME).read_text())
    data["format_version"] = "1.15"
    data["vision"] = {"architecture": "LlavaForConditionalGeneration", "vision_config": {}, "image_token_index": 7,
                      "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
                      "projector_hidden_act": "gelu", "text_hidden_size": 64}
    assert art.Manifest.from_dict(data).vision.spatial_merge_size is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_with_images_matches_transformers(artifact, hf, device):
    """One image (a bare [IMG], expanded by its size), an image of another size, both in one prompt (transformers
    encodes them as one sequence, block-diagonal; we encode each alone), the already-expanded ids, and a prompt
    without images: transformers' prompt ids, greedy tokens and their logprobs. A 40 x 36 image takes 3 rows of 3
    [IMG] (48 x 48 px in 16 px rows), a 64 x 24 one 2 rows of 3 (48 x 32)."""
    atol = 2e-4 if device == "cpu" else 2e-3
    first, second = image(1), image(2, size=SMALL)
    expected = [hf_generate(hf, PROMPT, [first]), hf_generate(hf, PROMPT, [second]),
                hf_generate(hf, TWO, [first, second])]
    tokenizer = hf[1]
    assert _grid(tokenizer, expected[2][0]) == [3, 3, 3, END, 3, 3, END]
    plain_ids = tokenizer("[INST]Hello there.[/INST]")["input_ids"]
    expected.append(hf_generate(hf, plain_ids, None))
    llm = LLM(artifact, device=device, max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64, block_size=8,
              gpu_memory_utilization=0.3)
    check_image_requests(llm, GREEDY, expected, PROMPT, TWO, plain_ids, first, second, atol)


def test_chunked_prefill_splits_an_image(artifact, hf, monkeypatch):
    """8 tokens a step: the images (12 and 8 tokens with their breaks) are split across chunks (causal: no
    chunk is cut back), and the replies are transformers'."""
    pictures = [image(3), image(4, size=SMALL)]
    expected = [hf_generate(hf, TWO, pictures), hf_generate(hf, PROMPT, pictures[1:])]
    check_chunked_image_prefill(artifact, monkeypatch, GREEDY,
                                [{"prompt": TWO, "multi_modal_data": {"image": pictures}},
                                 {"prompt": PROMPT, "multi_modal_data": {"image": pictures[1]}}], expected)


def test_a_prefix_cache_hit_that_ends_inside_an_image(artifact, hf):
    """The first prompt's cached blocks end inside its image (blocks of 8; the image's 12 tokens from position
    6); the second prompt, the first plus text, computes the image's rest with the cached blocks and replies as
    transformers does."""
    tokenizer = hf[1]
    head = tokenizer("[INST]the picture:")["input_ids"][:6]
    picture = image(5)
    img = tokenizer.convert_tokens_to_ids(IMG)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    [first] = llm.generate({"prompt_token_ids": head + [img], "multi_modal_data": {"image": picture}}, GREEDY)
    positions = [i for i, t in enumerate(first.prompt_token_ids) if t == img]
    assert positions[0] < 16 <= positions[-1] and len(first.prompt_token_ids) < 24
    second_ids = head + [img] + tokenizer("Describe it.", add_special_tokens=False)["input_ids"]
    hits = llm.stats()["prefix_cache_hits"]
    [second] = llm.generate({"prompt_token_ids": second_ids, "multi_modal_data": {"image": picture}}, GREEDY)
    assert llm.stats()["prefix_cache_hits"] > hits and second.num_cached_tokens == 16
    check_output(second, hf_generate(hf, second.prompt_token_ids, [picture]))
    # the same text with an image of another size shares no image block
    [other] = llm.generate({"prompt_token_ids": second_ids, "multi_modal_data": {"image": image(5, size=SMALL)}},
                           GREEDY)
    assert other.num_cached_tokens == 0
    check_output(other, hf_generate(hf, other.prompt_token_ids, [image(5, size=SMALL)]))


def test_chat_with_an_image_part_equals_the_offline_form(artifact, hf):
    picture = image(6, size=SMALL)
    expected = hf_generate(hf, PROMPT, [picture])
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    check_chat_image_parts(llm, GREEDY, picture, "Describe it.", expected)


def test_requests_with_images_are_checked(artifact, hf):
    tokenizer = hf[1]
    img, brk, end = tokenizer.convert_tokens_to_ids([IMG, BREAK, END])
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    with pytest.raises(RequestError, match="1 image placeholder\\(s\\) \\(\\[IMG\\], token id .* for 2 image\\(s\\)"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [image(1), image(2)]}}, GREEDY)
    with pytest.raises(RequestError, match="image placeholders .* but no images"):
        llm.generate(PROMPT, GREEDY)
    head = tokenizer("[INST]")["input_ids"]
    wrong = head + [img, img, brk, img, img, end]  # 2 x 2, where image(1) takes 3 x 3
    with pytest.raises(RequestError, match="placeholder of 6 tokens: .* its 3 rows of 3 \\[IMG\\] .* \\(12 tokens\\)"):
        llm.generate({"prompt_token_ids": wrong, "multi_modal_data": {"image": image(1)}}, GREEDY)
    for stray in (head + [img, brk], head + [end, img]):
        with pytest.raises(RequestError, match="\\[IMG_BREAK\\] or \\[IMG_END\\] .* outside an image"):
            llm.generate({"prompt_token_ids": stray, "multi_modal_data": {"image": image(1)}}, GREEDY)
    with pytest.raises(RequestError, match="2 image placeholder\\(s\\) .* for 1 image\\(s\\)"):  # two bare [IMG]
        llm.generate({"prompt_token_ids": head + [img, img], "multi_modal_data": {"image": image(1)}}, GREEDY)
    with LLM(artifact, device="cpu", limit_mm_per_prompt={"image": 1}) as limited:
        with pytest.raises(RequestError, match=r"^At most 1 image\(s\) may be provided in one prompt\.$"):
            limited.generate({"prompt": TWO, "multi_modal_data": {"image": [image(1), image(2)]}}, GREEDY)


def _recipe(checkpoint, out, **fields):
    return recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32", **fields})


def test_what_is_not_supported_is_refused_by_name(mistral3, tmp_path):
    with pytest.raises(RecipeError, match="onnx-cpu: vision models .*Mistral3ForConditionalGeneration"):
        build(_recipe(mistral3, tmp_path / "o", target={"device": "onnx-cpu"}), show_progress=False)
    with pytest.raises(RecipeError, match="parallel: vision models .* one rank"):
        build(_recipe(mistral3, tmp_path / "t", parallel={"tensor": 2}), show_progress=False)
    config = json.loads((mistral3 / "config.json").read_text())
    processor = json.loads((mistral3 / "processor_config.json").read_text())
    cases = [
        (config | {"vision_feature_layer": [-1, -2]}, None, "vision_feature_layer \\[-1, -2\\]: a list of layers"),
        (config | {"text_config": {**config["text_config"], "model_type": "qwen3"}}, None,
         "Mistral 3 language model of model_type 'qwen3' is not supported"),
        (config | {"vision_config": {**config["vision_config"], "model_type": "siglip_vision_model"}}, None,
         "vision tower 'siglip_vision_model' is not supported for Mistral 3"),
        (config, processor | {"spatial_merge_size": 1}, "spatial_merge_size 1 is not the model's \\(2\\)"),
        (config, processor | {"processor_class": "LlavaProcessor"},
         "processor_class 'LlavaProcessor' is not supported"),
        (config, processor | {"image_break_token": "[NOPE]"}, "the tokenizer has no token '\\[NOPE\\]'"),
        (config | {"vision_config": {**config["vision_config"], "image_size": 32}}, None,
         "longest edge 48 px, 16 px a row\\) makes images larger than the tower's image_size 32; set "
         "size.longest_edge to at most 32"),
    ]
    for number, (changed_config, changed_processor, message) in enumerate(cases):
        changed = tmp_path / f"c{number}"
        shutil.copytree(mistral3, changed)
        (changed / "config.json").write_text(json.dumps(changed_config))
        if changed_processor is not None:
            (changed / "processor_config.json").write_text(json.dumps(changed_processor))
        with pytest.raises(CheckpointError, match=message):
            build(_recipe(changed, tmp_path / "x"), show_progress=False)


def test_generate_encodes_images_of_different_sizes(artifact):
    """LLM.generate's prefetch hands the tower images of several sizes: each is encoded alone, and its rows and
    prefix-cache digest are those of encoding its request alone."""
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    vision, pictures = llm.engine.vision, [image(7), image(8, size=SMALL), image(9, size=(24, 60))]
    alone = [vision.encode([p]) for p in pictures]
    assert [rows[0].shape[:2] for rows, _ in alone] == [(3, 3), (2, 3), (3, 2)]
    calls = []
    rows_of = vision._rows
    vision._rows = lambda pixels: calls.append([tuple(p.shape) for p in pixels]) or rows_of(pixels)
    llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in pictures], GREEDY)
    assert calls == [[(3, 48, 48), (3, 32, 48), (3, 48, 32)]] and not vision._prefetched
    vision.prefetch(pictures)
    for picture, (rows, digest) in zip(pictures, alone):
        got_rows, got_digest = vision.encode([picture])
        assert got_digest == digest and torch.allclose(got_rows[0], rows[0], atol=1e-5)


# ---- LLaVA with a Pixtral tower (pixtral-12b's layout) -------------------------------------------------


@pytest.fixture(scope="module")
def pixtral_llava(tmp_path_factory):
    return make_pixtral_checkpoint(tmp_path_factory.mktemp("pixtral-llava") / "hf", llava=True, seed=1)


def test_pixtral_tower_llava_matches_transformers(pixtral_llava, tmp_path):
    """pixtral-12b's layout (LLaVA's projector, every patch a row: 8 px rows): one image, and two of different
    sizes in one prompt, against transformers' LlavaForConditionalGeneration with image_sizes."""
    artifact = build_float32(pixtral_llava, tmp_path / "a", target={"device": "cpu"})
    manifest = art.read_manifest(artifact)
    assert manifest.vision.architecture == "LlavaForConditionalGeneration"
    assert (manifest.vision.vision_config["model_type"], manifest.vision.vision_feature_select_strategy) == \
        ("pixtral", "full")
    hf = _hf(pixtral_llava, llava=True)
    first, second = image(1), image(2, size=SMALL)
    expected = [hf_generate(hf, PROMPT, [first]), hf_generate(hf, TWO, [first, second])]
    assert _grid(hf[1], expected[1][0]) == [5] * 5 + [END] + [6] * 3 + [END]  # 40 x 40 (40 x 36 kept) and 48 x 24
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=32, num_kv_blocks=64, block_size=8)
    outputs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": first}},
                            {"prompt": TWO, "multi_modal_data": {"image": [first, second]}}], GREEDY)
    for output, want in zip(outputs, expected):
        check_output(output, want)


def test_pixtral_llava_refusals(pixtral_llava, tmp_path):
    config = json.loads((pixtral_llava / "config.json").read_text())
    changed = tmp_path / "default"
    shutil.copytree(pixtral_llava, changed)
    (changed / "config.json").write_text(json.dumps(config | {"vision_feature_select_strategy": "default"}))
    with pytest.raises(CheckpointError, match="'default' with a Pixtral tower .* set it to \"full\""):
        build(_recipe(changed, tmp_path / "x"), show_progress=False)


def test_prompt_ids_equal_pixtral_processors(mistral3, hf):
    """Where torchvision is installed: transformers' PixtralProcessor writes the prompt ids `hf_inputs` writes."""
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(mistral3))
    pictures = [image(1), image(2, size=SMALL)]
    ids = processor(text=TWO, images=pictures, return_tensors="pt")["input_ids"][0].tolist()
    assert ids == hf_inputs(hf, TWO, pictures)["input_ids"][0].tolist()


@pytest.mark.slow  # two builds
def test_a_quantized_build_and_the_in_memory_weight_layout(mistral3, artifact, tmp_path):
    """transformers' in-memory names (model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*,
    lm_head.*) build the same artifact as save_pretrained's; an RTN build quantizes the language model's linears
    only (the vision side exact) and still runs with images."""
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "hf"
    shutil.copytree(mistral3, renamed)
    tensors = load_file(renamed / "model.safetensors")
    new = {}
    for name, t in tensors.items():
        if name.startswith("language_model.model."):
            new["model.language_model." + name.removeprefix("language_model.model.")] = t
        elif name.startswith("language_model.lm_head."):
            new[name.removeprefix("language_model.")] = t
        else:
            new[name if name.startswith(("model.", "lm_head.")) else "model." + name] = t
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    other = build_float32(renamed, tmp_path / "a", target={"device": "cpu"})
    for rel in ("rank-00/weights.safetensors", art.VISION_WEIGHTS):
        a, b = load_file(artifact / rel), load_file(other / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    quantized = build_float32(mistral3, tmp_path / "q", target={"device": "cpu"},
                              quantization={"method": "rtn", "group_size": 32})
    assert art.read_manifest(quantized).quant.modules["layers.0.attn.qkv"]["format"] != "dense"
    vision = load_file(quantized / art.VISION_WEIGHTS)
    merger = "multi_modal_projector.patch_merger.merging_layer.weight"
    assert torch.equal(vision[merger], load_file(mistral3 / "model.safetensors")[merger])
    [output] = LLM(quantized, device="cpu").generate({"prompt": PROMPT, "multi_modal_data": {"image": image(1)}},
                                                     GREEDY)
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens
