"""`llmc run ARTIFACT --input requests.jsonl --output results.jsonl`: OpenAI's batch file format."""

from __future__ import annotations

import json

import pytest

from llmc.cli import main
from llmc.runtime.server.batch import BatchFileError, read_batch_file


def _line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run_file(artifact, tmp_path, rows, capsys) -> list[dict]:
    """`llmc run ARTIFACT --input requests.jsonl --output results.jsonl` on these lines: the result lines."""
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    _write_jsonl(requests, rows)
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(artifact), "--device", "cpu", "--input", str(requests), "--output", str(results)])
    assert exit_info.value.code == 0, capsys.readouterr().err
    return [json.loads(line) for line in results.read_text().splitlines()]


def test_batch_file_end_to_end(server_artifact, tmp_path, capsys, restore_logging):
    rows = [_line(f"story-{i}", "/v1/completions",
                  {"model": "gpt-4o-mini", "prompt": f"Story {i % 4}: once", "max_tokens": 5, "temperature": 0,
                   "ignore_eos": True}) for i in range(24)]
    rows.insert(3, _line("chat", "/v1/chat/completions",
                         {"model": "x", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}))
    rows.insert(7, _line("bad", "/v1/completions", {"prompt": "x", "temperature": -1}))
    rows.insert(9, _line("scored", "/v1/completions",
                         {"prompt": [0, 51, 1002, 694], "echo": True, "max_tokens": 0, "logprobs": 1}))
    lines = _run_file(server_artifact, tmp_path, rows, capsys)
    assert [r["custom_id"] for r in lines] == [r["custom_id"] for r in rows]  # input order
    by_id = {r["custom_id"]: r for r in lines}
    for row in lines:
        assert set(row) == {"id", "custom_id", "response", "error"} and row["error"] is None
        assert row["id"].startswith("batch_req_")  # OpenAI's batch output id
        assert set(row["response"]) == {"status_code", "request_id", "body"}
    story = by_id["story-0"]["response"]
    assert story["status_code"] == 200 and story["body"]["usage"]["completion_tokens"] == 5
    assert story["request_id"] == story["body"]["id"] and story["body"]["object"] == "text_completion"
    chat = by_id["chat"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    bad = by_id["bad"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temperature"
    scored = by_id["scored"]["response"]["body"]["choices"][0]["logprobs"]
    assert scored["token_logprobs"][0] is None and len(scored["token_logprobs"]) == 4
    # Greedy lines do not depend on what else was batched: identical prompts, identical text.
    texts = {by_id[f"story-{i}"]["response"]["body"]["choices"][0]["text"] for i in (0, 4, 8, 12, 16, 20)}
    assert len(texts) == 1
    assert "27 request(s), 1 failed" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "message"), [
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n{oops\n', ":2: .* not valid JSON"),
    # what the server answers 400 for is refused before anything runs (it could not be written back, or
    # would reach the tokenizer as text that is not Unicode)
    ('{"custom_id": "\\ud800", "method": "POST", "url": "/v1/completions", "body": {}}\n', ":1: custom_id: .*surrogate"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"bad_words": ["\\ud800"]}}\n',
     ":1: .*bad_words.0: .*surrogate"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": ' + "[" * 3000 + "]" * 3000 + "}\n",
     ":1: .*nested too deeply"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"seed": ' + "1" * 4301 + "}}\n",
     ":1: .* not valid JSON"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}\n', ":1: method"),
    ('[1, 2]\n', ":1: the line is JSON but not an object \\(a list\\)"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/pooling", "body": {}}\n', ":1: url"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"stream": true}}\n', "stream"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n' * 2, "used twice"),
])
def test_malformed_batch_files_name_the_line(tmp_path, content, message):
    path = tmp_path / "requests.jsonl"
    path.write_text(content)
    with pytest.raises(BatchFileError, match=message.replace("/", ".")):
        read_batch_file(path)


