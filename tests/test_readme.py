"""A newcomer's path: the README's first commands, in order, with no network."""

import os
import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _quickstart() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_readme_opens_with_the_issue_commands():
    assert _quickstart() == [
        "pip install -e '.[dev]'",
        "llmc build recipes/ref-llama-12m.yaml",
        "llmc inspect build/ref-llama-12m",
        'llmc run build/ref-llama-12m --prompt "ROMEO:" --max-tokens 64 --temperature 0',
        "pytest",
    ]


def test_quickstart_runs_offline(tmp_path):
    # Run in a copy of what a fresh clone holds, so the repo's own build/ is left alone.
    for name in ("recipes", "checkpoints"):
        os.symlink(REPO / name, tmp_path / name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    outputs = []
    for command in _quickstart():
        if command.startswith("llmc "):
            result = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, f"{command}\n{result.stderr}"
            outputs.append(result.stdout)
    build, inspect, run = outputs
    assert "build/ref-llama-12m" in build
    assert "12.59 M" in inspect and "LlamaForCausalLM" in inspect
    # The checkpoint's README gives transformers' greedy continuation of this prompt.
    assert run.startswith("ROMEO:\nI'll have a little more.\n\nROMEO:\nI'll tell you, what's the matter?")
