"""tokenizer_pool_size: prompts are tokenized (and chat templates rendered) on pool threads, not on
the server's event loop, with the same token ids; the offline LLM tokenizes text prompts on its pool."""

import asyncio
import threading
from types import SimpleNamespace

import pytest
import httpx
from transformers import AutoTokenizer

from llmc.runtime.server.serving import ServingContext

API_KEY = "sk-llmc-test"
MODEL = "ref-llama"


class _RecordingTokenizer:
    """The reference tokenizer, noting the thread each call ran on."""

    def __init__(self, path):
        self.inner = AutoTokenizer.from_pretrained(str(path))
        self.chat_template = self.inner.chat_template
        self.threads: list[str] = []

    def encode(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self.inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self.inner.apply_chat_template(*args, **kwargs)


def test_prompts_are_tokenized_on_the_pool_threads(ref_model_dir):
    tokenizer = _RecordingTokenizer(ref_model_dir)
    text = "ROMEO: But soft, what light through yonder window breaks? " * 50
    messages = [{"role": "user", "content": "Who is there?"}]
    for size, on_pool in ((0, False), (2, True)):
        ctx = ServingContext(SimpleNamespace(tokenizer=tokenizer), MODEL, tokenizer_pool_size=size)

        async def main():
            loop_thread = threading.current_thread().name
            ids = await asyncio.gather(*(ctx.encode_off_loop(text) for _ in range(4)))
            chat = await ctx.render_chat_off_loop(messages)
            return loop_thread, ids, chat

        tokenizer.threads.clear()
        loop_thread, ids, chat = asyncio.run(main())
        ctx.close()
        assert all(i == tokenizer.inner.encode(text) for i in ids)
        assert chat == tokenizer.inner.encode(tokenizer.inner.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
        assert tokenizer.threads and all(t.startswith("llmc-tokenizer") == on_pool for t in tokenizer.threads)
        assert loop_thread not in tokenizer.threads  # pool 0: the default thread pool, never the loop


@pytest.mark.slow  # for the default run's time (session 42)
def test_a_server_with_a_tokenizer_pool_answers_as_one_without(start_server, server):
    pooled = start_server("--api-key", API_KEY, "--served-model-name", MODEL, "--disable-log-stats",
                          "--tokenizer-pool-size", "2")
    body = {"model": MODEL, "prompt": ["ROMEO: my lord", "JULIET: the night"], "max_tokens": 8, "temperature": 0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Who?"}], "max_tokens": 6, "temperature": 0}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        replies = [httpx.post(f"{s.base_url}{path}", json=request, headers=headers, timeout=60).json()
                   for s in (server, pooled)]
        assert replies[0]["choices"] == replies[1]["choices"] and replies[0]["usage"] == replies[1]["usage"]


def test_llm_tokenizes_text_prompts_on_its_pool(server_artifact):
    from llmc.errors import RequestError
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    prompts = ["ROMEO:", "JULIET: the night", [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=5)
    results = []
    for size in (0, 3):
        with LLM(server_artifact, tokenizer_pool_size=size, disable_log_stats=True) as llm:
            outputs = llm.generate(prompts, params)
            results.append([(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs])
    assert results[0] == results[1]
    assert results[0][0][1] == AutoTokenizer.from_pretrained(str(server_artifact / "tokenizer")).encode("ROMEO:")
    try:
        LLM(server_artifact, tokenizer_pool_size=-1)
    except RequestError as e:
        assert "tokenizer_pool_size" in str(e)
    else:
        raise AssertionError("a negative tokenizer_pool_size must be refused")
