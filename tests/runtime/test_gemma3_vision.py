"""Gemma 3's vision model (Gemma3ForConditionalGeneration): a tiny random checkpoint (SigLIP tower, 64 px images in
8 px patches pooled to 16 rows, a Gemma 3 text model with sliding layers) built float32 and run with images against
transformers' own Gemma3ForConditionalGeneration (its processor's prompts, its bidirectional image mask): greedy
tokens and their logprobs, chunked prefill that keeps an image whole, a prefix-cache hit that ends inside an image,
the chat form, and what is refused. The attention kernels' key limits are checked against float64 in
tests/kernels/test_attention.py."""

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
from tests.conftest import BIAS_STD, LINEAR_STD, NORM_JITTER, REF_MODEL_DIR, TIED_EMBED_STD, TOKENIZER_FILES
from tests.runtime.hf_oracle import build_float32
from tests.runtime.vision_oracle import (check_chat_image_parts, check_image_requests, check_output,
                                         hf_greedy_with_logprobs, record_chunks)
from tests.runtime.test_llava import image

SPECIAL = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
MM_TOKENS = 16  # 64 px / 8 px patches = 8 x 8, average-pooled 2 x 2 to 4 x 4
PROMPT = "user\n<start_of_image>Describe it.\nmodel\n"
TWO = "user\nFirst:<start_of_image>then<start_of_image>Compare.\nmodel\n"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}\n{% if m['content'] is string %}"
                 "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image>"
                 "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}model\n{% endif %}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def _randomise_(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    embed_scale = model.config.text_config.hidden_size ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(".bias"):
                p.copy_(BIAS_STD * noise)
            elif "norm" in name:  # Gemma's RMSNorms scale by 1 + w, SigLIP's LayerNorms by w
                p.copy_(1.0 + NORM_JITTER * noise)
            elif "embed_tokens" in name:  # tied: the LM head too
                p.copy_(TIED_EMBED_STD / embed_scale * noise)
            else:  # linears, the patch convolution, position embeddings, mm_input_projection_weight
                p.copy_(LINEAR_STD * noise)


def make_gemma3_checkpoint(path, seed: int = 0, **config_changes):
    """A tiny random float32 Gemma3ForConditionalGeneration with the reference tokenizer plus Gemma 3's image tokens
    and newline-run tokens, a Gemma3ImageProcessor and a chat template (Gemma3Processor's files)."""
    from transformers import (AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor,
                              Gemma3Processor, Gemma3TextConfig, SiglipVisionConfig)

    path.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(REF_MODEL_DIR / name, path / name)
    tokenizer = AutoTokenizer.from_pretrained(str(path), extra_special_tokens=SPECIAL)
    tokenizer.add_tokens(["\n\n", "\n\n\n", "\n\n\n\n"])  # as Gemma's has: the processor's "\n\n" merges with a "\n"
    text = Gemma3TextConfig(vocab_size=4160, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                            max_position_embeddings=256, sliding_window=12, bos_token_id=0, eos_token_id=1,
                            pad_token_id=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=64, patch_size=8, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=MM_TOKENS,
                          boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
                          image_token_index=tokenizer.image_token_id, **config_changes)
    model = Gemma3ForConditionalGeneration(config).eval()
    _randomise_(model, seed)
    model.save_pretrained(path)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 64, "width": 64}),
                                tokenizer=tokenizer, image_seq_length=MM_TOKENS, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3v") / "hf")


@pytest.fixture(scope="module")
def artifact(gemma, tmp_path_factory):
    return build_float32(gemma, tmp_path_factory.mktemp("gemma3v-art") / "a", target={"device": "cpu"})


@pytest.fixture(scope="module")
def hf(gemma):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(str(gemma), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    return model, AutoProcessor.from_pretrained(str(gemma))


def hf_generate(hf, prompt: str | list[int], images, max_tokens: int = GREEDY.max_tokens):
    """(the prompt ids, transformers' greedy tokens, each one's logprob). A text prompt goes through the processor;
    token ids (already expanded) are given with the processor's pixel values and token_type_ids (1: image token)."""
    model, processor = hf
    if isinstance(prompt, str):
        inputs = dict(processor(text=prompt, images=images, return_tensors="pt"))
    else:
        ids = torch.tensor([prompt])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "token_type_ids": (ids == model.config.image_token_id).long()}
        if images:
            inputs["pixel_values"] = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    return hf_greedy_with_logprobs(model, inputs, max_tokens)


