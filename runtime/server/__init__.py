"""`llmc run`'s serving modes: an OpenAI-compatible HTTP server and OpenAI batch files.

    engine_loop.py         the Engine on its own thread, fed by a command queue (EngineLoop)
    serving.py             shared by every endpoint: checks, prompt rendering, admission, Generation
    serving_completion.py  POST /v1/completions
    serving_chat.py        POST /v1/chat/completions
    tool_parsers.py        tool calls read out of the generated text (--tool-call-parser), streamed or whole
    tagged_tool_parsers.py the tag-delimited tool call parsers (glm45, qwen3_coder, deepseek_v3, kimi_k2, ...)
    reasoning_parsers.py   the thinking of reasoning models read apart from the answer (--reasoning-parser), streamed or whole
    harmony.py             gpt-oss's harmony messages read apart: analysis, final, calls (openai_gptoss / openai)
    protocol.py            request bodies (pydantic) and their SamplingParams
    formatting.py          logprobs, usage and SSE in OpenAI's wire format
    errors.py              OpenAI's error JSON and the HTTP status of each mistake
    metrics.py             Prometheus metrics (llmc:*) on a per-app registry
    api_server.py          the FastAPI app and `serve()` (uvicorn, graceful SIGTERM)
    batch.py               `--input requests.jsonl --output results.jsonl`

Nothing here is imported by `llmc.runtime` itself: the offline API needs no web stack.
"""
