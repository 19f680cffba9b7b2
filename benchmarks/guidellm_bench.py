"""guidellm against `llmc run` on loopback, for a bounded time; prints guidellm's summary.

    python benchmarks/guidellm_bench.py build/ref-llama-12m --max-seconds 60 [--device cpu] [--out DIR]

guidellm (pinned: GUIDELLM_VERSION) is no dependency of llmc: on first use it is installed into its
own virtualenv (default `.guidellm-venv`, git-ignored; it sees this interpreter's packages, and
torch stays the one installed here), so guidellm's dependencies never change llmc's environment. The script starts `llmc run ARTIFACT` on a free loopback port,
waits for /health, runs `guidellm run` (guidellm >= 0.8's CLI) with a synchronous profile and
synthetic prompts of --prompt-tokens / --output-tokens tokens for --max-seconds, stops the server
with SIGTERM, and writes guidellm's JSON report and console output under --out.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

GUIDELLM_VERSION = "0.8.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_guidellm(venv: Path) -> Path:
    """The guidellm executable of `venv`, created and installed with GUIDELLM_VERSION if needed."""
    executable = venv / "bin" / "guidellm"
    python = venv / "bin" / "python"
    if executable.exists():
        installed = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('guidellm'))"],
                                   capture_output=True, text=True).stdout.strip()
        if installed == GUIDELLM_VERSION:
            return executable
    # guidellm requires torch: the venv sees this interpreter's packages, and the torch already here is
    # pinned, so that pip neither downloads another (a CUDA build on Linux) nor changes this one.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pins = [f"guidellm=={GUIDELLM_VERSION}"]
    try:
        import torch

        pins.append(f"torch=={torch.__version__}")
    except ImportError:
        pass
    subprocess.run([str(python), "-m", "pip", "install", "-q", *pins], check=True)
    return executable


def _wait_healthy(base_url: str, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"llmc run exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"llmc run was not healthy after {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--max-seconds", type=float, default=60)
    parser.add_argument("--profile", default="synchronous", help="guidellm's profile kind (synchronous, concurrent, ...)")
    parser.add_argument("--rate", default=None, help="the profile's settings, e.g. streams=4 for concurrent")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--device", default=None)
    parser.add_argument("--venv", type=Path, default=Path(".guidellm-venv"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/guidellm"))
    args = parser.parse_args()

    guidellm = ensure_guidellm(args.venv)
    args.out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    beside = Path(sys.executable).with_name("llmc")  # this interpreter's llmc, not another one on PATH
    llmc = str(beside) if beside.exists() else shutil.which("llmc")
    command = [llmc, "run", args.artifact, "--port", str(port), "--served-model-name", "bench"]
    if args.device:
        command += ["--device", args.device]
    with (args.out / "server.log").open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(base_url, server)
        profile = f"kind={args.profile}" + (f",{args.rate}" if args.rate else "")
        bench = [str(guidellm), "run",
                 "--backend", f"kind=openai_http,target={base_url},model=bench",
                 "--tokenizer", f"kind=huggingface_auto,model={Path(args.artifact) / 'tokenizer'}",
                 "--profile", profile,
                 "--constraint", f"kind=max_duration,seconds={args.max_seconds:g}",
                 "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
                 "--output", f"kind=json,path={args.out / 'benchmarks.json'}",
                 "--disable-console-interactive"]
        print("$", " ".join(bench), flush=True)
        result = subprocess.run(bench, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        (args.out / "guidellm.txt").write_text(result.stdout)
        print(result.stdout)
        if result.returncode != 0:
            raise SystemExit(f"guidellm exited with {result.returncode}")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


if __name__ == "__main__":
    main()
