"""/v1/chat/completions (and LLM.chat) with vLLM's video_url parts on the tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL
checkpoints (tests/runtime/test_qwen2_vl.py, test_qwen3_vl.py): a video written here with PyAV (8 frames of 32 x 32
px, one random colour each) sent as a data URL gives transformers' greedy reply to the frames PyAV itself decodes from
it, sampled as vLLM samples them (numpy's linspace over the frames, truncated), and the offline API's reply to those
frames; Qwen3-VL's timestamps from the stream's frame rate and the kept frames' indices. What is refused answers 400
naming the part."""

from __future__ import annotations

import base64
import io
import sys

import httpx
import numpy as np
import pytest

from llmc.errors import ConfigError, RequestError
from llmc.runtime.engine import Engine
from llmc.runtime.llm import LLM
from llmc.runtime.multimodal import chat_images
from llmc.runtime.server.api_server import build_app
from llmc.runtime.video_io import sampled_indices
from tests.runtime.hf_oracle import build_float32
from tests.runtime.test_qwen2_vl_video import VIDEO_PROMPT
from tests.runtime.vision_oracle import check_output

av = pytest.importorskip("av")

RATE = 4  # frames a second of the videos written here


def write_video(seed: int, codec: str = "mpeg4", container: str = "mp4", count: int = 8) -> bytes:
    """A video of `count` 32 x 32 frames, each one random colour, `RATE` frames a second, encoded by PyAV."""
    colours = np.random.default_rng(seed).integers(0, 256, (count, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=RATE)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for colour in colours:
            frame = av.VideoFrame.from_ndarray(np.broadcast_to(colour, (32, 32, 3)).copy(), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buffer.getvalue()


def decoded_frames(raw: bytes, indices: list[int]) -> np.ndarray:
    """The reference frames: every frame PyAV decodes from `raw` as RGB, those at `indices` kept."""
    with av.open(io.BytesIO(raw)) as video:
        frames = [frame.to_ndarray(format="rgb24") for frame in video.decode(video=0)]
    return np.stack([frames[i] for i in indices])


def video_url(raw: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def _chat(base_url: str, content) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "logprobs": True})


def _video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def _token_strings(checkpoint, token_ids: list[int]) -> list[str]:
    """What the server reports as each token's text (its logprobs' `token`): the token decoded alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    return [tokenizer.decode([t]) for t in token_ids]


def _check_reply(checkpoint, reply, expected) -> None:
    """A served chat reply against transformers' (prompt ids, greedy tokens, logprobs)."""
    prompt_ids, tokens, logprobs = expected
    assert reply.status_code == 200, reply.text
    body = reply.json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == _token_strings(checkpoint, tokens)
    assert [e["logprob"] for e in content] == pytest.approx(logprobs, abs=2e-4)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)


def test_sampling_is_vllms_uniform_sampling():
    """vLLM's loader: linspace(0, total - 1, num_frames) truncated; every frame where the video has fewer, or -1."""
    assert sampled_indices(8, 4) == [0, 2, 4, 7]
    assert sampled_indices(100, 32)[:4] == [0, 3, 6, 9] and sampled_indices(100, 32)[-1] == 99
    assert sampled_indices(5, 32) == sampled_indices(5, -1) == [0, 1, 2, 3, 4]


