"""Offline batch files in OpenAI's batch format: `llmc run ARTIFACT --input in.jsonl --output out.jsonl`.

Input: one request per line, `{"custom_id", "method": "POST", "url": "/v1/completions",
"/v1/chat/completions", or "/v1/embeddings", "/v1/classify", "/v1/score", "/v1/rerank" (an embedding model,
--runner pooling, or a classifier), "body": {...}}`. Output: one line per request, in input order,
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`; a request
the server would refuse gets its error body and status (400, ...) in `response`. The body's
`model` is ignored (the artifact being run answers every line), unless it names a LoRA adapter of
--lora-modules: that line runs with it. The file is
checked whole before anything runs (a malformed line is an error naming it); then every request
goes to the engine at once, through the server's own handlers, so the engine batches them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from tqdm import tqdm

from llmc.errors import LlmcError
from llmc.runtime.server.engine_loop import EngineLoop
from llmc.runtime.server.errors import ApiError, as_api_error
from llmc.runtime.server.protocol import BatchRequestLine, parse_json_body
from llmc.runtime.server.lora_modules import LoraModule, ServedAdapters, with_adapters
from llmc.runtime.server.serving import ModelNames, ServingContext, new_id
from llmc.runtime.server.serving_chat import create_chat_completion
from llmc.runtime.server.serving_completion import create_completion
from llmc.runtime.server.serving_embedding import create_classification, create_embedding, create_rerank, create_score

logger = logging.getLogger("llmc")
_HANDLERS = {"/v1/completions": create_completion, "/v1/chat/completions": create_chat_completion,
             "/v1/embeddings": create_embedding, "/v1/classify": create_classification, "/v1/score": create_score,
             "/v1/rerank": create_rerank}


class BatchFileError(LlmcError):
    """The batch input file is malformed."""


@dataclass
class BatchSummary:
    num_requests: int
    num_failed: int
    output_path: Path


def read_batch_file(path: str | Path) -> list[BatchRequestLine]:
    """Parse and check every line (blank lines are skipped); custom_ids must be unique."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BatchFileError(f"{path}: cannot read the batch file ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        number = data.count(b"\n", 0, e.start) + 1
        raise BatchFileError(f"{path}:{number}: not UTF-8 text "
                             f"(byte {data[e.start]:#04x}); a batch file is UTF-8 JSON lines") from None
    # JSON Lines are separated by "\n" alone (an optional "\r" before it): str.splitlines() would also cut
    # at U+2028, U+2029 and U+0085, which JSON strings may hold raw (json.dumps(ensure_ascii=False) writes them)
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    requests, seen = [], set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = parse_json_body(line)
        except ApiError as e:  # not JSON, nested too deeply, or a lone surrogate (the server's 400s)
            raise BatchFileError(f"{path}:{number}: {e.message}") from None
        if not isinstance(value, dict):
            raise BatchFileError(f"{path}:{number}: the line is JSON but not an object (a {type(value).__name__}); "
                                 "each line is one request object with custom_id, method, url and body")
        try:
            request = BatchRequestLine.model_validate(value)
        except ValidationError as e:
            raise BatchFileError(f"{path}:{number}: {as_api_error(e).message} "
                                 "(a line needs custom_id, method POST, url /v1/completions, "
                                 "/v1/chat/completions, /v1/embeddings, /v1/classify, /v1/score or /v1/rerank, and "
                                 "body)") from None
        if request.body.get("stream"):
            raise BatchFileError(f"{path}:{number}: stream is not supported in a batch file; remove it")
        if request.custom_id in seen:
            raise BatchFileError(f"{path}:{number}: custom_id {request.custom_id!r} is used twice; make it unique")
        seen.add(request.custom_id)
        requests.append(request)
    return requests


