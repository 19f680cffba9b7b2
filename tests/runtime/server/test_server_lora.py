"""The server's LoRA adapters (vLLM's --enable-lora --lora-modules): a request whose model names an adapter runs
with it. The oracle is the LLM API under the same adapter (tests/runtime/test_lora_runtime.py checks that one
against transformers + PEFT); the base model's name runs without one."""

import json
import os
import time

import httpx
import pytest

from llmc.cli import main
from llmc.runtime.llm import LLM
from llmc.runtime.lora import LoRARequest
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import build_float32, make_peft_adapter
from tests.runtime.server.conftest import ServerProcess

pytest.importorskip("peft")

PROMPT = "ROMEO: what light through yonder window"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama):
    """(artifact, {name: adapter path}, {name or None: the LLM API's greedy text for PROMPT, ignore_eos})."""
    root = tmp_path_factory.mktemp("server-lora")
    artifact = build_float32(tiny_llama, root / "base")
    adapters = {"attn": make_peft_adapter(tiny_llama, root / "attn", 1, r=4, lora_alpha=8,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
                "mlp": make_peft_adapter(tiny_llama, root / "mlp", 2, r=8, lora_alpha=4,
                                target_modules=["gate_proj", "up_proj", "down_proj"])}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    names = [None, *adapters]
    with LLM(artifact, device="cpu", enable_lora=True, max_lora_rank=8, disable_log_stats=True) as llm:
        # the ids the server gives them: 1, 2 in --lora-modules order
        loras = [None] + [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())]
        outputs = llm.generate([PROMPT] * len(names), params, lora_request=loras)
        want = {name: o.outputs[0].text for name, o in zip(names, outputs)}
        assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 3  # each adapter changes the tokens
    assert len(set(want.values())) == 3
    return artifact, adapters, want


@pytest.fixture(scope="module")
def lora_server(setup, tmp_path_factory):
    artifact, adapters, _ = setup
    json_form = json.dumps({"name": "mlp", "path": str(adapters["mlp"]), "base_model_name": "tiny-alias"})
    server = ServerProcess(artifact, tmp_path_factory.mktemp("lora-log") / "server.log",
                           "--served-model-name", "tiny", "tiny-alias", "--disable-log-stats", "--enable-lora",
                           "--max-loras", "2", "--max-lora-rank", "8", "--data-parallel", "2",
                           "--lora-modules", f"attn={adapters['attn']}", json_form)
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.terminate() == 0, server.log()


def _complete(base_url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra})


def _text(body: dict) -> str:
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    return body["choices"][0]["text"]


