"""Hugging Face datasets named in the config (`data.hf_dataset_name`, `eval.hf_dataset_name`, the `hf_name` of a
`[[data.datasets]]` entry), tokenized once into the Forge cache and then read like any shards.

Training reads token shards, so that the sample order is a pure function of the step and a resumed run is
exact; a dataset named in the config therefore goes through `forge tokenize`'s machinery first. The entry is
`$FORGE_CACHE_DIR/hf/<digest>/`, the digest being tokenize's run key: the dataset's name, configuration,
split and fingerprint, the text column and the tokenizer's bytes. A changed dataset or tokenizer makes a new
entry. Every rank asks for the entry; a record lock on `<digest>.lock` lets one build it while the others
wait, and an interrupted build (a preempted job) resumes where it stopped on the next attempt.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.data import DEFAULT_SHARD_TOKENS
from engine.data.embedded import cache_entry
from engine.data.hub import HubSource
from engine.data.shards import MANIFEST
from engine.data.tokenize import Progress, ProgressFn, run_key, tokenize
from engine.data.tokenizer import Encoder
from engine.errors import DataError

PROGRESS_INTERVAL_S = 60.0
ProgressView = Callable[[str], contextlib.AbstractContextManager[ProgressFn]]
PROGRESS_VIEWS: list[ProgressView] = []  # the innermost `progress_shown_by` last
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL)


@dataclass(frozen=True)
class HubRequest:
    """A Hugging Face split to tokenize, and how errors name the config fields that asked for it."""

    name: str
    config: str | None
    split: str
    revision: str | None
    text_field: str
    field: str  # the field naming the dataset, e.g. data.hf_dataset_name
    fields: str  # every field that shapes it, for the hints


def cached_shards(request: HubRequest, streaming: bool, tokenizer: Path, vocab_size: int) -> Path:
    """The cache entry of `request` tokenized with `tokenizer`, built on first use (`engine.data.source_kinds`
    resolves a config's Hugging Face source to it). What goes wrong names the config's fields."""
    r = request
    if not tokenizer.is_file():
        raise DataError(
            f"{r.field} needs a tokenizer: {tokenizer} not found", "set data.tokenizer_path to a tokenizer.json"
        )
    encoder = Encoder.from_file(tokenizer, None)
    if encoder.vocab_size > vocab_size:  # found now rather than after hours of tokenizing
        raise DataError(
            f"the tokenizer {tokenizer} has {encoder.vocab_size} tokens, more than model.vocab_size = {vocab_size}",
            f"set model.vocab_size to at least {encoder.vocab_size}",
        )
    name = str(Path(r.name).resolve()) if Path(r.name).is_dir() else r.name  # a local folder, wherever the run starts
    try:
        source = HubSource(name, r.config, r.split, streaming, r.revision)
        source.check(r.text_field)
    except DataError as e:
        raise DataError(f"{r.field}: {e.message}", f"{e.hint} (config fields: {r.fields})") from None
    entry = cache_entry("hf", run_key(source, r.text_field, DEFAULT_SHARD_TOKENS, encoder, None, None)[:16])

    def build() -> None:
        say(f"tokenizing {source} into {entry} (once: later runs reuse it)")
        try:
            with (PROGRESS_VIEWS[-1] if PROGRESS_VIEWS else progress_lines)(str(source)) as progress:
                report = tokenize(source, entry, tokenizer=tokenizer, text_field=r.text_field, progress=progress)
        except DataError as e:
            raise DataError(f"{r.field}: {e.message}", f"{e.hint} (config fields: {r.fields})") from None
        say(f"tokenized {source}: {report.manifest.total_tokens:,} tokens in {report.seconds:.0f} s")

    return built_once(entry, f"{source} is being tokenized into {entry} by another process", build)


def built_once(entry: Path, waiting: str, build: Callable[[], None]) -> Path:
    """The cache folder `entry`, made by `build` unless its manifest (written last) is there already: one
    process builds it while the others (a run's other ranks, other runs) wait on its lock, saying `waiting`,
    and then reuse it."""
    if not (entry / MANIFEST).is_file():
        with locked(entry.parent / f"{entry.name}.lock", waiting):
            if not (entry / MANIFEST).is_file():  # another process may have built it while this one waited
                build()
    return entry


def say(line: str) -> None:
    """A line on stderr: tokenizing runs before the run's logging starts, and may take hours."""
    print(f"forge: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress_shown_by(view: ProgressView) -> Iterator[None]:
    """While the block runs, a cache build in this process reports through `view` (given the dataset's name, a
    context that yields the progress callback): the CLI's Rich bar on a terminal. Otherwise the build says
    where it is on stderr once a minute (`progress_lines`), which suits a job's log."""
    PROGRESS_VIEWS.append(view)
    try:
        yield
    finally:
        PROGRESS_VIEWS.remove(view)


@contextlib.contextmanager
def progress_lines(name: str) -> Iterator[ProgressFn]:
    last = time.monotonic()

    def report(p: Progress) -> None:
        nonlocal last
        if time.monotonic() - last >= PROGRESS_INTERVAL_S:
            last = time.monotonic()
            share = f" of {p.total:,}" if p.total is not None else ""
            say(f"{name}: {p.phase}, {p.done:,}{share} {p.unit}, {p.tokens:,} tokens")

    yield report


@contextlib.contextmanager
def locked(path: Path, waiting: str) -> Iterator[None]:
    """Hold an exclusive record lock on `path`, saying `waiting` if another process holds it. Building
    without a lock could let two ranks write the same directory, so a file system that cannot lock is an
    error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # never a planted link's target
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DataError(
                f"the Forge cache lock {path} is a symbolic link; Forge never writes through a link in its cache",
                f"remove the link (rm {path}; its target is left alone)",
            ) from None
        raise DataError(
            f"cannot write the Forge cache {path.parent} ({e.strerror})", "set FORGE_CACHE_DIR to a writable directory"
        ) from None
    try:
        if not lock(fd, path, blocking=False):
            say(f"waiting: {waiting}")
            lock(fd, path, blocking=True)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def lock(fd: int, path: Path, blocking: bool) -> bool:
    """Take the lock; False when another process holds it and `blocking` is off."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if not blocking and e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        if e.errno in NO_LOCKS:
            raise DataError(
                f"the Forge cache {path.parent} is on a file system without locks",
                "set FORGE_CACHE_DIR to a local directory, or tokenize the dataset first "
                "(forge tokenize hf:NAME …) and set data.dataset_path",
            ) from None
        raise DataError(
            f"could not lock {path} ({e.strerror})",
            "check the file system of FORGE_CACHE_DIR, or tokenize the dataset first "
            "(forge tokenize hf:NAME …) and set data.dataset_path",
        ) from None