def test_build_records_the_vision_side(artifact, gemma):
    manifest = art.read_manifest(artifact)
    config = json.loads((gemma / "config.json").read_text())
    assert manifest.format_version == art.FORMAT_VERSION
    assert tuple(map(int, manifest.format_version.split("."))) >= (1, 14)  # Gemma 3's vision section came in 1.14
    assert manifest.model.architecture == "Gemma3ForCausalLM" and manifest.model.sliding_window == 12
    vision = manifest.vision
    assert vision.architecture == "Gemma3ForConditionalGeneration" and vision.bidirectional_image_attention
    assert (vision.image_token_index, vision.boi_token_index, vision.eoi_token_index, vision.mm_tokens_per_image) == \
        (config["image_token_index"], config["boi_token_index"], config["eoi_token_index"], MM_TOKENS)
    assert vision.vision_config["model_type"] == "siglip_vision_model" and vision.vision_feature_layer is None
    assert {art.VISION_WEIGHTS, "tokenizer/processor_config.json", "tokenizer/chat_template.jinja"} <= \
        set(manifest.files)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_with_images_matches_transformers(artifact, hf, device):
    """One image (the bare <start_of_image>, expanded as the processor expands it), two images in one prompt, the
    processor's already-expanded ids, and a prompt without images: transformers' prompt ids, greedy tokens and
    their logprobs; different images give different replies. On a GPU the image steps run the Triton prefill
    kernel with key limits (the float32 logprobs within 2e-3 there)."""
    atol = 2e-4 if device == "cpu" else 2e-3
    first, second = image(1), image(2, size=(64, 48))
    expected = [hf_generate(hf, PROMPT, [first]), hf_generate(hf, PROMPT, [second]),
                hf_generate(hf, TWO, [first, second])]
    plain_ids = hf[1].tokenizer("user\nHello there.\nmodel\n")["input_ids"]
    expected.append(hf_generate(hf, plain_ids, None))
    llm = LLM(artifact, device=device, max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64, block_size=8,
              gpu_memory_utilization=0.3)
    check_image_requests(llm, GREEDY, expected, PROMPT, TWO, plain_ids, first, second, atol)


def test_chunked_prefill_keeps_an_image_whole(artifact, hf, monkeypatch):
    """A budget of 20 tokens a step for prompts whose 16-token images start at positions 8 and 31: no chunk ends
    inside an image (a chunk that would is cut back to the image's start), and the replies are transformers'."""
    pictures = [image(3), image(4)]
    expected = [hf_generate(hf, TWO, pictures), hf_generate(hf, PROMPT, pictures[:1])]
    chunks = record_chunks(monkeypatch)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=20, max_num_seqs=2, num_kv_blocks=64, block_size=8)
    outputs = llm.generate([{"prompt": TWO, "multi_modal_data": {"image": pictures}},
                            {"prompt": PROMPT, "multi_modal_data": {"image": pictures[0]}}], GREEDY)
    for output, want in zip(outputs, expected):
        check_output(output, want)
    spans = [span for request, _, _ in chunks for span in request.images.spans]
    assert len({tuple(s) for s in spans}) >= 2
    for request, start, n in chunks:
        assert not any(lo < start + n < hi for lo, hi in request.images.spans), (start, n, request.images.spans)
    cut = [(start, n) for request, start, n in chunks if start + n < request.num_prompt_tokens and n < 20]
    assert cut  # some chunk was cut back to an image's start


