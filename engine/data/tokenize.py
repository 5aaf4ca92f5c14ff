"""`forge tokenize`: text / JSONL / Parquet files or a Hugging Face dataset → `shard-NNNNN.npy` token shards
+ `manifest.json`.

Documents are encoded in batches of a few MB with `Tokenizer.encode_batch_fast`, which spreads a batch over
all cores in Rust threads (measured as fast as a process pool on 2 cores, without pickling token arrays
between processes; see benchmarks/results/tokenize.md), and every document is followed by the EOS token.

Interruption and reruns. Shards are written atomically and, after each one, `tokenize-state.json` records
the shards so far and the input position they reach. A rerun with the same inputs (paths, sizes,
modification times; a dataset's name, configuration, split, revision and, when not streamed, fingerprint)
and settings *resumes*: it keeps the finished shards and continues from that position,
and the result is byte-identical to an uninterrupted run. A rerun with anything changed restarts cleanly.
A finished directory (with its manifest) is left alone by a rerun with the same inputs and refused for
different ones. A user error (DataError) removes everything this run wrote.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engine.config.registry import SOURCE_KINDS, SourceKind, resolved
from engine.data import DEFAULT_SHARD_TOKENS
from engine.data.parts import Part, PartSource, part_record
from engine.data.shards import (
    MANIFEST,
    SHARD_GLOB,
    TOKENIZER_FILE,
    Manifest,
    ShardInfo,
    ShardWriter,
    open_shard,
    read_manifest,
    write_manifest,
)
from engine.data.sources import Document, FileSource
from engine.data.tokenizer import DEFAULT_EOS, Encoder, check_vocab_size
from engine.durable import TMP_SUFFIX, atomic_write, check_writable
from engine.errors import DataError
from engine.safe_paths import plain_name

BATCH_CHARS = 4_000_000  # text per encode call: enough documents to keep every core busy
STATE = "tokenize-state.json"


class Source(Protocol):
    """Where documents come from: files (`engine.data.sources.FileSource`) or a Hugging Face dataset
    (`engine.data.hub.HubSource`). Documents are addressed by (file, record) so a rerun can skip exactly
    the documents already tokenized; progress is counted in `unit`s (bytes of files, rows of a dataset)."""

    unit: str
    total: int | None  # None: a stream of unknown length

    def check(self, text_field: str) -> None: ...
    def identity(self) -> dict: ...
    def describe(self) -> list[str]: ...
    def documents(self, text_field: str, start: tuple[int, int] = (0, 0)) -> Iterator[Document]: ...
    def position(self, doc: Document) -> int: ...
    def start_at(self, position: int) -> tuple[int, int]: ...  # a start before every document past `position`


@dataclass(frozen=True)
class Progress:
    """Where a tokenize run stands; handed to the progress callback after every batch and shard."""

    phase: str  # "training tokenizer" or "tokenizing"
    done: int  # input read, in `unit`s
    total: int | None  # None when a streamed dataset does not say how long it is
    unit: str  # "bytes" or "rows"
    tokens: int
    documents: int
    shards: int


ProgressFn = Callable[[Progress], None]


@dataclass(frozen=True)
class TokenizeReport:
    directory: Path
    manifest: Manifest
    reused_shards: int  # finished shards kept from an interrupted earlier run
    already_complete: bool  # the directory already held this exact output; nothing was done
    seconds: float


@dataclass
class RunState:
    """The resume record: what the run is (its key), its tokenizer, the shards written, where input resumes."""

    key: str
    tokenizer_sha256: str = ""
    dtype: str = ""
    shards: list[ShardInfo] = field(default_factory=list)
    resume: tuple[int, int, int] = (0, 0, 0)  # file index, record index, tokens of that record already written

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "tokenizer_sha256": self.tokenizer_sha256,
            "dtype": self.dtype,
            "shards": [vars(s) for s in self.shards],
            "resume": list(self.resume),
        }


def tokenize_files(inputs: Sequence[Path], out_dir: Path, **options: Any) -> TokenizeReport:
    """`tokenize` over files and directories of them (see `engine.data.sources`)."""
    return tokenize(FileSource(inputs), out_dir, **options)


@dataclass(frozen=True)
class DatasetOptions:
    """The command-line options that shape a dataset input (configuration, split, streaming, revision), handed to
    the opener of the kind the input names; `given` spells them as flags, which a kind's registration lists."""

    config: str | None = None
    split: str | None = None
    streaming: bool = False
    revision: str | None = None

    def given(self) -> list[str]:
        flags = {"--hf-config": self.config, "--split": self.split, "--streaming": self.streaming}
        return [flag for flag, value in {**flags, "--revision": self.revision}.items() if value]


