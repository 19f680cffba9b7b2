"""/v1/chat/completions with image parts on a LLaVA artifact (tests/runtime/test_llava.py's tiny checkpoint): the
reply is transformers' greedy reply to the rendered prompt with that image; what is refused answers 400."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from llmc.errors import RequestError
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.server.engine_loop import EngineLoop, RequestStream, _Command
from llmc.runtime.server.api_server import build_app
from tests.runtime.hf_oracle import build_float32
from tests.runtime.test_llava import PROMPT, data_url, hf_generate, image, make_llava_checkpoint


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava") / "hf", seed=1)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _chat(base_url: str, content, **body) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "logprobs": True, **body})


@pytest.mark.slow
def test_chat_image_parts(llava, tmp_path, run_app, server_artifact):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    picture = image(7)
    model = LlavaForConditionalGeneration.from_pretrained(str(llava), attn_implementation="eager").eval()
    prompt_ids, expected = hf_generate((model, AutoProcessor.from_pretrained(str(llava))), PROMPT, [picture], 6)
    base_url = _served_reply_is(run_app, llava, tmp_path, 16, picture, "What is this?", prompt_ids, expected)
    refused = _chat(base_url, [{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}])
    assert refused.status_code == 400 and "http(s) image URLs are not fetched" in refused.json()["error"]["message"]
    text_only = run_app(build_app(lambda: Engine(server_artifact, device="cpu", disable_log_stats=True), "m",
                                  log_stats=False), wait_healthy=True)
    refused = _chat(text_only, [{"type": "image_url", "image_url": {"url": data_url(picture)}}])
    assert refused.status_code == 400 and "takes no images" in refused.json()["error"]["message"]


def _queued_together(artifact, requests: list) -> tuple[list, list[int]]:
    """Add `requests` ((prompt ids, multi_modal_data) each) to an EngineLoop while its engine thread is held by
    another command, so that they are queued together, as concurrent requests are under load; (each request's
    greedy tokens, or the exception its add raised; the number of images of each vision-tower call)."""
    tower_calls: list[int] = []

    def engine():
        engine = Engine(artifact, device="cpu", disable_log_stats=True)
        rows = engine.vision._rows
        engine.vision._rows = lambda pixels: (tower_calls.append(len(pixels)), rows(pixels))[1]
        return engine

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        await loop.wait_ready()
        started, release = threading.Event(), threading.Event()
        loop._commands.put(_Command(lambda _: (started.set(), release.wait(60))))
        assert await asyncio.to_thread(started.wait, 60)
        streams = [RequestStream(f"r{i}", asyncio.Queue(), i, time.monotonic()) for i in range(len(requests))]
        adds = [asyncio.ensure_future(loop.add_request(stream, ids, GREEDY, multi_modal_data=data))
                for stream, (ids, data) in zip(streams, requests)]
        await asyncio.sleep(0.2)  # every add's command is queued behind the held one
        release.set()
        added = await asyncio.gather(*adds, return_exceptions=True)
        replies = []
        for stream, error in zip(streams, added):
            output = None
            while error is None and (output is None or not output.finished):
                _, output = await asyncio.wait_for(stream.queue.get(), 60)
            replies.append(error if error is not None else output.outputs[0].token_ids)
        await loop.shutdown()
        return replies

    return asyncio.run(run()), tower_calls


def test_concurrent_requests_images_are_encoded_in_one_tower_call(llava, tmp_path):
    """Three LLaVA requests with an image each, queued while the engine thread is busy: their images go through
    the tower in one call (not one each), and each reply is transformers' greedy reply to its own image. With a
    malformed image queued among them, that request alone gets its error and the others their replies."""
    from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

    pictures = [image(11), image(12, size=(48, 30)), image(13)]
    model = LlavaForConditionalGeneration.from_pretrained(str(llava), attn_implementation="eager").eval()
    processor = AutoProcessor.from_pretrained(str(llava))
    expected = [hf_generate((model, processor), PROMPT, [picture], GREEDY.max_tokens)[1] for picture in pictures]
    assert len({tuple(tokens) for tokens in expected}) > 1  # the replies depend on the image
    ids = AutoTokenizer.from_pretrained(str(llava))(PROMPT)["input_ids"]
    artifact = build_float32(llava, tmp_path / "a", target={"device": "cpu"})
    replies, tower_calls = _queued_together(artifact, [(ids, {"image": picture}) for picture in pictures])
    assert replies == expected
    assert tower_calls == [3]
    mixed = [(ids, {"image": pictures[0]}), (ids, {"image": "not an image"}), (ids, {"image": pictures[2]})]
    replies, tower_calls = _queued_together(artifact, mixed)
    assert [replies[0], replies[2]] == [expected[0], expected[2]]
    assert isinstance(replies[1], RequestError) and "multi_modal_data.image[0]" in str(replies[1])
    assert tower_calls == [1, 1]  # the batch could not be preprocessed: each good image alone


def _served_reply_is(run_app, checkpoint, tmp_path, budget: int, picture, text: str, prompt_ids, expected) -> str:
    """Serve the checkpoint's float32 build (max_num_batched_tokens `budget`) and check that a chat of `picture` and
    `text` gives transformers' greedy tokens `expected`, its usage counting `prompt_ids` (the image's tokens
    included); the server's base URL."""
    artifact = build_float32(checkpoint, tmp_path / "a", target={"device": "cpu"})
    base_url = run_app(build_app(lambda: Engine(artifact, device="cpu", max_num_batched_tokens=budget,
                                                disable_log_stats=True), "m", log_stats=False), wait_healthy=True)
    reply = _chat(base_url, [{"type": "image_url", "image_url": {"url": data_url(picture)}},
                             {"type": "text", "text": text}])
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [entry["token"] for entry in body["choices"][0]["logprobs"]["content"]] == \
        _token_strings(checkpoint, expected)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    return base_url


