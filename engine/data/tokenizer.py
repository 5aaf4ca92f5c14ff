"""Tokenizers of the Hugging Face `tokenizers` library: load a user's tokenizer.json, or train a byte-level BPE.

A data set is tied to its tokenizer by the sha256 of the tokenizer.json bytes (its fingerprint), so
shards can never be read with a tokenizer other than the one that wrote them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.data.shards import token_dtype
from engine.errors import DataError

DEFAULT_EOS = "<|endoftext|>"
# Names used for the end-of-text token by common tokenizer families (GPT-2/NeoX, Llama/T5, Llama 3, Gemma).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
MIN_VOCAB = 257  # the 256 byte-level symbols plus EOS


@dataclass(frozen=True)
class Encoder:
    """A tokenizer, the exact tokenizer.json bytes it came from (its fingerprint), and its EOS token."""

    json_bytes: bytes
    eos_token: str
    eos_id: int

    @classmethod
    def from_file(cls, path: Path, eos_token: str | None = None) -> Encoder:
        """Load a user's tokenizer.json; a missing or malformed file is a DataError naming it."""
        if not path.is_file():
            raise DataError(
                f"tokenizer file {path} not found",
                "pass the path of a Hugging Face tokenizer.json, or use --train-tokenizer --vocab-size N",
            )
        data = path.read_bytes()
        tokenizer = parse_tokenizer(data, str(path))
        return cls(data, *find_eos(tokenizer, path, eos_token))

    @classmethod
    def trained(cls, texts: Iterable[str], vocab_size: int, eos_token: str = DEFAULT_EOS) -> Encoder:
        tokenizer = train_bpe(texts, vocab_size, eos_token)
        return cls(tokenizer.to_str(pretty=True).encode(), eos_token, tokenizer.token_to_id(eos_token))

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """Parsed from `json_bytes` (not kept from training) so a fresh and a resumed run encode identically.
        Special tokens inside document text are encoded as plain text: only Forge places EOS tokens."""
        tokenizer = parse_tokenizer(self.json_bytes, "tokenizer.json")
        tokenizer.encode_special_tokens = True
        return tokenizer

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.json_bytes).hexdigest()

    @cached_property
    def vocab_size(self) -> int:
        return vocab_size(self.tokenizer)

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Token arrays, one per text, each ending in EOS. `encode_batch_fast` spreads the batch over all
        cores (Rust threads) and skips computing character offsets, which we never use."""
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        eos, dtype = [self.eos_id], self.dtype
        return [np.array(e.ids + eos, dtype) for e in encodings]


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def parse_tokenizer(data: bytes, name: str) -> Tokenizer:
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # the Rust binding raises a bare Exception for every parse error
        raise DataError(
            f"{name} is not a valid tokenizer.json ({e})",
            "pass a tokenizer.json saved by the Hugging Face `tokenizers` library",
        ) from None


def adds_special_tokens(tokenizer: Tokenizer) -> bool:
    """Whether `encode` with add_special_tokens (its default, and what `tok(text)` in transformers does) adds
    tokens of the tokenizer's own around the text, e.g. a Llama BOS."""
    processor = tokenizer.post_processor
    return processor is not None and processor.num_special_tokens_to_add(False) > 0


def vocab_size(tokenizer: Tokenizer) -> int:
    """One more than the largest id, so added tokens with sparse ids still fit the embedding table."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def find_eos(tokenizer: Tokenizer, path: Path, eos_token: str | None = None) -> tuple[str, int]:
    """The token appended after every document: `eos_token` if given, else the one tokenizer_config.json
    beside the file names, else the first well-known end-of-text name present in the vocabulary."""
    if eos_token is not None:
        token_id = tokenizer.token_to_id(eos_token)
        if token_id is None:
            raise DataError(
                f"--eos-token {eos_token!r} is not in the vocabulary of {path}",
                "pass a token that the tokenizer knows, e.g. its end-of-text special token",
            )
        return eos_token, token_id
    for name in (*configured_eos(path), *EOS_CANDIDATES):
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return name, token_id
    raise DataError(
        f"cannot tell which token of {path} ends a document (none of {', '.join(EOS_CANDIDATES)})",
        "pass --eos-token TOKEN with the tokenizer's end-of-text token",
    )


def configured_eos(path: Path) -> list[str]:
    """`eos_token` from a Hugging Face tokenizer_config.json next to the tokenizer, if there is one."""
    config = path.with_name("tokenizer_config.json")
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return []
    if isinstance(eos, dict):
        eos = eos.get("content")
    return [eos] if isinstance(eos, str) else []


def train_bpe(texts: Iterable[str], vocab_size: int, eos_token: str = DEFAULT_EOS) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE (every byte is a symbol, so no text is ever unknown).

    Training is deterministic: the same texts give the same merges and the same tokenizer.json bytes,
    hence the same fingerprint on every machine.
    """
    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"--vocab-size {vocab_size} is too small",
            f"use at least {MIN_VOCAB} (256 byte symbols + the end-of-text token)",
        )
