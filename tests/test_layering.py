"""The dependency rule of DESIGN §1: kernels ← quant ← runtime ← compiler ← llmc.cli."""

import subprocess
import sys

import pytest


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return {m for m in out.split() if m.startswith("llmc")}


@pytest.mark.parametrize(
    ("statement", "forbidden"),
    [
        ("import llmc.kernels.attention, llmc.kernels.norm, llmc.kernels.rotary, llmc.kernels.activation, llmc.kernels.sampling", ("llmc.quant", "llmc.runtime", "llmc.compiler", "llmc.errors", "llmc.schema")),
        ("import llmc.quant.formats, llmc.quant.reference", ("llmc.runtime", "llmc.compiler", "llmc.cli")),
        ("from llmc.runtime.llm import LLM", ("llmc.compiler", "llmc.cli")),
        ("import llmc; llmc.LLM", ("llmc.compiler", "llmc.cli")),
        ("import llmc", ("llmc.runtime", "llmc.compiler", "llmc.quant", "llmc.kernels")),
    ],
)
def test_imports_point_one_way(statement, forbidden):
    loaded = _loaded_after(statement)
    offenders = sorted(m for m in loaded if m.startswith(forbidden))
    assert not offenders, f"{statement!r} loaded {offenders}"


def test_kernel_package_imports_nothing_of_llmc():
    loaded = _loaded_after("import llmc.kernels.attention")
    assert "llmc.kernels.attention" in loaded
    assert all(m in ("llmc", "llmc.kernels") or m.startswith("llmc.kernels.") for m in loaded), loaded
