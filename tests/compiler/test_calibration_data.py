"""Calibration data files: what each kind of file calibrates on."""

import json

import pytest

from llmc.compiler.calibration import read_text
from llmc.errors import RecipeError

TEXTS = ["The first calibration text.", "A second one, with a comma."]


def test_a_json_array_of_text_records_calibrates_on_the_texts(tmp_path):
    """A .json dataset (what `datasets.load_dataset("json")` and llm-compressor read) is its "text"
    fields, as a .jsonl file is; it was read as raw JSON text, brackets, keys and quotes included."""
    path = tmp_path / "calib.json"
    path.write_text(json.dumps([{"text": t, "id": i} for i, t in enumerate(TEXTS)], indent=2))
    assert read_text(path) == "\n\n".join(TEXTS)


def test_a_json_file_of_json_lines_calibrates_on_the_texts(tmp_path):
    path = tmp_path / "calib.json"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert read_text(path) == "\n\n".join(TEXTS)


def test_a_json_array_without_text_fields_is_refused(tmp_path):
    path = tmp_path / "calib.json"
    path.write_text(json.dumps([{"text": "a"}, {"messages": []}]))
    with pytest.raises(RecipeError, match=r'calib.json item 1 must be an object with a "text" string'):
        read_text(path)


@pytest.mark.parametrize("name", ["calib.csv", "calib.parquet", "calib.jsonl.gz"])
def test_other_dataset_files_are_refused_not_read_as_text(tmp_path, name):
    path = tmp_path / name
    path.write_text("text\n\"hello, world\"\n")
    with pytest.raises(RecipeError, match=r"quantization.calibration.data: .* files are not read; give a .txt"):
        read_text(path)


def test_text_and_jsonl_are_unchanged(tmp_path):
    (tmp_path / "a.txt").write_text("plain [text] {\"text\": 1}")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert read_text(tmp_path / "a.txt") == "plain [text] {\"text\": 1}"
    assert read_text(tmp_path / "a.jsonl") == "\n\n".join(TEXTS)