def kind_of(text: str) -> SourceKind | None:
    """The registered kind `text` names as an input by its prefix (`hf:NAME`; a URL's `scheme://` is fsspec's), if
    any: one of `SOURCE_KINDS.inputs()`, the kinds that open documents (engine/data/kinds.py)."""
    scheme, sep, rest = text.partition(":")
    if not sep or rest.startswith("//"):
        return None
    return next((kind for kind in SOURCE_KINDS.inputs() if kind.name == scheme), None)


def flags_refusal(given: list[str]) -> DataError:
    """`given` options apply to no input named: say which kinds of input they apply to (from the registry)."""
    verb, them = ("applies", "it") if len(given) == 1 else ("apply", "them")
    takers = [kind for kind in SOURCE_KINDS.inputs() if set(given) & set(kind.flags)]
    kinds = " or ".join(k.describe for k in takers)
    examples = ", ".join(k.example for k in takers)
    return DataError(
        f"{', '.join(given)} {verb} only to {kinds}", f"name the dataset (e.g. {examples}), or drop {them}"
    )


def open_source(
    inputs: Sequence[str],
    hf_config: str | None = None,
    split: str | None = None,
    streaming: bool = False,
    revision: str | None = None,
) -> Source:
    """The source the command line names: files, directories and URLs, or one input of a registered kind
    (`hf:NAME`), whose options (configuration, split, streaming, revision: the flags its registration lists)
    apply to it alone; a flag the named kind does not take is refused naming the kinds that do. A dataset is
    opened (and, when not streamed, downloaded) here, before any progress display starts."""
    options = DatasetOptions(hf_config, split, streaming, revision)
    claimed = [(text, kind) for text in inputs if (kind := kind_of(text)) is not None]
    if not claimed:
        if options.given():
            raise flags_refusal(options.given())
        return FileSource(list(inputs))
    if len(inputs) > 1:
        raise DataError(
            f"{claimed[0][0]} must be the only input (got {len(inputs)})",
            "tokenize the dataset and the files into separate directories",
        )
    text, kind = claimed[0]
    foreign = [flag for flag in options.given() if flag not in kind.flags]
    if foreign:
        raise flags_refusal(foreign)
    return resolved(kind.documents)(text[len(kind.name) + 1 :], options)


def check_request(
    out_dir: Path,
    tokenizer: Path | None = None,
    train_vocab_size: int | None = None,
    eos_token: str | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    part: Part | None = None,
) -> None:
    """The checks of `tokenize` that need no input, for a caller to run before opening a source that may
    download for hours: the options, the tokenizer file and its EOS token, and the output directory."""
    check_options(tokenizer, train_vocab_size, shard_tokens, part)
    if tokenizer is not None:
        Encoder.from_file(tokenizer, eos_token)
    check_out_dir(out_dir)


