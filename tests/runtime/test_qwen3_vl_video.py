"""Qwen3-VL videos (multi_modal_data {"video": frames or (frames, metadata)}) on the tiny random float32 Qwen3-VL of
test_qwen3_vl.py, against transformers' Qwen3VLForConditionalGeneration.generate with pixel_values_videos and
video_grid_thw: the prompt ids (each frame group's timestamp "<t seconds>" then <|vision_start|>, its <|video_pad|>
run and <|vision_end|>), the greedy tokens and their logprobs for a video alone (no metadata: 24 fps, as
Qwen3VLProcessor assumes), a video with vLLM's metadata (fps, frames_indices) beside an image, PIL frames, a text
prompt in one batch, prefill chunks ending inside the video; the positions against transformers' get_rope_index
(each frame group an image of t = 1); the timestamps against Qwen3VLProcessor's; a resized video's token count
against Qwen3VLVideoProcessor's; what is refused.

The reference per-video text is Qwen3VLProcessor.replace_video_token's own string (called with its fields, as its
video processor needs torchvision, which this machine's torch has no build of), put in place of
<|vision_start|><|video_pad|><|vision_end|> as the published processor (transformers 4.57, the model authors') and
vLLM put it (transformers 5 replaces the bare <|video_pad|> only, so its text nests the frames in one more
<|vision_start|> ... <|vision_end|>; README "Qwen3-VL"). The reference pixel_values_videos follow the video
processor's published patchify by hand (tests/runtime/test_qwen2_vl_video.video_patches: Qwen3VLVideoProcessor's
view and permute are Qwen2VLVideoProcessor's) for frames it does not resize (multiples of 16 px whose pixels, all
frames together, lie within the checkpoint's size)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from llmc.errors import ConfigError, RequestError
from llmc.runtime.llm import LLM
from llmc.runtime.multimodal import mrope_positions, qwen3_timestamps
from tests.runtime.test_llava import image
from tests.runtime.test_qwen2_vl_video import frames, video_patches
from tests.runtime.test_qwen2_vl import END, PAD, START, VIDEO, WIDE, expand, hf_inputs
from tests.runtime.test_qwen3_vl import GREEDY, artifact, checkpoint, hf  # noqa: F401
from tests.runtime.vision_oracle import check_output, hf_greedy_with_logprobs, record_chunks

CLIP = START + VIDEO + END
VIDEO_PROMPT = "User:" + CLIP + "What happens?"
BOTH = "Look:" + START + PAD + END + "and" + CLIP + "Compare them."
TWO_VIDEOS = "First:" + CLIP + "then\n" + CLIP + "Compare them."
MERGE = 2
METADATA = {"fps": 2.0, "frames_indices": [0, 3, 6, 9, 12], "total_num_frames": 20, "duration": 10.0,
            "video_backend": "opencv", "do_sample_frames": False}  # vLLM's form (5 frames: the last group padded)


def video_text(grid: list[int], fps: float | None, indices: list[int]) -> str:
    """Qwen3VLProcessor.replace_video_token's text for one video of video_grid_thw `grid` (its timestamps by its
    _calculate_timestamps; fps None: its default)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    fields = SimpleNamespace(video_processor=SimpleNamespace(merge_size=MERGE, temporal_patch_size=2),
                             vision_start_token=START, vision_end_token=END, video_token=VIDEO,
                             _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a))
    metadata = VideoMetadata(total_num_frames=max(indices) + 1, fps=fps, frames_indices=list(indices))
    return Qwen3VLProcessor.replace_video_token(fields, {"video_grid_thw": torch.tensor([grid]),
                                                         "video_metadata": [metadata]}, 0)


def hf_video_inputs(hf, prompt: str, images, videos) -> dict:  # noqa: F811
    """transformers' inputs: the image processor's patches, each video's (frames, fps or None, frames_indices)
    patched by hand, the prompt expanded (images by replace_image_token's count, each video's placeholder by
    `video_text`), mm_token_type_ids 1 at image tokens and 2 at video tokens."""
    model, tokenizer, image_processor = hf
    inputs, image_grids = {}, []
    if images:
        pixels = image_processor(images=images, return_tensors="pt")
        inputs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        image_grids = pixels["image_grid_thw"].tolist()
    if videos:
        patches = [video_patches(v, image_processor) for v, _, _ in videos]
        inputs.update(pixel_values_videos=torch.cat([p for p, _ in patches]),
                      video_grid_thw=torch.tensor([g for _, g in patches]))
        for (_, grid), (_, fps, indices) in zip(patches, videos):
            prompt = prompt.replace(CLIP, "\0" + video_text(grid, fps, indices) + "\0", 1)
    text = expand(prompt.replace("\0", ""), image_grids)
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    types = (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types, **inputs}


