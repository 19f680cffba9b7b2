"""Offline batch files in OpenAI's batch format: `llmc run ARTIFACT --input in.jsonl --output out.jsonl`.

Input: one request per line, `{"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}`. Output: one line per request, in input order,
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`; a request
the server would refuse gets its error body and status (400, ...) in `response`. The body's
`model` is ignored: the artifact being run answers every line. The file is
checked whole before anything runs (a malformed line is an error naming it); then every request
goes to the engine at once, through the server's own handlers, so the engine batches them.
"""

from __future__ import annotations

import asyncio
import json
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
from llmc.runtime.server.serving import ModelNames, ServingContext, new_id
from llmc.runtime.server.serving_chat import create_chat_completion
from llmc.runtime.server.serving_completion import create_completion

_HANDLERS = {"/v1/completions": create_completion, "/v1/chat/completions": create_chat_completion}


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
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise BatchFileError(f"{path}: cannot read the batch file ({e.strerror})") from None
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
                                 "(a line needs custom_id, method POST, url /v1/completions or "
                                 "/v1/chat/completions, and body)") from None
        if request.body.get("stream"):
            raise BatchFileError(f"{path}:{number}: stream is not supported in a batch file; remove it")
        if request.custom_id in seen:
            raise BatchFileError(f"{path}:{number}: custom_id {request.custom_id!r} is used twice; make it unique")
        seen.add(request.custom_id)
        requests.append(request)
    return requests


def run_batch(engine_factory: Callable[[], object], input_path: str | Path, output_path: str | Path,
              served_model_name: ModelNames, show_progress: bool = True) -> BatchSummary:
    """Run every request of `input_path` and write the results to `output_path` (atomically)."""
    requests = read_batch_file(input_path)
    output_path = Path(output_path)
    partial = output_path.with_name(output_path.name + ".partial")
    try:  # opened before anything runs: a path that cannot be written fails now, not after the work
        output = partial.open("w", encoding="utf-8")
    except OSError as e:
        raise BatchFileError(f"{output_path}: cannot write the output there ({e.strerror}); "
                             "give --output a path in an existing, writable folder") from None
    with output:
        results = asyncio.run(_run_all(engine_factory, requests, served_model_name, show_progress))
        for result in results:
            output.write(json.dumps(result, ensure_ascii=False) + "\n")
    os.replace(partial, output_path)
    num_failed = sum(r["response"]["status_code"] != 200 for r in results)
    return BatchSummary(len(results), num_failed, output_path)


async def _run_all(engine_factory, requests: list[BatchRequestLine], served_model_name: ModelNames,
                   show_progress: bool) -> list[dict]:
    engine_loop = EngineLoop(engine_factory)
    engine_loop.start()
    try:
        await engine_loop.wait_ready()
        # every line queues (no --max-waiting: there is no client to retry a 503); the file's chat templates are
        # its author's, who runs this command
        ctx = ServingContext(engine_loop, served_model_name, max_waiting=None, trust_request_chat_template=True)
        with tqdm(total=len(requests), desc="requests", disable=not show_progress) as bar:
            async def run_one(request: BatchRequestLine) -> dict:
                result = await _run_one(ctx, request)
                bar.update(1)
                return result

            return await asyncio.gather(*(run_one(r) for r in requests))
    finally:
        await engine_loop.shutdown()


async def _run_one(ctx: ServingContext, request: BatchRequestLine) -> dict:
    body = dict(request.body)
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
