"""`llmc run --prompt`: the completion on stdout, clean of statistics, even where stdout and stderr
share one terminal (here: one pipe, in the order the lines were written)."""

from __future__ import annotations

import os
import subprocess
import sys


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
