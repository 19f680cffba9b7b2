"""Starting, overload and stopping: 503 while loading and past --max-waiting, a failed start,
and SIGTERM letting a running stream finish before the process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from llmc.cli import main
from llmc.errors import ArtifactError, ConfigError
from llmc.runtime.engine import Engine
from llmc.runtime.server.api_server import bind_socket, build_app, serve, server_url

LONG = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0.8}


def test_503_while_the_model_loads(run_app, wait_healthy, server_artifact):
    release = threading.Event()

    def slow_engine():
        assert release.wait(30)
        return Engine(server_artifact, device="cpu")

    base_url = run_app(build_app(slow_engine, "m", log_stats=False))
    for reply in (httpx.get(f"{base_url}/health"), httpx.get(f"{base_url}/ping"), httpx.get(f"{base_url}/v1/models"),
                  httpx.post(f"{base_url}/v1/completions", json={"prompt": "x"})):
        assert reply.status_code == 503
        assert reply.json()["error"]["type"] == "service_unavailable_error"
        assert reply.headers["retry-after"] == "1"
    assert httpx.get(f"{base_url}/metrics").status_code == 200  # scrapeable while loading
    release.set()
    wait_healthy(base_url)
    reply = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_503_when_the_waiting_queue_is_full(run_app, server_artifact):
    app = build_app(lambda: Engine(server_artifact, device="cpu", max_num_seqs=1), "m", max_waiting=1,
                    log_stats=False)
    base_url = run_app(app, wait_healthy=True)
    with httpx.Client(base_url=base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
            lines = running.iter_lines()  # kept: a dropped line iterator closes the connection
            next(lines)  # the only seat is taken
            with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as waiting:
                assert waiting.status_code == 200  # queued: headers come once it is added
                refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert refused.status_code == 503, refused.text
                assert "overloaded" in refused.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while (reply := http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status_code == 503:
            assert time.monotonic() < deadline, "the aborted requests still count as waiting"
            time.sleep(0.05)
        assert reply.status_code == 200


def test_a_failed_start_is_raised_by_serve(free_port):
    def broken():
        raise ArtifactError("/nowhere: not an artifact")

    with pytest.raises(ArtifactError, match="not an artifact"):
        serve(broken, "m", port=free_port(), log_stats=False)


def test_cli_reports_a_failed_start_in_one_line(tmp_path, free_port, capsys, restore_logging):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(tmp_path / "missing"), "--device", "cpu", "--port", str(free_port()), "--disable-log-stats"])
    assert exit_info.value.code != 0
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llmc: error:")]
    assert len(errors) == 1 and "missing" in errors[0]


def test_a_port_in_use_fails_before_the_model_loads(free_port):
    # vLLM binds its socket before it starts the engine: a taken port is one error, no model loaded
    port = free_port()
    calls = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is in use; choose another with --port"):
            serve(lambda: calls.append("loaded"), "m", port=port, log_stats=False)
    assert calls == []


def test_a_host_is_bound_as_uvicorn_binds_it(monkeypatch):
    """uvicorn (what bound the port before) takes IPv4 unless the host has a ':': a name whose resolver
    lists ::1 first (many distributions' /etc/hosts for localhost) is still served on 127.0.0.1, and
    "" is every IPv4 interface. The reference is uvicorn's own Config.bind_socket."""
    import uvicorn

    real = socket.getaddrinfo

    def ipv6_first(host, *args, **kwargs):  # a resolver that lists ::1 before 127.0.0.1 for localhost
        infos = real(host, *args, **kwargs)
        if host == "localhost" and not args[1:2] and not kwargs.get("family"):
            infos = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", args[0] or 0, 0, 0)), *infos]
        return infos

    hosts = ["localhost", "", "127.0.0.1", "0.0.0.0"]
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        hosts.append("::1")
    except OSError:  # no IPv6 loopback here
        pass
    monkeypatch.setattr(socket, "getaddrinfo", ipv6_first)
    for host in hosts:
        with uvicorn.Config(None, host=host, port=0).bind_socket() as expected, bind_socket(host, 0) as sock:
            assert (sock.family, sock.getsockname()[0]) == (expected.family, expected.getsockname()[0]), host
            with socket.create_connection(sock.getsockname()[:2] if host else ("127.0.0.1", sock.getsockname()[1]),
                                          timeout=5):
                pass  # accepted into the backlog: the address clients are told is served


def test_a_host_that_is_not_this_machines_is_named_not_the_port():
    for host in ("nosuchhost.invalid", "192.0.2.1"):  # unresolvable; TEST-NET-1, no interface holds it
        with pytest.raises(ConfigError, match=f"--host '{host}': not an address of this machine"):
            bind_socket(host, 0)


def test_the_listening_url_brackets_an_ipv6_host():
    assert server_url("::", 8000) == "http://[::]:8000" and server_url("::1", 1) == "http://[::1]:1"
    assert server_url("0.0.0.0", 80) == "http://0.0.0.0:80" and server_url("localhost", 80) == "http://localhost:80"


def test_cli_refuses_bad_options_and_a_taken_port_before_loading(server_artifact, free_port, capsys, restore_logging):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        for flags in (["--port", str(port)], ["--port", str(free_port()), "--max-model-len", "99999"]):
            with pytest.raises(SystemExit) as exit_info:
                main(["run", str(server_artifact), "--device", "cpu", "--disable-log-stats", *flags])
            assert exit_info.value.code != 0
            err = capsys.readouterr().err
            errors = [line for line in err.splitlines() if line.startswith("llmc: error:")]
            assert len(errors) == 1 and ("in use" in errors[0] or "max_model_len 99999" in errors[0])
            assert "listening on" not in err and "KV cache" not in err  # nothing was loaded


def _sigterm_mid_stream(server, max_tokens: int) -> list[str]:
    """Start a streamed completion, SIGTERM the server after its first event, return every event."""
    body = {**LONG, "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
        server.process.send_signal(signal.SIGTERM)
        return [line for line in lines if line.startswith("data: ")]


def test_sigterm_lets_running_streams_finish_then_exits_0(start_server):
    server = start_server("--disable-log-stats")
    events = _sigterm_mid_stream(server, max_tokens=48)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(60) == 0, server.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.base_url}/health")


@pytest.mark.slow  # for the default run's time (session 42)
def test_sigterm_past_the_grace_period_ends_cut_streams_with_an_error_event(start_server):
    server = start_server("--disable-log-stats", "--shutdown-timeout", "0.2")
    events = _sigterm_mid_stream(server, max_tokens=250)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["type"] == "service_unavailable_error" and "shutting down" in error["message"]
    assert server.process.wait(60) == 0, server.log()


@pytest.mark.slow  # for the default run's time (session 42)
def test_statistics_lines_come_by_the_clock_and_not_while_idle(start_server):
    """vLLM's periodic line: every log_stats_interval while there is activity, covering only that interval.
    It used to be written by the engine's steps: a burst's last interval waited for the next request, and
    that request's line divided its tokens by the idle gap."""
    server = start_server("--log-stats-interval", "0.5")
    client = httpx.Client(base_url=server.base_url, timeout=60)
    reply = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 120, "ignore_eos": True})
    assert reply.status_code == 200
    time.sleep(1.2)  # the interval that held the request's end is logged without another request
    lines = [line for line in server.log().splitlines() if "generation" in line and "tokens/s" in line]
    assert lines, server.log()
    time.sleep(1.6)  # three idle intervals: no line
    assert len([line for line in server.log().splitlines() if "generation" in line and "tokens/s" in line]) == len(lines)
