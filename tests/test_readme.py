"""A newcomer's path: the README's first commands, in order, with no network."""

import os
import re
import shlex
import subprocess
import sys
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
            # The llmc of the interpreter running the tests (not another install found first on PATH).
            argv = [str(Path(sys.executable).with_name("llmc")), *shlex.split(command)[1:]]
            result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, f"{command}\n{result.stderr}"
            outputs.append(result.stdout)
    build, inspect, run = outputs
    assert "build/ref-llama-12m" in build
    assert re.search(r"KV tokens, \d+ sequences of 2048\n", build)  # whole sequences, not 12176.8
    assert "12.59 M" in inspect and "LlamaForCausalLM" in inspect
    # The checkpoint's README gives transformers' greedy continuation of this prompt.
    assert run.startswith("ROMEO:\nI'll have a little more.\n\nROMEO:\nI'll tell you, what's the matter?")


def test_cpu_torch_note_comes_before_the_install_command():
    text = (REPO / "README.md").read_text()
    note = text.index("--index-url https://download.pytorch.org/whl/cpu")
    assert note < text.index("pip install -e '.[dev]'")


def test_python_api_from_the_parent_of_a_clone_named_llmc(tmp_path):
    """What the README's Python API section says: a clone named llmc/ in the current directory
    shadows the installed package for `python -c`, and `python -P` avoids it."""
    os.symlink(REPO, tmp_path / "llmc")
    code = "from llmc import LLM, SamplingParams; print(LLM.__module__)"
    shadowed = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    safe = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert safe.returncode == 0 and safe.stdout.strip() == "llmc.runtime.llm", safe.stderr
    if shadowed.returncode != 0:  # an editable install: the folder is taken for a namespace package
        assert "cannot import name 'LLM' from 'llmc' (unknown location)" in shadowed.stderr
        assert "cannot import name 'LLM' from 'llmc' (unknown location)" in (REPO / "README.md").read_text()


def test_quantization_example_needs_nothing_outside_the_clone():
    from llmc.compiler.recipe import load_recipe

    text = (REPO / "README.md").read_text()
    readme_data = re.search(r"calibration:\n\s+data: (\S+)", text).group(1)
    recipe = load_recipe(REPO / "recipes" / "ref-llama-12m-gptq.yaml")
    assert recipe.quantization.calibration.data == readme_data
    data = REPO / readme_data
    assert data.is_file() and (REPO / recipe.model / "config.json").is_file()
    # Enough text for num_samples windows of seq_len tokens (and the 4 held-out windows of the report).
    from transformers import AutoTokenizer

    num_tokens = len(AutoTokenizer.from_pretrained(REPO / recipe.model)(data.read_text())["input_ids"])
    calibration = recipe.quantization.calibration
    assert num_tokens >= (calibration.num_samples + 4) * calibration.seq_len
