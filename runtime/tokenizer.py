"""The artifact's tokenizer (HF files copied at build time), loaded offline."""

from __future__ import annotations

from pathlib import Path

from llmc.errors import ArtifactError


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not path.is_dir():
        raise ArtifactError(f"{path}: the artifact has no tokenizer directory; rebuild it")
    _verify(path)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ArtifactError(f"{path}: the tokenizer cannot be loaded ({e}); rebuild the artifact") from None


def _verify(path: Path) -> None:
    """The tokenizer files of an artifact must match their sha256 in its manifest before they are parsed."""
    from llmc.runtime import artifact as art

    root = path.parent
    if path.name == art.TOKENIZER_DIR and (root / art.MANIFEST_NAME).exists():
        manifest = art.read_manifest(root)
        art.verify_for_load(root, manifest, art.tokenizer_files(manifest))


def apply_chat_template(tokenizer, messages: list[dict]) -> list[int]:
    """Render messages with the artifact's chat template, then tokenize the text without adding
    special tokens again (the template places them), as vLLM does."""
    if not getattr(tokenizer, "chat_template", None):
        from llmc.errors import RequestError

        raise RequestError("this model has no chat template; send a plain prompt instead of messages")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