def tokenize(
    source: Source,
    out_dir: Path,
    *,
    tokenizer: Path | None = None,
    train_vocab_size: int | None = None,
    eos_token: str | None = None,
    text_field: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: ProgressFn | None = None,
    part: Part | None = None,
) -> TokenizeReport:
    """Tokenize `source` into `out_dir` with `tokenizer` (a tokenizer.json) or a byte-level BPE of
    `train_vocab_size` trained on the source; with `part`, only that part of it (`engine.data.parts`).
    Options, inputs, the text field (of each file's first record, of a dataset's columns) and the tokenizer
    are checked before anything is written; a bad record found later removes the output."""
    started = time.perf_counter()
    check_options(tokenizer, train_vocab_size, shard_tokens, part)
    source.check(text_field)
    encoder = Encoder.from_file(tokenizer, eos_token) if tokenizer is not None else None
    record = {}
    if part is not None:
        record["part"] = part_record(part, run_key(source, text_field, shard_tokens, encoder, None, eos_token))
        source = PartSource(source, part)
    key = run_key(source, text_field, shard_tokens, encoder, train_vocab_size, eos_token)
    finished = finished_output(out_dir, key)
    if finished is not None:
        return TokenizeReport(out_dir, finished, len(finished.shards), True, time.perf_counter() - started)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        manifest, reused = Run(out_dir, source, text_field, shard_tokens, progress or (lambda p: None)).execute(
            key, encoder, train_vocab_size, eos_token or DEFAULT_EOS, record
        )
    except DataError:
        remove_outputs(out_dir, remove_dir=created)
        raise
    return TokenizeReport(out_dir, manifest, reused, False, time.perf_counter() - started)


def check_options(
    tokenizer: Path | None, train_vocab_size: int | None, shard_tokens: int, part: Part | None = None
) -> None:
    if (tokenizer is None) == (train_vocab_size is None):
        both = tokenizer is not None
        raise DataError(
            "--tokenizer and --train-tokenizer were both given" if both else "no tokenizer chosen",
            "pass either --tokenizer PATH/tokenizer.json or --train-tokenizer --vocab-size N",
        )
    if train_vocab_size is not None:
        check_vocab_size(train_vocab_size)
    if shard_tokens <= 0:
        raise DataError(f"--shard-tokens must be positive, got {shard_tokens}", "e.g. --shard-tokens 50000000")
    if part is not None and train_vocab_size is not None:
        raise DataError(
            "--train-tokenizer cannot be used with --num-shards: each part would train its own tokenizer",
            "train one first (forge tokenize SAMPLE --train-tokenizer --vocab-size N --out DIR), then pass "
            "--tokenizer DIR/tokenizer.json to every part",
        )


def run_key(
    source: Source,
    text_field: str,
    shard_tokens: int,
    encoder: Encoder | None,
    train_vocab_size: int | None,
    eos_token: str | None,
) -> str:
    """A digest of everything that determines the output bytes: equal keys mean identical shards."""
    if encoder is not None:
        tokenizer = {"sha256": encoder.sha256, "eos": encoder.eos_id}
    else:
        tokenizer = {"train": train_vocab_size, "eos": eos_token}
    spec = {**source.identity(), "text_field": text_field, "shard_tokens": shard_tokens, "tokenizer": tokenizer}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def is_ours(path: Path) -> bool:
    return (
        path.name in {MANIFEST, TOKENIZER_FILE, STATE} or path.match(SHARD_GLOB) or path.name.endswith(TMP_SUFFIX)
    ) and path.is_file()


def finished_output(out_dir: Path, key: str) -> Manifest | None:
    """The manifest when `out_dir` already holds this exact output; a DataError when it holds anything
    this run must not overwrite; None when the run may go ahead (new, empty, or an unfinished run)."""
    if not out_dir.exists():
        return None
    check_out_dir(out_dir)
    if not (out_dir / MANIFEST).exists():
        return None
    manifest = read_manifest(out_dir)
    if manifest.source.get("key") != key:
        raise DataError(
            f"--out {out_dir} already holds a data set tokenized from other inputs or settings",
            f"choose a new directory, or delete {out_dir} to replace it",
        )
    (out_dir / STATE).unlink(missing_ok=True)
    return manifest


def check_out_dir(out_dir: Path) -> None:
    """`out_dir` may be written: missing, or a directory holding nothing but an earlier run's files."""
    check_writable(out_dir, "--out", folder=True)
    if not out_dir.exists():
        return
    foreign = sorted(p.name for p in out_dir.iterdir() if not is_ours(p))
    if foreign:
        raise DataError(
            f"--out {out_dir} holds files forge tokenize did not write ({', '.join(foreign[:3])})",
            "choose a new or empty directory",
        )


