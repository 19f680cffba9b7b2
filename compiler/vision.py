"""Vision-language checkpoints (LlavaForConditionalGeneration, LlavaNextForConditionalGeneration,
Gemma3ForConditionalGeneration, Mistral3ForConditionalGeneration, Qwen2VLForConditionalGeneration,
Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration): the language
model built as its causal LM, the vision tower and projector kept dense in their own file.

A LLaVA checkpoint is a CLIP vision tower, a two-layer projector (linear, activation, linear) and a causal LM
(Llama, Mistral, Qwen2 or Ministral 3 here). The build reads the language model's config (`text_config`, with
transformers' defaults filled in) as the checkpoint's config and its tensors under the causal LM's names (TensorReader's
`llava_names`), so every step of the build (quantization, calibration, sharding) sees a plain causal LM; the
vision tower's and projector's tensors are written as they are, in the model dtype, to vision/weights.safetensors,
and the manifest's `vision` section records what the runtime needs to run them (runtime/multimodal.py).

Gemma 3's multimodal checkpoint is the same shape of thing: a SigLIP tower, Gemma3MultiModalProjector (an average
pool to mm_tokens_per_image rows, an RMSNorm, one matrix) and a Gemma 3 text model built as Gemma3ForCausalLM; its
images' tokens attend to each other both ways in the prefill (the manifest's bidirectional_image_attention).

Mistral 3 (Mistral3ForConditionalGeneration: Mistral-Small-3.1/3.2) is a Pixtral tower (each image at its own
size, in patches), Mistral3MultiModalProjector (an RMSNorm, Mistral3PatchMerger merging spatial_merge_size² patches
into one row, linear-act-linear) and a Mistral text model, or Ministral 3's (3B / 8B / 14B: text model_type
ministral3, built as Ministral3ForCausalLM with its query temperature); pixtral-12b is a
LlavaForConditionalGeneration with a Pixtral tower and LLaVA's projector (vision_feature_select_strategy "full": every
patch a row). Their images' tokens attend causally, as LLaVA's.

LLaVA-NeXT (LlavaNextForConditionalGeneration: llava-v1.6-*, llama3-llava-next) is LLaVA's CLIP tower and projector
plus anyres tiling: each image resized and padded to the best of `image_grid_pinpoints`, cut into tiles of the
tower's size, encoded with the image itself resized (the base), and one learned `image_newline` row appended after
each row of the tiles' features (unpadded to the image's aspect); its tensor goes to vision/weights.safetensors
with the tower's. Its images' tokens attend causally.

Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration) are transformers'
vision transformer (patches of temporal_patch_size frames, 2-D rotary, Qwen2.5's window attention, the 2 x 2 patch
merger at its end: one module, written whole under `vision_tower.`) and a Qwen2 language model whose rotary
positions are M-RoPE's: three per token (temporal, height, width), `mrope_section` splitting the rotary frequencies
among them. The language model is built as Qwen2ForCausalLM (its tensors are a Qwen2's), the split goes to the
vision section (`mrope_section`), and the runtime computes the positions (runtime/mrope.py). Its images' tokens
attend causally.

Qwen3-VL (Qwen3VLForConditionalGeneration, dense) is the same shape: transformers' Qwen3VLVisionModel (16 px patches,
learned position embeddings interpolated to each image's grid, 2-D rotary, the patch merger, and one more merger per
`deepstack_visual_indexes` layer: their rows are added to the language model's hidden states at the image tokens
after its first decoder layers) written whole under `vision_tower.`, and a Qwen3 language model (q/k RMSNorm per
head) built as Qwen3ForCausalLM whose M-RoPE interleaves the three positions' frequencies (`mrope_interleaved`).
Its video processor's files are checked as Qwen2-VL's (Qwen3VLVideoProcessor's defaults; runtime/multimodal.py).

Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration) is Qwen3-VL with a Qwen3-MoE language model: its tower (transformers'
Qwen3VLMoeVisionModel subclasses Qwen3VLVisionModel and changes nothing) and prompt layout are dense Qwen3-VL's, so
its vision section is Qwen3-VL's (architecture Qwen3VLForConditionalGeneration) and the runtime runs it as that; the
language model is built as Qwen3MoeForCausalLM (softmax top-k router, always renormalised: transformers'
Qwen3VLMoeTextTopKRouter reads no norm_topk_prob), its experts read from each layer's two fused tensors
(`qwen3_vl_moe_expert_tensors`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmc.errors import CheckpointError, RecipeError
from llmc.runtime import artifact as art

logger = logging.getLogger("llmc")

LLAVA = "LlavaForConditionalGeneration"
LLAVA_NEXT = "LlavaNextForConditionalGeneration"
GEMMA3 = "Gemma3ForConditionalGeneration"
MISTRAL3 = "Mistral3ForConditionalGeneration"
QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
QWEN3_VL = "Qwen3VLForConditionalGeneration"
QWEN3_VL_MOE = "Qwen3VLMoeForConditionalGeneration"  # built with Qwen3-VL's vision section (above)
QWEN_VL_ARCHITECTURES = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE)  # M-RoPE's positions (runtime/mrope.py)
VISION_ARCHITECTURES = (LLAVA, LLAVA_NEXT, GEMMA3, MISTRAL3, QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE)
# text_config.model_type → the causal LM the language model is built as
TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "ministral3": "Ministral3ForCausalLM"}
# a Mistral 3 wrapper's text_config.model_type → the causal LM its language model is built as, served as text only
# (no vision section: the tower is not built, an image is refused by name): Mistral-Small-4's Mistral 4
TEXT_ONLY_ARCHITECTURES = {"mistral4": "Mistral4ForCausalLM"}
VISION_MODEL_TYPES = ("clip_vision_model", "pixtral")
STRATEGIES = ("default", "full")

# Weight-name prefixes of the two layouts: transformers >= 4.52 in memory (model.language_model.*, lm_head.*) and
# what save_pretrained writes (transformers 5 included) and older checkpoints hold (language_model.model.*, ...)
_LM_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
_NEWLINE_NAMES = ("model.image_newline", "image_newline")  # LLaVA-NeXT's row separator
# Qwen2-VL / Qwen2.5-VL: the vision transformer (transformers >= 4.52 in memory: model.visual.*; saved and older:
# visual.*) and the language model (model.language_model.* in memory; saved and older: model.*, a Qwen2's names)
_QWEN_VISUAL_PREFIXES = ("model.visual.", "visual.")


def is_vision_model(config: dict) -> bool:
    return any(arch in VISION_ARCHITECTURES for arch in config.get("architectures") or [])


def text_only_config(config: dict) -> dict | None:
    """A Mistral3ForConditionalGeneration whose language model is a Mistral 4 (TEXT_ONLY_ARCHITECTURES): its
    text_config (transformers' defaults filled in) as Mistral4ForCausalLM's config.json, its weights read under the
    causal LM's names (TensorReader's llava_names), the Pixtral tower and projector not built: served as text, an image
    refused by name. None for any other checkpoint."""
    text_type = (config.get("text_config") or {}).get("model_type")
    if MISTRAL3 not in (config.get("architectures") or []) or text_type not in TEXT_ONLY_ARCHITECTURES:
        return None
    from transformers import Mistral3Config

    try:
        parsed = Mistral3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json is not a Mistral 3 config transformers reads ({e})") from None
    text = _text_config(parsed, config, TEXT_ONLY_ARCHITECTURES[text_type])
    logger.info("%s with a %s language model: the language model is built as %s, served as text; the vision tower "
                "is not built (an image is refused)", MISTRAL3, text_type, text["architectures"][0])
    return text


def vision_config(config: dict, model_dir: Path) -> tuple[dict, art.VisionSpec]:
    """(the language model's config as a causal LM's config.json, the manifest's vision section) of a LLaVA,
    LLaVA-NeXT, Gemma 3 or Mistral 3 checkpoint."""
    from llmc.runtime.multimodal import is_pixtral, pixtral_image_processor, pixtral_processor_fields

    if set(QWEN_VL_ARCHITECTURES) & set(config.get("architectures") or []):
        from llmc.runtime.multimodal import qwen_vl_image_processor, qwen_vl_video_kwargs

        text, spec = qwen_vl_config(config, model_dir)
        qwen_vl_image_processor(model_dir, spec, CheckpointError)  # what the runtime expands <|image_pad|> by
        qwen_vl_video_kwargs(model_dir, spec, CheckpointError)  # and <|video_pad|>
        return text, spec
    if GEMMA3 in (config.get("architectures") or []):
        return gemma3_config(config, model_dir)
    if LLAVA_NEXT in (config.get("architectures") or []):
        from llmc.runtime.multimodal import check_anyres_processor

        text, spec = llava_next_config(config, model_dir)
        check_anyres_processor(model_dir, spec, CheckpointError)  # what the runtime expands <image> by: checked now
        return text, spec
    text, spec = (mistral3_config if MISTRAL3 in (config.get("architectures") or []) else llava_config)(config,
                                                                                                        model_dir)
    if is_pixtral(spec):  # its processor files are what the runtime expands [IMG] by: checked now
        pixtral_image_processor(model_dir, spec, pixtral_processor_fields(model_dir, spec, CheckpointError),
                                CheckpointError)
    return text, spec


def _read_config(config_class, config: dict, model_dir: Path, family: str, towers: tuple[str, ...]):
    """`config` as transformers' `config_class` reads it, its vision tower one of the model_types `towers` (the
    first when config.json names none); another tower, or a config the class refuses, is one CheckpointError."""
    vision_type = (config.get("vision_config") or {}).get("model_type", towers[0])
    if vision_type not in towers:
        raise CheckpointError(f"{model_dir}: vision tower {vision_type!r} is not supported for {family}; supported: "
                              f"{', '.join(towers)}")
    try:
        return config_class(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{model_dir}: config.json is not a {family} config transformers reads ({e})") from None


def mistral3_config(config: dict, model_dir: Path) -> tuple[dict, art.VisionSpec]:
    """Mistral3ForConditionalGeneration: the text config (transformers' defaults filled in) as its causal LM's, and
    the vision section (the Pixtral tower's config, the layer its features are read from, the patch merger's
    spatial_merge_size, the projector's norm eps: the text model's rms_norm_eps, as transformers builds it)."""
    from transformers import Mistral3Config

    text_type = (config.get("text_config") or {}).get("model_type", "mistral")
    if text_type not in TEXT_ARCHITECTURES:
        raise CheckpointError(f"{model_dir}: a Mistral 3 language model of model_type {text_type!r} is not "
                              f"supported; supported: {', '.join(TEXT_ARCHITECTURES)}")
    mistral = _read_config(Mistral3Config, config, model_dir, "Mistral 3", ("pixtral",))
    layer = _feature_layer(mistral.vision_feature_layer, mistral.vision_config.num_hidden_layers, model_dir)
    _check_activation(mistral.projector_hidden_act, model_dir)
    merge = mistral.spatial_merge_size
    if not isinstance(merge, int) or merge < 1:
        raise CheckpointError(f"{model_dir}: spatial_merge_size {merge!r} is not a positive integer")
    text = _text_config(mistral, config, TEXT_ARCHITECTURES[text_type])
    spec = art.VisionSpec(
        architecture=MISTRAL3, vision_config=_tower_config(mistral.vision_config),
        image_token_index=int(mistral.image_token_index), vision_feature_layer=layer,
        projector_hidden_act=mistral.projector_hidden_act,
        projector_bias=bool(getattr(mistral, "multimodal_projector_bias", True)), text_hidden_size=text["hidden_size"],
        spatial_merge_size=merge, projector_norm_eps=float(mistral.text_config.rms_norm_eps),
    )
    return text, spec


def _feature_layer(layer, num_layers: int, model_dir: Path) -> int:
    """vision_feature_layer checked: one index into the tower's hidden states (a list is refused by name)."""
    if not isinstance(layer, int):
        raise CheckpointError(f"{model_dir}: vision_feature_layer {layer!r}: a list of layers (their features "
                              "concatenated) is not supported; one layer index is")
    if not -num_layers - 1 <= layer <= num_layers:
        raise CheckpointError(f"{model_dir}: vision_feature_layer {layer} is outside the vision tower's "
                              f"{num_layers} layers (hidden states 0..{num_layers}, or negative from the last)")
    return layer


def _check_activation(act: str, model_dir: Path) -> None:
    from transformers.activations import ACT2FN

    if act not in ACT2FN:
        raise CheckpointError(f"{model_dir}: projector_hidden_act {act!r} is not an activation transformers knows")


def _text_config(parsed, config: dict, architecture: str) -> dict:
    """The language model's config (transformers' defaults filled in) as its causal LM's config.json."""
    text = parsed.text_config.to_dict()
    text["architectures"] = [architecture]
    text["tie_word_embeddings"] = bool(parsed.tie_word_embeddings or text.get("tie_word_embeddings"))
    dtype = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    text["dtype"] = str(dtype).removeprefix("torch.") if dtype is not None else None
    return text


def _tower_config(vision) -> dict:
    return {k: v for k, v in vision.to_dict().items()
            if k not in ("transformers_version", "architectures", "dtype", "torch_dtype")}


def gemma3_config(config: dict, model_dir: Path) -> tuple[dict, art.VisionSpec]:
    """Gemma3ForConditionalGeneration: the text config (transformers' defaults filled in) as Gemma3ForCausalLM's,
    and the vision section; pan-and-scan and towers other than SigLIP are refused by name."""
    from transformers import Gemma3Config

    for name in ("preprocessor_config.json", "processor_config.json"):
        path = model_dir / name
        processor = json.loads(path.read_text()) if path.is_file() else {}
        if processor.get("do_pan_and_scan") or (processor.get("image_processor") or {}).get("do_pan_and_scan"):
            raise CheckpointError(f"{path}: do_pan_and_scan true (pan-and-scan crops, several images per image) is not "
                                  "supported; set it to false (one image resized to the tower's size)")
    if not isinstance(config.get("text_config"), dict) or not isinstance(config.get("vision_config"), dict):
        raise CheckpointError(f"{model_dir}: a Gemma3ForConditionalGeneration config.json needs text_config and "
                              "vision_config; a text-only Gemma 3 checkpoint is Gemma3ForCausalLM (model_type "
                              "gemma3_text)")
    gemma = _read_config(Gemma3Config, config, model_dir, "Gemma 3", ("siglip_vision_model",))
    vision = gemma.vision_config
    patches = vision.image_size // vision.patch_size
    side = int(round(gemma.mm_tokens_per_image ** 0.5))
    if side * side != gemma.mm_tokens_per_image or patches % side:
        raise CheckpointError(f"{model_dir}: mm_tokens_per_image {gemma.mm_tokens_per_image} is not a square whose "
                              f"side divides the tower's {patches} patches a side (image_size / patch_size)")
    text = gemma.text_config.to_dict()
    text["architectures"] = ["Gemma3ForCausalLM"]
    text["tie_word_embeddings"] = bool(getattr(gemma, "tie_word_embeddings", True)
                                       or text.get("tie_word_embeddings"))
    dtype = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    text["dtype"] = str(dtype).removeprefix("torch.") if dtype is not None else None
    vision_dict = {k: v for k, v in vision.to_dict().items()
                   if k not in ("transformers_version", "architectures", "dtype", "torch_dtype")}
    spec = art.VisionSpec(
        architecture=GEMMA3, vision_config=vision_dict, image_token_index=int(gemma.image_token_index),
        text_hidden_size=text["hidden_size"], mm_tokens_per_image=int(gemma.mm_tokens_per_image),
        boi_token_index=int(gemma.boi_token_index), eoi_token_index=int(gemma.eoi_token_index),
        bidirectional_image_attention=True,
    )
    return text, spec


def llava_config(config: dict, model_dir: Path) -> tuple[dict, art.VisionSpec]:
    """(the language model's config as a causal LM's config.json, the manifest's vision section), refusing by
    name what the runtime does not run."""
    from transformers import LlavaConfig

    for key, what in (("image_grid_pinpoints", "LLaVA-NeXT's anyres tiling"),
                      ("spatial_merge_size", "a patch-merging projector"), ("downsample_ratio", "pixel shuffle")):
        if config.get(key) is not None:
            raise CheckpointError(f"{model_dir}: {key} ({what}) is not supported in a LlavaForConditionalGeneration; "
                                  "LLaVA-1.5-style checkpoints (one image resized to the vision tower's size) are, and "
                                  "anyres tiling as LlavaNextForConditionalGeneration")
    text_type = (config.get("text_config") or {}).get("model_type", "llama")
    if text_type not in TEXT_ARCHITECTURES:
        raise CheckpointError(f"{model_dir}: a LLaVA language model of model_type {text_type!r} is not supported; "
                              f"supported: {', '.join(TEXT_ARCHITECTURES)}")
    llava = _read_config(LlavaConfig, config, model_dir, "LLaVA", VISION_MODEL_TYPES)
    vision_type = llava.vision_config.model_type
    layer = _feature_layer(llava.vision_feature_layer, llava.vision_config.num_hidden_layers, model_dir)
    strategy = llava.vision_feature_select_strategy
    if strategy not in STRATEGIES:
        raise CheckpointError(f"{model_dir}: vision_feature_select_strategy {strategy!r}: supported are "
                              f"{', '.join(STRATEGIES)}")
    if vision_type == "pixtral" and strategy != "full":
        raise CheckpointError(f"{model_dir}: vision_feature_select_strategy {strategy!r} with a Pixtral tower (it "
                              "has no CLS row to drop) is not supported; set it to \"full\"")
    _check_activation(llava.projector_hidden_act, model_dir)
    text = _text_config(llava, config, TEXT_ARCHITECTURES[text_type])
    vision_config = _tower_config(llava.vision_config)
    spec = art.VisionSpec(
        architecture=LLAVA, vision_config=vision_config, image_token_index=int(llava.image_token_index),
        vision_feature_layer=layer, vision_feature_select_strategy=strategy,
        projector_hidden_act=llava.projector_hidden_act,
        projector_bias=bool(getattr(llava, "multimodal_projector_bias", True)),
        text_hidden_size=text["hidden_size"],
    )
    return text, spec


def llava_next_config(config: dict, model_dir: Path) -> tuple[dict, art.VisionSpec]:
    """LlavaNextForConditionalGeneration: LLaVA's fields (CLIP tower only) and image_grid_pinpoints, each
    resolution a [height, width] of multiples of the tower's image_size (the tiles transformers cuts it into)."""
    from transformers import LlavaNextConfig

    text_type = (config.get("text_config") or {}).get("model_type", "llama")
    if text_type not in TEXT_ARCHITECTURES:
        raise CheckpointError(f"{model_dir}: a LLaVA-NeXT language model of model_type {text_type!r} is not "
                              f"supported; supported: {', '.join(TEXT_ARCHITECTURES)}")
    for key, what in (("spatial_merge_size", "a patch-merging projector"), ("downsample_ratio", "pixel shuffle")):
        if config.get(key) is not None:
            raise CheckpointError(f"{model_dir}: {key} ({what}) is not supported for LLaVA-NeXT")
    nxt = _read_config(LlavaNextConfig, config, model_dir, "LLaVA-NeXT", ("clip_vision_model",))
    layer = _feature_layer(nxt.vision_feature_layer, nxt.vision_config.num_hidden_layers, model_dir)
    strategy = nxt.vision_feature_select_strategy
    if strategy != "default":  # "full" keeps CLIP's CLS row: a tile's rows are no grid (transformers fails too)
        raise CheckpointError(f"{model_dir}: vision_feature_select_strategy {strategy!r} is not supported for "
                              "LLaVA-NeXT (its tiles' rows must be a grid of patches); set it to \"default\"")
    _check_activation(nxt.projector_hidden_act, model_dir)
    tile = nxt.vision_config.image_size
    pinpoints = nxt.image_grid_pinpoints
    if not (isinstance(pinpoints, list) and pinpoints and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, int) and x > 0 and x % tile == 0
                                                                for x in p) for p in pinpoints)):
        raise CheckpointError(f"{model_dir}: image_grid_pinpoints {pinpoints!r}: expected a list of [height, width] "
                              f"resolutions, each a multiple of the vision tower's image_size {tile}")
    text = _text_config(nxt, config, TEXT_ARCHITECTURES[text_type])
    spec = art.VisionSpec(
        architecture=LLAVA_NEXT, vision_config=_tower_config(nxt.vision_config),
        image_token_index=int(nxt.image_token_index), vision_feature_layer=layer,
        vision_feature_select_strategy=strategy, projector_hidden_act=nxt.projector_hidden_act,
        projector_bias=bool(getattr(nxt, "multimodal_projector_bias", True)), text_hidden_size=text["hidden_size"],
        image_grid_pinpoints=[[int(h), int(w)] for h, w in pinpoints],
    )
    return text, spec


