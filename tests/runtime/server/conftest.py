"""Fixtures of the server tests: a float32 build of ref-llama-12m, a real `llmc run` server in a
subprocess on a free loopback port, and helpers to read its /metrics.

* ``server_artifact`` -> Path of the artifact (max_model_len 256, 640 KV blocks)
* ``server`` -> a running ``ServerProcess`` (API key ``API_KEY``, model name ``MODEL``), shared
  by the session; stopped with SIGTERM at the end, which must exit 0
* ``client`` / ``async_client`` -> openai clients for it (no retries)
* ``start_server`` -> starts another ``ServerProcess`` (stopped at teardown)
* ``read_metrics`` -> (base_url) -> {metric sample name: value summed over labels}
* ``run_app`` -> (ASGI app) -> base_url: serves the app with uvicorn on a thread of this process
* ``free_port`` -> () -> a free loopback port
* ``restore_logging``: puts the root logger back after a test that runs the CLI in-process (the
  CLI's logging.basicConfig(force=True) would leave a handler on pytest's captured stderr)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict

API_KEY = "sk-llmc-test"
MODEL = "ref-llama"
MAX_MODEL_LEN = 256
STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`llmc run ARTIFACT` in a subprocess; its log goes to a file (shown when it fails)."""

    def __init__(self, artifact: Path, log_path: Path, *args: str):
        self.artifact = artifact
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-c", "from llmc.cli import main; main()", "run", str(artifact),
                   "--device", "cpu", "--port", str(self.port), *args]
        # One intra-op thread: on a small shared CPU, torch's OpenMP threads spin against the
        # test process and other jobs and a step can take 100x longer.
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        with log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the server did not become healthy in {timeout} s:\n{self.log()}")

    def terminate(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"the server ignored SIGTERM for {timeout} s:\n{self.log()}") from None


@pytest.fixture(scope="session")
def server_artifact(tmp_path_factory, ref_model_dir) -> Path:
    out = tmp_path_factory.mktemp("server_artifact") / "ref-llama-12m"
    recipe = recipe_from_dict({
        "model": str(ref_model_dir), "output": str(out), "dtype": "float32",
        "runtime": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 64, "num_kv_blocks": 640},
    })
    build(recipe, show_progress=False)
    return out


@pytest.fixture(scope="session")
def start_server(server_artifact, tmp_path_factory):
    started: list[ServerProcess] = []

    def start(*args: str, wait: bool = True) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("server_log") / "server.log"
        server = ServerProcess(server_artifact, log_path, *args)
        started.append(server)
        if wait:
            server.wait_ready()
        return server

    yield start
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="session")
def server(start_server):
    server = start_server("--api-key", API_KEY, "--served-model-name", MODEL, "--disable-log-stats",
                          "--trust-request-chat-template")
    yield server
    code = server.terminate()
    assert code == 0, f"SIGTERM should shut the server down cleanly, got exit code {code}:\n{server.log()}"


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def switch(app):
    """switch(name=value, ...): set ServingContext attributes of the module's `app` ((base URL, ServingContext)) for
    one test; put back after it."""
    ctx, saved = app[1], {}

    def set_(**values):
        for name, value in values.items():
            saved.setdefault(name, getattr(ctx, name))
            setattr(ctx, name, value)

    yield set_
    for name, value in saved.items():
        setattr(ctx, name, value)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _read_metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


@pytest.fixture(scope="session")
def read_metrics():
    return _read_metrics


def _wait_healthy(base_url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{base_url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine did not load"
        time.sleep(0.05)


@pytest.fixture(scope="session", name="wait_healthy")
def _wait_healthy_fixture():
    """wait_healthy(base_url): poll /health until the engine has loaded (60 s at most)."""
    return _wait_healthy


@pytest.fixture(scope="session", name="free_port")
def _free_port_fixture():
    return free_port


@contextlib.contextmanager
def _served(app, wait_healthy: bool = False):
    """The app served by uvicorn on a thread of this process: its base URL once uvicorn listens (and, with
    wait_healthy, once its engine is loaded); stopped (lifespan shutdown included) on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        base_url = f"http://127.0.0.1:{port}"
        if wait_healthy:
            _wait_healthy(base_url, timeout=120)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive(), "uvicorn did not stop"


@pytest.fixture(scope="session")
def served():
    """served(app, wait_healthy=False): a context manager serving the app (for module-scoped apps)."""
    return _served


@pytest.fixture
def run_app():
    """Serve ASGI apps on threads of this process; stopped (lifespan shutdown included) at teardown."""
    with contextlib.ExitStack() as stack:
        yield lambda app, wait_healthy=False: stack.enter_context(_served(app, wait_healthy))


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
