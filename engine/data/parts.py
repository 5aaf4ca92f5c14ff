"""Tokenizing one corpus on many machines: `forge tokenize --num-shards N --shard-index I` and `forge tokenize
merge`.

Part I of N holds the documents whose *end* lies in the I-th of N equal ranges of the input's position (bytes
of the files, in the order the one-process run reads them; rows of a dataset). Positions only grow along the
input, so each part is a contiguous run of documents, the parts are disjoint, together they hold every
document, and their concatenation in index order is the one-process document sequence: the same tokens, the
same document count. With many files a part is a run of whole files (balanced by size); with few, a file is
cut between documents. A part skips the files that end before its range without reading them (a dataset's
rows by row index), and stops reading after its range.

`merge` joins finished parts into one data set: their shards, renumbered in part order (hard-linked where the
file system allows, else copied), one tokenizer and one manifest. The parts' shard boundaries are kept, so
the merged set's last shard of each part is shorter than --shard-tokens; the token sequence is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.data.shards import (
    MANIFEST,
    TOKENIZER_FILE,
    Manifest,
    ShardInfo,
    open_shard,
    read_manifest,
    shard_name,
    write_manifest,
)
from engine.data.sources import Document
from engine.durable import TMP_SUFFIX, fsync_dir
from engine.errors import DataError

if TYPE_CHECKING:
    from engine.data.tokenize import Source


@dataclass(frozen=True)
class Part:
    """Which slice of the input one `forge tokenize` process writes: `index` of `count` (from 0)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise DataError(f"--num-shards must be at least 1, got {self.count}", "e.g. --num-shards 8")
        if not 0 <= self.index < self.count:
            raise DataError(
                f"--shard-index {self.index} is outside 0…{self.count - 1} (--num-shards {self.count})",
                "pass --shard-index from 0 to --num-shards - 1",
            )

    def to_json(self) -> dict:
        return {"index": self.index, "count": self.count}


def part_of(num_shards: int | None, shard_index: int | None) -> Part | None:
    """The part the command line asks for; both options or neither."""
    if num_shards is None and shard_index is None:
        return None
    if num_shards is None or shard_index is None:
        given, missing = ("--num-shards", "--shard-index") if shard_index is None else ("--shard-index", "--num-shards")
        raise DataError(f"{given} needs {missing}", "pass both, e.g. --num-shards 8 --shard-index 0")
    return Part(shard_index, num_shards)


class PartSource:
    """`source`'s documents of one part, as a tokenize source; progress counts the part's own range."""

    def __init__(self, source: Source, part: Part) -> None:
        if source.total is None:
            raise DataError(
                f"--num-shards needs the input's length, and {', '.join(source.describe())} does not declare it "
                "(a streamed dataset without split sizes)",
                "tokenize it without --streaming (its rows are counted once downloaded), or in one process",
            )
        self.source, self.part, self.unit = source, part, source.unit
        self.low = source.total * part.index // part.count
        self.high = source.total * (part.index + 1) // part.count
        self.total: int | None = self.high - self.low

    def check(self, text_field: str) -> None:
        self.source.check(text_field)

    def identity(self) -> dict:
        return {**self.source.identity(), "part": self.part.to_json()}

    def describe(self) -> list[str]:
        return self.source.describe()

    def start_at(self, position: int) -> tuple[int, int]:
        return self.source.start_at(self.low + position)

    def documents(self, text_field: str, start: tuple[int, int] = (0, 0)) -> Iterator[Document]:
        """The part's documents from `start` on (a resume point inside the part, or its beginning)."""
        fresh = start == (0, 0)
        start = max(start, self.source.start_at(self.low))
        found = False
        for doc in self.source.documents(text_field, start):
            position = self.source.position(doc)
            if position > self.high:
                break
            if self.part.index == 0 or position > self.low:
                found = True
                yield doc
        if fresh and not found:
            raise DataError(
                f"part {self.part.index} of {self.part.count} holds no documents: the input has too few "
                f"(or too small) documents for {self.part.count} parts",
                "pass a smaller --num-shards",
            )

    def position(self, doc: Document) -> int:
        return self.source.position(doc) - self.low


def part_record(part: Part, whole_key: str) -> dict:
    """What a part's manifest says about it: its place, and the key of the whole run it is a part of."""
    return {**part.to_json(), "of": whole_key}


@dataclass(frozen=True)
class MergeReport:
    directory: Path
    manifest: Manifest
    parts: int
    linked: bool  # the shards are hard links to the parts' files (else copies)
    already_complete: bool