def qwen_vl_config(config: dict, model_dir: Path) -> tuple[dict, art.VisionSpec]:
    """Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration / Qwen3VLForConditionalGeneration /
    Qwen3VLMoeForConditionalGeneration: the text config (transformers' defaults filled in, a flat legacy config.json
    read as transformers reads it) as Qwen2ForCausalLM's (Qwen3-VL: Qwen3ForCausalLM's; Qwen3-VL-MoE:
    Qwen3MoeForCausalLM's), and the vision section (the tower's config, the image and video tokens, the patch merger's
    side, M-RoPE's mrope_section; Qwen3-VL: its interleaved frequencies, its deepstack layers checked against the
    language model's; Qwen3-VL-MoE: Qwen3-VL's section)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

    architectures = config.get("architectures") or []
    arch = next(a for a in QWEN_VL_ARCHITECTURES if a in architectures)
    family, config_class, towers = {
        QWEN2_VL: ("Qwen2-VL", Qwen2VLConfig, ("qwen2_vl_vision", "qwen2_vl")),
        QWEN2_5_VL: ("Qwen2.5-VL", Qwen2_5_VLConfig, ("qwen2_5_vl_vision", "qwen2_5_vl")),
        QWEN3_VL: ("Qwen3-VL", Qwen3VLConfig, ("qwen3_vl_vision", "qwen3_vl")),
        QWEN3_VL_MOE: ("Qwen3-VL-MoE", Qwen3VLMoeConfig, ("qwen3_vl_moe_vision", "qwen3_vl_moe")),
    }[arch]
    qwen3 = arch in (QWEN3_VL, QWEN3_VL_MOE)
    parsed = _read_config(config_class, config, model_dir, family, towers)
    text = parsed.text_config.to_dict()
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    interleaved = bool(rope.pop("mrope_interleaved", qwen3))
    if interleaved != qwen3:  # transformers interleaves Qwen3-VL's always, the others' never
        raise CheckpointError(f"{model_dir}: mrope_interleaved {interleaved} is not what {family} runs "
                              f"({qwen3}); drop it from rope_parameters")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(f"{model_dir}: {family}'s rope type {rope_type!r} is not supported; M-RoPE over the "
                              "default rotary is (rope_type default)")
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if not (isinstance(section, list) and len(section) == 3 and all(isinstance(n, int) and n >= 0 for n in section)
            and sum(section) == head_dim // 2):
        raise CheckpointError(f"{model_dir}: mrope_section {section!r}: expected 3 counts of rotary frequencies "
                              f"(temporal, height, width) summing to head_dim / 2 = {head_dim // 2}")
    rope["rope_type"] = "default"
    rope.pop("type", None)
    text["rope_parameters"] = rope
    text.pop("rope_scaling", None)
    text["model_type"], text["architectures"] = {QWEN3_VL: ("qwen3", ["Qwen3ForCausalLM"]),
                                                 QWEN3_VL_MOE: ("qwen3_moe", ["Qwen3MoeForCausalLM"])}.get(
        arch, ("qwen2", ["Qwen2ForCausalLM"]))
    # (Qwen3VLMoeTextConfig defaults its own tie_word_embeddings to true; transformers ties by the top level's)
    text["tie_word_embeddings"] = bool(parsed.tie_word_embeddings or (arch != QWEN3_VL_MOE
                                                                      and text.get("tie_word_embeddings")))
    if arch == QWEN3_VL_MOE:
        text = _qwen3_vl_moe_text(text, model_dir)
    dtype = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    text["dtype"] = str(dtype).removeprefix("torch.") if dtype is not None else None
    vision = _tower_config(parsed.vision_config)
    out = "hidden_size" if arch == QWEN2_VL else "out_hidden_size"  # the merger's output width
    if vision.get(out) != text["hidden_size"]:
        raise CheckpointError(f"{model_dir}: vision_config.{out} {vision.get(out)} (the patch merger's output) is not "
                              f"the language model's hidden_size {text['hidden_size']}")
    if qwen3:
        _check_deepstack(vision, text["num_hidden_layers"], model_dir)
    if arch == QWEN3_VL_MOE:  # the same tower (Qwen3VLMoeVisionModel is Qwen3VLVisionModel): Qwen3-VL's section
        arch, vision["model_type"] = QWEN3_VL, "qwen3_vl_vision"
    spec = art.VisionSpec(
        architecture=arch, vision_config=vision,
        image_token_index=int(parsed.image_token_id), text_hidden_size=text["hidden_size"],
        spatial_merge_size=int(parsed.vision_config.spatial_merge_size), mrope_section=list(section),
        video_token_index=int(parsed.video_token_id), mrope_interleaved=interleaved,
    )
    return text, spec


def _qwen3_vl_moe_text(text: dict, model_dir: Path) -> dict:
    """Qwen3-VL-MoE's language model as Qwen3MoeForCausalLM's config: num_experts (transformers 5 writes it as
    num_local_experts) and norm_topk_prob true, as transformers' Qwen3VLMoeTextTopKRouter always renormalises the
    top-k; a config asking otherwise is refused by name."""
    if text.get("norm_topk_prob") is False:
        raise CheckpointError(f"{model_dir}: text_config.norm_topk_prob false: transformers' Qwen3-VL-MoE router "
                              "renormalises the top-k weights always (it reads no norm_topk_prob); set it to true")
    num_experts = text.get("num_experts") or text.get("num_local_experts")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise CheckpointError(f"{model_dir}: text_config.num_experts {num_experts!r}: Qwen3-VL-MoE needs experts (a "
                              "positive count)")
    return {**text, "num_experts": num_experts, "norm_topk_prob": True}


def qwen3_vl_moe_expert_tensors(reader, spec, config) -> dict:
    """Qwen3-VL-MoE's experts, as `TensorReader` derived tensors under Qwen3-MoE's per-expert names (gate_proj,
    up_proj, down_proj of `mlp.experts.{e}.`, output-major), each read as expert e's slice of its layer's two fused
    tensors (only that slice). The fused tensors come in two layouts: the published checkpoints' (transformers 4.57's,
    used with bmm: gate_up_proj [E, hidden, 2 * width], down_proj [E, width, hidden]) and the one transformers 5 holds
    in memory and its save_pretrained writes (gate_up_proj [E, 2 * width, hidden], down_proj [E, hidden, width]; it
    transposes the published ones as it loads them); gate is the first `width` outputs of gate_up, up the rest. The two
    tensors' shapes together tell the layouts apart (one tensor's can fit both: gate_up's where hidden == 2 * width,
    down's where hidden == width, never both at once); a layer whose shapes fit neither is refused by name."""
    hidden, width, experts = config.hidden_size, config.moe_intermediate_size, config.num_experts
    layouts = {"published": ((experts, hidden, 2 * width), (experts, width, hidden)),
               "save_pretrained": ((experts, 2 * width, hidden), (experts, hidden, width))}
    derived = {}
    for i in config.moe_layers:
        layer = f"{spec.hf_layer_prefix}{i}.mlp.experts."
        gate_up, down = layer + "gate_up_proj", layer + "down_proj"
        shapes = (reader.shape(gate_up), reader.shape(down))
        fits = [name for name, want in layouts.items() if shapes == want]
        if not fits:
            raise CheckpointError(f"{reader.model_dir}: {gate_up} {list(shapes[0])} and {down} {list(shapes[1])}: "
                                  f"expected {list(layouts['published'][0])} and {list(layouts['published'][1])} "
                                  f"(the published layout) or {list(layouts['save_pretrained'][0])} and "
                                  f"{list(layouts['save_pretrained'][1])} (transformers 5's) for num_experts "
                                  f"{experts}, hidden_size {hidden}, moe_intermediate_size {width}")
        major = (lambda t: t.t().contiguous()) if fits[0] == "published" else (lambda t: t)  # → [out, in]
        for e in range(experts):
            prefix = f"{layer}{e}."
            derived |= {
                prefix + "gate_proj.weight": lambda r, n=gate_up, e=e, m=major: m(r.get_index(n, e))[:width],
                prefix + "up_proj.weight": lambda r, n=gate_up, e=e, m=major: m(r.get_index(n, e))[width:],
                prefix + "down_proj.weight": lambda r, n=down, e=e, m=major: m(r.get_index(n, e)),
            }
    return derived


