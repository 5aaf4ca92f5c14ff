"""Checksums of a checkpoint's files, so that bytes damaged on disk (not only a truncated file) are caught
before a run continues from them.

Each rank sums the DCP files it wrote itself (`__R_*.distcp`, and `.metadata` on rank 0) right after writing
them: in the save for a synchronous one, in the background writer for an asynchronous one, so the loop
does not wait. Rank 0 then gathers them, with `train_state.json`'s, into `checksums.json`, before COMPLETE.
CRC-32 (zlib): it is about 2x faster than SHA-256 and 4x faster than BLAKE2b here (3.3 GB/s on a 2-core VM),
and damage on disk is not an adversary. A checkpoint written before checksums existed has no
`checksums.json` and is loaded unverified.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint.layout import COMPLETE
from engine.safe_paths import UnsafePath, file_in

CHECKSUMS = "checksums.json"
CHUNK = 16 << 20  # bytes read at a time: a shard is never held in memory whole


class ChecksumMismatch(ValueError):
    """A checkpoint file's bytes are not the ones written."""


def file_checksum(path: Path, progress: Callable[[int], None] | None = None) -> str:
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            if progress is not None:
                progress(len(chunk))
    return f"crc32:{crc:08x}"


def partial_name(rank: int) -> str:
    return f".checksums_rank{rank}.json"


def record_rank_checksums(path: Path, rank: int) -> None:
    """Sum the files rank `rank` wrote into step folder `path`; rank 0 merges them in `merge_checksums`."""
    files = sorted(path.glob(f"__{rank}_*.distcp")) + ([path / ".metadata"] if rank == 0 else [])
    sums = {file.name: file_checksum(file) for file in files}
    (path / partial_name(rank)).write_text(json.dumps(sums))


def merge_checksums(path: Path, also: list[str]) -> None:
    """Rank 0, once every rank has recorded its files: one `checksums.json` for the folder, plus the files
    named in `also` (written by rank 0 after the shards)."""
    sums: dict[str, str] = {}
    for part in sorted(path.glob(".checksums_rank*.json")):
        sums.update(json.loads(part.read_text()))
        part.unlink()
    sums.update({name: file_checksum(path / name) for name in also})
    (path / CHECKSUMS).write_text(json.dumps(dict(sorted(sums.items())), indent=1))


def checksum_list(path: Path) -> dict[str, str]:
    """Step folder `path`'s `checksums.json`: file name → checksum. A checkpoint may come from anywhere, so
    every name must be a regular file's plain name inside the folder (`engine.safe_paths.file_in`: no
    `../`, no absolute path, no device such as /dev/zero that would be read forever), else UnsafePath naming
    the entry, before any file is read."""
    listed = path / CHECKSUMS
    sums = json.loads(listed.read_text())
    if not isinstance(sums, dict) or not all(isinstance(value, str) for value in sums.values()):
        raise ValueError(f"{listed} is not an object of file names and checksums")
    for name in sums:
        file_in(path, name, listed)
    return sums


def checksummed_bytes(path: Path) -> int:
    """How many bytes `verify_checkpoint` reads: for a progress bar."""
    try:
        names = checksum_list(path)
    except (OSError, ValueError):  # none, damaged or refused: `verify_checkpoint` says which
        return 0
    return sum(file.stat().st_size for name in names if (file := path / name).is_file())


def verify_checkpoint(path: Path, progress: Callable[[int], None] | None = None) -> bool:
    """Raise ChecksumMismatch (naming the file) or FileNotFoundError if a file of step folder `path` is not
    what was written, UnsafePath if its checksum list names anything but a file in it; False when the
    checkpoint has no checksums to check (written before they existed)."""
    if not (path / CHECKSUMS).is_file():
        return False
    for name, expected in checksum_list(path).items():
        actual = file_checksum(path / name, progress)
        if actual != expected:
            raise ChecksumMismatch(f"{path / name} is damaged (checksum {actual}, written as {expected})")
    return True


@dataclass(frozen=True)
class Verdict:
    """What checking one step folder found: ok, unverified (no checksums), damaged or incomplete."""

    path: Path
    status: str
    detail: str = ""


def verify_folders(folders: list[Path], progress: Callable[[int, int], None] | None = None) -> list[Verdict]:
    """Check every step folder in `folders` (oldest first), reading each file once; `progress(done, total)`
    is called with bytes as they are read."""
    total = sum(checksummed_bytes(path) for path in folders if (path / COMPLETE).is_file())
    done = 0

    def advance(size: int) -> None:
        nonlocal done
        done += size
        if progress is not None:
            progress(done, total)

    verdicts = []
    for path in folders:
        if not (path / COMPLETE).is_file():
            verdicts.append(Verdict(path, "incomplete", "its save was interrupted; it is never loaded"))
            continue
        try:
            checked = verify_checkpoint(path, advance)
        except UnsafePath:
            raise  # not damage but a list naming files elsewhere: refused (exit 2), nothing else read
        except (ChecksumMismatch, OSError, ValueError) as err:
            verdicts.append(Verdict(path, "damaged", str(err)))
            continue
        verdicts.append(Verdict(path, "ok") if checked else Verdict(path, "unverified", f"no {CHECKSUMS}"))
    return verdicts
