"""Images (and Qwen2-VL's and Qwen3-VL's videos) for vision-language models (LLaVA, LLaVA-NeXT, Gemma 3, Mistral 3,
Qwen2-VL, Qwen2.5-VL, Qwen3-VL): preprocessing, the vision encoder, and the image embeddings that replace the image
tokens' embedding rows in a prompt's prefill (DESIGN §5, "Images").

A request's images are encoded once, when it is added (`VisionEncoder.prompt_inputs`): transformers' image
processor of the artifact (tokenizer/'s processor files) makes the pixel values, a tower and a projector chosen by
the manifest's vision architecture make the rows, and each image's placeholder in the prompt becomes one token per
embedding row. LLaVA: transformers' CLIPVisionModel, the configured layer's hidden states (CLS row dropped under
strategy "default"), its two-layer projector; the placeholder is one <image> token. Gemma 3: transformers'
SiglipVisionModel's last hidden state through transformers' Gemma3MultiModalProjector (mm_tokens_per_image rows);
the placeholder is <start_of_image>, expanded as Gemma3Processor expands it ("\n\n", <start_of_image>, the image
tokens, <end_of_image>, "\n\n"), or already expanded so; its images' tokens attend to each other both ways in
the prefill (`ImageInputs.spans`, `step_key_limits`). Pixtral towers (Mistral 3, LLaVA's pixtral-12b): each
image at its own size (PixtralImageProcessor's resize to a multiple of the patch, times spatial_merge_size),
encoded alone by transformers' PixtralVisionModel (a batch of images is one sequence to it, its attention
block-diagonal: alone is the same rows at a single image's cost), then Mistral3MultiModalProjector (RMSNorm, patch
merger, linear-act-linear) or LLaVA's projector; the placeholder is one [IMG], expanded as PixtralProcessor expands
it (a row of [IMG] per row of merged patches, each row ended by [IMG_BREAK], the last by [IMG_END]), or already
expanded so; the rows replace the [IMG] tokens only, and attend causally. LLaVA-NeXT: LLaVA's tower and
projector run on each tile of the anyres grid (LlavaNextImageProcessor's: the image resized and padded to the best of
image_grid_pinpoints, cut into tiles of the tower's size, after the image itself resized, the base), the tiles'
features laid out as the grid, unpadded to the image's aspect and ended row by row with `image_newline`
(`_anyres_rows`); the placeholder is one <image>, expanded to that image's rows (as many as LlavaNextProcessor
writes), or already expanded so. Qwen2-VL / Qwen2.5-VL: each image at its own size (Qwen2VLImageProcessor's
dynamic resolution: its image_grid_thw), every image of a call in one run of transformers' vision transformer (its
attention is per image: cu_seqlens), whose patch merger gives the rows, a grid [rows, columns] of merged patches;
the placeholder is one <|image_pad|>, expanded to that image's rows (as Qwen2VLProcessor writes them), or already
expanded so; its tokens attend causally, and the request's M-RoPE positions (three per token, runtime/mrope.py)
are computed with the expansion (`ImageInputs.mrope`). Qwen2-VL's videos (multi_modal_data's 'video': frames) go
through the same tower, each frame preprocessed by the image processor and the frames grouped temporal_patch_size
at a time (`_video_pixels`), <|video_pad|> expanded to t x h x w / merge² rows, the frame groups' temporal
positions apart by `video_interval`; a prompt's images and videos share its ImageInputs. Qwen3-VL: Qwen2-VL's flow
with transformers' Qwen3VLVisionModel, whose deepstack mergers give each image token one more row per deepstack
layer (`ImageInputs.deepstack`), added to the language model's hidden state at that token after decoder layer 0, 1,
... (`step_deepstack_rows`), and interleaved M-RoPE frequencies (runtime/mrope.py). Its videos (`Video`: frames,
and vLLM's metadata fps and frames_indices) are resized as Qwen3VLVideoProcessor resizes them (its smart_resize over
all frames, `_qwen3_frames`), patched as Qwen2-VL's, and each <|vision_start|><|video_pad|><|vision_end|> (or a bare
<|video_pad|>) becomes, per frame group, its timestamp "<t seconds>" (`qwen3_timestamps`), <|vision_start|>, the
group's <|video_pad|> run and <|vision_end|>, as Qwen3VLProcessor and vLLM write it; each group's positions are an
image's (t = 1), and its tokens take deepstack rows as image tokens do. The
request keeps the embeddings
(`ImageInputs`) until it ends, so a chunk of its prompt, and a recompute after preemption, puts the same rows in
(`step_image_rows`); the model's forward writes them over those tokens' embedding rows. The chat API's parts
(`chat_images`): images as data URLs or PIL images, and for the models that take videos vLLM's video_url parts,
decoded by runtime/video_io.py.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import numbers
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from llmc.errors import ArtifactError, RequestError
from llmc.runtime import artifact as art
from llmc.runtime.tokenizer import TEXT_PART_FIELDS

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an image sent inline (a data URL), decoded
MAX_ENCODER_BATCH = 32  # images per vision-tower call when a batch of requests' images is encoded ahead (prefetch)
CHAT_IMAGE_PARTS = ("image_url", "image_pil")  # the content parts that carry an image (OpenAI's; vLLM's PIL one)
CHAT_VIDEO_PART = "video_url"  # vLLM's content part of a video (a data URL; runtime/video_io.py decodes it)
QWEN3_DEFAULT_FPS = 24.0  # Qwen3VLProcessor's frame rate for a video whose metadata gives none (its timestamps)


@dataclass(eq=False)
class ImageInputs:
    """A request's images, encoded.

    Fields:
        positions: the prompt positions of its image tokens, ascending (one per embedding row).
        embeds: [len(positions), hidden_size] on the model's device: the rows those positions take.
        hash: sha256 of the images' pixel values: the root of its prefix-cache blocks (block_pool), so a prompt's
            blocks never match those of the same text with other images, or without.
        spans: each image's token positions [start, end) where its tokens attend to each other both ways (Gemma 3):
            a prefill chunk never ends inside one (`chunk_end`); empty: causal images (LLaVA), chunked anywhere.
        mrope: Qwen2-VL's M-RoPE positions of the prompt's tokens, [3, prompt tokens] int64 (temporal, height,
            width; a text token's three equal), or None: the 1-D positions (every other model).
        rope_delta: the rotary position of a token after the prompt minus its index (vLLM's mrope_position_delta:
            the prompt's largest M-RoPE position + 1 - its length; 0 without M-RoPE).
        deepstack: Qwen3-VL's deepstack rows [levels, len(positions), hidden_size] on the model's device: level k is
            added to the hidden state of the token at positions[i] after decoder layer k; None: no deepstack.
    """

    positions: list[int]
    embeds: Tensor
    hash: bytes
    spans: list[tuple[int, int]] = field(default_factory=list)
    mrope: np.ndarray | None = None
    rope_delta: int = 0
    deepstack: Tensor | None = None

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """[3, end - start] int64: the M-RoPE positions of tokens start..end-1 (the prompt's, then index + rope_delta
        for the tokens after it, three equal)."""
        prompt = self.mrope.shape[1]
        after = np.arange(max(start, prompt), end, dtype=np.int64) + self.rope_delta
        return np.concatenate([self.mrope[:, start:min(end, prompt)], np.broadcast_to(after, (3, len(after)))], axis=1)

    def chunk_end(self, start: int, end: int) -> int:
        """The end of a prefill chunk [start, end) that ends inside no span: cut back to that image's start, or to
        `start` (nothing this step) where the chunk starts inside or at the image (the whole image must fit)."""
        for lo, hi in self.spans:
            if lo < end < hi:
                return lo if lo > start else start
        return end


def images_of(multi_modal_data) -> list:
    """vLLM's multi_modal_data ({"image": a PIL image or a list of them}) → the images; RequestError otherwise."""
    from PIL import Image

    if not isinstance(multi_modal_data, dict):
        raise RequestError(f"multi_modal_data: expected a dict such as {{'image': PIL.Image}}, got "
                           f"{type(multi_modal_data).__name__}", param="multi_modal_data")
    other = sorted(set(multi_modal_data) - {"image", "video"})  # videos: videos_of
    if other:
        raise RequestError(f"multi_modal_data.{other[0]}: only images are supported (the 'image' key)",
                           param="multi_modal_data")
    images = multi_modal_data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [] if images is None else [images]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise RequestError(f"multi_modal_data.image[{i}]: expected a PIL.Image.Image, got {type(image).__name__}",
                               param="multi_modal_data")
    return images


@dataclass(eq=False)
class Video:
    """One video of a request: its frames (PIL RGB images of one size), and for Qwen3-VL the rate and source frame
    indices its frame timestamps are computed from (`qwen3_timestamps`)."""

    frames: list
    fps: float = QWEN3_DEFAULT_FPS
    indices: list[int] = field(default_factory=list)


VIDEO_METADATA_KEYS = ("fps", "frames_indices", "total_num_frames", "duration", "video_backend", "do_sample_frames")


def videos_of(multi_modal_data, takes_video: bool, refusal: str | None = None,
              metadata: bool = False) -> list[Video]:
    """vLLM's multi_modal_data's videos ({"video": frames or a list of them}; frames: a uint8 numpy array
    [num_frames, height, width, 3] or a list of PIL images of one size) → each video's frames as PIL RGB images;
    RequestError where the model takes no video (`takes_video`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL; `refusal` says why)
    or a video is malformed. `metadata` (Qwen3-VL): a video may also be vLLM's (frames, metadata dict) pair, whose
    fps and frames_indices make its frame timestamps (`_video_metadata`)."""
    from PIL import Image

    videos = multi_modal_data.get("video") if isinstance(multi_modal_data, dict) else None
    if videos is None:
        return []
    if not takes_video:
        why = refusal or "only images are supported (the 'image' key)"
        raise RequestError(f"multi_modal_data.video: {why}", param="multi_modal_data")
    if isinstance(videos, tuple) and not metadata:
        raise RequestError("multi_modal_data.video: (frames, metadata) pairs are not supported (frames are taken as "
                           "sampled at 2 fps); give the frames alone", param="multi_modal_data")
    if isinstance(videos, (np.ndarray, tuple)) or (isinstance(videos, list) and videos
                                                   and all(isinstance(f, Image.Image) for f in videos)):
        videos = [videos]
    if not isinstance(videos, list):
        raise RequestError(f"multi_modal_data.video: expected frames (a uint8 array [num_frames, height, width, 3] "
                           f"or a list of PIL images) or a list of them, got {type(videos).__name__}",
                           param="multi_modal_data")
    out = []
    for i, video in enumerate(videos):
        where = f"multi_modal_data.video[{i}]"
        if isinstance(video, tuple) and metadata:
            if len(video) != 2:
                raise RequestError(f"{where}: expected a (frames, metadata) pair, got a tuple of {len(video)}",
                                   param="multi_modal_data")
            frames = _frames(video[0], where)
            out.append(Video(frames, *_video_metadata(video[1], len(frames), where)))
        elif isinstance(video, tuple):
            raise RequestError(f"{where}: (frames, metadata) pairs are not supported (frames are taken as sampled at "
                               "2 fps); give the frames alone", param="multi_modal_data")
        else:
            frames = _frames(video, where)
            out.append(Video(frames, QWEN3_DEFAULT_FPS, list(range(len(frames)))))
    return out


def _video_metadata(metadata, count: int, where: str) -> tuple[float, list[int]]:
    """(fps, frames_indices) of vLLM's video metadata dict for `count` frames: fps (QWEN3_DEFAULT_FPS where absent or
    None, as Qwen3VLProcessor assumes) and frames_indices (the frames' indices in the source video; 0..count-1 where
    absent) make the timestamps; total_num_frames, duration and video_backend only describe the source (checked
    where they bound the indices); do_sample_frames true (sample the frames again) is refused: the frames given are
    the frames used. Any other key is refused by name."""
    if not isinstance(metadata, dict):
        raise RequestError(f"{where}: expected (frames, metadata) with metadata a dict such as {{'fps': 2.0, "
                           f"'frames_indices': [...]}}, got {type(metadata).__name__}", param="multi_modal_data")
    other = sorted(set(metadata) - set(VIDEO_METADATA_KEYS))
    if other:
        raise RequestError(f"{where}: video metadata {other[0]!r} is not supported (only "
                           f"{', '.join(VIDEO_METADATA_KEYS)}); drop it", param="multi_modal_data")
    if metadata.get("do_sample_frames"):
        raise RequestError(f"{where}: do_sample_frames true (sampling the frames again) is not supported; give the "
                           "frames to use, with do_sample_frames false", param="multi_modal_data")
    fps = metadata.get("fps")
    fps = QWEN3_DEFAULT_FPS if fps is None else fps
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps) or fps <= 0:
        raise RequestError(f"{where}: video metadata fps must be a positive number, got {fps!r}",
                           param="multi_modal_data")
    indices = metadata.get("frames_indices")
    indices = list(range(count)) if indices is None else indices
    if isinstance(indices, np.ndarray):
        indices = indices.tolist()
    if (not isinstance(indices, (list, tuple)) or len(indices) != count
            or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0 for x in indices)):
        raise RequestError(f"{where}: video metadata frames_indices must be {count} non-negative ints (one per frame "
                           f"given), got {indices!r:.80}", param="multi_modal_data")
    total = metadata.get("total_num_frames")
    if total is not None and (not isinstance(total, numbers.Integral) or any(x >= total for x in indices)):
        raise RequestError(f"{where}: video metadata frames_indices reach past total_num_frames {total!r}",
                           param="multi_modal_data")
    return float(fps), [int(x) for x in indices]