def remove_outputs(out_dir: Path, remove_dir: bool) -> None:
    for path in out_dir.iterdir():
        if is_ours(path):
            path.unlink()
    if remove_dir:
        out_dir.rmdir()


def read_state(out_dir: Path, key: str) -> RunState | None:
    """The resume record of an interrupted run with the same key; None for none, another key, or garbage."""
    try:
        raw = json.loads((out_dir / STATE).read_text())
        if raw["key"] != key:
            return None
        shards = [ShardInfo(plain_name(s["file"], STATE), int(s["tokens"]), int(s["documents"])) for s in raw["shards"]]
        file, record, done = (int(x) for x in raw["resume"])
        return RunState(key, str(raw["tokenizer_sha256"]), str(raw["dtype"]), shards, (file, record, done))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_state(out_dir: Path, state: RunState) -> None:
    atomic_write(out_dir / STATE, lambda f: f.write(json.dumps(state.to_json()).encode()))


class Run:
    """One tokenize run into a prepared directory: tokenizer, then shards, then the manifest."""

    def __init__(self, out_dir: Path, source: Source, text_field: str, shard_tokens: int, progress: ProgressFn) -> None:
        self.out_dir, self.source, self.text_field = out_dir, source, text_field
        self.shard_tokens, self.progress = shard_tokens, progress

    def execute(
        self, key: str, encoder: Encoder | None, train_vocab_size: int | None, eos_token: str, record: dict
    ) -> tuple[Manifest, int]:
        state = self.resumable_state(key)
        encoder = encoder or self.trained_encoder(state, train_vocab_size, eos_token)
        if state.tokenizer_sha256 != encoder.sha256:
            remove_outputs(self.out_dir, remove_dir=False)
            atomic_write(self.out_dir / TOKENIZER_FILE, lambda f: f.write(encoder.json_bytes))
            state = RunState(key, encoder.sha256, str(encoder.dtype))
            write_state(self.out_dir, state)
        reused = len(state.shards)
        self.write_shards(state, encoder)
        if not state.shards:
            raise DataError(
                "no documents found: every document in the inputs is empty", "check the inputs and --text-field"
            )
        source = {"key": key, "text_field": self.text_field, "inputs": self.source.describe(), **record}
        manifest = manifest_of(encoder, state.shards, source)
        write_manifest(self.out_dir, manifest)
        (self.out_dir / STATE).unlink()
        return manifest, reused

    def resumable_state(self, key: str) -> RunState:
        """The interrupted run's state if it matches and its shards are intact, with every file it does not
        vouch for (temporary files, shards written after the last state update) removed; else a fresh one."""
        state = read_state(self.out_dir, key)
        try:
            for info in state.shards if state else ():
                open_shard(self.out_dir, info, state.dtype)
        except DataError:
            state = None
        keep = {STATE, TOKENIZER_FILE, *(s.file for s in state.shards)} if state else set()
        for path in self.out_dir.iterdir():
            if path.name not in keep:
                path.unlink()
        return state or RunState(key)

    def trained_encoder(self, state: RunState, vocab_size: int | None, eos_token: str) -> Encoder:
        """Reuse the tokenizer an interrupted run already trained; otherwise train one on all documents."""
        assert vocab_size is not None
        saved = self.out_dir / TOKENIZER_FILE
        if state.tokenizer_sha256 and saved.is_file():
            encoder = Encoder.from_file(saved, eos_token)
            if encoder.sha256 == state.tokenizer_sha256:
                return encoder
        documents = self.source.documents(self.text_field)
        return Encoder.trained(
            (doc.text for doc in self.reported("training tokenizer", documents)), vocab_size, eos_token
        )

    def write_shards(self, state: RunState, encoder: Encoder) -> None:
        """Encode documents from the resume point on; after each shard, record the new resume point."""

        def shard_done(info: ShardInfo, key: tuple[int, int], done: int) -> None:
            state.shards.append(info)
            state.resume = (*key, done)
            write_state(self.out_dir, state)

        file, record, done = state.resume
        writer = ShardWriter(self.out_dir, encoder.dtype, self.shard_tokens, len(state.shards), shard_done)
        tokens = sum(s.tokens for s in state.shards)
        documents = sum(s.documents for s in state.shards)
        documents_left = self.source.documents(self.text_field, (file, record))
        read = 0
        for batch, encoded in encode_ahead(batches(documents_left, BATCH_CHARS), encoder):
            for doc, ids in zip(batch, encoded):
                skip = done if (doc.file, doc.record) == (file, record) else 0
                if skip < len(ids):
                    writer.add((doc.file, doc.record), ids[skip:], skip)
                    tokens += len(ids) - skip
                    documents += 1
            read = self.source.position(batch[-1])
            self.report(read, tokens, documents, len(state.shards))
        writer.close()
        self.report(self.source.total if self.source.total is not None else read, tokens, documents, len(state.shards))

    def report(self, done: int, tokens: int, documents: int, shards: int) -> None:
        self.progress(Progress("tokenizing", done, self.source.total, self.source.unit, tokens, documents, shards))

    def reported(self, phase: str, documents: Iterable[Document]) -> Iterator[Document]:
        """Pass documents through, reporting progress every BATCH_CHARS characters."""
        chars = 0
        for count, doc in enumerate(documents, start=1):
            yield doc
            chars += len(doc.text)
            if chars >= BATCH_CHARS:
                chars = 0
                self.progress(
                    Progress(phase, self.source.position(doc), self.source.total, self.source.unit, 0, count, 0)
                )


