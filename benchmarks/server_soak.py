"""Soak test of `llmc run` (CPU). Starts the server, drives a random request mix for --minutes,
samples resources every --interval seconds, runs quiet-period accounting checks, then SIGTERMs.

    llmc build recipes/ref-llama-12m.yaml
    python benchmarks/server_soak.py --artifact build/ref-llama-12m --minutes 27 --out /tmp/soak

The measurement behind RESULTS.md's session 35 soak (27.5 minutes, ~11,700 requests).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROBE = {"prompt": "ROMEO: my lord,", "max_tokens": 16, "temperature": 0}

WORDS: list[str] = []  # the held-out text's words (main() reads --data)
PREFIXES: list[str] = []  # shared prompt prefixes


def rand_prompt(rng):
    r = rng.random()
    if r < 0.5:
        p = rng.choice(PREFIXES)
        return p + " " + " ".join(rng.choices(WORDS, k=rng.randint(0, 20)))
    if r < 0.8:
        return " ".join(rng.choices(WORDS, k=rng.randint(1, 40)))
    return rng.choice(["ROMEO:", "Once upon a time", "The old sailor said", "JULIET: O", "Hello"])


class Stats:
    def __init__(self):
        self.http = {}           # status -> count
        self.kinds = {}          # kind -> count
        self.errors_5xx = []     # (t, kind, status, body[:300])
        self.unexpected = []     # (t, kind, desc)
        self.client_aborts = 0   # requests we cut (and that had not finished)
        self.hung = []
        self.lat = []
        self.seeded = {}         # key -> text
        self.seed_mismatch = []
        self.gen200 = 0  # generation requests answered 200 (each one engine request: one prompt each)
        self.timeout_aborts = 0

    def note(self, kind, status):
        self.http[status] = self.http.get(status, 0) + 1
        if status == 200 and kind in ("cmpl", "chat", "cmpl-stream", "chat-stream", "probe"):
            self.gen200 += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


S = Stats()
T0 = time.monotonic()
GO = asyncio.Event()
INFLIGHT = [0]


def t():
    return round(time.monotonic() - T0, 1)


def unexpected(kind, desc):
    S.unexpected.append((t(), kind, str(desc)[:600]))
    print(f"[{t()}] UNEXPECTED {kind}: {str(desc)[:300]}", flush=True)


def check_status(kind, r, body, expect=200):
    S.note(kind, r.status_code)
    if r.status_code >= 500:
        S.errors_5xx.append((t(), kind, r.status_code, str(body)[:300]))
        print(f"[{t()}] 5xx {kind} {r.status_code}: {str(body)[:300]}", flush=True)
    elif r.status_code != expect:
        unexpected(kind, f"status {r.status_code} (expected {expect}) body={str(body)[:300]}")


def make_request(rng):
    """Returns (path, body, meta)."""
    chat = rng.random() < 0.45
    stream = rng.random() < 0.45
    body = {"model": "ref-llama-12m", "max_tokens": rng.randint(1, 200), "stream": stream}
    n = rng.choice([1, 1, 1, 2, 3])
    if n > 1:
        body["n"] = n
    greedy = rng.random() < 0.3 and n == 1  # llmc refuses n>1 with temperature 0 (400)
    body["temperature"] = 0 if greedy else rng.choice([0.5, 0.8, 1.0, 1.3])
    if not greedy and rng.random() < 0.5:
        body["seed"] = rng.randint(0, 5)
    if rng.random() < 0.2:
        body["stop"] = rng.choice(["\n", ".", ["the", "and"], [",", "!"]])
    if rng.random() < 0.1:
        body["top_k"] = rng.choice([5, 40])
        body["top_p"] = 0.9
    structured = None
    if rng.random() < 0.08:
        if rng.random() < 0.5:
            structured = {"type": "json_object"}
        else:
            structured = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
                "required": ["a", "b"], "additionalProperties": False}}}
        body["response_format"] = structured
        body["max_tokens"] = 200
        body.pop("stop", None)
    if stream and rng.random() < 0.6:
        body["stream_options"] = {"include_usage": True}
    if chat:
        msgs = [{"role": "user", "content": rand_prompt(rng)}]
        if rng.random() < 0.3:
            msgs = [{"role": "system", "content": PREFIXES[0]}] + msgs
        body["messages"] = msgs
        if rng.random() < 0.3:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
        path = "/v1/chat/completions"
    else:
        body["prompt"] = rand_prompt(rng)
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
        if not stream and rng.random() < 0.15:
            body["echo"] = True
        path = "/v1/completions"
    return path, body


async def do_generate(client, rng, abort_mode=None):
    path, body = make_request(rng)
    kind = ("chat" if "chat" in path else "cmpl") + ("-stream" if body["stream"] else "")
    t_start = time.monotonic()
    try:
        if body["stream"]:
            chunks = 0
            cut_after = rng.randint(0, 6) if abort_mode == "stream" else None
            finished_idx = set()
            usage = None
            async with client.stream("POST", path, json=body, timeout=300) as r:
                if r.status_code != 200:
                    txt = await r.aread()
                    check_status(kind, r, txt)
                    return
                S.note(kind, 200)
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        unexpected(kind, f"error event {obj} body={body}")
                        continue
                    if obj.get("usage") and not obj.get("choices"):
                        usage = obj["usage"]
                    for c in obj.get("choices", []):
                        if c.get("finish_reason"):
                            finished_idx.add(c["index"])
                    chunks += 1
                    if cut_after is not None and chunks >= cut_after:
                        if len(finished_idx) < body.get("n", 1):
                            S.client_aborts += 1
                        return  # leaving the context closes the connection
                if not done:
                    unexpected(kind, f"stream ended without [DONE] body={body}")
                elif len(finished_idx) != body.get("n", 1):
                    unexpected(kind, f"stream finished {finished_idx} of n={body.get('n', 1)} body={body}")
        else:
            timeout = rng.uniform(0.02, 0.5) if abort_mode == "timeout" else 300
            try:
                r = await client.post(path, json=body, timeout=timeout)
            except httpx.TimeoutException:
                if abort_mode == "timeout":
                    S.client_aborts += 1
                    S.timeout_aborts += 1
                    return
                raise
            js = r.json()
            check_status(kind, r, js)
            if r.status_code != 200:
                return
            validate(kind, body, js)
    except (httpx.TimeoutException,) as e:
        S.hung.append((t(), kind, body))
        unexpected(kind, f"timeout {type(e).__name__} body={body}")
    except Exception as e:  # noqa: BLE001
        unexpected(kind, f"{type(e).__name__}: {e} body={body}")
    finally:
        S.lat.append(time.monotonic() - t_start)


def validate(kind, body, js):
    n = body.get("n", 1)
    ch = js.get("choices", [])
    if len(ch) != n:
        unexpected(kind, f"{len(ch)} choices for n={n}")
    for c in ch:
        text = c["message"]["content"] if "message" in c else c["text"]
        if text is None:
            text = ""
        stop = body.get("stop")
        if stop and c["finish_reason"] == "stop":
            stops = [stop] if isinstance(stop, str) else stop
            gen = text[len(body["prompt"]):] if body.get("echo") else text
            for s_ in stops:
                if s_ in gen:
                    unexpected(kind, f"stop string {s_!r} in output {gen!r}")
        if body.get("echo") and not text.startswith(body["prompt"]):
            unexpected(kind, f"echo text does not start with prompt")
        if body.get("response_format") and c["finish_reason"] == "stop":
            try:
                obj = json.loads(text[len(body["prompt"]):] if body.get("echo") else text)  # echo: prompt first
                if body["response_format"]["type"] == "json_schema" and not (
                        isinstance(obj, dict) and isinstance(obj.get("a"), int) and isinstance(obj.get("b"), str)):
                    unexpected(kind, f"json_schema violated: {text!r}")
            except Exception:  # noqa: BLE001
                unexpected(kind, f"structured output not JSON: {text!r} body={body}")
        lp = c.get("logprobs")
        if body.get("logprobs") not in (None, False) and lp is None:
            unexpected(kind, "logprobs missing")
        if "message" not in c and lp and not body.get("echo"):
            if lp and len(lp["tokens"]) != js["usage"]["completion_tokens"] and n == 1:
                unexpected(kind, f"logprobs tokens {len(lp['tokens'])} != completion_tokens {js['usage']['completion_tokens']}")
    u = js.get("usage", {})
    if body.get("seed") is not None and n == 1 and not body.get("response_format"):
        key = json.dumps(body, sort_keys=True)
        text = ch[0]["message"]["content"] if "message" in ch[0] else ch[0]["text"]
        prev = S.seeded.get(key)
        if prev is None:
            S.seeded[key] = text
        elif prev != text:
            S.seed_mismatch.append((t(), body, prev, text))
            unexpected(kind, f"seeded output changed: {prev!r} vs {text!r}")


INVALID = [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 2.0}, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 100}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404),
    ("/v1/completions", {"prompt": [999999999]}, 400),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, 400),
    ("/v1/chat/completions", {"messages": "notalist"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 200}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": True}, 400),
    ("/v1/completions", {"prompt": "hi", "stream": True, "use_beam_search": True, "n": 2}, 400),
]


async def do_invalid(client, rng):
    path, body, exp = rng.choice(INVALID)
    r = await client.post(path, json=body, timeout=60)
    check_status("invalid", r, r.text, expect=exp)


async def do_misc(client, rng):
    which = rng.choice(["tok", "models", "health", "metrics", "badct"])
    if which == "tok":
        p = rand_prompt(rng)
        r = await client.post("/tokenize", json={"prompt": p, "add_special_tokens": False}, timeout=60)
        check_status("tokenize", r, r.text)
        toks = r.json().get("tokens")
        r2 = await client.post("/detokenize", json={"tokens": toks}, timeout=60)
        check_status("detokenize", r2, r2.text)
        if r2.status_code == 200 and r2.json().get("prompt") != p:
            unexpected("detokenize", f"roundtrip {p!r} -> {r2.json().get('prompt')!r}")
    elif which == "models":
        r = await client.get("/v1/models", timeout=60)
        check_status("models", r, r.text)
    elif which == "health":
        r = await client.get("/health", timeout=60)
        check_status("health", r, r.text)
    elif which == "metrics":
        r = await client.get("/metrics", timeout=60)
        check_status("metrics", r, r.text[:200])
    else:
        r = await client.post("/v1/completions", content=b'{"prompt":"hi"}', headers={"content-type": "text/plain"}, timeout=60)
        check_status("badct", r, r.text, expect=400)


async def worker(i, client, seed):
    rng = random.Random(seed)
    while not STOP[0]:
        await GO.wait()
        INFLIGHT[0] += 1
        try:
            x = rng.random()
            if x < 0.70:
                await do_generate(client, rng)
            elif x < 0.80:
                await do_generate(client, rng, abort_mode=rng.choice(["stream", "timeout"]))
            elif x < 0.88:
                await do_invalid(client, rng)
            else:
                await do_misc(client, rng)
        except Exception as e:  # noqa: BLE001
            unexpected("worker", f"{type(e).__name__}: {e}")
        finally:
            INFLIGHT[0] -= 1


STOP = [False]
PROBES = []  # (t, latency, text)


async def probe_loop(client):
    while not STOP[0]:
        await GO.wait()
        t1 = time.monotonic()
        INFLIGHT[0] += 1
        try:
            try:
                r = await client.post("/v1/completions", json=PROBE, timeout=120)
            finally:
                INFLIGHT[0] -= 1
            dt = time.monotonic() - t1
            S.note("probe", r.status_code)
            if r.status_code == 200:
                PROBES.append((t(), dt, r.json()["choices"][0]["text"]))
            else:
                unexpected("probe", f"{r.status_code} {r.text[:200]}")
        except Exception as e:  # noqa: BLE001
            unexpected("probe", f"{type(e).__name__}: {e}")
        await asyncio.sleep(2.0)


def proc_info(pid):
    st = {}
    for line in open(f"/proc/{pid}/status"):
        k, v = line.split(":", 1)
        st[k] = v.strip()
    return {"rss_kb": int(st["VmRSS"].split()[0]), "threads": int(st["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


async def metrics(client):
    r = await client.get("/metrics", timeout=60)
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            key = s.name
            if "finished_reason" in s.labels:
                key += "{" + s.labels["finished_reason"] + "}"
            if s.name.endswith("_bucket") or s.name.endswith("_created"):
                continue
            out[key] = s.value
    return out


async def drain(client, max_wait=240):
    GO.clear()
    t1 = time.monotonic()
    await asyncio.sleep(0.1)
    while INFLIGHT[0] > 0 and time.monotonic() - t1 < max_wait:
        await asyncio.sleep(0.2)
    if INFLIGHT[0] > 0:
        unexpected("drain", f"{INFLIGHT[0]} client requests still in flight after {max_wait}s")
    # let the server process the aborts
    for _ in range(50):
        m = await metrics(client)
        if m.get("llmc:num_requests_running") == 0 and m.get("llmc:num_requests_waiting") == 0:
            break
        await asyncio.sleep(0.2)
    return m


ACCOUNTING = []


async def accounting_check(client, rng, label):
    """Quiet period: no other traffic. Idle gauges must be 0; then send a known batch and compare
    /metrics deltas with the usage the responses report."""
    m0 = await drain(client)
    await asyncio.sleep(1.0)
    m0 = await metrics(client)
    idle = {k: m0.get(k) for k in ("llmc:num_requests_running", "llmc:num_requests_waiting", "llmc:kv_cache_usage_perc")}
    exp = {"prompt": 0, "gen": 0, "stop": 0, "length": 0, "abort": 0, "n_req": 0}
    tasks = []

    async def one(j):
        chat = j % 2 == 0
        n = 1 + j % 3
        body = {"max_tokens": rng.randint(1, 60), "temperature": 0.8, "n": n}
        if j % 4 == 1:
            body["stop"] = "."
        if chat:
            body["messages"] = [{"role": "user", "content": rand_prompt(rng)}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = rand_prompt(rng)
            path = "/v1/completions"
        if j % 3 == 0:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            usage, reasons = None, {}
            async with client.stream("POST", path, json=body, timeout=300) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line[6:] != "[DONE]":
                        o = json.loads(line[6:])
                        if o.get("usage"):
                            usage = o["usage"]
                        for c in o.get("choices", []):
                            if c.get("finish_reason"):
                                reasons[c["index"]] = c["finish_reason"]
            r0 = reasons.get(0)
        else:
            r = await client.post(path, json=body, timeout=300)
            js = r.json()
            usage = js["usage"]
            r0 = js["choices"][0]["finish_reason"]
        exp["prompt"] += usage["prompt_tokens"]
        exp["gen"] += usage["completion_tokens"]
        exp[r0] += 1
        exp["n_req"] += 1
        S.gen200 += 1

    await asyncio.gather(*(one(j) for j in range(12)))
    m1 = await drain(client)
    await asyncio.sleep(0.5)
    m1 = await metrics(client)
    d = lambda k: m1.get(k, 0) - m0.get(k, 0)  # noqa: E731
    got = {"prompt": d("llmc:prompt_tokens_total"), "gen": d("llmc:generation_tokens_total"),
           "stop": d("llmc:request_success_total{stop}"), "length": d("llmc:request_success_total{length}"),
           "abort": d("llmc:request_success_total{abort}")}
    rec = {"t": t(), "label": label, "idle_before": idle, "expected": exp, "metrics_delta": got,
           "idle_after": {k: m1.get(k) for k in idle}}
    ACCOUNTING.append(rec)
    ok = all(got[k] == exp[k] for k in ("prompt", "gen", "stop", "length", "abort"))
    ok = ok and idle["llmc:kv_cache_usage_perc"] == 0 and rec["idle_after"]["llmc:kv_cache_usage_perc"] == 0
    print(f"[{t()}] ACCOUNTING {label} ok={ok} {json.dumps(rec)}", flush=True)
    if not ok:
        unexpected("accounting", json.dumps(rec))
    GO.set()


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=27)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--interval", type=float, default=30)
    ap.add_argument("--accounting-every", type=float, default=300)
    ap.add_argument("--out", default="/tmp/soak")
    ap.add_argument("--artifact", default="build/ref-llama-12m")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parent.parent / "data" / "heldout.txt"),
                    help="text the prompts are drawn from")
    ap.add_argument("--server-args", default="--num-kv-blocks 96 --max-model-len 512 --max-num-seqs 16 --enable-prefix-caching")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(out / "server.log", "w")
    WORDS[:] = Path(a.data).read_text().split()
    PREFIXES[:] = [" ".join(WORDS[i * 97:i * 97 + 60]) for i in range(6)]
    cmd = ["llmc", "run", a.artifact, "--device", "cpu", "--port", str(a.port)] + a.server_args.split()
    print("server:", " ".join(cmd), flush=True)
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{a.port}"
    limits = httpx.Limits(max_connections=40, max_keepalive_connections=20)
    async with httpx.AsyncClient(base_url=base, limits=limits) as client:
        for _ in range(600):
            try:
                if (await client.get("/health", timeout=5)).status_code == 200:
                    break
            except Exception:  # noqa: BLE001
                pass
            await asyncio.sleep(0.5)
        global T0
        T0 = time.monotonic()
        samples = open(out / "samples.jsonl", "w")
        GO.set()
        rng = random.Random(1234)
        tasks = [asyncio.create_task(worker(i, client, 1000 + i)) for i in range(a.workers)]
        tasks.append(asyncio.create_task(probe_loop(client)))
        end = T0 + a.minutes * 60
        next_acc = T0 + a.accounting_every
        last_probe_i = 0
        while time.monotonic() < end:
            await asyncio.sleep(a.interval)
            if time.monotonic() >= next_acc:
                await accounting_check(client, rng, f"t={t()}")
                next_acc += a.accounting_every
            pi = proc_info(srv.pid)
            m = await metrics(client)
            window = PROBES[last_probe_i:]
            last_probe_i = len(PROBES)
            lats = [x[1] for x in window]
            texts = {x[2] for x in PROBES}
            rec = {"t": t(), **pi,
                   "kv": m.get("llmc:kv_cache_usage_perc"), "running": m.get("llmc:num_requests_running"),
                   "waiting": m.get("llmc:num_requests_waiting"), "preempt": m.get("llmc:num_preemptions_total"),
                   "succ_stop": m.get("llmc:request_success_total{stop}"), "succ_length": m.get("llmc:request_success_total{length}"),
                   "succ_abort": m.get("llmc:request_success_total{abort}"),
                   "gen_tok": m.get("llmc:generation_tokens_total"), "prompt_tok": m.get("llmc:prompt_tokens_total"),
                   "pc_hits": m.get("llmc:prefix_cache_hits_total"), "pc_q": m.get("llmc:prefix_cache_queries_total"),
                   "probe_n": len(lats), "probe_p50": pct(lats, 0.5), "probe_p99": pct(lats, 0.99),
                   "probe_texts": len(texts), "http": dict(S.http), "n5xx": len(S.errors_5xx),
                   "unexpected": len(S.unexpected), "client_aborts": S.client_aborts, "timeout_aborts": S.timeout_aborts, "gen200": S.gen200, "inflight": INFLIGHT[0]}
            samples.write(json.dumps(rec) + "\n")
            samples.flush()
            print(json.dumps({k: rec[k] for k in rec if k != "http"}), flush=True)
        # final: quiet, idle check + accounting
        await accounting_check(client, rng, "final")
        STOP[0] = True
        GO.set()
        await asyncio.sleep(0)
        for tk in tasks:
            tk.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(5)
        m = await metrics(client)
        idle = {k: m.get(k) for k in ("llmc:num_requests_running", "llmc:num_requests_waiting", "llmc:kv_cache_usage_perc")}
        pi = proc_info(srv.pid)
    srv.send_signal(signal.SIGTERM)
    try:
        rc = srv.wait(timeout=60)
    except subprocess.TimeoutExpired:
        rc = "HUNG"
        srv.kill()
    summary = {"rc_after_sigterm": rc, "final_idle": idle, "final_proc": pi, "http": S.http, "kinds": S.kinds,
               "errors_5xx": S.errors_5xx, "unexpected": S.unexpected, "hung": S.hung, "client_aborts": S.client_aborts,
               "probe_texts": sorted({x[2] for x in PROBES}), "probes": len(PROBES), "accounting": ACCOUNTING,
               "seed_mismatch": S.seed_mismatch[:20], "seeded_keys": len(S.seeded), "gen200": S.gen200, "timeout_aborts": S.timeout_aborts,
               "final_metrics": m}
    json.dump(summary, open(out / "summary.json", "w"), indent=1, default=str)
    print("SUMMARY", json.dumps({k: summary[k] for k in ("rc_after_sigterm", "final_idle", "http", "probe_texts")}, default=str))
    print("unexpected:", len(S.unexpected), "5xx:", len(S.errors_5xx))


if __name__ == "__main__":
    asyncio.run(main())