def test_cli_batch_needs_both_paths(server_artifact, tmp_path, capsys, restore_logging):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(server_artifact), "--input", str(tmp_path / "in.jsonl")])
    assert exit_info.value.code == 2 and "--output" in capsys.readouterr().err


def test_an_output_path_that_cannot_be_written_fails_before_anything_runs(tmp_path, capsys, restore_logging):
    requests = tmp_path / "requests.jsonl"
    _write_jsonl(requests, [_line("a", "/v1/completions", {"prompt": "x", "max_tokens": 1})])
    with pytest.raises(SystemExit) as exit_info:  # no artifact there: it fails before the model would load
        main(["run", str(tmp_path / "no-artifact"), "--device", "cpu", "--input", str(requests),
              "--output", str(tmp_path / "missing-folder" / "out.jsonl")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "cannot write the output there" in err and "Traceback" not in err


def test_every_line_of_a_large_batch_is_queued_not_refused(server_artifact, tmp_path, capsys, restore_logging):
    """More sequences than the server's seats plus --max-waiting: a server would answer 503 to a client that can
    retry; a batch file has no client, so every line waits for its turn."""
    rows = [_line(f"r{i}", "/v1/completions", {"prompt": "x", "n": 128, "max_tokens": 1, "temperature": 1.0})
            for i in range(9)]  # 1152 sequences > 64 seats + 1024 waiting
    lines = _run_file(server_artifact, tmp_path, rows, capsys)
    assert [r["response"]["status_code"] for r in lines] == [200] * 9
    assert all(len(r["response"]["body"]["choices"]) == 128 for r in lines)


def test_flags_of_another_mode_are_refused_not_ignored(server_artifact, tmp_path, capsys, restore_logging):
    for args, flag in [(["--input", "in.jsonl", "--output", "out.jsonl", "--max-waiting", "5"], "--max-waiting"),
                       (["--input", "in.jsonl", "--output", "out.jsonl", "--temperature", "0"], "--temperature"),
                       (["--prompt", "x", "--port", "9000"], "--port"), (["--temperature", "0"], "--temperature")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["run", str(server_artifact), "--device", "cpu", *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"{flag} applies to" in err, err


def test_tool_calling_flags_apply_to_batch_files(server_artifact, tmp_path, capsys, restore_logging):
    """A batch line is answered by the server's handlers: tools with tool_choice "auto" (the default) need
    --enable-auto-tool-choice and --tool-call-parser there too, and the 400 without them says so."""
    forced = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "f"}}], "guided_choice": [forced]}
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    _write_jsonl(requests, [_line("auto", "/v1/chat/completions", body)])
    (line,) = _run_file(server_artifact, tmp_path, [_line("auto", "/v1/chat/completions", body)], capsys)
    error = line["response"]["body"]["error"]
    assert line["response"]["status_code"] == 400 and "--enable-auto-tool-choice" in error["message"]
    assert "server" not in error["message"].split(";")[-1].replace("(the server, or a batch file)", "")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(server_artifact), "--device", "cpu", "--input", str(requests), "--output", str(results),
              "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    (line,) = [json.loads(text) for text in results.read_text().splitlines()]
    choice = line["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == \
        [("f", '{"x": 1}')]


def test_line_separators_inside_json_strings_do_not_split_a_line(tmp_path):
    """JSON strings may hold U+2028, U+2029 and U+0085 raw (json.dumps(ensure_ascii=False) writes them so):
    only "\\n" ends a line, and the line numbers of later lines stay right."""
    path = tmp_path / "requests.jsonl"
    rows = [_line(f"p{i}", "/v1/completions", {"prompt": f"a{sep}b", "max_tokens": 1})
            for i, sep in enumerate(["\u2028", "\u2029", "\x85"])]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    assert [r.body["prompt"] for r in read_batch_file(path)] == ["a\u2028b", "a\u2029b", "a\x85b"]
    path.write_text(json.dumps(rows[0], ensure_ascii=False) + "\n{oops\n", encoding="utf-8")
    with pytest.raises(BatchFileError, match=":2: .*not valid JSON"):
        read_batch_file(path)


def test_a_file_that_is_not_utf8_is_one_error_naming_the_line(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_bytes(json.dumps(_line("a", "/v1/completions", {"prompt": "x"})).encode() + b"\n"
                     + b'{"custom_id": "caf\xe9"}\n')
    with pytest.raises(BatchFileError, match=":2: not UTF-8 text \\(byte 0xe9\\)"):
        read_batch_file(path)


def test_a_failed_run_leaves_the_output_as_it_was_and_no_partial_file(tmp_path, capsys, restore_logging):
    """The engine cannot start: the old output is untouched and no empty .partial file is left behind."""
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    _write_jsonl(requests, [_line("a", "/v1/completions", {"prompt": "x", "max_tokens": 1})])
    results.write_text("old\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(tmp_path / "no-artifact"), "--device", "cpu", "--input", str(requests),
              "--output", str(results)])
    assert exit_info.value.code != 0
    assert results.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl",
                                                                                              "results.jsonl"]