def encode_ahead(
    batches: Iterable[list[Document]], encoder: Encoder
) -> Iterator[tuple[list[Document], list[np.ndarray]]]:
    """Each batch with its token arrays. Batch k is encoded on a helper thread (the Rust encoder releases the
    GIL) while the caller reads batch k + 1 and writes batch k - 1, so the cores do not wait on Python."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        previous = None
        for batch in batches:
            current = (batch, pool.submit(encoder.encode, [d.text for d in batch]))
            if previous is not None:
                yield previous[0], previous[1].result()
            previous = current
        if previous is not None:
            yield previous[0], previous[1].result()


def batches(documents: Iterable[Document], max_chars: int) -> Iterator[list[Document]]:
    """Group documents into lists of about `max_chars` characters of text."""
    batch: list[Document] = []
    chars = 0
    for doc in documents:
        batch.append(doc)
        chars += len(doc.text)
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def tokenize_texts(
    texts: Sequence[str], out_dir: Path, encoder: Encoder, source: dict, shard_tokens: int = DEFAULT_SHARD_TOKENS
) -> Manifest:
    """In-memory documents → a finished data set in a new directory, in one encode call (small inputs only;
    no resume: the caller builds in a temporary directory)."""
    return write_encoded(encoder.encode(list(texts)), out_dir, encoder, source, shard_tokens)


def write_encoded(
    documents: Sequence[np.ndarray],
    out_dir: Path,
    encoder: Encoder,
    source: dict,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> Manifest:
    """Documents `encoder` already encoded (each ending in EOS) → a finished data set in a new directory."""
    out_dir.mkdir(parents=True)
    atomic_write(out_dir / TOKENIZER_FILE, lambda f: f.write(encoder.json_bytes))
    writer = ShardWriter(out_dir, encoder.dtype, shard_tokens)
    for index, ids in enumerate(documents):
        writer.add(index, ids)
    writer.close()
    manifest = manifest_of(encoder, writer.written, source)
    write_manifest(out_dir, manifest)
    return manifest


def manifest_of(encoder: Encoder, shards: Sequence[ShardInfo], source: dict) -> Manifest:
    """The manifest of shards `encoder` wrote: its tokenizer's fingerprint, vocabulary, EOS and dtype."""
    return Manifest(
        encoder.sha256, encoder.vocab_size, encoder.eos_id, encoder.eos_token, str(encoder.dtype), tuple(shards), source
    )