def merge_parts(part_dirs: Sequence[Path], out_dir: Path) -> MergeReport:
    """Join the finished parts of one sharded tokenization into `out_dir`. Every part is checked first (finished,
    intact shards, the same run and tokenizer, each index once and none missing); a failure while writing
    removes what was written."""
    parts = sorted(read_parts(part_dirs), key=lambda p: p[1].source["part"]["index"])
    check_parts(parts)
    whole = parts[0][1].source["part"]["of"]
    done = finished_merge(out_dir, whole)
    if done is not None:
        return MergeReport(out_dir, done, len(parts), False, True)
    check_empty(out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        manifest, linked = write_merged(parts, out_dir, whole)
    except BaseException:
        for path in out_dir.iterdir():
            path.unlink()
        if created:
            out_dir.rmdir()
        raise
    return MergeReport(out_dir, manifest, len(parts), linked, False)


def read_parts(part_dirs: Sequence[Path]) -> list[tuple[Path, Manifest]]:
    if not part_dirs:
        raise DataError("no parts given", "forge tokenize merge PART_DIR… --out DIR")
    found = []
    for directory in part_dirs:
        if not (directory / MANIFEST).is_file():
            raise DataError(
                f"part {directory} is not finished (no {MANIFEST}: its forge tokenize did not complete)",
                "rerun that part's forge tokenize command (it resumes where it stopped), then merge",
            )
        manifest = read_manifest(directory)
        if "part" not in manifest.source:
            raise DataError(
                f"{directory} is not a part (it was not written with --num-shards/--shard-index)",
                "merge the directories written by forge tokenize --num-shards N --shard-index I",
            )
        for info in manifest.shards:
            open_shard(directory, info, manifest.dtype)
        found.append((directory, manifest))
    return found


def check_parts(parts: list[tuple[Path, Manifest]]) -> None:
    """The parts are all the parts of one run, with one tokenizer."""
    first_dir, first = parts[0]
    count = first.source["part"]["count"]
    for directory, manifest in parts[1:]:
        if manifest.tokenizer_sha256 != first.tokenizer_sha256 or manifest.dtype != first.dtype:
            raise DataError(
                f"part {directory} was tokenized with another tokenizer (sha256 {manifest.tokenizer_sha256[:16]}…, "
                f"{manifest.dtype}) than part {first_dir} ({first.tokenizer_sha256[:16]}…, {first.dtype})",
                "tokenize every part with the same --tokenizer",
            )
        if manifest.source["part"]["of"] != first.source["part"]["of"] or manifest.source["part"]["count"] != count:
            raise DataError(
                f"part {directory} is a part of another tokenization (other inputs, options or --num-shards) "
                f"than part {first_dir}",
                "merge the parts of one forge tokenize --num-shards run",
            )
    indices = [m.source["part"]["index"] for _, m in parts]
    twice = sorted({i for i in indices if indices.count(i) > 1})
    if twice:
        named = [str(d) for d, m in parts if m.source["part"]["index"] == twice[0]]
        raise DataError(f"part {twice[0]} is given twice ({', '.join(named)})", "name each part once")
    missing = sorted(set(range(count)) - set(indices))
    if missing:
        raise DataError(f"parts {', '.join(map(str, missing))} of {count} are missing", "name every part's directory")


def finished_merge(out_dir: Path, whole: str) -> Manifest | None:
    """The manifest when `out_dir` already holds this merge (a rerun does nothing)."""
    if not (out_dir / MANIFEST).is_file():
        return None
    manifest = read_manifest(out_dir)
    if manifest.source.get("merged", {}).get("of") != whole:
        raise DataError(
            f"--out {out_dir} already holds another data set", f"choose a new directory, or delete {out_dir}"
        )
    return manifest


def check_empty(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DataError(f"--out {out_dir} is not an empty directory", "choose a new or empty directory")


def write_merged(parts: list[tuple[Path, Manifest]], out_dir: Path, whole: str) -> tuple[Manifest, bool]:
    """Shards in part order under new names, the tokenizer, and the manifest last (it marks the set finished)."""
    first_dir, first = parts[0]
    shards, linked = [], True
    for directory, manifest in parts:
        for info in manifest.shards:
            target = ShardInfo(shard_name(len(shards)), info.tokens, info.documents)
            linked = place(directory / info.file, out_dir / target.file) and linked
            shards.append(target)
    if (first_dir / TOKENIZER_FILE).is_file():
        place(first_dir / TOKENIZER_FILE, out_dir / TOKENIZER_FILE)
    fsync_dir(out_dir)
    source = {
        "key": hashlib.sha256(json.dumps({"merged": whole}).encode()).hexdigest(),
        "text_field": first.source.get("text_field"),
        "inputs": first.source.get("inputs", []),
        "merged": {"of": whole, "parts": [str(d.resolve()) for d, _ in parts]},
    }
    manifest = Manifest(
        first.tokenizer_sha256, first.vocab_size, first.eos_id, first.eos_token, first.dtype, tuple(shards), source
    )
    write_manifest(out_dir, manifest)
    return manifest, linked


def place(source: Path, target: Path) -> bool:
    """`target` as a hard link to `source` (True), or a copy where the file system cannot link (False). Shards
    are never changed in place (every write is a rename), so a link is as safe as a copy."""
    try:
        os.link(source, target)
        return True
    except OSError:
        tmp = target.with_name(target.name + TMP_SUFFIX)
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
        return False