def hf_generate(hf, prompt, images, videos):  # noqa: F811
    return hf_greedy_with_logprobs(hf[0], hf_video_inputs(hf, prompt, images, videos), GREEDY.max_tokens)


def test_timestamps_equal_qwen3_vl_processors():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    for indices, fps in (([0, 1, 2, 3], 24.0), ([0, 3, 6, 9, 12], 2.0), ([5, 17, 40], 29.97), ([7], 1.0)):
        assert qwen3_timestamps(indices, fps, 2) == Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)


def test_video_mrope_positions_equal_transformers(artifact, hf):  # noqa: F811
    """An image (3 x 4 tokens), then a video of 5 frames (3 groups of 2 x 3 tokens between timestamps): our prompt
    ids are the reference's, and our positions and delta get_rope_index's (each frame group an image of t = 1)."""
    picture, clip = image(1, size=WIDE), frames(1, count=5, width=48)
    inputs = hf_video_inputs(hf, BOTH, [picture], [(clip, METADATA["fps"], METADATA["frames_indices"])])
    want, delta = hf[0].model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                             inputs["image_grid_thw"], inputs["video_grid_thw"])
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    ids = hf[1](BOTH)["input_ids"]
    vision = llm.engine.vision
    from llmc.runtime.multimodal import videos_of

    expanded, inputs_ours = vision.prompt_inputs(ids, [picture], videos_of({"video": (clip, METADATA)}, True,
                                                                           metadata=True))
    assert expanded == inputs["input_ids"][0].tolist()
    assert np.array_equal(inputs_ours.mrope, want[:, 0].numpy()) and inputs_ours.rope_delta == int(delta)
    types = inputs["mm_token_type_ids"][0].tolist()
    starts = [i for i, t in enumerate(types) if t and not types[i - 1]]
    ours, _ = mrope_positions(len(expanded), [(s, r, c) for s, (r, c) in zip(starts, [(3, 4)] + [(2, 3)] * 3)])
    assert np.array_equal(ours, inputs_ours.mrope)
    assert hf[1].decode(expanded).count("seconds>") == 3 and "<3.8 seconds>" in hf[1].decode(expanded)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_with_videos_matches_transformers(artifact, hf, device):  # noqa: F811
    """In one batch: a video of 4 frames (no metadata: 24 fps), a 5-frame video with vLLM's metadata beside an image,
    the first video as PIL frames with metadata, both videos in one prompt, a text prompt: transformers' prompt ids,
    greedy tokens and logprobs
    (the deepstack rows of video tokens included: transformers adds them at the video tokens as at image tokens)."""
    atol = 2e-4 if device == "cpu" else 2e-3
    clip, other, picture = frames(2), frames(3, count=5, height=48), image(4, size=WIDE)
    pil_metadata = {"fps": np.float32(1.0), "frames_indices": list(np.arange(2, 10, 2))}  # numpy scalars too
    plain_ids = hf[1]("User:Hello there.")["input_ids"]
    expected = [hf_generate(hf, VIDEO_PROMPT, None, [(clip, None, [0, 1, 2, 3])]),
                hf_generate(hf, BOTH, [picture], [(other, 2.0, METADATA["frames_indices"])]),
                hf_generate(hf, VIDEO_PROMPT, None, [(clip, 1.0, [2, 4, 6, 8])]),
                hf_greedy_with_logprobs(hf[0], hf_inputs(hf, plain_ids, None), GREEDY.max_tokens),
                hf_generate(hf, TWO_VIDEOS, None,
                            [(other, 2.0, METADATA["frames_indices"]), (clip, None, [0, 1, 2, 3])])]
    video_id = hf[0].config.video_token_id
    assert [expected[0][0].count(video_id), expected[1][0].count(video_id)] == [8, 18]
    assert expected[0][0] != expected[2][0]  # the timestamps differ
    llm = LLM(artifact, device=device, max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64, block_size=8,
              limit_mm_per_prompt={"image": 1, "video": 2}, gpu_memory_utilization=0.3)
    outputs = llm.generate([{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": clip}},
                            {"prompt": BOTH, "multi_modal_data": {"image": picture, "video": (other, METADATA)}},
                            {"prompt": VIDEO_PROMPT,
                             "multi_modal_data": {"video": [([Image.fromarray(f) for f in clip], pil_metadata)]}},
                            {"prompt_token_ids": plain_ids},
                            {"prompt": TWO_VIDEOS, "multi_modal_data": {"video": [(other, METADATA), clip]}}], GREEDY)
    for output, want in zip(outputs, expected, strict=True):
        check_output(output, want, atol)


def test_a_bare_video_pad_and_chunks_inside_the_video(artifact, hf, monkeypatch):  # noqa: F811
    """A bare <|video_pad|> (no <|vision_start|>/<|vision_end|> around it) is replaced alone, as the processor
    replaces it; 8 tokens a step split the video's frame groups across chunks; the replies are transformers'."""
    clip, picture = frames(6, count=4, height=48), image(5, size=WIDE)
    bare = "User:" + VIDEO + "What happens?"
    expected = [hf_generate(hf, BOTH, [picture], [(clip, None, [0, 1, 2, 3])])]
    grid = video_patches(clip, hf[2])[1]
    text = bare.replace(VIDEO, video_text(grid, None, [0, 1, 2, 3]))
    patches = video_patches(clip, hf[2])[0]
    ids = torch.tensor([hf[1](text)["input_ids"]])
    types = 2 * (ids == hf[0].config.video_token_id).int()
    expected.append(hf_greedy_with_logprobs(hf[0], {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                    "mm_token_type_ids": types, "pixel_values_videos": patches,
                                                    "video_grid_thw": torch.tensor([grid])}, GREEDY.max_tokens))
    chunks = record_chunks(monkeypatch)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=8, max_num_seqs=2, num_kv_blocks=64, block_size=8)
    outputs = llm.generate([{"prompt": BOTH, "multi_modal_data": {"image": picture, "video": clip}},
                            {"prompt": bare, "multi_modal_data": {"video": clip}}], GREEDY)
    for output, want in zip(outputs, expected, strict=True):
        check_output(output, want)
    video_id = hf[0].config.video_token_id
    video = [i for i, t in enumerate(outputs[0].prompt_token_ids) if t == video_id]
    assert any(video[0] < start + n <= video[-1] for _, start, n in chunks)  # a chunk ended inside the video