def test_results_finished_before_an_interrupt_are_kept_in_order(tmp_path, monkeypatch, restore_logging):
    """Ctrl-C (or a crash) after some requests finished: those results, in input order, stay in the .partial
    file (and the log says where); a write that fails removes the .partial file and is one error line."""
    import llmc.runtime.server.batch as batch

    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    _write_jsonl(requests, [_line(f"r{i}", "/v1/completions", {"prompt": "x"}) for i in range(4)])

    async def fake_run_all(engine_factory, reqs, served_model_name, show_progress, writer, *tool_options):
        for index in (1, 0, 3):  # out of order: 0 and 1 can be written, 3 waits for 2
            writer.add(index, {"custom_id": reqs[index].custom_id, "response": {"status_code": 200}})
        raise KeyboardInterrupt

    monkeypatch.setattr(batch, "_run_all", fake_run_all)
    with pytest.raises(KeyboardInterrupt):
        batch.run_batch(None, requests, results, ["m"], show_progress=False)
    partial = tmp_path / "results.jsonl.partial"
    assert not results.exists()
    assert [json.loads(line)["custom_id"] for line in partial.read_text().split("\n") if line] == ["r0", "r1"]

    class CutWrite:  # a second Ctrl-C arrives inside a write: half of the line reached the file
        def __init__(self, file):
            self.file = file

        def write(self, data):
            self.file.write(data[:len(data) // 2])
            self.file.flush()
            raise KeyboardInterrupt

    async def cut_mid_line(engine_factory, reqs, served_model_name, show_progress, writer, *tool_options):
        for index in (0, 1):
            writer.add(index, {"custom_id": reqs[index].custom_id, "response": {"status_code": 200}})
        writer.output = CutWrite(writer.output)
        writer.add(2, {"custom_id": reqs[2].custom_id, "response": {"status_code": 200}})

    monkeypatch.setattr(batch, "_run_all", cut_mid_line)
    with pytest.raises(KeyboardInterrupt):
        batch.run_batch(None, requests, results, ["m"], show_progress=False)
    text = partial.read_text()
    assert text.endswith("\n") and [json.loads(line)["custom_id"] for line in text.split("\n") if line] == ["r0", "r1"]
    partial.unlink()

    class FullDisk:
        def write(self, text):
            raise OSError(28, "No space left on device")

    async def failing_write(engine_factory, reqs, served_model_name, show_progress, writer, *tool_options):
        writer.output = FullDisk()
        writer.add(0, {"custom_id": "r0", "response": {"status_code": 200}})

    monkeypatch.setattr(batch, "_run_all", failing_write)
    with pytest.raises(BatchFileError, match="writing the results failed \\(No space left on device\\)"):
        batch.run_batch(None, requests, results, ["m"], show_progress=False)
    assert not partial.exists() and not results.exists()
