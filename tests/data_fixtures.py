"""Data made inside tests: a JSONL corpus whose every token is unique, and its word-level tokenizer.

Document ``i`` of :func:`unique_jsonl` is the words ``w<i>_0 .. w<i>_<n-1>`` (``n`` from 1 to
``max_words``); the tokenizer of :func:`unique_tokenizer` gives every word its own id and has an
end-of-text token, so a token id names one position of one document: counting ids in batches
counts how often each document token was trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"


def unique_jsonl(path: Path, n_docs: int = 1000, max_words: int = 40, seed: int = 0) -> list[list[str]]:
    """Write ``n_docs`` documents (field ``text``) to ``path``; returns each document's words."""
    rng = np.random.default_rng(seed)
    docs = [[f"w{i}_{j}" for j in range(int(rng.integers(1, max_words + 1)))] for i in range(n_docs)]
    path.write_text("".join(json.dumps({"text": " ".join(d), "id": i}) + "\n" for i, d in enumerate(docs)))
    return docs


def unique_tokenizer(path: Path, docs: list[list[str]]) -> Path:
    """A word-level ``tokenizer.json`` at ``path`` with id 0 = [UNK], 1 = end-of-text, then every word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, EOS: 1}
    for d in docs:
        for w in d:
            vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path
