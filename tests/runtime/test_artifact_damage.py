"""Damaged artifacts (issue 20): each is refused by `llmc run --prompt` and `llmc inspect --verify` with
one `llmc: error:` line that names what is wrong, a non-zero exit and no traceback; the weights a load
reads are verified against the manifest's sha256 (then stamped, so later starts skip the hash).

A manifest damage is "sealed" when the test recomputes manifest_sha256 after it, as a buggy writer or
a hand edit would: then the schema and consistency checks are what refuse it, not the digest.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError
from llmc.runtime import integrity
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest, read_safetensors_header
from llmc.runtime.llm import LLM

WEIGHTS = "rank-00/weights.safetensors"


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("damage") / "tiny"
    build(recipe_from_dict({"model": str(tiny_llama), "output": str(out)}), show_progress=False)
    return out


@pytest.fixture
def artifact(built, tmp_path):
    copy = tmp_path / "artifact"
    shutil.copytree(built, copy)
    return copy


def _edit(artifact, edit, seal=True):
    path = artifact / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    if seal:  # a digest an independent reader computes: sha256 of the sorted, compact JSON without the key
        rest = {k: v for k, v in data.items() if k != "manifest_sha256"}
        canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        data["manifest_sha256"] = hashlib.sha256(canonical.encode()).hexdigest()
    path.write_text(json.dumps(data, indent=2))


def _raw(text):
    return lambda a: (a / "manifest.json").write_text(text)


def _write_weights(transform):
    def damage(a):
        path = a / WEIGHTS
        path.write_bytes(transform(path.read_bytes()))
    return damage


def _flip(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 4096]) + data[middle + 4096:]


def _fifo(a):
    (a / WEIGHTS).unlink()
    os.mkfifo(a / WEIGHTS)


def _outside_link(a):
    outside = a.parent / "elsewhere.safetensors"
    shutil.move(a / WEIGHTS, outside)
    (a / WEIGHTS).symlink_to(outside)


def _add_file(rel):
    return lambda a: _edit(a, lambda d: d["files"].__setitem__(rel, {"sha256": "0" * 64, "size": 5}))


def _set(section, key, value, seal=True):
    return lambda a: _edit(a, lambda d: d[section].__setitem__(key, value), seal)


# (id, damage, what the run error says, what the verify error says (None: the same))
DAMAGES = [
    ("manifest-is-a-list", _raw("[]"), "expected a JSON object, got a list", None),
    ("manifest-not-json", _raw('{"format_version": "1.2",'), "is not valid JSON", None),
    ("manifest-nan", lambda a: _raw((a / "manifest.json").read_text().replace('"cpu_kv_cache_gib": 1.0', '"cpu_kv_cache_gib": NaN'))(a),
     "NaN is not a JSON number", None),
    ("manifest-fifo", lambda a: ((a / "manifest.json").unlink(), os.mkfifo(a / "manifest.json")),
     "manifest.json is not a regular file (a FIFO)", None),
    ("missing-model", lambda a: _edit(a, lambda d: d.pop("model")), "model: required key is missing", None),
    ("negative-layers", _set("model", "num_layers", -2), "model.num_layers: -2 is too small", None),
    ("hidden-size-string", _set("model", "hidden_size", "64"), "model.hidden_size: expected an integer", None),
    ("unknown-key", _set("model", "num_shared_experts", 8), "model.num_shared_experts: unknown key", None),
    ("kv-disagrees", _set("kv", "num_layers", 7), "kv does not match the model", None),
    ("format-version-int", lambda a: _edit(a, lambda d: d.__setitem__("format_version", 1)),
     "format_version must be a string", None),
    ("format-version-1.99", lambda a: _edit(a, lambda d: d.__setitem__("format_version", "1.99")),
     "format_version '1.99' is not supported", None),
    ("digest-missing", lambda a: _edit(a, lambda d: d.pop("manifest_sha256"), seal=False), "manifest_sha256 is missing", None),
    ("edited-unsealed", _set("runtime", "max_num_seqs", 3, seal=False), "does not match its manifest_sha256", None),
    ("quant-modules-emptied-unsealed", _set("quant", "modules", {}, seal=False), "does not match its manifest_sha256", None),
    ("quant-modules-emptied", _set("quant", "modules", {}), "quant.modules has no format for layers.0.attn.qkv", None),
    ("quant-module-unknown-format", lambda a: _edit(a, lambda d: d["quant"]["modules"]["layers.1.mlp.down"].update(format="w2a2")),
     "quant.modules['layers.1.mlp.down'] is not a format", "quant.modules['layers.1.mlp.down'] is not a format"),
    ("files-dotdot", _add_file("../../../../etc/hostname"), "'../../../../etc/hostname' is not a relative path inside", None),
    ("files-absolute", _add_file("/etc/hostname"), "'/etc/hostname' is not a relative path inside", None),
    ("files-size-string", lambda a: _edit(a, lambda d: d["files"][WEIGHTS].update(size="big")),
     f"files entry '{WEIGHTS}' needs a sha256", None),
    ("weights-fifo", _fifo, f"{WEIGHTS} is not a regular file (a FIFO)", f"{WEIGHTS}: is not a regular file (a FIFO)"),
    ("weights-directory", lambda a: ((a / WEIGHTS).unlink(), (a / WEIGHTS).mkdir()),
     f"{WEIGHTS} is not a regular file (a directory)", f"{WEIGHTS}: is not a regular file (a directory)"),
    ("weights-link-outside", _outside_link, f"{WEIGHTS} is a link to a file outside the artifact",
     f"{WEIGHTS}: is a link to a file outside the artifact"),
    ("weights-missing", lambda a: (a / WEIGHTS).unlink(), f"{WEIGHTS} is missing", f"{WEIGHTS}: missing"),
    ("weights-zero-bytes", _write_weights(lambda d: b""), "is 0 bytes but the manifest says", f"{WEIGHTS}: size 0 bytes"),
    ("weights-truncated", _write_weights(lambda d: d[:-100]), "(truncated or replaced)", f"{WEIGHTS}: size"),
    ("weights-flipped", _write_weights(_flip), f"{WEIGHTS} does not match its sha256", f"{WEIGHTS}: sha256 mismatch"),
    ("header-length-2**62", _write_weights(lambda d: (2**62).to_bytes(8, "little") + d[8:]),
     f"{WEIGHTS} does not match its sha256", f"{WEIGHTS}: sha256 mismatch"),
    ("tokenizer-garbage", lambda a: (a / "tokenizer" / "tokenizer.json").write_bytes(b"\xff" * 64),
     "tokenizer/tokenizer.json is", "tokenizer/tokenizer.json: size"),
    ("tokenizer-flipped", lambda a: (a / "tokenizer" / "tokenizer.json").write_bytes(_flip((a / "tokenizer" / "tokenizer.json").read_bytes())),
     "tokenizer/tokenizer.json does not match its sha256", "tokenizer/tokenizer.json: sha256 mismatch"),
]
HANGS_IF_OPENED = {"weights-fifo", "manifest-fifo"}  # run in a subprocess with a timeout


def _llmc_subprocess(*args):
    result = subprocess.run([sys.executable, "-m", "llmc.cli", *map(str, args)], capture_output=True, text=True,
                            timeout=120)
    return result.returncode, result.stderr


def _assert_one_line_error(code, stderr, expected):
    assert code not in (0, None), stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("llmc: error: "), stderr
    assert stderr.rstrip().splitlines()[-1] == errors[0]  # the message is one line, the last one
    assert expected in errors[0], errors[0]


@pytest.mark.parametrize("command", ["run", "verify"])
@pytest.mark.parametrize("name, damage, run_message, verify_message", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_damaged_artifact_is_one_line_error(artifact, llmc_cli, command, name, damage, run_message, verify_message):
    damage(artifact)
    args = (["run", artifact, "--prompt", "hi", "--max-tokens", "2", "--device", "cpu"] if command == "run"
            else ["inspect", artifact, "--verify"])
    code, stderr = (_llmc_subprocess(*args) if name in HANGS_IF_OPENED else llmc_cli(*args))
    expected = run_message if command == "run" else (verify_message or run_message)
    _assert_one_line_error(code, stderr, expected)


def test_the_intact_artifact_passes_both(artifact, llmc_cli):
    code, _ = llmc_cli("inspect", artifact, "--verify")
    assert code == 0
    code, _ = llmc_cli("run", artifact, "--prompt", "hi", "--max-tokens", "2", "--device", "cpu")
    assert code == 0


def test_the_digest_is_sha256_of_the_canonical_manifest(built):
    data = json.loads((built / "manifest.json").read_text())
    assert data["format_version"] == FORMAT_VERSION and tuple(map(int, FORMAT_VERSION.split("."))) >= (1, 2)  # digested from 1.2 on
    rest = {k: v for k, v in data.items() if k != "manifest_sha256"}
    expected = hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert data["manifest_sha256"] == expected


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_older_manifests_without_a_digest_still_load(artifact, version):
    _edit(artifact, lambda d: (d.pop("manifest_sha256"), d.__setitem__("format_version", version)), seal=False)
    assert read_manifest(artifact).format_version == version
    _edit(artifact, lambda d: d["runtime"].__setitem__("max_num_seqs", 3), seal=True)  # one that carries a digest is checked
    _edit(artifact, lambda d: d["runtime"].__setitem__("max_num_seqs", 4), seal=False)
    with pytest.raises(ArtifactError, match="does not match its manifest_sha256"):
        read_manifest(artifact)


def test_huge_header_length_is_refused_without_allocating(artifact):
    path = artifact / WEIGHTS
    path.write_bytes((2**62).to_bytes(8, "little") + path.read_bytes()[8:])
    with pytest.raises(ArtifactError, match="not a safetensors file"):
        read_safetensors_header(path)
    path.write_bytes(b"")
    with pytest.raises(ArtifactError, match="not a safetensors file"):
        read_safetensors_header(path)


def test_the_first_load_hashes_and_stamps_later_loads_trust_the_stamp(artifact, monkeypatch):
    monkeypatch.setattr(integrity, "STAMP_MIN_AGE_NS", 0)
    hashed = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda path, *a: hashed.append(path.name) or real(path, *a))
    manifest = read_manifest(artifact)
    integrity.verify_for_load(artifact, manifest.files, [WEIGHTS])
    assert hashed == ["weights.safetensors"]
    stamp = json.loads((artifact / integrity.STAMP_NAME).read_text())["files"][WEIGHTS]
    assert stamp["sha256"] == manifest.files[WEIGHTS]["sha256"] and stamp["ino"] == (artifact / WEIGHTS).stat().st_ino
    integrity.verify_for_load(artifact, manifest.files, [WEIGHTS])
    assert hashed == ["weights.safetensors"]  # the stamp matched: no second hash


def test_changed_bytes_are_refused_even_after_a_stamp_and_a_restored_mtime(artifact, monkeypatch):
    monkeypatch.setattr(integrity, "STAMP_MIN_AGE_NS", 0)
    with LLM(artifact, device="cpu") as llm:  # verifies, stamps
        assert llm.generate(["hi"])  # it serves
    assert (artifact / integrity.STAMP_NAME).is_file()
    path = artifact / WEIGHTS
    before = path.stat()
    with open(path, "r+b") as f:  # 4 KiB flipped in place: same size, same inode
        f.seek(before.st_size // 2)
        chunk = f.read(4096)
        f.seek(before.st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back; the ctime cannot be
    with pytest.raises(ArtifactError, match=f"{WEIGHTS} does not match its sha256"):
        LLM(artifact, device="cpu")


def test_a_copied_artifact_is_hashed_again(artifact, tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "STAMP_MIN_AGE_NS", 0)
    manifest = read_manifest(artifact)
    integrity.verify_for_load(artifact, manifest.files, [WEIGHTS])
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)  # the stamp travels, but the inode and ctime do not match it
    hashed = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda path, *a: hashed.append(path) or real(path, *a))
    integrity.verify_for_load(copy, manifest.files, [WEIGHTS])
    assert hashed == [copy / WEIGHTS]


def test_a_read_only_artifact_loads_without_a_stamp(artifact, monkeypatch):
    monkeypatch.setattr(integrity, "STAMP_MIN_AGE_NS", 0)
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    os.chmod(artifact, 0o555)
    try:
        integrity.verify_for_load(artifact, read_manifest(artifact).files, [WEIGHTS])
        assert not (artifact / integrity.STAMP_NAME).exists()
    finally:
        os.chmod(artifact, 0o755)
