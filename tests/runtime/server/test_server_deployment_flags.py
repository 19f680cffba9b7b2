"""vLLM's deployment flags on `llmc run`: --chat-template (server, batch files, --chat), HTTPS
(--ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs), --root-path, uvicorn's log level and
access log. The reference for a rendered template is transformers' own apply_chat_template."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import time

import httpx
import pytest
from transformers import AutoTokenizer

from llmc.cli import main
from tests.runtime.server.conftest import free_port

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | upper }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Where is Verona?"}]


def _self_signed(tmp_path, name: str = "server"):
    """A PEM key and a certificate for 127.0.0.1 signed by that key (cryptography)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = tmp_path / f"{name}-key.pem", tmp_path / f"{name}-cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def _reference_ids(artifact, messages) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(artifact / "tokenizer"))
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<system>BE BRIEF\n")  # the template given, not the artifact's
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.slow  # for the default run's time (session 42)
def test_https_root_path_and_chat_template_on_the_server(start_server, server_artifact, tmp_path):
    key, cert = _self_signed(tmp_path)
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    server = start_server("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/llm",
                          "--chat-template", str(template), "--disable-uvicorn-access-log", "--disable-log-stats",
                          "--enable-log-requests", "--max-log-len", "4", wait=False)
    base = f"https://127.0.0.1:{server.port}"
    with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=60) as client:
        for _ in range(600):
            assert server.process.poll() is None, server.log()
            try:
                if client.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        # behind a proxy that strips /llm, requests arrive at /v1 (ASGI: root_path is the prefix outside)
        assert client.get(f"{base}/v1/models").json()["data"][0]["id"] == "ref-llama-12m"
        reply = client.post(f"{base}/tokenize", json={"model": "ref-llama-12m", "messages": MESSAGES})
        assert reply.status_code == 200, reply.text
        assert reply.json()["tokens"] == _reference_ids(server_artifact, MESSAGES)
        prompt = "ROMEO: Good morrow, cousin."
        reply = client.post(f"{base}/v1/completions", json={"model": "ref-llama-12m", "prompt": prompt, "max_tokens": 1})
        assert reply.status_code == 200, reply.text
        request_id = reply.json()["id"]
        num_prompt = reply.json()["usage"]["prompt_tokens"]
    with pytest.raises(httpx.TransportError):  # plain HTTP on an HTTPS port
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
        httpx.get(f"{base}/health", timeout=5)
    assert server.terminate() == 0
    log = server.log()
    assert f"listening on https://127.0.0.1:{server.port} (OpenAI API under /v1, /llm/v1 behind the proxy)" in log
    assert '"GET /v1/models' not in log and '"POST /tokenize' not in log  # no access log
    # --enable-log-requests --max-log-len 4: the prompt's first 4 characters and token ids
    line = next(line for line in log.splitlines() if f"received request {request_id}-0:" in line)
    tokenizer = AutoTokenizer.from_pretrained(str(server_artifact / "tokenizer"))
    ids = tokenizer(prompt).input_ids
    assert len(ids) == num_prompt and f"prompt_token_ids: {ids[:4]} (first 4 of {num_prompt})" in line
    assert f"prompt: {tokenizer.decode(ids[:4])[:4]!r}, params: " in line and "max_tokens=1" in line


def test_a_batch_file_and_chat_use_the_chat_template(server_artifact, tmp_path, capsys):
    requests = tmp_path / "in.jsonl"
    body = {"model": "ref-llama-12m", "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    requests.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                    "body": body}) + "\n")
    results = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(server_artifact), "--device", "cpu", "--input", str(requests), "--output", str(results),
              "--chat-template", TEMPLATE])
    assert exit_info.value.code == 0
    usage = json.loads(results.read_text())["response"]["body"]["usage"]
    assert usage["prompt_tokens"] == len(_reference_ids(server_artifact, MESSAGES))


@pytest.mark.parametrize(("args", "message"), [
    (["--chat", "-p", "x", "--chat-template", "missing.jinja"], "--chat-template missing.jinja: no such file, and not a Jinja template"),
    (["--chat", "-p", "x", "--chat-template", "{% for m in messages %}"], "--chat-template: not a valid Jinja template (line 1"),
    (["-p", "x", "--chat-template", "{{ x }}"], "--chat-template renders messages: it applies to the server"),
    (["--ssl-keyfile", "KEY"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-ca-certs", "CERT"], "--ssl-ca-certs configures HTTPS: give --ssl-keyfile and --ssl-certfile too"),
    (["--ssl-keyfile", "KEY", "--ssl-certfile", "CERT", "--ssl-cert-reqs", "2"], "--ssl-cert-reqs 2 asks clients"),
    (["--ssl-keyfile", "OTHER_KEY", "--ssl-certfile", "CERT"], "not a usable certificate and private key"),
    (["--ssl-keyfile", "KEY", "--ssl-certfile", "MISSING"], "not a usable certificate and private key"),
    (["--ssl-keyfile", "KEY", "--ssl-certfile", "CERT", "--ssl-ca-certs", "KEY"], "--ssl-ca-certs"),
    (["-p", "x", "--ssl-keyfile", "KEY"], "--ssl-keyfile applies to the server"),
    (["-p", "x", "--root-path", "/llm"], "--root-path applies to the server"),
    (["--max-log-len", "10"], "--max-log-len bounds the request log: give --enable-log-requests too"),
    (["--enable-log-requests", "--disable-log-requests"], "contradict each other"),
    (["-p", "x", "--enable-responses-store"], "--enable-responses-store applies to the server"),
])
def test_deployment_flags_are_checked_before_the_model_loads(args, message, server_artifact, tmp_path, capsys):
    key, cert = _self_signed(tmp_path)
    other_key, _ = _self_signed(tmp_path, "other")
    files = {"KEY": str(key), "CERT": str(cert), "OTHER_KEY": str(other_key), "MISSING": str(tmp_path / "none.pem")}
    server_mode = not {"-p", "--chat"} & set(args)
    argv = ["run", str(server_artifact), "--device", "cpu", "--disable-log-stats", *[files.get(a, a) for a in args],
            *(["--port", str(free_port())] if server_mode else [])]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code in (1, 2)
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert "loading the model" not in err