def test_a_prefix_cache_hit_that_ends_inside_an_image(artifact, hf):
    """The first prompt's cached blocks end inside its image (16 tokens at 12..27, blocks of 8: the hit is 24
    tokens); the second prompt, the first plus text, computes the image's last four tokens with the cached ones
    (whose KV was computed with the whole image) and replies as transformers does."""
    tokenizer = hf[1].tokenizer
    boi = tokenizer.boi_token_id
    head = tokenizer("user\nthe picture we have here:")["input_ids"][:9]  # bos + 8 tokens
    picture = image(5)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    [first] = llm.generate({"prompt_token_ids": head + [boi], "multi_modal_data": {"image": picture}}, GREEDY)
    positions = [i for i, t in enumerate(first.prompt_token_ids) if t == tokenizer.image_token_id]
    assert positions[0] < 24 < positions[-1] and len(first.prompt_token_ids) < 32
    second_ids = head + [boi] + tokenizer("Describe it.", add_special_tokens=False)["input_ids"]
    hits = llm.stats()["prefix_cache_hits"]
    [second] = llm.generate({"prompt_token_ids": second_ids, "multi_modal_data": {"image": picture}}, GREEDY)
    assert llm.stats()["prefix_cache_hits"] > hits and second.num_cached_tokens == 24
    check_output(second, hf_generate(hf, second.prompt_token_ids, [picture]))
    check_output(first, hf_generate(hf, first.prompt_token_ids, [picture]))


def test_chat_with_an_image_part_equals_the_offline_form(artifact, hf):
    picture = image(6)
    expected = hf_generate(hf, PROMPT, [picture])
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    check_chat_image_parts(llm, GREEDY, picture, "Describe it.", expected)


def test_requests_with_images_are_checked(artifact, hf):
    tokenizer = hf[1].tokenizer
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    with pytest.raises(RequestError, match="1 image placeholder\\(s\\) \\(<start_of_image>.* for 2 image\\(s\\)"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [image(1), image(2)]}}, GREEDY)
    with pytest.raises(RequestError, match="<start_of_image> .* but no images"):
        llm.generate(PROMPT, GREEDY)
    partial = tokenizer("user\n")["input_ids"] + [tokenizer.boi_token_id] + [tokenizer.image_token_id] * 3 + \
        [tokenizer.eoi_token_id]
    with pytest.raises(RequestError, match="<start_of_image> and 3 image tokens: .* followed by 16 image tokens"):
        llm.generate({"prompt_token_ids": partial, "multi_modal_data": {"image": image(1)}}, GREEDY)
    stray = tokenizer("user\n<start_of_image>")["input_ids"] + [tokenizer.image_token_id]
    with pytest.raises(RequestError, match="<start_of_image> and 1 image tokens"):
        llm.generate({"prompt_token_ids": stray, "multi_modal_data": {"image": image(1)}}, GREEDY)
    loose = tokenizer(PROMPT)["input_ids"] + [tokenizer.image_token_id]
    with pytest.raises(RequestError, match="image tokens .* outside an image placeholder"):
        llm.generate({"prompt_token_ids": loose, "multi_modal_data": {"image": image(1)}}, GREEDY)
    small = LLM(artifact, device="cpu", max_num_batched_tokens=12)
    with pytest.raises(RequestError, match="an image of 16 tokens is more than max_num_batched_tokens \\(12\\)"):
        small.generate({"prompt": PROMPT, "multi_modal_data": {"image": image(1)}}, GREEDY)


def _recipe(checkpoint, out, **fields):
    return recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32", **fields})