def test_chat_parts_are_checked(monkeypatch):
    """A model that takes no video, an http(s) URL, another URL kind, JPEG frames, a corrupt container and no PyAV:
    each refused naming the part (before any engine sees it)."""
    from llmc.runtime.multimodal import ChatVideos

    def chat(url, videos=ChatVideos(32, False)):
        return chat_images([{"role": "user", "content": [{"type": "text", "text": "x"}, _video_part(url)]}], videos)

    raw = write_video(0)
    with pytest.raises(RequestError, match="messages.0.content.1: a video_url part needs a model that takes videos"):
        chat(video_url(raw), None)
    for url, words in [("https://example.com/a.mp4", "http\\(s\\) video URLs are not fetched"),
                       ("data:image/png;base64,AAAA", "expected a base64 data URL of a video"),
                       ("data:video/jpeg;base64,AAAA", "data:video/jpeg .* is not supported"),
                       ("data:video/mp4;base64," + base64.b64encode(b"not a video").decode(), "not a readable video"),
                       (video_url(raw[: len(raw) // 3]), "not a readable video")]:
        with pytest.raises(RequestError, match="messages.0.content.1.video_url: (.*)" + words):
            chat(url)
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    with pytest.raises(RequestError, match="need PyAV .* pip install 'llmc\\[video\\]'"):
        chat(video_url(raw))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen2(request, tmp_path_factory):
    """(checkpoint, float32 artifact, transformers' model, tokenizer and image processor) of Qwen2-VL and of
    Qwen2.5-VL."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers import Qwen2VLForConditionalGeneration

    from tests.runtime.test_qwen2_vl import make_qwen_vl_checkpoint

    family = request.param
    checkpoint = make_qwen_vl_checkpoint(tmp_path_factory.mktemp(family) / "hf", family, seed=3)
    artifact = build_float32(checkpoint, tmp_path_factory.mktemp(f"{family}-art") / "a", target={"device": "cpu"})
    kind = Qwen2VLForConditionalGeneration if family == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    model = kind.from_pretrained(str(checkpoint), attn_implementation="eager").eval()
    return checkpoint, artifact, (model, AutoTokenizer.from_pretrained(str(checkpoint)),
                                  AutoImageProcessor.from_pretrained(str(checkpoint)))


def test_qwen2_vl_served_video_url(qwen2, run_app, monkeypatch):
    """Qwen2-VL and Qwen2.5-VL (its frames taken at 2 fps), --media-io-kwargs '{"video": {"num_frames": 4}}': an
    8-frame mp4 (MPEG-4 part 2) sent as a data URL is frames 0, 2, 4, 7 as PyAV decodes them: the reply's tokens are
    transformers' greedy tokens for those frames, its prompt_tokens the expanded prompt's; the offline API
    (LLM.generate with the frames) answers the same. Over the server: an http URL, a corrupt video and no PyAV are
    400s naming the part."""
    from tests.runtime.test_qwen2_vl_video import hf_generate

    checkpoint, artifact, hf = qwen2
    raw = write_video(1)
    frames = decoded_frames(raw, [0, 2, 4, 7])
    prompt_ids, tokens, logprobs = hf_generate(hf, VIDEO_PROMPT, None, [frames])
    base_url = run_app(build_app(lambda: Engine(artifact, device="cpu", disable_log_stats=True,
                                                media_io_kwargs={"video": {"num_frames": 4}}), "m", log_stats=False),
                       wait_healthy=True)
    reply = _chat(base_url, [_video_part(video_url(raw)), {"type": "text", "text": "What happens?"}])
    _check_reply(checkpoint, reply, (prompt_ids, tokens, logprobs))
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    from tests.runtime.test_qwen2_vl import GREEDY

    [offline] = llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames}}, GREEDY)
    check_output(offline, (prompt_ids, tokens, logprobs))
    for url, words in [("http://example.com/a.mp4", "http(s) video URLs are not fetched"),
                       (video_url(raw[:200]), "not a readable video")]:
        refused = _chat(base_url, [_video_part(url), {"type": "text", "text": "x"}])
        message = refused.json()["error"]["message"]
        assert refused.status_code == 400 and message.startswith("messages.0.content.0.video_url") and words in message
    monkeypatch.setitem(sys.modules, "av", None)
    refused = _chat(base_url, [_video_part(video_url(raw)), {"type": "text", "text": "x"}])
    assert refused.status_code == 400 and "pip install 'llmc[video]'" in refused.json()["error"]["message"]


def test_qwen2_vl_chat_default_frames_and_options(qwen2):
    """LLM.chat with the default 32 frames: an 8-frame video keeps every frame (the offline reply to all 8 decoded
    frames); media_io_kwargs' num_frames 0 and keys other than video are refused by name."""
    from tests.runtime.test_qwen2_vl import GREEDY

    _, artifact, _ = qwen2
    raw = write_video(2, codec="libvpx", container="webm")
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    [chat] = llm.chat([{"role": "user", "content": [_video_part(video_url(raw, "video/webm")),
                                                    {"type": "text", "text": "What happens?"}]}], GREEDY)
    [offline] = llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": decoded_frames(raw, range(8))}},
                             GREEDY)
    assert chat.prompt_token_ids == offline.prompt_token_ids
    assert chat.outputs[0].token_ids == offline.outputs[0].token_ids
    assert chat.prompt_token_ids.count(hf_video_token(llm)) == 4 * 4  # 8 frames: 4 groups of 2 x 2 tokens
    with pytest.raises(ConfigError, match="media_io_kwargs.video.num_frames: 0 keeps no frame"):
        LLM(artifact, device="cpu", media_io_kwargs={"video": {"num_frames": 0}})
    with pytest.raises(ConfigError, match="media_io_kwargs.image: unknown key"):
        LLM(artifact, device="cpu", media_io_kwargs={"image": {"num_frames": 4}})


def hf_video_token(llm) -> int:
    return llm.engine.manifest.vision.video_token_index


def test_qwen3_vl_served_video_url(tmp_path, run_app):
    """Qwen3-VL: an 8-frame webm (VP8) with the default 32 frames is every frame, timed by the stream's 4 fps and
    indices 0..7 (vLLM's metadata): the reply is transformers' greedy reply with Qwen3VLProcessor's timestamps, and
    the offline API's reply to ((frames, metadata))."""
    from tests.runtime.test_qwen3_vl import GREEDY, make_qwen3_vl_checkpoint
    from tests.runtime.test_qwen3_vl_video import hf_generate
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

    checkpoint = make_qwen3_vl_checkpoint(tmp_path / "hf", seed=4)
    artifact = build_float32(checkpoint, tmp_path / "a", target={"device": "cpu"})
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(checkpoint), attn_implementation="eager").eval()
    hf = (model, AutoTokenizer.from_pretrained(str(checkpoint)), AutoImageProcessor.from_pretrained(str(checkpoint)))
    raw = write_video(5, codec="libvpx", container="webm")
    frames = decoded_frames(raw, range(8))
    prompt_ids, tokens, logprobs = hf_generate(hf, VIDEO_PROMPT, None, [(frames, float(RATE), list(range(8)))])
    base_url = run_app(build_app(lambda: Engine(artifact, device="cpu", disable_log_stats=True), "m",
                                 log_stats=False), wait_healthy=True)
    reply = _chat(base_url, [_video_part(video_url(raw, "video/webm")), {"type": "text", "text": "What happens?"}])
    _check_reply(checkpoint, reply, (prompt_ids, tokens, logprobs))
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=64)
    metadata = {"fps": float(RATE), "frames_indices": list(range(8)), "total_num_frames": 8}
    [offline] = llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": (frames, metadata)}}, GREEDY)
    check_output(offline, (prompt_ids, tokens, logprobs))


def test_a_model_without_videos_refuses_media_io_kwargs(server_artifact):
    with pytest.raises(ConfigError, match="media_io_kwargs.video: this model .* takes no videos"):
        LLM(server_artifact, device="cpu", media_io_kwargs={"video": {"num_frames": 4}})


def test_mm_processor_kwargs_are_refused_by_name():
    """vLLM's per-request processor settings (a video's fps, do_sample_frames) would change the frames: a 400 naming
    the field, not a warning."""
    from llmc.runtime.server.errors import ApiError
    from llmc.runtime.server.protocol import ChatCompletionRequest
    from llmc.runtime.server.serving import parse_body

    with pytest.raises(ApiError, match="mm_processor_kwargs: not supported"):
        parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                           "mm_processor_kwargs": {"fps": 1}})
