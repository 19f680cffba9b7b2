"""`llmc run --prompt`: the completion on stdout, clean of statistics, even where stdout and stderr
share one terminal (here: one pipe, in the order the lines were written)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_prompt_output_is_clean_text_with_statistics_after_it(server_artifact):
    command = [sys.executable, "-c", "from llmc.cli import main; main()", "run", str(server_artifact), "--device",
               "cpu", "--prompt", "ROMEO:", "--max-tokens", "24", "--temperature", "0",
               "--log-stats-interval", "0.001"]  # a statistics line would be due after every step
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout
    output = result.stdout[result.stdout.index("ROMEO:"):]
    *text, summary = output.rstrip("\n").split("\n")
    assert text and not any("llmc:" in line for line in text)  # nothing written into the text
    assert summary.startswith("llmc: 24 tokens in") and "tokens/s" in summary
    # The checkpoint's README gives transformers' greedy continuation of this prompt.
    assert "\n".join(text).startswith("ROMEO:\nI'll have a little more.")


@pytest.mark.slow  # for the default run's time (session 42)
def test_a_notice_about_the_device_comes_before_the_text(ref_model_dir, tmp_path):
    """FP8 weights on a CPU (no FP8 matmul) are announced at load, not in the middle of the completion."""
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    artifact = tmp_path / "fp8"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(artifact), "quantization": {"method": "fp8"},
                            "runtime": {"max_model_len": 64, "num_kv_blocks": 16}}), show_progress=False)
    command = [sys.executable, "-c", "from llmc.cli import main; main()", "run", str(artifact), "--device", "cpu",
               "--prompt", "ROMEO:", "--max-tokens", "8", "--temperature", "0"]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout
    notice, text = result.stdout.index("has no FP8 matmul"), result.stdout.index("ROMEO:")
    assert notice < text, result.stdout
    *completion, summary = result.stdout[text:].rstrip("\n").split("\n")
    assert not any("llmc:" in line for line in completion) and summary.startswith("llmc: 8 tokens in")


def test_interactive_chat_survives_a_turn_it_cannot_take(server_artifact):
    """A turn too long for the context, or bytes that are not UTF-8, is one error line; the conversation
    goes on with its history (the next turn is answered as LLM.chat answers it)."""
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    command = [sys.executable, "-c", "from llmc.cli import main; main()", "run", str(server_artifact), "--device",
               "cpu", "--chat", "--max-tokens", "6", "--temperature", "0"]
    turns = b"hello\n" + b"word " * 300 + b"\nx\xff\nsecond\n"
    result = subprocess.run(command, input=turns, capture_output=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert err.count("the turn is dropped") == 2 and "Traceback" not in err
    assert "max_model_len" in err and "not Unicode text" in err
    greedy = SamplingParams(temperature=0, max_tokens=6)
    with LLM(server_artifact, device="cpu", disable_log_stats=True) as llm:
        first = llm.chat([{"role": "user", "content": "hello"}], greedy)[0].outputs[0].text
        second = llm.chat([{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                           {"role": "user", "content": "second"}], greedy)[0].outputs[0].text
    assert result.stdout.decode().split("\n")[:2] == [first, second]


@pytest.mark.slow  # for the default run's time (session 42)
def test_ctrl_c_at_the_chat_prompt_exits_130(server_artifact):
    """As the README says of every command: Ctrl-C exits 128 + SIGINT; only the end of input ends a chat with 0."""
    import signal
    import threading
    import time

    command = [sys.executable, "-c", "from llmc.cli import main; main()", "run", str(server_artifact), "--device",
               "cpu", "--chat"]
    def as_a_terminal_starts_it():
        # A child inherits its parent's blocked-signal mask and ignored signals through fork and exec: a SIGINT
        # blocked or ignored in the pytest process (by a library, for a while) would reach no handler in the CLI,
        # which a shell never does to a command it starts. Seen twice in full runs: a hang, then an exit 0 at EOF.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=as_a_terminal_starts_it)
    try:
        seen = b""
        deadline = time.monotonic() + 300
        while b"you> " not in seen:  # the prompt is written once the model has loaded
            assert time.monotonic() < deadline and process.poll() is None, seen.decode()
            seen += os.read(process.stderr.fileno(), 4096)
        process.send_signal(signal.SIGINT)
        # stdin stays open (its end would end the chat with 0); a thread drains stderr (a full pipe would hold the exit)
        drained = []
        reader = threading.Thread(target=lambda: drained.append(process.stderr.read()), daemon=True)
        reader.start()
        code = process.wait(120)
        reader.join(10)
        assert code == 130, (seen + b"".join(drained)).decode(errors="replace")[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_prompt_that_is_not_utf8_is_one_error_line(server_artifact):
    """As --chat says of such a turn: bytes that are not UTF-8 are not text, said in one line, not a traceback."""
    command = [sys.executable, "-c", "from llmc.cli import main; main()", "run", str(server_artifact), "--device",
               "cpu", "--max-tokens", "2"]
    result = subprocess.run([*map(os.fsencode, command), b"--prompt", b"\xff\xfe bad"], capture_output=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert "Traceback" not in err and "llmc: error: --prompt: not Unicode text" in err


@pytest.mark.parametrize("extra, mode", [([], "FULL_DECODE_ONLY"),
                                          (["--compilation-config", '{"cudagraph_mode": "PIECEWISE"}'], "PIECEWISE")])
def test_one_completion_defaults_to_decode_graphs_only(server_artifact, llmc_cli, monkeypatch, extra, mode):
    """--prompt runs one prefill step: the piecewise graphs' capture (seconds at start) is skipped
    unless compilation_config asks for it; the engine gets what the flag says."""
    import llmc.runtime.llm

    seen = {}
    real = llmc.runtime.llm.LLM

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(llmc.runtime.llm, "LLM", recording)
    code, _ = llmc_cli("run", server_artifact, "--prompt", "ROMEO:", "--max-tokens", "2", "--device", "cpu", *extra)
    assert code in (0, None) and seen["compilation_config"] == {"cudagraph_mode": mode}


def test_one_completion_keeps_the_recipe_s_own_graph_mode(ref_model_dir, tmp_path, llmc_cli, monkeypatch):
    """An artifact whose recipe set compilation_config keeps it: the --prompt default does not replace it."""
    import llmc.runtime.llm
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    out = tmp_path / "a"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "runtime": {
        "max_model_len": 64, "compilation_config": {"cudagraph_mode": "PIECEWISE"}}}), show_progress=False)
    seen = {}
    real = llmc.runtime.llm.LLM

    def recording(*args, **kwargs):
        seen.update(kwargs)
        llm = real(*args, **kwargs)
        seen["mode"] = llm.engine.options.compilation_config.cudagraph_mode
        return llm

    monkeypatch.setattr(llmc.runtime.llm, "LLM", recording)
    code, _ = llmc_cli("run", out, "--prompt", "ROMEO:", "--max-tokens", "2", "--device", "cpu")
    assert code in (0, None) and "compilation_config" not in seen and seen["mode"] == "PIECEWISE"