def _check_deepstack(vision: dict, num_layers: int, model_dir: Path) -> None:
    """Qwen3-VL's deepstack_visual_indexes: each a layer of the tower, distinct, and no more of them than decoder
    layers (the k-th feature transformers collects, in the tower's layer order, is added after decoder layer k)."""
    indexes, depth = vision.get("deepstack_visual_indexes") or [], vision.get("depth")
    if (not all(isinstance(i, int) and 0 <= i < depth for i in indexes) or len(set(indexes)) != len(indexes)
            or len(indexes) > num_layers):
        raise CheckpointError(f"{model_dir}: vision_config.deepstack_visual_indexes {list(indexes)!r}: expected "
                              f"distinct tower layers in 0..{depth - 1}, no more of them than the language model's "
                              f"{num_layers} decoder layers")


def _qwen_vl_names(names: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Qwen2-VL's / Qwen2.5-VL's / Qwen3-VL's tensor names (either layout): ({causal LM name: checkpoint name},
    {artifact name (`vision_tower.` + the vision transformer's own name): checkpoint name})."""
    language, vision = {}, {}
    for name in names:
        old = next((p for p in _QWEN_VISUAL_PREFIXES if name.startswith(p)), None)
        if old is not None:
            vision["vision_tower." + name[len(old):]] = name
        elif name.startswith("model.language_model."):
            language["model." + name.removeprefix("model.language_model.")] = name
        else:
            language[name] = name
    return language, vision


def llava_names(names: list[str]) -> tuple[dict[str, str], dict[str, str]] | None:
    """For a LLaVA, LLaVA-NeXT, Gemma 3 or Mistral 3 multimodal checkpoint's tensor names (either layout): ({causal
    LM name: checkpoint name} of the language model, {artifact name: checkpoint name} of the vision tower, projector
    and LLaVA-NeXT's image_newline); Qwen2-VL's and Qwen2.5-VL's (a `visual.` tower) by `_qwen_vl_names`;
    None for any other checkpoint. The vision tower's names lose CLIPVisionModel's / SiglipVisionModel's
    `vision_model.` level (transformers 5's vision models, and PixtralVisionModel, have none)."""
    if any(name.startswith(_QWEN_VISUAL_PREFIXES) for name in names):
        return _qwen_vl_names(names)
    if not any(name.startswith(_PROJECTOR_PREFIXES) for name in names):
        return None
    language, vision = {}, {}
    for name in names:
        lm = next((new + name[len(old):] for old, new in _LM_PREFIXES if name.startswith(old)), None)
        if lm is None and name.startswith("lm_head."):
            lm = name
        if lm is not None:
            language[lm] = name
            continue
        if name in _NEWLINE_NAMES:
            vision["image_newline"] = name
            continue
        for prefixes, to in ((_VISION_PREFIXES, "vision_tower."), (_PROJECTOR_PREFIXES, "multi_modal_projector.")):
            old = next((p for p in prefixes if name.startswith(p)), None)
            if old is not None:
                vision[to + name[len(old):].removeprefix("vision_model.")] = name
    return language, vision


def check_vision_recipe(recipe) -> None:
    """A vision model runs on the torch runtime, on one rank: an onnx-cpu or parallel build is refused by name."""
    names = " and ".join(VISION_ARCHITECTURES)
    if recipe.target.device == "onnx-cpu":
        raise RecipeError(f"target.device onnx-cpu: vision models ({names}) are not exported to ONNX; use "
                          "target.device cpu or cuda")
    if recipe.parallel.tensor * recipe.parallel.pipeline > 1:
        raise RecipeError(f"parallel: vision models ({names}) run on one rank; set parallel.tensor and "
                          "parallel.pipeline to 1")


def write_vision_weights(reader, path: Path, dtype: str) -> int:
    """The vision tower's and projector's tensors, in the model dtype, to `path`; returns its size in bytes."""
    tensors = {name: reader.get_source(source).to(getattr(torch, dtype)).contiguous()
               for name, source in sorted(reader.vision_names.items())}
    if not any(name.startswith(("multi_modal_projector.", "vision_tower.merger.")) for name in tensors):
        raise CheckpointError(f"{reader.model_dir}: no multi_modal_projector (or Qwen2-VL's / Qwen3-VL's "
                              "visual.merger) tensors in the checkpoint")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path.stat().st_size