def test_a_request_naming_an_adapter_runs_with_it(setup, lora_server):
    """completions under each adapter and the base model's names: the LLM API's greedy tokens under the same
    adapter (the adapters' outputs differ from the base model's); chat and responses name adapters too."""
    _, _, want = setup
    base_url = lora_server.base_url
    for model, key in [("attn", "attn"), ("mlp", "mlp"), ("tiny", None), ("tiny-alias", None), ("attn", "attn")]:
        response = _complete(base_url, model)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        assert _text(response.json()) == want[key], model
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "logprobs": True}
    outs = {}
    for model in ("attn", "tiny"):
        response = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={"model": model, **chat})
        assert response.status_code == 200, response.text
        outs[model] = [t["token"] for t in response.json()["choices"][0]["logprobs"]["content"]]
    assert outs["attn"] != outs["tiny"]
    response = httpx.post(f"{base_url}/v1/responses", timeout=60, json={
        "model": "attn", "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "attn"


def test_prefix_caching_keeps_adapters_apart(lora_server, read_metrics):
    """A long prompt on the base model (cold), then twice under an adapter (the second reuses the adapter's own
    blocks), then on the base model again: its text is the cold run's, not the adapter's."""
    url, prompt = lora_server.base_url, PROMPT * 6
    cold = _text(_complete(url, "tiny", prompt=prompt).json())
    tuned = _text(_complete(url, "attn", prompt=prompt).json())
    hits = read_metrics(url)["llmc:prefix_cache_hits_total"]
    assert _text(_complete(url, "attn", prompt=prompt).json()) == tuned
    assert read_metrics(url)["llmc:prefix_cache_hits_total"] > hits
    assert tuned != cold and _text(_complete(url, "tiny", prompt=prompt).json()) == cold


@pytest.mark.slow
def test_every_data_parallel_replica_serves_the_adapters(setup, lora_server):
    """Concurrent requests go to both replicas (the least loaded): each runs its adapter as the LLM API does."""
    from concurrent.futures import ThreadPoolExecutor

    _, _, want = setup
    models = ["mlp", "attn", "mlp", "attn", "tiny", "mlp"]
    with ThreadPoolExecutor(len(models)) as pool:
        bodies = list(pool.map(lambda m: _complete(lora_server.base_url, m, max_tokens=40).json(), models))
    for model, body in zip(models, bodies):
        assert body["usage"]["completion_tokens"] == 40
        assert body["choices"][0]["text"].startswith(want[None if model == "tiny" else model]), model
    lines = [line for line in lora_server.log().splitlines() if "LoRA adapter 'mlp' (id 2" in line]
    assert len(lines) == 2, lora_server.log()  # read by each replica's engine, with the same id


def test_models_lists_the_adapters_and_an_unknown_model_is_404(setup, lora_server):
    _, adapters, _ = setup
    base_url = lora_server.base_url
    cards = {card["id"]: card for card in httpx.get(f"{base_url}/v1/models").json()["data"]}
    assert list(cards) == ["tiny", "tiny-alias", "attn", "mlp"]
    assert (cards["attn"]["root"], cards["attn"]["parent"]) == (str(adapters["attn"]), "tiny")
    assert (cards["mlp"]["root"], cards["mlp"]["parent"]) == (str(adapters["mlp"]), "tiny-alias")
    assert cards["tiny"]["parent"] is None and cards["attn"]["object"] == "model"
    assert httpx.get(f"{base_url}/v1/models/mlp").json()["parent"] == "tiny-alias"
    response = _complete(base_url, "nope")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert "'attn'" in response.json()["error"]["message"]
    # vLLM's dynamic endpoints are off without VLLM_ALLOW_RUNTIME_LORA_UPDATING: a 400 naming --lora-modules
    response = httpx.post(f"{base_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
    assert response.status_code == 400 and "--lora-modules" in response.json()["error"]["message"]


@pytest.mark.slow
def test_adapters_load_and_unload_at_run_time_when_allowed(setup, tmp_path):
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING=1: a loaded adapter runs as the LLM API runs it, a bad path is a 400,
    unloading an adapter with a running request is a 400, an unloaded one is a 404 afterwards."""
    artifact, adapters, want = setup
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    try:
        server = ServerProcess(artifact, tmp_path / "server.log", "--served-model-name", "tiny", "--disable-log-stats",
                               "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"attn={adapters['attn']}")
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    try:
        server.wait_ready()
        url = server.base_url
        bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "is not a folder" in bad.text
        taken = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": str(adapters["mlp"])})
        assert taken.status_code == 400
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])})
        assert loaded.status_code == 200, loaded.text
        assert _text(_complete(url, "mlp").json()) == want["mlp"]
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": "attn", "prompt": PROMPT, "max_tokens": 100, "n": 64, "ignore_eos": True,
                "stream": True}) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the response (the request is aborted)
            first = next(lines)
            assert stream.status_code == 200 and first.startswith("data: "), first
            busy = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "attn"})
            assert busy.status_code == 400 and "has 1 unfinished request" in busy.text, busy.text
        for _ in range(100):  # the closed stream's request is aborted between two steps
            unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "attn"})
            if unloaded.status_code == 200:
                break
            time.sleep(0.05)
        assert unloaded.status_code == 200, unloaded.text
        assert _complete(url, "attn").status_code == 404
        assert [c["id"] for c in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny", "mlp"]
        assert _text(_complete(url, "tiny").json()) == want[None]
    finally:
        assert server.terminate() == 0, server.log()


@pytest.mark.parametrize(("args", "message"), [
    (["--lora-modules", "a=ADAPTER"], "--lora-modules serves LoRA adapters at run time: give --enable-lora too"),
    (["--enable-lora", "--lora-modules", "a=MISSING"], "--lora-modules a=MISSING: MISSING is not a folder"),
    (["--enable-lora", "--max-lora-rank", "2", "--lora-modules", "a=ADAPTER"], "rank 4 is above max_lora_rank 2"),
    (["--enable-lora", "--lora-modules", "a"], "expected NAME=PATH"),
    (["--enable-lora", "--lora-modules", "a=ADAPTER", "a=ADAPTER"], "the name 'a' is given twice"),
    (["--enable-lora", "--lora-modules", "a=ADAPTER", "-p", "x"], "--lora-modules applies to the server and batch files"),
])
def test_bad_lora_modules_fail_at_start_in_one_line(args, message, setup, tmp_path, capsys, free_port):
    artifact, adapters, _ = setup
    files = {"ADAPTER": str(adapters["attn"]), "MISSING": str(tmp_path / "missing")}
    args = [files.get(a, a.replace("ADAPTER", files["ADAPTER"]).replace("MISSING", files["MISSING"])) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(artifact), "--device", "cpu", "--disable-log-stats", "--port", str(free_port()), *args]
             if "-p" not in args else ["run", str(artifact), "--device", "cpu", *args])
    assert exit_info.value.code in (1, 2)
    err = capsys.readouterr().err
    message = message.replace("MISSING", files["MISSING"])
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # for the default run's time (session 42)
def test_a_batch_file_line_naming_an_adapter_runs_with_it(setup, tmp_path):
    artifact, adapters, want = setup
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True}}
             for name, model in [("attn", "attn"), ("mlp", "mlp"), ("base", "some-other-model")]]
    requests, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(artifact), "--device", "cpu", "--input", str(requests), "--output", str(results),
              "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"attn={adapters['attn']}",
              f"mlp={adapters['mlp']}"])
    assert exit_info.value.code == 0
    out = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, results.read_text().splitlines())}
    assert _text(out["attn"]) == want["attn"]
    assert _text(out["mlp"]) == want["mlp"]
    assert _text(out["base"]) == want[None]