def test_a_resized_video_takes_the_video_processors_token_count(artifact, hf):  # noqa: F811
    """6 frames of 64 x 80 px are over the size's longest_edge all together (6 x 64 x 80 > 16384): resized by
    Qwen3VLVideoProcessor's smart_resize over the whole video, to the token count transformers' video processor
    gives (its get_num_of_video_patches / merge²), in 3 timestamped groups."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    processor = Qwen3VLVideoProcessor(patch_size=8, merge_size=MERGE, temporal_patch_size=2,
                                      size={"shortest_edge": 16 * 16, "longest_edge": 128 * 128},
                                      cap_pixels_per_frame=False)  # the checkpoint's (test_qwen3_vl's) size
    want = processor.get_num_of_video_patches(6, 64, 80) // MERGE**2
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=128)
    [output] = llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames(7, count=6, height=64,
                                                                                         width=80)}}, GREEDY)
    ids = output.prompt_token_ids
    assert ids.count(hf[0].config.video_token_id) == want == 18 < 6 // 2 * (64 // 16) * (80 // 16)  # 32 x 48 px
    assert hf[1].decode(ids).count(" seconds>") == 3


def test_videos_are_checked(artifact, hf):  # noqa: F811
    tokenizer = hf[1]
    video_id = tokenizer.convert_tokens_to_ids(VIDEO)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64, limit_mm_per_prompt={"video": 1})
    with pytest.raises(RequestError, match="At most 1 video\\(s\\) may be provided in one prompt"):
        llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": [frames(1), frames(2)]}}, GREEDY)
    with pytest.raises(RequestError, match="video placeholders .* but no videos"):
        llm.generate(VIDEO_PROMPT, GREEDY)
    bad = [((frames(1), {"fps": 2.0, "width": 32}), "video metadata 'width' is not supported"),
           ((frames(1), {"do_sample_frames": True}), "do_sample_frames true .* is not supported"),
           ((frames(1), {"fps": 0}), "fps must be a positive number, got 0"),
           ((frames(1), {"frames_indices": [0, 1]}), "frames_indices must be 4 non-negative ints"),
           ((frames(1), {"frames_indices": [0, 1, 2, 9], "total_num_frames": 5}), "reach past total_num_frames 5"),
           ((frames(1), [2.0]), "metadata a dict"),
           ((frames(1), {}, {}), "a \\(frames, metadata\\) pair, got a tuple of 3"),
           (frames(1, count=1), "1 frame\\(s\\); Qwen3-VL's video processor takes at least temporal_patch_size"),
           (frames(1)[0], "expected a uint8 array \\[num_frames, height, width, 3\\]")]
    for video, message in bad:
        with pytest.raises(RequestError, match=message):
            llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video}}, GREEDY)
    head = tokenizer("User:" + START)["input_ids"]
    with pytest.raises(RequestError, match="a video placeholder of 4 tokens: a Qwen3-VL video takes one "):
        llm.generate({"prompt_token_ids": head + [video_id] * 4, "multi_modal_data": {"video": frames(1)}}, GREEDY)
    with pytest.raises(RequestError, match="not its timestamped expansion"):
        llm.generate({"prompt_token_ids": head + [video_id, 5, video_id], "multi_modal_data": {"video": frames(1)}},
                     GREEDY)
    with pytest.raises(ConfigError, match="limit_mm_per_prompt.video"):
        LLM(artifact, device="cpu", limit_mm_per_prompt={"video": -1})


def test_the_published_video_processor_files(checkpoint, tmp_path):  # noqa: F811
    """A video_preprocessor_config.json as Qwen3-VL publishes it (do_sample_frames true, fps 2, min/max_frames: not
    applied, the frames given are used, as vLLM uses its loader's) with a size of at most 1024 px a video: 4 frames
    of 32 x 32 px are resized to 16 x 16 (smart_resize over all frames), 1 token a group; cap_pixels_per_frame and
    fields that disagree with the tower are refused at build."""
    import json
    import shutil

    from llmc.compiler.build import build
    from llmc.errors import CheckpointError
    from tests.runtime.hf_oracle import build_float32
    from tests.runtime.test_qwen2_vl import _recipe

    changed = tmp_path / "hf"
    shutil.copytree(checkpoint, changed)
    video = {"size": {"shortest_edge": 256, "longest_edge": 1024}, "patch_size": 8, "merge_size": MERGE,
             "temporal_patch_size": 2, "do_sample_frames": True, "fps": 2, "min_frames": 4, "max_frames": 768,
             "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "video_processor_type": "Qwen3VLVideoProcessor"}
    (changed / "video_preprocessor_config.json").write_text(json.dumps(video))
    llm = LLM(build_float32(changed, tmp_path / "a", target={"device": "cpu"}), device="cpu")
    [output] = llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames(1)}}, GREEDY)
    assert output.prompt_token_ids.count(llm.get_tokenizer().convert_tokens_to_ids(VIDEO)) == 2
    for change, message in (({"cap_pixels_per_frame": True}, "cap_pixels_per_frame true .* is not supported"),
                            ({"patch_size": 16}, "the video processor's patch_size 16 is not the model's \\(8\\)")):
        (changed / "video_preprocessor_config.json").write_text(json.dumps(video | change))
        with pytest.raises(CheckpointError, match=message):
            build(_recipe(changed, tmp_path / "x"), show_progress=False)


def test_video_patches_equal_qwen3_vl_video_processor(hf):  # noqa: F811
    """Where torchvision is installed: transformers' Qwen3VLVideoProcessor makes the patches `video_patches` makes
    (the reference above) for frames it does not resize, and the grid ours takes for frames it resizes."""
    pytest.importorskip("torchvision")
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    processor = Qwen3VLVideoProcessor(patch_size=8, merge_size=MERGE, temporal_patch_size=2, image_mean=[0.5] * 3,
                                      image_std=[0.5] * 3, size={"shortest_edge": 16 * 16, "longest_edge": 128 * 128})
    video = frames(7, count=5, height=48)
    out = processor(videos=[video], return_tensors="pt", do_sample_frames=False, cap_pixels_per_frame=False)
    patches, grid = video_patches(video, hf[2])
    assert out["video_grid_thw"].tolist() == [grid]
    torch.testing.assert_close(out["pixel_values_videos"], patches, atol=1e-5, rtol=0)
    resized = processor(videos=[frames(7, count=6, height=64, width=80)], return_tensors="pt", do_sample_frames=False,
                        cap_pixels_per_frame=False)
    assert resized["video_grid_thw"].tolist() == [[3, 4, 6]]  # 32 x 48 px: test_a_resized_video's 18 tokens
