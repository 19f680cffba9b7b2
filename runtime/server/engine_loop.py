"""The engine's own thread: the synchronous `Engine` steps there while asyncio serves HTTP.

NOTE: one thread owns the Engine; the asyncio side never calls it. It sends the thread commands
through a thread-safe queue (add a request, abort one, stop) and the thread answers through
`loop.call_soon_threadsafe`: a future per command, and each request's outputs into the asyncio
queue its handler reads. The thread's loop is: run every queued command, step once if any
request is unfinished, deliver the step's outputs in one batch, repeat; with nothing to do it
blocks on the command queue. So an HTTP handler never waits for a step to finish before it can
answer, and a slow client never delays a step. Aborts run between two steps: the request's KV
blocks are free before the next step starts.

The tokenizer is shared read-only: handlers encode prompts and decode logprob tokens on the
asyncio thread (HF fast tokenizers are safe to use concurrently as long as nobody changes their
truncation or padding, which nothing here does).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from llmc.errors import WorkerError
from llmc.runtime.outputs import RequestOutput
from llmc.runtime.sampling_params import SamplingParams

logger = logging.getLogger("llmc")


class EngineStopped(Exception):
    """Delivered to requests still running when the engine loop stops (server shutdown)."""


class RequestFailed(Exception):
    """Delivered to a request the engine ended because handling it failed (the message names it)."""


# The engine is wedged when one step (or command batch) has run this long: /health answers 503.
STALL_TIMEOUT_S = 60.0
# A loop whose steps failed this many times in a row (each failing every request) is unhealthy.
MAX_CONSECUTIVE_RESETS = 3


@dataclass(eq=False)
class RequestStream:
    """One engine request as the asyncio side sees it.

    Its outputs are put on `queue` as `(tag, RequestOutput)`, or `(tag, Exception)` if the engine
    failed; several requests (a completion with several prompts) may share one queue, told apart
    by `tag`. The timing fields are written by the engine thread only (for metrics).
    """

    request_id: str
    queue: asyncio.Queue
    tag: Any
    arrival_time: float  # time.monotonic() when the HTTP request came in
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    is_finished: bool = False
    lora_int_id: int | None = None  # its run-time LoRA adapter's id (the server's --lora-modules), else None


class StepObserver(Protocol):
    """Told about every delivered output, and every request that ends without one (aborted: the client
    went away, the engine failed it or is stopping), on the engine thread (metrics)."""

    def on_output(self, stream: RequestStream, output: RequestOutput, now: float, step_start: float) -> None: ...

    def on_abort(self, stream: RequestStream, now: float) -> None: ...


@dataclass
class _Command:
    run: Callable[[Any], Any]  # fn(engine) -> result, on the engine thread
    future: asyncio.Future | None = field(default=None)
    # an add's images (a vision model's request), encoded in one tower call with the other adds queued beside it
    # (EngineLoop._prefetch_images)
    images: list = field(default_factory=list)


_STOP = object()


class EngineLoop:
    """Owns the engine thread. `start()` returns at once; the engine loads on its thread
    (`is_ready`/`wait_ready()` tell when), so a server can answer 503 while it loads."""

    def __init__(self, engine_factory: Callable[[], Any], observer: StepObserver | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self._engine_factory = engine_factory
        self._observer = observer
        self._on_fatal = on_fatal  # told, on the engine thread, when the engine can never step again
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        # Sequences of adds sent to the engine thread (asyncio side) and run by it (engine thread; copied
        # into each stats snapshot): their difference is the adds not run yet, exact against the snapshot.
        self._num_sequences_sent = 0
        self._num_sequences_added = 0
        self.engine = None  # set once loaded; read-only from the asyncio side (options, tokenizer)
        self._failure_lock = threading.Lock()
        self._cancel_loading = threading.Event()
        self.stats: dict = {}  # engine.stats() after the latest step or command batch (a fresh dict each time)
        self.failure: BaseException | None = None  # set if a step raised: the engine is unusable
        self.busy_since: float | None = None  # time.monotonic() when the running step/command began
        self.consecutive_resets = 0  # steps in a row that failed as a whole

    # ---- lifecycle (asyncio thread) --------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="llmc-engine", daemon=True)
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        return self._ready is not None and self._ready.done() and self._ready.exception() is None

    def health_problem(self, stall_timeout_s: float = STALL_TIMEOUT_S) -> str | None:
        """Why this loop is not serving (None when it is): its thread is gone, its engine failed for
        good, its steps keep failing, or one step has run longer than `stall_timeout_s`."""
        if self._thread is None or not self._thread.is_alive():
            return "the engine thread is not running"
        self._notice_dead_ranks()
        if self.failure is not None:
            return f"the engine failed: {type(self.failure).__name__}: {self.failure}"
        if self.consecutive_resets >= MAX_CONSECUTIVE_RESETS:
            return f"the last {self.consecutive_resets} engine steps failed"
        busy_since = self.busy_since
        if busy_since is not None and time.monotonic() - busy_since > stall_timeout_s:
            return (f"the engine has been in one step for {time.monotonic() - busy_since:.0f} s "
                    f"({self.stats.get('num_running', 0)} running, {self.stats.get('num_waiting', 0)} waiting)")
        return None

    def _notice_dead_ranks(self) -> None:
        """A rank of a parallel engine that died while the engine was idle (no step to fail): the engine
        is down for good, as when a step finds it (`failure`, `on_fatal`: a server stops)."""
        runner_failure = getattr(getattr(self.engine, "runner", None), "failure", None)
        if runner_failure is not None and self.failure is None:
            error = WorkerError(f"the parallel engine is down: {runner_failure}")
            if self._fail_for_good(error):
                logger.error("%s", error)

    def _fail_for_good(self, error: BaseException) -> bool:
        """Record that the engine can never step again and tell `on_fatal`, once (the engine thread's step
        and the health check can both find a dead rank); False if it was already recorded."""
        with self._failure_lock:
            if self.failure is not None:
                return False
            self.failure = error
        if self._on_fatal is not None:
            self._on_fatal(error)
        return True

    @property
    def replicas(self) -> list[EngineLoop]:
        """The engine loops that serve (a router's are several): this one."""
        return [self]

    async def wait_ready(self) -> None:
        """Return once the engine is loaded; raise what loading raised."""
        await asyncio.shield(self._ready)

    async def shutdown(self) -> None:
        """Abort what is still running (its handlers get EngineStopped) and join the thread."""
        if self._thread is None:
            return
        self._cancel_loading.set()  # a parallel engine still waiting for its ranks gives up
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    # ---- requests (asyncio thread) ---------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a seat, counting adds the engine thread has not run yet."""
        stats = self.stats  # one snapshot: its counts and its adds agree
        return stats.get("num_waiting", 0) + self._num_sequences_sent - stats.get("num_sequences_added", 0)

    @property
    def num_unfinished_sequences(self) -> int:
        """Sequences running or waiting, counting adds the engine thread has not run yet."""
        stats = self.stats
        return (stats.get("num_running", 0) + stats.get("num_waiting", 0)
                + self._num_sequences_sent - stats.get("num_sequences_added", 0))

    @property
    def num_seats(self) -> int:
        """Sequences the engine runs at once (max_num_seqs)."""
        return self.engine.options.max_num_seqs

    async def add_request(self, stream: RequestStream, prompt_token_ids: list[int] | Tensor, params: SamplingParams,
                          priority: int = 0, lora_request=None, multi_modal_data: dict | None = None,
                          cache_salt: str | None = None) -> None:
        """Queue a request; raises what `Engine.add_request` raises (RequestError for a bad one). A tensor in
        place of the token ids is the prompt's embeddings (runtime/prompt_embeds.py).
        `lora_request`: its run-time LoRA adapter (runtime/lora.py), None for the base model. `multi_modal_data`:
        its images (a vision model's); its prompt's tokens are then counted after their expansion."""
        stream.num_prompt_tokens = len(prompt_token_ids)
        num_sequences = params.best_of or params.n

        def add(engine) -> None:
            try:
                embeds = isinstance(prompt_token_ids, Tensor)
                engine.add_request(None, params, None if embeds else prompt_token_ids, request_id=stream.request_id,
                                   priority=priority, arrival_time=stream.arrival_time,
                                   **({"prompt_embeds": prompt_token_ids} if embeds else {}),
                                   **({"cache_salt": cache_salt} if cache_salt is not None else {}),
                                   **({"lora_request": lora_request} if lora_request is not None else {}),
                                   **({"multi_modal_data": multi_modal_data} if multi_modal_data is not None else {}))
                if multi_modal_data is not None:  # each image's placeholder became its embedding rows' tokens
                    stream.num_prompt_tokens = len(engine.groups[stream.request_id].prompt_token_ids)
            finally:
                self._num_sequences_added += num_sequences  # in the snapshot taken right after
            self._streams[stream.request_id] = stream

        if self._thread is None:
            raise EngineStopped("the engine is stopped")
        self._num_sequences_sent += num_sequences
        try:
            await self._call(add, images=_images(multi_modal_data))
        except asyncio.CancelledError:
            self.abort(stream.request_id)  # the add may still run: undo it right after
            raise

    async def read_adapter(self, lora_request) -> None:
        """Have the engine read and check a LoRA adapter (/v1/load_lora_adapter); RequestError for a bad one."""
        await self._call(lambda engine: engine.runner.lora.read(lora_request))

    async def reset_prefix_cache(self) -> bool:
        """Engine.reset_prefix_cache, on the engine thread after every command queued before it."""
        return await self._call(lambda engine: engine.reset_prefix_cache())

    async def num_lora_requests(self, lora_int_id: int) -> int:
        """Unfinished requests with this LoRA adapter (/v1/unload_lora_adapter refuses to unload it then):
        counted on the engine thread, after every add queued before this call."""
        return await self._call(lambda engine: sum(s.lora_int_id == lora_int_id for s in self._streams.values()))

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it finished); its blocks are freed before the next step."""
        self._commands.put(_Command(lambda engine: self._abort(engine, request_id)))

    def abort_all(self, error: BaseException) -> None:
        """Abort every running request; each handler gets `error` (shutdown past its grace period)."""
        if self._thread is not None:
            self._commands.put(_Command(lambda engine: self._abort_all(engine, error)))

    async def _call(self, fn: Callable[[Any], Any], images: list | None = None) -> Any:
        if self._thread is None:
            raise EngineStopped("the engine is stopped")
        future = self._loop.create_future()
        self._commands.put(_Command(fn, future, images or []))
        return await future

    # ---- the engine thread -----------------------------------------------------------------

    def _post(self, fn: Callable, *args) -> None:
        """Run fn(*args) on the asyncio thread; dropped if its loop is already closed."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    def _run(self) -> None:
        from llmc.runtime.parallel.launcher import cancellable_loading

        try:
            with cancellable_loading(self._cancel_loading):
                engine = self._engine_factory()
        except BaseException as e:  # noqa: BLE001 - handed to the asyncio side, which reports it
            self._post(_settle, self._ready, None, e)
            return
        self.engine = engine
        self.stats = self._snapshot(engine)
        self._post(_settle, self._ready, None, None)
        try:
            while self._run_commands(engine, block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    self._step(engine)
        except BaseException as e:  # noqa: BLE001 - the loop itself broke: fail every request, then stop
            logger.exception("the engine loop stopped")
            self.failure = e
            self._abort_all(engine, e)
            raise
        self._abort_all(engine, EngineStopped("the server is shutting down"))
        close = getattr(engine, "close", None)
        if close is not None:
            close()  # a parallel engine's worker ranks and process groups

    def _run_commands(self, engine, block: bool) -> bool:
        """Run the queued commands (waiting for one if `block`); False once told to stop. The images of the adds
        queued together are encoded together first (`_prefetch_images`)."""
        command = self._commands.get() if block else _get_nowait(self._commands)
        vision = getattr(engine, "vision", None)
        while command is not None:
            commands = []  # what is queued now (commands queued while these run come in the next round)
            while command is not None and command is not _STOP:
                commands.append(command)
                command = _get_nowait(self._commands)
            try:
                self._prefetch_images(vision, commands)
                self._run_each(engine, commands)
            finally:
                if vision is not None:
                    vision.clear_prefetched()  # an add aborted or refused before its images were taken
            if command is _STOP:
                return False
            command = _get_nowait(self._commands)
        return True

    def _prefetch_images(self, vision, commands: list[_Command]) -> None:
        """The images of several queued adds (concurrent vision requests) encoded MAX_ENCODER_BATCH to a tower call
        (VisionEncoder.prefetch, as LLM.generate does), not one request's at a time as each add runs. An image that
        cannot be preprocessed stops the prefetch where it is: each add then encodes what is left alone, and only
        the request with the bad image gets its error."""
        images = [image for command in commands for image in command.images]
        if vision is None or len(images) < 2:
            return
        self.busy_since = time.monotonic()
        try:
            vision.prefetch(images)
        except Exception:  # noqa: BLE001 - the bad request's own add reports it
            pass
        finally:
            self.busy_since = None

    def _run_each(self, engine, commands: list[_Command]) -> None:
        for command in commands:
            self.busy_since = time.monotonic()
            try:
                result, error = command.run(engine), None
            except Exception as e:  # noqa: BLE001 - a bad request: its handler raises it
                result, error = None, e
            finally:
                self.busy_since = None
            self.stats = self._snapshot(engine)  # before the handler resumes: admission reads num_waiting
            if command.future is not None:
                self._post(_settle, command.future, result, error)

    def _step(self, engine) -> None:
        step_start = self.busy_since = time.monotonic()
        try:
            resets = getattr(engine, "num_resets", 0)
            outputs = engine.step()
        except WorkerError as e:  # a rank of a parallel engine is gone: nothing can run any more
            logger.error("%s; aborting %d running request(s)", e, len(self._streams))
            self._fail_for_good(e)  # first: a handler woken by the abort may look for it
            self._abort_all(engine, e)
            return
        except Exception as e:  # noqa: BLE001 - an engine bug the engine did not contain
            logger.exception("engine step failed; aborting %d running request(s)", len(self._streams))
            self.consecutive_resets += 1
            self._abort_all(engine, e)
            return
        finally:
            self.busy_since = None
        self.consecutive_resets = self.consecutive_resets + 1 if getattr(engine, "num_resets", 0) > resets else 0
        now = time.monotonic()
        self.stats = self._snapshot(engine)
        deliveries = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                stream.is_finished = True
                del self._streams[output.request_id]
            if getattr(output, "error", None) is not None:
                deliveries.append((stream, RequestFailed(output.error)))
                self._observe_abort(stream, now)
                continue
            if self._observer is not None:
                self._observer.on_output(stream, output, now, step_start)
            deliveries.append((stream, output))
        if deliveries:
            self._post(_deliver, deliveries)

    def _observe_abort(self, stream: RequestStream, now: float) -> None:
        if self._observer is not None:
            self._observer.on_abort(stream, now)

    def _snapshot(self, engine) -> dict:
        return {**engine.stats(), "num_sequences_added": self._num_sequences_added}

    def _abort(self, engine, request_id: str) -> None:
        engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.is_finished = True  # a router counts it as load until then
            self._observe_abort(stream, time.monotonic())

    def _abort_all(self, engine, error: BaseException) -> None:
        deliveries, now = [], time.monotonic()
        for request_id, stream in list(self._streams.items()):
            engine.abort_request(request_id)
            stream.is_finished = True
            deliveries.append((stream, error))
            self._observe_abort(stream, now)
        self._streams.clear()
        self.stats = self._snapshot(engine)
        if deliveries:
            self._post(_deliver, deliveries)


def _images(multi_modal_data: dict | None) -> list:
    """A request's images as VisionEncoder.prefetch takes them; none where it has none or they are malformed (its
    add reports that)."""
    if not isinstance(multi_modal_data, dict):
        return []
    images = multi_modal_data.get("image")
    return list(images) if isinstance(images, (list, tuple)) else [] if images is None else [images]


def _get_nowait(commands: queue.SimpleQueue):
    try:
        return commands.get_nowait()
    except queue.Empty:
        return None


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting handler was cancelled (client went away)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver(deliveries: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in deliveries:
        stream.queue.put_nowait((stream.tag, item))