def _frames(video, where: str) -> list:
    from PIL import Image

    if isinstance(video, np.ndarray):
        if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3 or 0 in video.shape:
            raise RequestError(f"{where}: expected a uint8 array [num_frames, height, width, 3], got {video.dtype} "
                               f"{list(video.shape)}", param="multi_modal_data")
        return [Image.fromarray(frame) for frame in video]
    if not isinstance(video, list) or not video or not all(isinstance(f, Image.Image) for f in video):
        raise RequestError(f"{where}: expected a uint8 array [num_frames, height, width, 3] or a non-empty list of "
                           f"PIL images, got {type(video).__name__}", param="multi_modal_data")
    if len({f.size for f in video}) > 1:
        raise RequestError(f"{where}: its frames differ in size ({sorted({f.size for f in video})}); give frames of "
                           "one size", param="multi_modal_data")
    return [f.convert("RGB") for f in video]


class Projector(nn.Module):
    """LLaVA's multi_modal_projector: linear_1, the activation, linear_2."""

    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool):
        from transformers.activations import ACT2FN

        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def is_pixtral(spec: art.VisionSpec) -> bool:
    """Whether the tower is Pixtral's (Mistral 3, LLaVA's pixtral-12b): images of any size, PixtralProcessor's
    placeholders."""
    return spec.vision_config.get("model_type") == "pixtral"


QWEN3_VL = "Qwen3VLForConditionalGeneration"


def is_qwen_vl(spec: art.VisionSpec) -> bool:
    """Whether the model is Qwen2-VL, Qwen2.5-VL or Qwen3-VL: dynamic resolution, the merger in the tower, M-RoPE
    positions."""
    return spec.architecture in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                                 QWEN3_VL)


def takes_videos(spec: art.VisionSpec | None) -> bool:
    """Whether the model runs videos (multi_modal_data's 'video'): Qwen2-VL, Qwen2.5-VL and Qwen3-VL (Qwen3-VL-MoE
    builds Qwen3-VL's vision section)."""
    return spec is not None and is_qwen_vl(spec)


def _tower_and_projector(spec: art.VisionSpec) -> tuple[nn.Module, nn.Module | None]:
    """The manifest's vision tower and projector, unloaded: LLaVA's and LLaVA-NeXT's CLIPVisionModel (or LLaVA's
    PixtralVisionModel) and Projector, Gemma 3's SiglipVisionModel and transformers' Gemma3MultiModalProjector, Mistral 3's
    PixtralVisionModel and transformers' Mistral3MultiModalProjector; Qwen2-VL's / Qwen2.5-VL's vision transformer
    (transformers' Qwen2VisionTransformerPretrainedModel / Qwen2_5_VisionTransformerPretrainedModel: its patch merger
    is the projector) and None; Qwen3-VL's Qwen3VLVisionModel (its mergers, deepstack's included) and None."""
    if spec.architecture == "Qwen2VLForConditionalGeneration":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(**spec.vision_config)).eval(), None
    if spec.architecture == "Qwen2_5_VLForConditionalGeneration":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**spec.vision_config)).eval(), None
    if spec.architecture == QWEN3_VL:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel(Qwen3VLVisionConfig(**spec.vision_config)).eval(), None
    if is_pixtral(spec):
        from transformers import Mistral3Config, PixtralVisionConfig, PixtralVisionModel
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        config = PixtralVisionConfig(**spec.vision_config)
        tower = PixtralVisionModel(config).eval()
        if spec.architecture != "Mistral3ForConditionalGeneration":
            return tower, Projector(config.hidden_size, spec.text_hidden_size, spec.projector_hidden_act,
                                    spec.projector_bias)
        mistral = Mistral3Config(
            vision_config=config.to_dict(), spatial_merge_size=spec.spatial_merge_size,
            text_config={"model_type": "mistral", "hidden_size": spec.text_hidden_size,
                         "rms_norm_eps": spec.projector_norm_eps},
            projector_hidden_act=spec.projector_hidden_act, multimodal_projector_bias=spec.projector_bias,
            vision_feature_layer=spec.vision_feature_layer)
        return tower, Mistral3MultiModalProjector(mistral).eval()
    if spec.architecture == "Gemma3ForConditionalGeneration":
        from transformers import Gemma3Config, SiglipVisionConfig, SiglipVisionModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        config = SiglipVisionConfig(**spec.vision_config)
        gemma = Gemma3Config(vision_config=config.to_dict(), text_config={"hidden_size": spec.text_hidden_size},
                             mm_tokens_per_image=spec.mm_tokens_per_image)
        return SiglipVisionModel(config).eval(), Gemma3MultiModalProjector(gemma).eval()
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(**spec.vision_config)
    return (CLIPVisionModel(config).eval(),
            Projector(config.hidden_size, spec.text_hidden_size, spec.projector_hidden_act, spec.projector_bias))


