"""Tokenizers: byte-level (no download) and HuggingFace ``tokenizer.json``.

Both expose the same small interface (:class:`Tokenizer`): ``name``,
``vocab_size``, ``encode(str) -> list[int]``, ``decode(list[int]) -> str`` and
``encode_docs(docs, sep) -> np.ndarray`` (the fast bulk path used to tokenise a
corpus). ``name`` identifies the tokenizer *and its contents* (the HF one
carries a hash of the file), so it can key the token cache.

The HF tokenizer needs the optional ``tokenizers`` package
(``pip install tokenizers``); it is imported only when such a file is loaded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import numpy as np

from axo4d.config.errors import DataError


class Tokenizer:
    """Interface shared by the tokenizers."""

    name: str
    vocab_size: int
    eos_id: int | None = None
    """The end-of-text token separating documents, if the tokenizer has one."""
    bos_id: int | None = None
    """The beginning-of-text token a prompt starts with, if the tokenizer adds one."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens``: as the tokenizer frames a prompt, e.g. BOS)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids ``ids``."""
        raise NotImplementedError

    def encode_docs(self, docs: Sequence[str], sep: str = "") -> np.ndarray:
        """Tokenise ``sep.join(docs)``-like stream of documents as one int64 array.

        Subclasses may tokenise documents independently (then ``sep`` is appended
        to every document but the last before encoding).
        """
        text = sep.join(docs)
        return np.asarray(self.encode(text), dtype=np.int64)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """The UTF-8 bytes of the text: vocabulary 256, ids are byte values."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        try:
            raw = bytes(int(i) for i in ids)
        except ValueError:
            bad = next(int(i) for i in ids if not 0 <= int(i) < 256)
            raise DataError(f"byte tokenizer cannot decode token id {bad}: valid ids are 0..255") from None
        return raw.decode("utf-8", errors="replace")

    def encode_docs(self, docs: Sequence[str], sep: str = "") -> np.ndarray:
        # No Python loop over bytes: one encode, one frombuffer.
        return np.frombuffer(sep.join(docs).encode("utf-8"), dtype=np.uint8)


class HFTokenizer(Tokenizer):
    """A HuggingFace ``tokenizers`` tokenizer loaded from a ``tokenizer.json``."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError:
            raise DataError(
                f"tokenizer {str(path)!r} needs the 'tokenizers' package: pip install tokenizers "
                f"(or use tokenizer 'byte')"
            ) from None
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read tokenizer file {str(path)!r}: {e.strerror}") from None
        try:
            self._tok = _HFTok.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust side raises plain Exception
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"tokenizer file {str(path)!r} is not a valid HuggingFace tokenizer.json: {msg}") from None
        self.path = path
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.name = f"hf:{path.name}:{hashlib.sha256(raw).hexdigest()[:16]}"
        self.eos_id, self.bos_id = self._special("eos"), self._special("bos")

    def _special(self, kind: str) -> int | None:
        """The ``kind`` ('eos', 'bos') token: from tokenizer_config.json or config.json beside the
        file, else a conventional name found in the vocabulary."""
        import json

        for fname, key in (("tokenizer_config.json", f"{kind}_token"), ("config.json", f"{kind}_token_id")):
            f = self.path.parent / fname
            try:
                val = json.loads(f.read_text()).get(key) if f.is_file() else None
            except (OSError, ValueError):
                val = None
            if isinstance(val, dict):
                val = val.get("content")
            if isinstance(val, list):
                val = val[0] if val else None
            if isinstance(val, str):
                val = self._tok.token_to_id(val)
            if isinstance(val, int) and 0 <= val < self.vocab_size:
                return val
        names = {
            "eos": ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"),
            "bos": ("<|begin_of_text|>", "<s>", "<bos>"),
        }[kind]
        return next((i for i in map(self._tok.token_to_id, names) if i is not None), None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_docs(self, docs: Sequence[str], sep: str = "") -> np.ndarray:
        if not docs:
            return np.zeros(0, dtype=np.int64)
        texts = [d + sep for d in docs[:-1]] + [docs[-1]]
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        parts = [np.asarray(e.ids, dtype=np.int64) for e in encs]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def load_tokenizer(spec: str) -> Tokenizer:
    """``'byte'``, or the path of a ``tokenizer.json`` (or of a directory holding one)."""
    spec = str(spec).strip()
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(
            f"tokenizer {spec!r} is neither 'byte' nor an existing tokenizer.json file "
            f"(valid: 'byte' or the path of a HuggingFace tokenizer.json)"
        )
    return HFTokenizer(path)