def run_batch(engine_factory: Callable[[], object], input_path: str | Path, output_path: str | Path,
              served_model_name: ModelNames, show_progress: bool = True, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, lora_modules: list[LoraModule] = ()) -> BatchSummary:
    """Run every request of `input_path` and write the results to `output_path` (atomically).
    `enable_auto_tool_choice` / `tool_call_parser`: the server's tool calling flags, for lines whose tools
    leave tool_choice "auto". `lora_modules`: adapters a line's model may name (the engine needs enable_lora)."""
    ServingContext.check_tool_options(enable_auto_tool_choice, tool_call_parser)
    requests = read_batch_file(input_path)
    output_path = Path(output_path)
    partial = output_path.with_name(output_path.name + ".partial")
    try:  # opened before anything runs: a path that cannot be written fails now, not after the work
        output = partial.open("wb")
    except OSError as e:
        raise BatchFileError(f"{output_path}: cannot write the output there ({e.strerror}); "
                             "give --output a path in an existing, writable folder") from None
    writer = _OrderedWriter(output)
    try:
        try:
            asyncio.run(_run_all(engine_factory, requests, served_model_name, show_progress, writer,
                                 enable_auto_tool_choice, tool_call_parser, lora_modules))
        finally:
            try:
                output.close()
            except OSError as e:  # the last buffered lines could not be written
                writer.write_error = writer.write_error or e
        if writer.write_error is not None:
            raise writer.write_error
    except BaseException:
        # the output keeps what it held; results finished in input order stay in the .partial file, said so
        if writer.write_error is not None or writer.written == 0:
            partial.unlink(missing_ok=True)
        else:
            if partial.stat().st_size > writer.size:  # a second Ctrl-C cut a write: keep the whole lines only
                os.truncate(partial, writer.size)
            logger.error("stopped: the results of the first %d of %d request(s), in input order, are in %s; "
                         "%s was left as it was", writer.written, len(requests), partial, output_path)
        if writer.write_error is not None:
            raise BatchFileError(f"{partial}: writing the results failed ({writer.write_error.strerror}); "
                                 f"{output_path} was left as it was") from None
        raise
    os.replace(partial, output_path)
    return BatchSummary(len(requests), writer.failed, output_path)


class _OrderedWriter:
    """Writes each result as soon as every earlier line's result is written (vLLM's ordered streaming writer):
    the file is in input order, and only the out-of-order results are held in memory. `written` and `size`
    count the lines written and flushed (and their bytes) only once the write has returned: an interrupt
    inside it leaves them as they were, and the file is cut back to `size`."""

    def __init__(self, output):
        self.output, self.pending, self.written, self.failed, self.size = output, {}, 0, 0, 0
        self.write_error: OSError | None = None  # disk full, quota, file size limit

    def add(self, index: int, result: dict) -> None:
        self.pending[index] = result
        ready = []
        while self.written + len(ready) in self.pending:
            ready.append(self.pending.pop(self.written + len(ready)))
        if not ready:
            return
        data = "".join(json.dumps(result, ensure_ascii=False) + "\n" for result in ready).encode("utf-8")
        try:
            self.output.write(data)
            self.output.flush()
        except OSError as e:
            self.write_error = e
            raise
        self.written, self.size = self.written + len(ready), self.size + len(data)
        self.failed += sum(result["response"]["status_code"] != 200 for result in ready)


async def _run_all(engine_factory, requests: list[BatchRequestLine], served_model_name: ModelNames,
                   show_progress: bool, writer: _OrderedWriter, enable_auto_tool_choice: bool = False,
                   tool_call_parser: str | None = None, lora_modules: list[LoraModule] = ()) -> None:
    first_name = served_model_name if isinstance(served_model_name, str) else served_model_name[0]
    adapters = ServedAdapters(list(lora_modules), default_base=first_name)
    engine_loop = EngineLoop(with_adapters(engine_factory, adapters) if adapters else engine_factory)
    engine_loop.start()
    try:
        await engine_loop.wait_ready()
        # every line queues (no --max-waiting: there is no client to retry a 503); the file's chat templates are
        # its author's, who runs this command
        ctx = ServingContext(engine_loop, served_model_name, max_waiting=None, trust_request_chat_template=True,
                             enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                             adapters=adapters)
        with tqdm(total=len(requests), desc="requests", disable=not show_progress) as bar:
            async def run_one(index: int, request: BatchRequestLine) -> None:
                writer.add(index, await _run_one(ctx, request))
                bar.update(1)

            await asyncio.gather(*(run_one(i, r) for i, r in enumerate(requests)))
    finally:
        await engine_loop.shutdown()


async def _run_one(ctx: ServingContext, request: BatchRequestLine) -> dict:
    body = dict(request.body)
    model = body.get("model")
    if not (isinstance(model, str) and model in ctx.adapters):  # an adapter's name runs with it (--lora-modules)
        body.pop("model", None)  # one model serves the whole file (a file written for another server runs as is)
    try:
        status, reply = 200, await _HANDLERS[request.url](ctx, body)
    except Exception as e:  # noqa: BLE001 - a refused request is reported in its output line
        error = as_api_error(e)
        status, reply = error.status_code, error.body()
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",  # OpenAI's form of a batch request id
        "custom_id": request.custom_id,
        "response": {"status_code": status, "request_id": reply.get("id", new_id("req")), "body": reply},
        "error": None,
    }