def _token_strings(checkpoint, token_ids: list[int]) -> list[str]:
    """What the server reports as each token's text (its logprobs' `token`): the token decoded alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    return [tokenizer.decode([t]) for t in token_ids]


@pytest.mark.slow
def test_gemma3_chat_image_parts(tmp_path, run_app):
    """Gemma 3's vision model (tests/runtime/test_gemma3_vision.py's checkpoint): a data-URL image part gives
    transformers' greedy reply to the rendered prompt with that image, the image's 16 tokens (and the processor's
    <start_of_image>, <end_of_image> and newlines around them) counted in prompt_tokens."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from tests.runtime.test_gemma3_vision import PROMPT as GEMMA_PROMPT
    from tests.runtime.test_gemma3_vision import hf_generate as gemma_generate
    from tests.runtime.test_gemma3_vision import make_gemma3_checkpoint

    checkpoint = make_gemma3_checkpoint(tmp_path / "hf", seed=2)
    picture = image(8)
    model = Gemma3ForConditionalGeneration.from_pretrained(str(checkpoint), attn_implementation="eager").eval()
    prompt_ids, expected, _ = gemma_generate((model, AutoProcessor.from_pretrained(str(checkpoint))), GEMMA_PROMPT,
                                             [picture], 6)
    _served_reply_is(run_app, checkpoint, tmp_path, 24, picture, "Describe it.", prompt_ids, expected)


@pytest.mark.slow
def test_mistral3_chat_image_parts(tmp_path, run_app):
    """Mistral 3's vision model (tests/runtime/test_mistral3_vision.py's checkpoint): a data-URL image part of a
    64 x 24 image gives transformers' greedy reply, its [IMG] rows and their [IMG_BREAK] / [IMG_END] counted in
    prompt_tokens; its image split across 8-token chunks."""
    from tests.runtime.test_mistral3_vision import PROMPT as MISTRAL3_PROMPT
    from tests.runtime.test_mistral3_vision import SMALL, _hf, make_pixtral_checkpoint
    from tests.runtime.test_mistral3_vision import hf_generate as mistral3_generate

    checkpoint = make_pixtral_checkpoint(tmp_path / "hf", seed=2)
    picture = image(9, size=SMALL)
    prompt_ids, expected, _ = mistral3_generate(_hf(checkpoint, llava=False), MISTRAL3_PROMPT, [picture], 6)
    _served_reply_is(run_app, checkpoint, tmp_path, 8, picture, "Describe it.", prompt_ids, expected)


@pytest.mark.slow
def test_qwen3_vl_chat_image_parts(tmp_path, run_app):
    """Qwen3-VL (tests/runtime/test_qwen3_vl.py's checkpoint): a data-URL image part of a 64 x 48 image gives
    transformers' greedy reply (its 12 image tokens' deepstack rows added, split across 8-token chunks), the image's
    tokens counted in prompt_tokens; a video_url part that is no video is refused by name."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

    from tests.runtime.test_qwen3_vl import PROMPT as QWEN3_PROMPT
    from tests.runtime.test_qwen3_vl import WIDE, make_qwen3_vl_checkpoint
    from tests.runtime.test_qwen3_vl import hf_generate as qwen3_generate

    checkpoint = make_qwen3_vl_checkpoint(tmp_path / "hf", seed=2)
    picture = image(10, size=WIDE)
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(checkpoint), attn_implementation="eager").eval()
    hf = (model, AutoTokenizer.from_pretrained(str(checkpoint)), AutoImageProcessor.from_pretrained(str(checkpoint)))
    prompt_ids, expected, _ = qwen3_generate(hf, QWEN3_PROMPT, [picture], 6)
    base_url = _served_reply_is(run_app, checkpoint, tmp_path, 8, picture, "Describe it.", prompt_ids, expected)
    refused = _chat(base_url, [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                               {"type": "text", "text": "Describe it."}])
    assert refused.status_code == 400 and "video_url: not a readable video" in refused.json()["error"]["message"]


@pytest.mark.slow
def test_qwen3_vl_moe_chat_image_parts(tmp_path, run_app):
    """Qwen3-VL-MoE (tests/runtime/test_qwen3_vl_moe.py's checkpoint): a data-URL image part gives transformers'
    greedy reply (the image tokens through the experts, split across 8-token chunks)."""
    from tests.runtime.test_qwen3_vl import WIDE
    from tests.runtime.test_qwen3_vl_moe import PROMPT as MOE_PROMPT
    from tests.runtime.test_qwen3_vl_moe import hf_generate as moe_generate
    from tests.runtime.test_qwen3_vl_moe import load_hf, make_qwen3_vl_moe_checkpoint

    checkpoint = make_qwen3_vl_moe_checkpoint(tmp_path / "hf", seed=3)
    picture = image(11, size=WIDE)
    prompt_ids, expected, _ = moe_generate(load_hf(checkpoint), MOE_PROMPT, [picture])
    _served_reply_is(run_app, checkpoint, tmp_path, 8, picture, "Describe it.", prompt_ids, expected)