def test_what_is_not_supported_is_refused_by_name(gemma, tmp_path):
    with pytest.raises(RecipeError, match="onnx-cpu: vision models .*Gemma3ForConditionalGeneration"):
        build(_recipe(gemma, tmp_path / "o", target={"device": "onnx-cpu"}), show_progress=False)
    with pytest.raises(RecipeError, match="parallel: vision models .* one rank"):
        build(_recipe(gemma, tmp_path / "t", parallel={"tensor": 2}), show_progress=False)
    pan = tmp_path / "pan"
    shutil.copytree(gemma, pan)
    processor = json.loads((pan / "processor_config.json").read_text())
    processor["image_processor"]["do_pan_and_scan"] = True
    (pan / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(CheckpointError, match="do_pan_and_scan true .* not supported"):
        build(_recipe(pan, tmp_path / "p"), show_progress=False)
    config = json.loads((gemma / "config.json").read_text())
    for change, message in (({"mm_tokens_per_image": 15}, "mm_tokens_per_image 15 is not a square"),
                            ({"vision_config": {**config["vision_config"], "model_type": "clip_vision_model"}},
                             "vision tower 'clip_vision_model' is not supported for Gemma 3"),
                            ({"text_config": None}, "needs text_config and vision_config; a text-only Gemma 3")):
        changed = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(gemma, changed)
        (changed / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CheckpointError, match=message):
            build(_recipe(changed, tmp_path / "x"), show_progress=False)


def test_a_format_1_13_vision_section_still_loads(artifact):
    """A LLaVA manifest of format 1.13 (no Gemma 3 fields) reads as before."""
    data = json.loads((artifact / art.MANIFEST_NAME).read_text())
    data["format_version"] = "1.13"
    data["model"]["vocab_size"] = 4160
    data["vision"] = {"architecture": "LlavaForConditionalGeneration", "vision_config": {}, "image_token_index": 7,
                      "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
                      "projector_hidden_act": "gelu", "text_hidden_size": 64, "projector_bias": True}
    vision = art.Manifest.from_dict(data).vision
    assert (vision.mm_tokens_per_image, vision.bidirectional_image_attention) == (None, False)


def test_the_scheduler_never_ends_a_chunk_inside_an_image():
    """Budget 10. Waiting: b (a 10-token image at 5..15) is admitted beside a's 4-token prompt with its 5 tokens
    before the image, not 6 (cut back to the image's start). Running: while a decodes, the 9 tokens left are short of
    b's image and b waits (no chunk of it); once a has finished, b's image goes in one chunk. A request whose image
    is as large as the budget never starves; no chunk ends inside an image."""
    from llmc.runtime.multimodal import ImageInputs
    from llmc.runtime.request import Request
    from llmc.runtime.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=64, block_size=4,
                                          num_blocks=32))
    a = Request("a", list(range(100, 104)), 3, arrival_time=0.0)
    b = Request("b", list(range(200, 220)), 2, arrival_time=1.0)
    b.images = ImageInputs(list(range(5, 15)), torch.zeros(10, 4), b"b", [(5, 15)])
    scheduler.add_request(a)
    scheduler.add_request(b)
    steps = []
    while scheduler.has_unfinished_requests() and len(steps) < 20:
        batch = scheduler.schedule()
        steps.append({s.request.request_id: (s.request.num_computed_tokens, s.num_new_tokens) for s in batch.requests})
        scheduler.update(batch, {s.request.request_id: [7] for s in batch.requests if s.is_last_chunk})
    assert steps[:5] == [{"a": (0, 4), "b": (0, 5)}, {"a": (4, 1)}, {"a": (5, 1)}, {"b": (5, 10)}, {"b": (15, 5)}]
    assert not scheduler.has_unfinished_requests()


@pytest.mark.slow  # two builds
def test_a_quantized_build_and_the_in_memory_weight_layout(gemma, artifact, tmp_path, hf):
    """transformers' in-memory names (model.language_model.*, model.vision_tower.vision_model.*,
    model.multi_modal_projector.*) build the same artifact as save_pretrained's; an RTN build quantizes the
    language model's linears only (the vision side exact) and still runs with images."""
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "hf"
    shutil.copytree(gemma, renamed)
    tensors = load_file(renamed / "model.safetensors")
    new = {("model.language_model." + name.removeprefix("language_model.model.")
            if name.startswith("language_model.model.") else "model." + name): t for name, t in tensors.items()}
    save_file(new, renamed / "model.safetensors", metadata={"format": "pt"})
    other = build_float32(renamed, tmp_path / "a", target={"device": "cpu"})
    for rel in ("rank-00/weights.safetensors", art.VISION_WEIGHTS):
        a, b = load_file(artifact / rel), load_file(other / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    quantized = build_float32(gemma, tmp_path / "q", target={"device": "cpu"},
                              quantization={"method": "rtn", "group_size": 32})
    assert art.read_manifest(quantized).quant.modules["layers.0.attn.qkv"]["format"] != "dense"
    vision = load_file(quantized / art.VISION_WEIGHTS)
    assert torch.equal(vision["multi_modal_projector.mm_input_projection_weight"],
                       hf[0].model.multi_modal_projector.mm_input_projection_weight.detach())
    [output] = LLM(quantized, device="cpu").generate({"prompt": PROMPT, "multi_modal_data": {"image": image(1)}},
                                                     GREEDY)
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens
