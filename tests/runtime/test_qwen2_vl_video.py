"""Qwen2-VL and Qwen2.5-VL videos (multi_modal_data {"video": frames}) on the tiny random float32 checkpoints of
test_qwen2_vl.py, against transformers' own models' generate with pixel_values_videos, video_grid_thw (and
second_per_grid_ts for Qwen2.5-VL): the prompt ids (<|video_pad|> expanded to t x h x w / merge² tokens), the greedy
tokens and their logprobs for a video alone, a video and an image in one prompt, beside a text prompt in one batch,
with prefill chunks that end inside the video; the M-RoPE positions against transformers' get_rope_index; what is
refused.

The reference pixel_values_videos follow Qwen2VLVideoProcessor's published layout (frames rescaled and normalized
with the processor's mean and std, padded to whole groups of temporal_patch_size by repeating the last, patchified
by its view and permute): frames of 32 x 32 and 48 x 32 px are not resized (multiples of 16 px within the
processor's pixel bounds). Qwen2VLVideoProcessor itself needs torchvision, which this machine's torch has no build
of; where torchvision is installed, `test_video_patches_equal_qwen2_vl_video_processor` checks the reference
against it."""

import numpy as np
import pytest
import torch
from PIL import Image

from llmc.errors import ConfigError, RequestError
from llmc.runtime.llm import LLM
from llmc.runtime.multimodal import mrope_positions
from tests.runtime.test_llava import image
from tests.runtime.test_qwen2_vl import (END, GREEDY, IMAGE, PAD, START, VIDEO, WIDE, artifact, checkpoint,  # noqa: F401
                                         family, hf, hf_inputs)
from tests.runtime.vision_oracle import check_output, hf_greedy_with_logprobs, record_chunks

CLIP = START + VIDEO + END
VIDEO_PROMPT = "User:" + CLIP + "What happens?"
BOTH = "Look:" + IMAGE + "and" + CLIP + "Compare them."
MERGE, TEMPORAL, PATCH = 2, 2, 8


def frames(seed: int, count: int = 4, height: int = 32, width: int = 32) -> np.ndarray:
    """A random video: uint8 [count, height, width, 3]."""
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def video_patches(video: np.ndarray, image_processor) -> tuple[torch.Tensor, list[int]]:
    """Qwen2VLVideoProcessor's pixel_values_videos and video_grid_thw for frames it does not resize (its
    rescale_and_normalize, patchify's padding, view and permute)."""
    x = torch.from_numpy(video).double().permute(0, 3, 1, 2) / 255  # [frames, channels, height, width]
    mean = torch.tensor(image_processor.image_mean, dtype=torch.float64)[:, None, None]
    std = torch.tensor(image_processor.image_std, dtype=torch.float64)[:, None, None]
    x = ((x - mean) / std).float()[None]
    if pad := -x.shape[1] % TEMPORAL:
        x = torch.cat([x, x[:, -1:].expand(-1, pad, -1, -1, -1)], dim=1)
    _, count, channels, height, width = x.shape
    t, h, w = count // TEMPORAL, height // PATCH, width // PATCH
    x = x.view(1, t, TEMPORAL, channels, h // MERGE, MERGE, PATCH, w // MERGE, MERGE, PATCH)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(t * h * w, channels * TEMPORAL * PATCH * PATCH)
    return x, [t, h, w]


def hf_video_inputs(hf, prompt: str, images, videos) -> dict:
    """transformers' inputs for a prompt with images and videos (in the order their placeholders come): each
    placeholder repeated t * h * w / merge² times (Qwen2VLProcessor's replace_image_token / replace_video_token),
    mm_token_type_ids 1 at image tokens, 2 at video tokens, second_per_grid_ts 2 frames / 2 fps for Qwen2.5-VL."""
    model, tokenizer, image_processor = hf
    inputs, grids = {}, {PAD: [], VIDEO: []}
    if images:
        pixels = image_processor(images=images, return_tensors="pt")
        inputs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        grids[PAD] = pixels["image_grid_thw"].tolist()
    if videos:
        patches = [video_patches(v, image_processor) for v in videos]
        inputs.update(pixel_values_videos=torch.cat([p for p, _ in patches]),
                      video_grid_thw=torch.tensor([g for _, g in patches]))
        grids[VIDEO] = [g for _, g in patches]
        if model.config.model_type == "qwen2_5_vl":
            inputs["second_per_grid_ts"] = torch.tensor([TEMPORAL / 2.0] * len(videos))
    text, counters = "", {PAD: iter(grids[PAD]), VIDEO: iter(grids[VIDEO])}
    for piece in prompt.replace(VIDEO, "\0" + VIDEO + "\0").replace(PAD, "\0" + PAD + "\0").split("\0"):
        text += piece * (int(np.prod(next(counters[piece]))) // MERGE**2) if piece in counters else piece
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    types = (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types, **inputs}


def hf_generate(hf, prompt, images, videos, max_tokens: int = GREEDY.max_tokens):
    return hf_greedy_with_logprobs(hf[0], hf_video_inputs(hf, prompt, images, videos), max_tokens)


def test_video_mrope_positions_equal_transformers(hf, family):
    """An image (3 x 4 tokens), then a video of 5 frames (3 groups of 2 x 3 tokens), then text: our positions and
    delta are get_rope_index's (Qwen2.5-VL's temporal positions tokens_per_second apart, past the text after)."""
    inputs = hf_video_inputs(hf, BOTH, [image(1, size=WIDE)], [frames(1, count=5, width=48)])
    ids, types = inputs["input_ids"][0].tolist(), inputs["mm_token_type_ids"][0].tolist()
    want, delta = hf[0].model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                             inputs["image_grid_thw"], inputs["video_grid_thw"],
                                             inputs.get("second_per_grid_ts"))
    image_start, video_start = types.index(1), types.index(2)
    interval = hf[0].config.vision_config.tokens_per_second * 1.0 if family == "qwen2_5_vl" else 1.0
    ours, our_delta = mrope_positions(len(ids), [(image_start, 3, 4), (video_start, 2, 3, 3, interval)])
    assert np.array_equal(ours, want[:, 0].numpy()) and our_delta == int(delta)
    if family == "qwen2_5_vl":
        end = video_start + 18  # the last group's temporal position is past the next text token's
        assert ours[0, video_start:end].max() > ours[0, end]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_with_videos_matches_transformers(artifact, hf, family, device):
    """In one batch: a video of 4 frames, a video of 3 (the last repeated) beside an image, a text prompt; then the
    expanded ids of the second: transformers' prompt ids, greedy tokens and logprobs (on CUDA: the Triton kernels
    at the videos' M-RoPE positions, and the tower on the GPU)."""
    atol = 2e-4 if device == "cpu" else 2e-3
    clip, other, picture = frames(2), frames(3, count=3, height=48), image(4, size=WIDE)
    plain_ids = hf[1]("User:Hello there.")["input_ids"]
    expected = [hf_generate(hf, VIDEO_PROMPT, None, [clip]), hf_generate(hf, BOTH, [picture], [other]),
                hf_greedy_with_logprobs(hf[0], hf_inputs(hf, plain_ids, None), GREEDY.max_tokens)]
    video_id = hf[0].config.video_token_id
    assert [expected[0][0].count(video_id), expected[1][0].count(video_id)] == [8, 12]
    llm = LLM(artifact, device=device, max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64, block_size=8,
              limit_mm_per_prompt={"image": 1, "video": 1}, gpu_memory_utilization=0.3)
    frame_list = [Image.fromarray(f) for f in clip]  # a list of PIL images is one video too
    outputs = llm.generate([{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frame_list}},
                            {"prompt": BOTH, "multi_modal_data": {"image": picture, "video": other}},
                            {"prompt_token_ids": plain_ids}], GREEDY)
    for output, want in zip(outputs, expected, strict=True):
        check_output(output, want, atol)
    [expanded] = llm.generate({"prompt_token_ids": expected[1][0],
                               "multi_modal_data": {"image": [picture], "video": [other]}}, GREEDY)
    check_output(expanded, expected[1], atol)


def test_chunked_prefill_ends_inside_a_video(artifact, hf, monkeypatch):
    """8 tokens a step: the video's 12 tokens (after the image's) are split across chunks; the reply is
    transformers'."""
    picture, clip = image(5, size=WIDE), frames(6, count=4, height=48)
    expected = hf_generate(hf, BOTH, [picture], [clip])
    chunks = record_chunks(monkeypatch)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=8, max_num_seqs=2, num_kv_blocks=64, block_size=8)
    [output] = llm.generate({"prompt": BOTH, "multi_modal_data": {"image": picture, "video": clip}}, GREEDY)
    check_output(output, expected)
    video_id = hf[0].config.video_token_id
    video = [i for i, t in enumerate(output.prompt_token_ids) if t == video_id]
    assert any(video[0] < start + n <= video[-1] for _, start, n in chunks)  # a chunk ended inside the video


def test_videos_are_checked(artifact, hf):
    tokenizer = hf[1]
    video_id = tokenizer.convert_tokens_to_ids(VIDEO)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64, limit_mm_per_prompt={"video": 1})
    with pytest.raises(RequestError, match="At most 1 video\\(s\\) may be provided in one prompt"):
        llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": [frames(1), frames(2)]}}, GREEDY)
    with pytest.raises(RequestError, match="1 video placeholder\\(s\\) \\(<\\|video_pad\\|>, token id .* for 0 "):
        llm.generate({"prompt": BOTH, "multi_modal_data": {"image": image(1)}}, GREEDY)
    with pytest.raises(RequestError, match="video placeholders .* but no videos"):
        llm.generate(VIDEO_PROMPT, GREEDY)
    bad = [(frames(1)[0], "expected a uint8 array \\[num_frames, height, width, 3\\], got uint8 \\[32, 32, 3\\]"),
           (frames(1).astype(np.float32), "got float32"),
           (frames(1)[..., :1], "got uint8 \\[4, 32, 32, 1\\]"),
           ([Image.new("RGB", (32, 32)), Image.new("RGB", (48, 32))], "its frames differ in size"),
           ([[]], "a non-empty list of PIL images"),
           ((frames(1), {"fps": 4}), "\\(frames, metadata\\) pairs are not supported")]
    for video, message in bad:
        with pytest.raises(RequestError, match=message):
            llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video}}, GREEDY)
    head = tokenizer("User:" + START)["input_ids"]
    with pytest.raises(RequestError, match="a video placeholder of 3 tokens: this video takes one <\\|video_pad\\|>, "
                                           "or 8 \\(its 2 frame group\\(s\\) of 2 x 2 merged patches\\)"):
        llm.generate({"prompt_token_ids": head + [video_id] * 3, "multi_modal_data": {"video": frames(1)}}, GREEDY)
    with pytest.raises(ConfigError, match="limit_mm_per_prompt.video"):
        LLM(artifact, device="cpu", limit_mm_per_prompt={"video": -1})


def test_video_patches_equal_qwen2_vl_video_processor(checkpoint, hf):  # noqa: F811
    """Where torchvision is installed: transformers' Qwen2VLVideoProcessor makes the patches `video_patches`
    makes (the reference above)."""
    pytest.importorskip("torchvision")
    from transformers import Qwen2VLVideoProcessor

    processor = Qwen2VLVideoProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                      size={"shortest_edge": 16 * 16, "longest_edge": 128 * 128})
    video = frames(7, count=3, height=48)
    out = processor(videos=[video], return_tensors="pt", cap_pixels_per_frame=False)
    patches, grid = video_patches(video, hf[2])
    assert out["video_grid_thw"].tolist() == [grid]
    torch.testing.assert_close(out["pixel_values_videos"], patches, atol=1e-5, rtol=0)


def test_chat_video_url_parts_that_are_no_video_are_refused(artifact):
    """A video_url part (decoded with PyAV: tests/runtime/server/test_server_video.py) whose data is no video, beside
    an image or alone, is refused by name, not dropped."""
    from tests.runtime.test_llava import data_url

    pytest.importorskip("av")
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    for parts in ([{"type": "image_url", "image_url": {"url": data_url(image(1))}}, video], [video]):
        with pytest.raises(RequestError, match="video_url: not a readable video"):
            llm.chat([{"role": "user", "content": parts + [{"type": "text", "text": "What happens?"}]}], GREEDY)


def test_the_video_processor_files_decide_the_frames_size(checkpoint, family, tmp_path):  # noqa: F811
    """A video_preprocessor_config.json (carried into the artifact) of at most 512 px a frame: 4 frames of 32 x 32 px
    are resized to 16 x 16 (smart_resize), 2 video tokens, while images keep the image processor's size; its fields
    that disagree with the tower, and frame sampling, are refused at build."""
    import json
    import shutil

    from llmc.compiler.build import build
    from llmc.errors import CheckpointError
    from tests.runtime.hf_oracle import build_float32
    from tests.runtime.test_qwen2_vl import _recipe

    if family != "qwen2_vl":
        pytest.skip("the processor files are read alike for Qwen2.5-VL")
    changed = tmp_path / "hf"
    shutil.copytree(checkpoint, changed)
    video = {"size": {"shortest_edge": 256, "longest_edge": 512}, "patch_size": PATCH, "merge_size": MERGE,
             "temporal_patch_size": TEMPORAL, "video_processor_type": "Qwen2VLVideoProcessor"}
    (changed / "video_preprocessor_config.json").write_text(json.dumps(video))
    artifact = build_float32(changed, tmp_path / "a", target={"device": "cpu"})  # noqa: F811
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    [output] = llm.generate({"prompt": BOTH, "multi_modal_data": {"image": image(1, size=WIDE), "video": frames(1)}},
                            GREEDY)
    ids = output.prompt_token_ids
    assert ids.count(llm.get_tokenizer().convert_tokens_to_ids(VIDEO)) == 2
    assert ids.count(llm.get_tokenizer().convert_tokens_to_ids(PAD)) == 12
    for change, message in (({"merge_size": 1}, "the video processor's merge_size 1 is not the model's \\(2\\)"),
                            ({"do_sample_frames": True}, "do_sample_frames true .* is not supported")):
        (changed / "video_preprocessor_config.json").write_text(json.dumps(video | change))
        with pytest.raises(CheckpointError, match=message):
            build(_recipe(changed, tmp_path / "x"), show_progress=False)