class VisionEncoder:
    """The image side of a vision artifact, on the engine's device in the compute dtype."""

    def __init__(self, artifact_dir: Path, manifest: art.Manifest, device: torch.device, dtype: torch.dtype):
        from safetensors.torch import load_file

        spec = manifest.vision
        self.spec, self.device, self.dtype = spec, device, dtype
        self.image_token_id = spec.image_token_index
        self.is_gemma3 = spec.architecture == "Gemma3ForConditionalGeneration"
        self.is_pixtral = is_pixtral(spec)
        self.is_next = spec.architecture == "LlavaNextForConditionalGeneration"
        self.is_qwen = is_qwen_vl(spec)
        self.is_qwen3 = spec.architecture == QWEN3_VL  # deepstack rows; timestamped videos
        self.takes_videos = takes_videos(spec)
        if self.is_qwen:  # its processor files checked against the tower (what <|image_pad|> expands to)
            processor = qwen_vl_image_processor(artifact_dir / art.TOKENIZER_DIR, spec, ArtifactError)
        if self.takes_videos:
            self.video_interval = video_interval(spec)
            self.video_kwargs = qwen_vl_video_kwargs(artifact_dir / art.TOKENIZER_DIR, spec, ArtifactError)
        if self.is_qwen3:  # a video's frame timestamps ("<0.5 seconds>") are tokenized as the prompt is
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(artifact_dir / art.TOKENIZER_DIR), local_files_only=True)
            ids = self.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
            if None in ids or self.tokenizer.unk_token_id in ids:
                raise ArtifactError(f"{art.TOKENIZER_DIR}: the tokenizer has no <|vision_start|> or <|vision_end|> "
                                    "token (Qwen3-VL's video frames are written between them); rebuild the artifact")
            self.vision_start, self.vision_end = ids
        elif self.is_next:  # its processor files checked against the model's tiling (what <image> expands to)
            processor = check_anyres_processor(artifact_dir / art.TOKENIZER_DIR, spec, ArtifactError)
        elif self.is_pixtral:  # PixtralProcessor's fields read from its files (it needs torchvision; we do not)
            self.pixtral = pixtral_processor_fields(artifact_dir / art.TOKENIZER_DIR, spec, ArtifactError)
            processor = pixtral_image_processor(artifact_dir / art.TOKENIZER_DIR, spec, self.pixtral, ArtifactError)
        else:
            processor = _processor(artifact_dir / art.TOKENIZER_DIR)
        self.image_processor = processor if not hasattr(processor, "image_processor") else processor.image_processor
        if getattr(self.image_processor, "do_pan_and_scan", None):
            raise ArtifactError(f"{art.TOKENIZER_DIR}: the image processor's do_pan_and_scan is true (pan-and-scan "
                                "crops) and is not supported; set it to false in its processor files")
        self._image_sequence = self._gemma3_image_sequence(processor) if self.is_gemma3 else None
        art.verify_for_load(artifact_dir, manifest, [art.VISION_WEIGHTS])
        tensors = load_file(str(artifact_dir / art.VISION_WEIGHTS))
        self.tower, self.projector = _tower_and_projector(spec)
        nested = next(iter(self.tower.state_dict())).startswith("vision_model.")  # transformers < 5's naming
        tower = {("vision_model." if nested else "") + name.removeprefix("vision_tower."): t
                 for name, t in tensors.items() if name.startswith("vision_tower.")}
        self.image_newline = tensors.get("image_newline")
        if self.is_next and (self.image_newline is None or self.image_newline.shape != (spec.text_hidden_size,)):
            raise ArtifactError(f"{art.VISION_WEIGHTS} has no image_newline of {spec.text_hidden_size} values "
                                "(LLaVA-NeXT's row separator); rebuild the artifact")
        projector = {name.removeprefix("multi_modal_projector."): t
                     for name, t in tensors.items() if name.startswith("multi_modal_projector.")}
        try:
            self.tower.load_state_dict(tower, strict=True)
            if self.projector is not None:
                self.projector.load_state_dict(projector, strict=True)
        except RuntimeError as e:
            raise ArtifactError(f"{art.VISION_WEIGHTS} does not match the manifest's vision config "
                                f"({str(e).splitlines()[0]}); rebuild the artifact") from None
        self.tower.to(device=device, dtype=dtype)
        if torch.device(device).type == "cuda" and dtype == torch.float32:
            # PyTorch lets cuDNN round a float32 convolution's inputs to TF32 by default: Qwen2-VL's Conv3d patch
            # embedding then moved its image tokens' logprobs by up to 6e-3 from the CPU's (session 44, H200; 1e-5
            # with it off, as text-only requests agree). A float32 artifact computes in float32; llmc's own
            # kernels use no cuDNN, so the process-wide flag changes only the towers.
            torch.backends.cudnn.allow_tf32 = False
        if self.projector is not None:
            self.projector.to(device=device, dtype=dtype)
        if self.image_newline is not None:
            self.image_newline = self.image_newline.to(device=device, dtype=dtype)
        # images encoded ahead of their requests (prefetch): id(image) → (image, its pixel values, its rows)
        self._prefetched: dict[int, tuple[object, Tensor, Tensor]] = {}

    def prefetch(self, images: list) -> None:
        """Encode the images of requests about to be added (LLM.generate's prompts), MAX_ENCODER_BATCH to a tower
        call, for `encode` to take: one call per batch instead of one per request. `clear_prefetched` drops what
        no request took."""
        for start in range(0, len(images), MAX_ENCODER_BATCH):
            chunk = images[start : start + MAX_ENCODER_BATCH]
            pixels = self._pixels(chunk)
            for image, px, rows in zip(chunk, pixels, self._rows(pixels)):
                self._prefetched[id(image)] = (image, px, rows)

    def clear_prefetched(self) -> None:
        self._prefetched.clear()

    @torch.inference_mode()
    def encode(self, images: list) -> tuple[list[Tensor], bytes]:
        """(each image's embeddings [rows, text hidden_size], the sha256 of their pixel values); images prefetched
        are taken from there."""
        hits = [self._prefetched.pop(id(image), None) for image in images]
        if all(hit is not None and hit[0] is image for hit, image in zip(hits, images)):
            pixels, rows = [hit[1] for hit in hits], [hit[2] for hit in hits]
        else:
            pixels = self._pixels(images)
            rows = self._rows(pixels)
        return rows, self._digest(pixels)

    def _digest(self, pixels: list) -> bytes:
        """The sha256 of images' (or Qwen2-VL videos') pixel values as `_pixels` gives them, with their sizes where
        those differ (Pixtral's images; LLaVA-NeXT's and Qwen2-VL's: their own)."""
        digest = hashlib.sha256()
        for px in pixels:
            if self.is_next or self.is_qwen:
                digest.update(repr(px[1]).encode())
                px = px[0]
            if self.is_pixtral:
                digest.update(repr(tuple(px.shape)).encode())
            digest.update(px.float().numpy().tobytes())
        return digest.digest()

    def _pixels(self, images: list) -> list:
        """Each image's pixel values [3, height, width]: the tower's size, or a Pixtral image's own (resized to a
        multiple of patch_size * spatial_merge_size, as PixtralProcessor asks its image processor); LLaVA-NeXT:
        (its tiles [base + grid, 3, size, size], its (height, width)); Qwen2-VL: (its patches [t * h * w,
        channels * temporal_patch_size * patch_size²], its image_grid_thw (t, h, w))."""
        kwargs = {}
        if self.is_pixtral:
            side = self.pixtral["patch_size"] * self.pixtral["spatial_merge_size"]
            kwargs["patch_size"] = {"height": side, "width": side}
        try:
            out = self.image_processor(images=images, return_tensors="pt", **kwargs)
        except Exception as e:  # noqa: BLE001 - the processor's own types (a mode it cannot convert, ...)
            raise RequestError(f"multi_modal_data: an image cannot be preprocessed ({type(e).__name__}: {e})",
                               param="multi_modal_data") from None
        if self.is_qwen:
            grids = [tuple(int(x) for x in grid) for grid in out["image_grid_thw"].tolist()]
            return list(zip(out["pixel_values"].split([math.prod(g) for g in grids]), grids))
        if self.is_next:
            sizes = [tuple(int(x) for x in size) for size in out["image_sizes"].tolist()]
            return [(px[: 1 + math.prod(self._grid(size))].contiguous(), size)
                    for px, size in zip(out["pixel_values"], sizes)]
        if not self.is_pixtral:
            return list(out["pixel_values"])
        return [px[:, :h, :w].contiguous() for px, (h, w) in zip(out["pixel_values"], out["image_sizes"].tolist())]

    @torch.inference_mode()
    def _rows(self, pixels: list[Tensor]) -> list[Tensor]:
        """Each image's embedding rows: the tower's configured layer (CLS dropped for "default"), projected;
        Gemma 3: the tower's last hidden state (after its post-layernorm), pooled and projected; Pixtral: each
        image alone, its rows as a grid [rows, columns, hidden_size] (`_pixtral_rows`)."""
        if self.is_pixtral:
            return [self._pixtral_rows(px) for px in pixels]
        if self.is_qwen:
            return self._qwen_rows(pixels)
        if self.is_next:  # every image's tiles in one tower call, then each image's packed alone
            tiles = torch.cat([px for px, _ in pixels])
            features = self._projected(tiles).split([px.shape[0] for px, _ in pixels])
            return [self._anyres_rows(f, size) for f, (_, size) in zip(features, pixels)]
        pixels = torch.stack(pixels)
        if self.is_gemma3:
            return list(self.projector(self.tower(pixels.to(self.device, self.dtype)).last_hidden_state))
        return list(self._projected(pixels))

    def _projected(self, pixels: Tensor) -> Tensor:
        """LLaVA's rows of a batch of images [n, 3, size, size] → [n, patches (+ CLS under "full"), hidden_size]:
        the tower's configured layer, CLS dropped for "default", projected."""
        out = self.tower(pixels.to(self.device, self.dtype), output_hidden_states=True)
        features = out.hidden_states[self.spec.vision_feature_layer]
        if self.spec.vision_feature_select_strategy == "default":
            features = features[:, 1:]
        return self.projector(features)

    def _grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """LLaVA-NeXT: the tiles (rows, columns) of an image of `size` (height, width): the best of
        image_grid_pinpoints (transformers' select_best_resolution, as its image processor picks it) in tiles."""
        from transformers.image_processing_utils import select_best_resolution

        tile = self.spec.vision_config["image_size"]
        height, width = select_best_resolution(size, self.spec.image_grid_pinpoints)
        return height // tile, width // tile

    def _anyres_rows(self, features: Tensor, size: tuple[int, int]) -> Tensor:
        """One LLaVA-NeXT image's rows: the base image's, then the tiles' features as one grid of patches
        [rows, columns], the padding the resize added (to fit the image's aspect in the grid) cut off, and
        image_newline after each row of patches (LlavaNextModel.pack_image_features' order)."""
        side = self.spec.vision_config["image_size"] // self.spec.vision_config["patch_size"]
        rows, columns = self._grid(size)
        base, tiles = features[0], features[1:]
        if tiles.shape[1] != side * side:
            raise ArtifactError(f"the vision tower gives {tiles.shape[1]} rows a tile, not {side * side} (its "
                                "patches); vision_feature_select_strategy \"default\" needs a tower with a CLS row")
        grid = tiles.view(rows, columns, side, side, -1).permute(0, 2, 1, 3, 4).reshape(rows * side, columns * side, -1)
        height, width = size
        grid_height, grid_width = grid.shape[:2]
        if width / height > grid_width / grid_height:  # wider than the grid: padded above and below
            pad = (grid_height - int(round(height * (grid_width / width), 7))) // 2
            grid = grid[pad : grid_height - pad]
        else:  # padded left and right
            pad = (grid_width - int(round(width * (grid_height / height), 7))) // 2
            grid = grid[:, pad : grid_width - pad]
        newline = self.image_newline.expand(grid.shape[0], 1, -1)
        return torch.cat([base, torch.cat([grid, newline], dim=1).reshape(-1, grid.shape[-1])])

    def _qwen_rows(self, pixels: list[tuple[Tensor, tuple[int, int, int]]]) -> list[Tensor]:
        """Qwen2-VL's / Qwen2.5-VL's images in one call of the vision transformer (Qwen2VLModel.get_image_features:
        its attention is per image, and Qwen2.5's windows stay within one), each image's merged rows as a grid
        [t, h / merge, w / merge, hidden_size] (an image is one frame: t 1; a video t frame groups). Qwen3-VL: each
        grid [..., (1 + levels) * hidden_size], the merger's row then each deepstack merger's side by side
        (Qwen3VLModel.get_image_features' pooler_output and deepstack_features; `_qwen_prompt_inputs` parts them)."""
        grids = [grid for _, grid in pixels]
        patches = torch.cat([px for px, _ in pixels]).to(self.device, self.dtype)
        out = self.tower(patches, grid_thw=torch.tensor(grids, device=self.device))
        rows = out.pooler_output
        if self.is_qwen3 and out.deepstack_features:
            rows = torch.cat([rows, *out.deepstack_features], dim=-1)
        merge = self.spec.spatial_merge_size
        return [r.reshape(t, h // merge, w // merge, r.shape[-1])
                for r, (t, h, w) in zip(rows.split([math.prod(g) // merge**2 for g in grids]), grids)]

    def _pixtral_rows(self, pixels: Tensor) -> Tensor:
        """One image's rows [rows, columns, hidden_size] (Mistral3Model.get_image_features / LlavaModel's with
        image_sizes): PixtralVisionModel's configured hidden state, then Mistral3MultiModalProjector (RMSNorm,
        patch merger, linears) or LLaVA's projector; rows and columns: its patches per side / spatial_merge_size."""
        sizes = [tuple(pixels.shape[-2:])]
        out = self.tower(pixels[None].to(self.device, self.dtype), image_sizes=sizes, output_hidden_states=True)
        features = out.hidden_states[self.spec.vision_feature_layer][0]
        if self.spec.architecture == "Mistral3ForConditionalGeneration":
            rows = self.projector(features, sizes)
        else:
            rows = self.projector(features)
        side = self.pixtral["patch_size"] * self.pixtral["spatial_merge_size"]
        return rows.reshape(sizes[0][0] // side, sizes[0][1] // side, rows.shape[-1])

    def prompt_inputs(self, token_ids: list[int], images: list, videos: list = ()) -> tuple[list[int], ImageInputs]:
        """The prompt with each image's placeholder (one image token, or as many as it has rows, as transformers'
        processor writes it) expanded to one image token per embedding row, and the request's ImageInputs;
        `videos` (`Video`s): Qwen2-VL's and Qwen3-VL's only (videos_of refuses them for other models)."""
        if self.is_gemma3:
            return self._gemma3_prompt_inputs(token_ids, images)
        if self.is_pixtral:
            return self._pixtral_prompt_inputs(token_ids, images)
        if self.is_qwen:
            return self._qwen_prompt_inputs(token_ids, images, videos)
        runs = self._placeholder_runs(token_ids)
        if len(runs) != len(images):
            raise RequestError(f"the prompt has {len(runs)} image placeholder(s) (token id {self.image_token_id}) for "
                               f"{len(images)} image(s); put one placeholder (e.g. <image>) in the prompt per image",
                               param="multi_modal_data")
        embeds, digest = self.encode(images)
        expanded, positions, at = [], [], 0
        for (start, end), rows in zip(runs, embeds):
            if end - start not in (1, rows.shape[0]):
                raise RequestError(f"an image placeholder of {end - start} tokens: this model takes one per image, or "
                                   f"{rows.shape[0]} (its embedding rows)", param="multi_modal_data")
            expanded += token_ids[at:start]
            positions += range(len(expanded), len(expanded) + rows.shape[0])
            expanded += [self.image_token_id] * rows.shape[0]
            at = end
        expanded += token_ids[at:]
        return expanded, ImageInputs(positions, torch.cat(embeds), digest)

    def _qwen_prompt_inputs(self, token_ids: list[int], images: list, videos: list[Video]
                            ) -> tuple[list[int], ImageInputs]:
        """Qwen2-VL: each <|image_pad|> / <|video_pad|> run either one token (expanded to the image's or video's
        rows, as Qwen2VLProcessor expands it: t x h x w / merge² for a video's video_grid_thw) or already that many
        (kept); the request's M-RoPE positions (`mrope_positions`) with it. Images and videos take their runs in
        order, each kind its own. A Qwen3-VL video's one <|video_pad|> (with the <|vision_start|> and <|vision_end|>
        around it, where they are) becomes, per frame group, its timestamp's tokens (`_qwen3_timestamps`),
        <|vision_start|>, the group's h x w / merge² <|video_pad|> and <|vision_end|>; each group's positions are an
        image's (t = 1), as Qwen3VLModel.get_rope_index splits video_grid_thw."""
        video = self.spec.video_token_index
        runs = self._placeholder_runs(token_ids, (self.image_token_id, video))
        counts = [sum(token_ids[lo] == t for lo, _ in runs) for t in (self.image_token_id, video)]
        if counts[0] != len(images):
            raise RequestError(f"the prompt has {counts[0]} image placeholder(s) (<|image_pad|>, token id "
                               f"{self.image_token_id}) for {len(images)} image(s); put one "
                               "<|vision_start|><|image_pad|><|vision_end|> in the prompt per image",
                               param="multi_modal_data")
        if counts[1] != len(videos):
            expanded = (" (a Qwen3-VL video's placeholder is one <|video_pad|>, not its timestamped expansion)"
                        if self.is_qwen3 and counts[1] > len(videos) else "")
            raise RequestError(f"the prompt has {counts[1]} video placeholder(s) (<|video_pad|>, token id {video}) for "
                               f"{len(videos)} video(s); put one <|vision_start|><|video_pad|><|vision_end|> in the "
                               f"prompt per video{expanded}", param="multi_modal_data")
        image_grids, digest = self.encode(images) if images else ([], b"")
        if videos:
            video_grids, video_digest = self.encode_videos(videos)
            digest = hashlib.sha256(digest + b"video" + video_digest).digest()
        items = {self.image_token_id: iter(image_grids), video: iter(zip(video_grids, videos) if videos else [])}
        expanded, positions, places, grids, at = [], [], [], [], 0
        for start, end in runs:
            token = token_ids[start]
            grid, clip = next(items[token]) if token == video else (next(items[token]), None)
            frames, rows, columns = grid.shape[:3]
            n = frames * rows * columns
            if self.is_qwen3 and token == video:  # its frame groups' runs between timestamps
                if end - start != 1:
                    raise RequestError(f"a video placeholder of {end - start} tokens: a Qwen3-VL video takes one "
                                       "<|video_pad|> (expanded with its frame timestamps here); give the prompt "
                                       "unexpanded", param="multi_modal_data")
                whole = start > 0 and token_ids[start - 1 : start + 2] == [self.vision_start, video, self.vision_end]
                if whole:  # <|vision_start|><|video_pad|><|vision_end|> is replaced as a whole
                    start, end = start - 1, end + 1
                expanded += token_ids[at:start]
                for stamp in self._qwen3_timestamps(clip):
                    expanded += stamp + [self.vision_start]
                    places.append((len(expanded), rows, columns))
                    positions += range(len(expanded), len(expanded) + rows * columns)
                    expanded += [video] * (rows * columns) + [self.vision_end]
                grids.append(grid.reshape(-1, grid.shape[-1]))
                at = end
                continue
            if end - start not in (1, n):
                what = (f"this image takes one <|image_pad|>, or {n} (its {rows} x {columns} merged patches)"
                        if token != video else f"this video takes one <|video_pad|>, or {n} (its {frames} frame "
                        f"group(s) of {rows} x {columns} merged patches)")
                raise RequestError(f"a{'n image' if token != video else ' video'} placeholder of {end - start} "
                                   f"tokens: {what}", param="multi_modal_data")
            expanded += token_ids[at:start]
            places.append((len(expanded), rows, columns) if token != video else
                          (len(expanded), rows, columns, frames, self.video_interval))
            positions += range(len(expanded), len(expanded) + n)
            expanded += [token] * n
            grids.append(grid.reshape(-1, grid.shape[-1]))
            at = end
        expanded += token_ids[at:]
        mrope, delta = mrope_positions(len(expanded), places)
        rows, deepstack, hidden = torch.cat(grids), None, self.spec.text_hidden_size
        if rows.shape[-1] > hidden:  # Qwen3-VL: [n, (1 + levels) * hidden] → rows, deepstack [levels, n, hidden]
            rows, deepstack = rows[:, :hidden], rows[:, hidden:].reshape(len(rows), -1, hidden).transpose(0, 1)
            rows, deepstack = rows.contiguous(), deepstack.contiguous()
        return expanded, ImageInputs(positions, rows, digest, mrope=mrope, rope_delta=delta, deepstack=deepstack)

    def _qwen3_timestamps(self, video: Video) -> list[list[int]]:
        """The tokens of each frame group's timestamp, "<{seconds:.1f} seconds>" (`qwen3_timestamps`), each tokenized
        alone (as vLLM does; the same ids as Qwen3VLProcessor's whole text where a special token or a newline comes
        before the video)."""
        temporal = self.spec.vision_config["temporal_patch_size"]
        return [self.tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
                for seconds in qwen3_timestamps(video.indices, video.fps, temporal)]

    @torch.inference_mode()
    def encode_videos(self, videos: list[Video]) -> tuple[list[Tensor], bytes]:
        """Qwen2-VL: (each video's rows [frame groups, rows, columns, hidden_size], the sha256 of their pixel
        values and grids, and for Qwen3-VL their timestamps). The vision tower runs a video's patches as an image's,
        its video_grid_thw's t > 1 (Qwen2VLModel.get_video_features; Qwen3VLModel's too)."""
        pixels = [self._video_pixels(video.frames, i) for i, video in enumerate(videos)]
        digest = self._digest(pixels)
        if self.is_qwen3:  # the timestamps are part of the prompt: another fps is another prefix
            digest = hashlib.sha256(digest + repr([(v.fps, v.indices) for v in videos]).encode()).digest()
        return self._qwen_rows(pixels), digest

    def _video_pixels(self, frames: list, number: int) -> tuple[Tensor, tuple[int, int, int]]:
        """One video's patches [t * h * w, channels * temporal_patch_size * patch_size²] and its video_grid_thw
        (t, h, w), laid out as Qwen2VLVideoProcessor lays them out: each frame resized, rescaled and normalized by
        the artifact's image processor (transformers'; Qwen2VLVideoProcessor itself needs torchvision) with the
        video processor's size, mean and std (`qwen_vl_video_kwargs`), the
        frames taken temporal_patch_size at a time (the last repeated to fill the last group), each group's
        patches in the image processor's order (merge windows row-major) with the frames as the temporal axis.
        Qwen3-VL: Qwen3VLVideoProcessor's size instead (`_qwen3_frames`), the same layout."""
        kwargs = self.video_kwargs
        if self.is_qwen3:
            frames, kwargs = self._qwen3_frames(frames, number), {**kwargs, "do_resize": False}
            kwargs.pop("size"), kwargs.pop("resample")
        try:
            out = self.image_processor(images=frames, return_tensors="pt", **kwargs)
        except Exception as e:  # noqa: BLE001 - the processor's own types
            raise RequestError(f"multi_modal_data.video[{number}]: its frames cannot be preprocessed "
                               f"({type(e).__name__}: {e})", param="multi_modal_data") from None
        grid = out["image_grid_thw"]
        _, h, w = (int(x) for x in grid[0])
        temporal, patch = self.image_processor.temporal_patch_size, self.image_processor.patch_size
        # each frame's patches hold it temporal_patch_size times (an image's layout): one copy per frame
        px = out["pixel_values"].view(len(frames), h * w, -1, temporal, patch * patch)[:, :, :, 0]
        if pad := -len(frames) % temporal:
            px = torch.cat([px, px[-1:].expand(pad, -1, -1, -1)])
        t = px.shape[0] // temporal
        px = px.view(t, temporal, h * w, -1, patch * patch).permute(0, 2, 3, 1, 4)
        return px.reshape(t * h * w, -1).contiguous(), (t, h, w)

    def _qwen3_frames(self, frames: list, number: int) -> list:
        """Qwen3-VL: the frames resized (PIL, the video processor's resample) to the one size transformers'
        Qwen3VLVideoProcessor gives them: its smart_resize over the whole video (the pixels of all frames within
        the size's shortest_edge..longest_edge, so more frames get smaller ones), a multiple of patch × merge px."""
        from PIL import Image
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        temporal = self.spec.vision_config["temporal_patch_size"]
        if len(frames) < temporal:
            raise RequestError(f"multi_modal_data.video[{number}]: {len(frames)} frame(s); Qwen3-VL's video processor "
                               f"takes at least temporal_patch_size ({temporal}) frames", param="multi_modal_data")
        width, height = frames[0].size
        size = self.video_kwargs["size"]
        try:
            h, w = smart_resize(len(frames), height, width, temporal_factor=temporal,
                                factor=self.spec.vision_config["patch_size"] * self.spec.spatial_merge_size,
                                min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        except ValueError as e:  # an aspect ratio over 200
            raise RequestError(f"multi_modal_data.video[{number}]: {e}", param="multi_modal_data") from None
        if (h, w) == (height, width):
            return frames
        return [f.resize((w, h), resample=Image.Resampling(self.video_kwargs["resample"])) for f in frames]

    def _check_no_video_placeholders(self, token_ids: list[int]) -> None:
        video = self.spec.video_token_index
        if video is not None and video in token_ids:
            raise RequestError(f"the prompt holds video placeholders (<|video_pad|>, token id {video}) but no videos; "
                               "give the videos (multi_modal_data's 'video'), or drop the placeholders",
                               param="multi_modal_data")

    def _pixtral_placeholders(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """[start, end) of each image placeholder: a bare [IMG], or an expanded image (a run of [IMG] and
        [IMG_BREAK] closed by [IMG_END]); break or end tokens outside an image are refused."""
        image, brk, end = self.image_token_id, self.pixtral["break_id"], self.pixtral["end_id"]
        places, i = [], 0
        while i < len(token_ids):
            if token_ids[i] not in (image, brk, end):
                i += 1
                continue
            j = i
            while j < len(token_ids) and token_ids[j] in (image, brk):
                j += 1
            if j < len(token_ids) and token_ids[j] == end and j > i:
                places.append((i, j + 1))
                i = j + 1
            elif brk in token_ids[i:j] or j == i:
                raise RequestError(f"the prompt holds {self.pixtral['break_token']} or {self.pixtral['end_token']} "
                                   f"(token ids {brk}, {end}) outside an image; write one {self.pixtral['image_token']}"
                                   " per image", param="multi_modal_data")
            else:
                places += [(k, k + 1) for k in range(i, j)]
                i = j
        return places

    def _pixtral_prompt_inputs(self, token_ids: list[int], images: list) -> tuple[list[int], ImageInputs]:
        """Pixtral: each [IMG] either bare (expanded as PixtralProcessor expands it, by the image's resized size)
        or already expanded so (kept); only the [IMG] positions take rows."""
        image, brk, end = self.image_token_id, self.pixtral["break_id"], self.pixtral["end_id"]
        places = self._pixtral_placeholders(token_ids)
        if len(places) != len(images):
            raise RequestError(f"the prompt has {len(places)} image placeholder(s) ({self.pixtral['image_token']}, "
                               f"token id {image}) for {len(images)} image(s); put one {self.pixtral['image_token']}"
                               " in the prompt per image", param="multi_modal_data")
        grids, digest = self.encode(images)
        expanded, positions, at = [], [], 0
        for (start, stop), grid in zip(places, grids):
            rows, columns = grid.shape[:2]
            sequence = ([image] * columns + [brk]) * rows
            sequence[-1] = end
            if stop - start != 1 and token_ids[start:stop] != sequence:
                raise RequestError(
                    f"an image placeholder of {stop - start} tokens: this image takes {self.pixtral['image_token']} "
                    f"alone, or its {rows} rows of {columns} {self.pixtral['image_token']} each ended by "
                    f"{self.pixtral['break_token']}, the last by {self.pixtral['end_token']} ({len(sequence)} tokens)",
                    param="multi_modal_data")
            expanded += token_ids[at:start]
            positions += [len(expanded) + i for i, t in enumerate(sequence) if t == image]
            expanded += sequence
            at = stop
        expanded += token_ids[at:]
        embeds = torch.cat([grid.reshape(-1, grid.shape[-1]) for grid in grids])
        return expanded, ImageInputs(positions, embeds, digest)

    def _gemma3_image_sequence(self, processor) -> list[int]:
        """The tokens Gemma3Processor puts for one <start_of_image> (its full_image_sequence, tokenized)."""
        n = self.spec.mm_tokens_per_image
        if not hasattr(processor, "full_image_sequence") or getattr(processor, "image_seq_length", n) != n:
            raise ArtifactError(f"{art.TOKENIZER_DIR}: no Gemma3Processor with image_seq_length {n} "
                                "(mm_tokens_per_image); rebuild the artifact from a checkpoint with its processor files")
        self.tokenizer = processor.tokenizer
        ids = self.tokenizer.encode(processor.full_image_sequence, add_special_tokens=False)
        boi, eoi = self.spec.boi_token_index, self.spec.eoi_token_index
        if ids.count(boi) != 1 or ids.count(eoi) != 1 or ids.count(self.image_token_id) != n:
            raise ArtifactError(f"{art.TOKENIZER_DIR}: the processor's image sequence does not tokenize to one "
                                f"<start_of_image> ({boi}), {n} image tokens ({self.image_token_id}) and one "
                                f"<end_of_image> ({eoi}); rebuild the artifact")
        return ids

    def _gemma3_prompt_inputs(self, token_ids: list[int], images: list) -> tuple[list[int], ImageInputs]:
        """Gemma 3: each <start_of_image> either bare (expanded as Gemma3Processor expands it, the newlines then
        tokenized as the whole text's would be) or already followed by mm_tokens_per_image image tokens and
        <end_of_image> (kept)."""
        boi, eoi, n = self.spec.boi_token_index, self.spec.eoi_token_index, self.spec.mm_tokens_per_image
        starts = [i for i, t in enumerate(token_ids) if t == boi]
        if len(starts) != len(images):
            raise RequestError(f"the prompt has {len(starts)} image placeholder(s) (<start_of_image>, token id {boi}) "
                               f"for {len(images)} image(s); put one <start_of_image> in the prompt per image",
                               param="multi_modal_data")
        expanded, at, after_bare = [], 0, False
        for start in starts:
            run = 0
            while start + 1 + run < len(token_ids) and token_ids[start + 1 + run] == self.image_token_id:
                run += 1
            text = token_ids[at:start]
            expanded = self._merge_newlines(expanded, text) if after_bare else expanded + text
            after_bare = run == 0
            if run == 0:
                expanded = self._merge_newlines(expanded, self._image_sequence)
                at = start + 1
            elif run == n and token_ids[start + 1 + n : start + 2 + n] == [eoi]:
                expanded += token_ids[start : start + n + 2]
                at = start + n + 2
            else:
                raise RequestError(f"an image placeholder of <start_of_image> and {run} image tokens: this model takes "
                                   f"<start_of_image> alone, or followed by {n} image tokens (token id "
                                   f"{self.image_token_id}) and <end_of_image>", param="multi_modal_data")
        expanded = self._merge_newlines(expanded, token_ids[at:]) if after_bare else expanded + token_ids[at:]
        positions = [i for i, t in enumerate(expanded) if t == self.image_token_id]
        if len(positions) != n * len(images):
            raise RequestError(f"the prompt holds image tokens (token id {self.image_token_id}) outside an image "
                               "placeholder; write <start_of_image> per image", param="multi_modal_data")
        embeds, digest = self.encode(images)
        spans = [(positions[i], positions[i] + n) for i in range(0, len(positions), n)]
        return expanded, ImageInputs(positions, torch.cat(embeds), digest, spans)

    def _merge_newlines(self, head: list[int], tail: list[int]) -> list[int]:
        """head + tail, the run of newline-only tokens where they meet tokenized again as one text: a tokenizer
        with tokens for "\n\n\n" (Gemma's) writes the processor's "\n\n" beside the prompt's "\n" as one."""
        def is_newlines(token: int) -> bool:
            text = self.tokenizer.decode([token])
            return bool(text) and not text.strip("\n")

        lo = len(head)
        while lo > 0 and is_newlines(head[lo - 1]):
            lo -= 1
        hi = 0
        while hi < len(tail) and is_newlines(tail[hi]):
            hi += 1
        if lo == len(head) or hi == 0:
            return head + tail
        text = self.tokenizer.decode(head[lo:] + tail[:hi])
        return head[:lo] + self.tokenizer.encode(text, add_special_tokens=False) + tail[hi:]

    def check_no_placeholders(self, token_ids: list[int]) -> None:
        """A prompt without images must not hold image tokens (their embedding rows would stand in for images)."""
        if self.is_qwen:
            self._check_no_video_placeholders(token_ids)
        if self.is_gemma3 and self.spec.boi_token_index in token_ids:
            raise RequestError(f"the prompt holds <start_of_image> (token id {self.spec.boi_token_index}) but no "
                               "images; give the images (multi_modal_data, or image_url content parts), or drop the "
                               "placeholders", param="multi_modal_data")
        if self.image_token_id in token_ids:
            raise RequestError(f"the prompt holds image placeholders (token id {self.image_token_id}) but no images; "
                               "give the images (multi_modal_data, or image_url content parts), or drop the "
                               "placeholders", param="multi_modal_data")

    def _placeholder_runs(self, token_ids: list[int], tokens: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
        """[start, end) of each run of one placeholder token (the image token, or any of `tokens`)."""
        tokens = tokens or (self.image_token_id,)
        runs, i = [], 0
        while i < len(token_ids):
            if token_ids[i] in tokens:
                start = i
                while i < len(token_ids) and token_ids[i] == token_ids[start]:
                    i += 1
                runs.append((start, i))
            else:
                i += 1
        return runs


PIXTRAL_PROCESSOR = {"patch_size": 16, "spatial_merge_size": 1, "image_token": "[IMG]",
                     "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}  # PixtralProcessor's defaults


def pixtral_processor_fields(tokenizer_dir: Path, spec: art.VisionSpec, error: type[Exception]) -> dict:
    """PixtralProcessor's fields from its processor_config.json (its defaults where absent), checked against the
    model's (its patch_size the tower's, its spatial_merge_size the patch merger's, its image token the config's),
    with the token ids: {patch_size, spatial_merge_size, image_token, break_token, end_token, break_id, end_id}.
    `error`: CheckpointError at build, ArtifactError at load."""
    from transformers import AutoTokenizer

    path = tokenizer_dir / "processor_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if config.get("processor_class", "PixtralProcessor") != "PixtralProcessor":
        raise error(f"{path}: processor_class {config['processor_class']!r} is not supported with a Pixtral tower; "
                    "PixtralProcessor's files are")
    fields = {key: config.get(key, default) for key, default in PIXTRAL_PROCESSOR.items()}
    merge = spec.spatial_merge_size or 1
    for key, model in (("patch_size", spec.vision_config.get("patch_size")), ("spatial_merge_size", merge)):
        if fields[key] != model:
            raise error(f"{path}: {key} {fields[key]!r} is not the model's ({model}); set it to {model}")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    ids = {key: tokenizer.convert_tokens_to_ids(fields[key])
           for key in ("image_token", "image_break_token", "image_end_token")}
    unknown = [fields[key] for key, i in ids.items() if i is None or i == tokenizer.unk_token_id]
    if unknown or ids["image_token"] != spec.image_token_index:
        raise error(f"{path}: the tokenizer has no token {unknown[0]!r}" if unknown else
                    f"{path}: image_token {fields['image_token']!r} is token id {ids['image_token']}, not the "
                    f"model's image_token_index {spec.image_token_index}")
    return {"patch_size": fields["patch_size"], "spatial_merge_size": merge, "image_token": fields["image_token"],
            "break_token": fields["image_break_token"], "end_token": fields["image_end_token"],
            "break_id": ids["image_break_token"], "end_id": ids["image_end_token"]}


def pixtral_image_processor(tokenizer_dir: Path, spec: art.VisionSpec, fields: dict, error: type[Exception]):
    """transformers' image processor of a Pixtral checkpoint or artifact (AutoImageProcessor: PixtralImageProcessor,
    or its PIL twin without torchvision), checked: its largest image, in patches a side, within the tower's
    rotary table (vision_config.image_size / patch_size)."""
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        raise error(f"{tokenizer_dir}: no image processor (preprocessor_config.json); use a checkpoint that has its "
                    "processor files") from None
    size = getattr(processor, "size", None) or {}
    longest = size.get("longest_edge") or max(size.get("height") or 0, size.get("width") or 0)
    side, patch = fields["patch_size"] * fields["spatial_merge_size"], fields["patch_size"]
    image_size = spec.vision_config.get("image_size")
    if not longest:
        raise error(f"{tokenizer_dir}: the image processor's size {size!r} has no longest_edge (or height and "
                    "width); PixtralImageProcessor's files have one")
    if image_size and -(-longest // side) * side // patch > image_size // patch:
        raise error(f"{tokenizer_dir}: the image processor's size (longest edge {longest} px, {side} px a row) makes "
                    f"images larger than the tower's image_size {image_size}; set size.longest_edge to at most "
                    f"{image_size // side * side}")
    return processor


def mrope_positions(num_tokens: int, items: list[tuple]) -> tuple[np.ndarray, int]:
    """Qwen2-VL's M-RoPE positions of a prompt of `num_tokens` whose images and videos are (first token, rows,
    columns) of merged patches, or (first token, rows, columns, frame groups, interval) for a video, in order:
    ([3, num_tokens] int64 temporal, height, width positions, the rope delta). Text tokens count on one by one,
    their three equal; an item's tokens (frame group by frame group, each row-major) take p + floor(group *
    interval) as temporal (p: its first position; interval 1 for Qwen2-VL, tokens_per_second *
    second_per_grid_ts for Qwen2.5-VL's videos), p + row, p + column as height and width; the text after it goes
    on from p + max(rows, columns) (transformers' Qwen2VLModel.get_rope_index). The delta: the largest position
    + 1 minus num_tokens, what every later token's index is shifted by."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    at = index = 0  # the next text position, the next token
    for start, rows, columns, *video in items:
        groups, interval = video if video else (1, 1.0)
        positions[:, index:start] = np.arange(at, at + start - index)
        at += start - index
        end = start + groups * rows * columns
        temporal = (np.arange(groups, dtype=np.float32) * np.float32(interval)).astype(np.int64)  # as torch's .long()
        positions[0, start:end] = at + np.repeat(temporal, rows * columns)
        positions[1, start:end] = at + np.tile(np.repeat(np.arange(rows), columns), groups)
        positions[2, start:end] = at + np.tile(np.arange(columns), rows * groups)
        at += max(rows, columns)
        index = end
    positions[:, index:] = np.arange(at, at + num_tokens - index)
    return positions, int(positions.max(initial=-1)) + 1 - num_tokens


VIDEO_FPS = 2.0  # the rate a video's frames are taken as sampled at (Qwen2_5_VLProcessor's default fps)


def video_interval(spec: art.VisionSpec) -> float:
    """The temporal M-RoPE step between a video's frame groups: Qwen2-VL 1; Qwen2.5-VL tokens_per_second *
    second_per_grid_ts (temporal_patch_size / VIDEO_FPS seconds a group, as Qwen2_5_VLProcessor computes it),
    float32 as transformers multiplies it."""
    if spec.architecture != "Qwen2_5_VLForConditionalGeneration":
        return 1.0
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    config = Qwen2_5_VLVisionConfig(**spec.vision_config)  # its tokens_per_second, or transformers' default
    return float(np.float32(config.tokens_per_second) * np.float32(config.temporal_patch_size / VIDEO_FPS))


VIDEO_CONFIG_FILES = ("processor_config.json", "video_preprocessor_config.json", "preprocessor_config.json")
QWEN_VIDEO_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}  # Qwen2VLVideoProcessor.size
QWEN3_VIDEO_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}  # Qwen3VLVideoProcessor.size
BICUBIC = 3  # PIL's (and the Qwen video processors' default) resample


def qwen_vl_video_kwargs(processor_dir: Path, spec: art.VisionSpec, error: type[Exception]) -> dict:
    """What Qwen2VLVideoProcessor's files (transformers' order: processor_config.json's video_processor, else
    video_preprocessor_config.json, else preprocessor_config.json) set for the frames, as keywords of the image
    processor's call: size (its class default, overridden by the files' size, then min_pixels / max_pixels, as
    Qwen2VLVideoProcessor reads them), image_mean, image_std;
    its patch_size, temporal_patch_size and merge_size checked against the tower's, and frame sampling
    (do_sample_frames) refused: every frame given is used. Qwen3-VL (Qwen3VLVideoProcessor's files): its class
    default size, the files' size only (it reads no min_pixels / max_pixels), and resample; its frame sampling
    fields (do_sample_frames, fps, min_frames, max_frames) are not applied, as vLLM passes do_sample_frames false
    for the frames its loader sampled: the frames given are the frames used; cap_pixels_per_frame true is refused.
    `error`: CheckpointError at build, ArtifactError at load."""
    config, path = {}, processor_dir
    for name in VIDEO_CONFIG_FILES:
        path = processor_dir / name
        data = json.loads(path.read_text()) if path.is_file() else {}
        data = data.get("video_processor", {}) if name == "processor_config.json" else data
        if data:
            config = data
            break
    for key, model in _qwen_patch_sizes(spec).items():
        if key in config and config[key] != model:
            raise error(f"{path}: the video processor's {key} {config[key]!r} is not the model's ({model!r}); set it to "
                        f"{model!r}")
    qwen3 = spec.architecture == QWEN3_VL
    if config.get("do_sample_frames") and not qwen3:
        raise error(f"{path}: do_sample_frames true (the video processor samples frames by fps) is not supported; "
                    "set it to false (videos are given as the frames to use)")
    if qwen3 and config.get("cap_pixels_per_frame"):
        raise error(f"{path}: cap_pixels_per_frame true (Qwen3VLVideoProcessor's per-frame pixel cap) is not "
                    "supported; set it to false or drop it")
    kwargs = {key: config[key] for key in ("image_mean", "image_std") if config.get(key) is not None}
    size = dict(config.get("size") or (QWEN3_VIDEO_SIZE if qwen3 else QWEN_VIDEO_SIZE))
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if config.get(key) is not None and not qwen3:
            size[edge] = config[key]
    if not (size.get("shortest_edge") and size.get("longest_edge")):
        raise error(f"{path}: the video processor's size {size!r} needs shortest_edge and longest_edge (or "
                    "min_pixels and max_pixels)")
    kwargs["size"] = {"shortest_edge": size["shortest_edge"], "longest_edge": size["longest_edge"]}
    if qwen3:
        kwargs["resample"] = config.get("resample", BICUBIC)
    return kwargs


def qwen3_timestamps(indices: list[int], fps: float, temporal_patch_size: int) -> list[float]:
    """Qwen3-VL's frame group timestamps in seconds, as Qwen3VLProcessor computes them: each frame at its source
    index / fps (the indices padded to whole groups by repeating the last, as the frames are), a group at the mean
    of its first and last frame's."""
    indices = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [index / fps for index in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(seconds), temporal_patch_size)]


def _qwen_patch_sizes(spec: art.VisionSpec) -> dict:
    """The tower's patch_size, temporal_patch_size and merge_size, which Qwen2-VL's image and video processors must
    cut patches by."""
    tower = spec.vision_config
    return {"patch_size": tower.get("patch_size"), "temporal_patch_size": tower.get("temporal_patch_size"),
            "merge_size": spec.spatial_merge_size}


def qwen_vl_image_processor(processor_dir: Path, spec: art.VisionSpec, error: type[Exception]):
    """Qwen2-VL's / Qwen2.5-VL's image processor (AutoImageProcessor: Qwen2VLImageProcessor, or its PIL twin without
    torchvision) of a checkpoint or artifact, checked against the tower: its patch_size, temporal_patch_size and
    merge_size the tower's (the patches it cuts and the rows Qwen2VLProcessor expands <|image_pad|> to).
    `error`: CheckpointError at build, ArtifactError at load."""
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(str(processor_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        processor = None
    if processor is None or not hasattr(processor, "merge_size"):
        raise error(f"{processor_dir}: no Qwen2-VL image processor (Qwen2VLImageProcessor's "
                    "preprocessor_config.json); use a checkpoint that has its processor files")
    for key, model in _qwen_patch_sizes(spec).items():
        if getattr(processor, key, None) != model:
            raise error(f"{processor_dir}: the image processor's {key} {getattr(processor, key, None)!r} is not the "
                        f"model's ({model!r}); set it to {model!r} in preprocessor_config.json")
    return processor


def check_anyres_processor(processor_dir: Path, spec: art.VisionSpec, error: type[Exception]):
    """LLaVA-NeXT's processor (AutoProcessor: LlavaNextProcessor with LlavaNextImageProcessor, or its PIL twin
    without torchvision) of a checkpoint or artifact, checked against the model: its image_grid_pinpoints and
    crop_size the model's (the tiles), and LlavaNextProcessor's patch_size, vision_feature_select_strategy and
    num_additional_image_tokens (its count of <image> tokens) the tower's, so it expands <image> as we do.
    `error`: CheckpointError at build, ArtifactError at load."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(processor_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        processor = None
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None or not hasattr(image_processor, "image_grid_pinpoints"):
        raise error(f"{processor_dir}: no LLaVA-NeXT processor (LlavaNextProcessor's processor_config.json); use a "
                    "checkpoint that has its processor files")
    tile = spec.vision_config["image_size"]
    crop = getattr(image_processor, "crop_size", None) or {}
    crop = {key: crop.get(key) for key in ("height", "width")} if isinstance(crop, dict) else \
        {"height": crop.height, "width": crop.width}
    pinpoints = [list(p) for p in image_processor.image_grid_pinpoints or []]
    wanted = {"image_grid_pinpoints": (pinpoints, spec.image_grid_pinpoints),
              "crop_size": (crop, {"height": tile, "width": tile}),
              "patch_size": (getattr(processor, "patch_size", None), spec.vision_config["patch_size"]),
              "vision_feature_select_strategy": (getattr(processor, "vision_feature_select_strategy", None),
                                                 spec.vision_feature_select_strategy),
              "num_additional_image_tokens": (getattr(processor, "num_additional_image_tokens", None), 1)}
    for key, (value, model) in wanted.items():
        if value != model:
            raise error(f"{processor_dir}: the processor's {key} {value!r} is not the model's ({model!r}); set it to "
                        f"{model!r} in its processor files")
    return processor


def _processor(tokenizer_dir: Path):
    """transformers' processor of the artifact (AutoProcessor), else its image processor (AutoImageProcessor)."""
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(tokenizer_dir), local_files_only=True)
        if hasattr(processor, "image_processor"):
            return processor
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        return AutoImageProcessor.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        raise ArtifactError(f"{tokenizer_dir}: no image processor (processor_config.json or preprocessor_config.json); "
                            "rebuild the artifact from a checkpoint that has its processor files") from None


def _step_image_tokens(batch):
    """(each request's ImageInputs, the range [lo, hi) of its positions in this step, their flat token indices) for
    the step's requests with image tokens in it, in the order StepBuffers packs the step's tokens."""
    offset = 0
    for scheduled in batch.requests:
        request = scheduled.request
        images = request.images
        if images is not None and request.num_computed_tokens <= images.positions[-1]:
            start = request.num_computed_tokens
            end = start + scheduled.num_new_tokens - len(scheduled.draft_token_ids)
            lo, hi = bisect_left(images.positions, start), bisect_left(images.positions, end)
            if hi > lo:
                yield images, lo, hi, [offset + p - start for p in images.positions[lo:hi]]
        offset += scheduled.num_new_tokens


def step_image_rows(batch) -> tuple[Tensor, Tensor] | None:
    """(flat token indices [n], image embedding rows [n, hidden_size]) of the step's image tokens, in the order
    StepBuffers packs the step's tokens (each scheduled request's chunk in turn); None when the step has none."""
    indices, rows = [], []
    for images, lo, hi, flat in _step_image_tokens(batch):
        indices += flat
        rows.append(images.embeds[lo:hi])
    if not rows:
        return None
    return torch.tensor(indices, dtype=torch.long, device=rows[0].device), torch.cat(rows)


def step_deepstack_rows(batch) -> tuple[Tensor, Tensor] | None:
    """Qwen3-VL: (flat token indices [n], deepstack rows [levels, n, hidden_size]) of the step's image tokens (those
    of step_image_rows), added to their hidden states after decoder layers 0..levels-1 (ForwardBatch.deepstack_rows);
    None when the step has no image token with deepstack rows."""
    indices, rows = [], []
    for images, lo, hi, flat in _step_image_tokens(batch):
        if images.deepstack is not None:
            indices += flat
            rows.append(images.deepstack[:, lo:hi])
    if not rows:
        return None
    return torch.tensor(indices, dtype=torch.long, device=rows[0].device), torch.cat(rows, dim=1)


def step_key_limits(batch, positions: Tensor) -> Tensor | None:
    """The last key position each of the step's query tokens may attend to (kernels/attention.py's key_limits),
    [num_tokens] int32: an image token of a bidirectional image (ImageInputs.spans) sees its whole image, every
    other token up to its own position. None when no token of the step is in such an image. The scheduler keeps
    such an image in one chunk (ImageInputs.chunk_end), so its last position is in the step too."""
    indices, limits, offset = [], [], 0
    for scheduled in batch.requests:
        request = scheduled.request
        images = request.images
        if images is not None and images.spans and request.num_computed_tokens < images.spans[-1][1]:
            start = request.num_computed_tokens
            end = start + scheduled.num_new_tokens - len(scheduled.draft_token_ids)
            for lo, hi in images.spans:
                for p in range(max(lo, start), min(hi, end)):
                    indices.append(offset + p - start)
                    limits.append(hi - 1)
        offset += scheduled.num_new_tokens
    if not indices:
        return None
    key_limits = positions.to(torch.int32, copy=True)
    index = torch.tensor(indices, dtype=torch.long)
    return key_limits.index_copy_(0, index.to(positions.device),
                                  torch.tensor(limits, dtype=torch.int32).to(positions.device))


# ---- chat content parts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatVideos:
    """How a chat's video_url parts are read: the model takes videos (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), sampled to
    `num_frames` each (vLLM's media_io_kwargs video num_frames; -1: every frame), given to the engine with vLLM's
    metadata where `metadata` (Qwen3-VL: its timestamps), else as frames alone."""

    num_frames: int
    metadata: bool


def chat_images(messages: list[dict], videos: ChatVideos | None = None) -> tuple[list[dict], list, list]:
    """Messages whose content parts hold images (OpenAI's {"type": "image_url", "image_url": {"url": data URL}},
    vLLM's {"type": "image_pil", "image_pil": PIL image}) or videos (vLLM's {"type": "video_url", "video_url":
    {"url": data URL}}, decoded by runtime/video_io.py as `videos` says; None: the model takes no video, and the
    part is refused by name) → (the messages as a vision model's chat template reads them: each image a
    {"type": "image"} part, each video a {"type": "video"} part, every content a list of parts; the images, in
    order; the videos, in order, as multi_modal_data's 'video' takes them). Messages without either come back as
    they are, with none."""
    if not has_image_parts(messages):
        return messages, [], []
    images, clips, rendered = [], [], []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = []
            for number, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                where = f"messages.{index}.content.{number}"
                if kind in CHAT_IMAGE_PARTS:
                    images.append(_part_image(part, kind, where))
                    parts.append({"type": "image"})
                elif kind == CHAT_VIDEO_PART:
                    clips.append(_part_video(part, where, videos))
                    parts.append({"type": "video"})
                elif kind not in TEXT_PART_FIELDS:  # audio: the template would drop them unseen
                    raise RequestError(f"{where}: {kind!r} parts are not supported beside images (text, "
                                       f"{', '.join(CHAT_IMAGE_PARTS)} and {CHAT_VIDEO_PART} parts are)")
                else:
                    parts.append(part)
        else:
            rendered.append(message)
            continue
        rendered.append({**message, "content": parts})
    return rendered, images, clips


def has_image_parts(messages: list) -> bool:
    """Whether some message's content parts carry an image or a video (CHAT_IMAGE_PARTS, CHAT_VIDEO_PART)."""
    kinds = (*CHAT_IMAGE_PARTS, CHAT_VIDEO_PART)
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") in kinds for p in m["content"])
               for m in messages)


def _part_video(part: dict, where: str, videos: ChatVideos | None):
    """A video_url part's frames (Qwen3-VL: with vLLM's metadata), or RequestError where the model takes none."""
    from llmc.runtime.video_io import load_video_url

    if videos is None:
        raise RequestError(f"{where}: a video_url part needs a model that takes videos (Qwen2-VL, Qwen2.5-VL, "
                           "Qwen3-VL); this one takes images only: drop the video")
    value = part.get(CHAT_VIDEO_PART)
    url = value.get("url") if isinstance(value, dict) else value
    frames, metadata = load_video_url(url, f"{where}.video_url", videos.num_frames)
    return (frames, metadata) if videos.metadata else frames


def _part_image(part: dict, kind: str, where: str):
    from PIL import Image

    if kind == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise RequestError(f"{where}.image_pil: expected a PIL.Image.Image, got {type(image).__name__}")
        return image
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    return load_image_url(url, f"{where}.image_url")


def inline_data(url, where: str, media: str, example: str, max_bytes: int) -> tuple[str, str]:
    """A base64 data URL of `media` ("image", "video": data:MEDIA/...;base64,...) → (its header, its base64 text);
    RequestError naming `where` for no string, an http(s) URL (nothing is fetched), another kind of URL, or more than
    max_bytes once decoded. `example`: the MIME type the messages show (image/png, video/mp4)."""
    article = "an" if media[0] in "aeiou" else "a"
    if not isinstance(url, str):
        raise RequestError(f"{where}: expected {{\"url\": \"data:{example};base64,...\"}}, got {type(url).__name__}")
    if url.startswith(("http://", "https://")):
        raise RequestError(f"{where}: http(s) {media} URLs are not fetched; send the {media} inline as a data URL "
                           f"(data:{example};base64,...)")
    header, comma, data = url.partition(",")
    if not (url.startswith(f"data:{media}/") and comma and header.endswith(";base64")):
        raise RequestError(f"{where}: expected a base64 data URL of {article} {media} (data:{example};base64,...), "
                           f"got {url[:40]!r}")
    if len(data) > max_bytes * 4 // 3 + 4:
        raise RequestError(f"{where}: the {media} is over {max_bytes // (1024 * 1024)} MiB; send a smaller one")
    return header, data


def load_image_url(url, where: str):
    """A data URL's image (data:image/...;base64,...), decoded; http(s) URLs are refused by name (not fetched)."""
    from PIL import Image

    _, data = inline_data(url, where, "image", "image/png", MAX_IMAGE_BYTES)
    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        image.load()
    except (binascii.Error, ValueError, OSError, Image.DecompressionBombError) as e:
        raise RequestError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
    return image
