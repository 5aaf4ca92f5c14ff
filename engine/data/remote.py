"""Remote input files for `forge tokenize`: `s3://`, `gs://`, `https://`, `memory://` and any other fsspec URL.

A URL names a file or (where the store has them) a folder searched recursively like a local directory. Files
are read as streams: front to back in blocks, the whole file never held; Parquet files by range requests for
the row groups. Every call to the store (listing, size, each read) is retried a bounded number of times with
doubling waits; a read that fails is retried by reopening the file at the byte it reached. A store that keeps
failing is a `FetchError` naming the URL: exit 2, with the shards finished so far and the resume record kept
(every file is written atomically, so nothing is half-written) and a rerun of the same command resumes.

Credentials are never part of the command or the config: each store's client reads its usual environment
(`AWS_*` variables or `~/.aws` for s3://, `GOOGLE_APPLICATION_CREDENTIALS` or gcloud's login for gs://). A URL's
user, password and query string (a presigned URL's signature) are left out of everything shown or recorded.

fsspec (and aiohttp for http(s)://) is an optional dependency, `pip install 'forge-lm[remote]'`; s3:// and
gs:// also need `s3fs` / `gcsfs`. They are imported only when a URL is given.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from engine.errors import DataError, UserError

FETCH_TRIES = 5  # attempts per call to the store
FIRST_WAIT = 0.5  # seconds before the second attempt, doubling after each failure: 7.5 s of waiting in all
READ_BLOCK = 1 << 20  # bytes per read from the store
VERSION_FIELDS = ("ETag", "etag", "Last-Modified", "LastModified", "mtime", "generation", "md5Hash", "created")
T = TypeVar("T")


class FetchError(UserError):
    """A remote input could not be read after every retry. Not a DataError: the finished shards are kept."""


def is_url(text: str) -> bool:
    return "://" in text


def shown(url: str) -> str:
    """The URL without user, password, query and fragment: what messages, progress and manifests show."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def not_found(error: BaseException) -> bool:
    """A missing file, as opposed to a failure worth retrying. fsspec's HTTP store says FileNotFoundError both for
    a 404 and for a server that fails or cannot be reached, so the error behind it decides: an HTTP status (4xx
    but timeout and rate limit: missing) or a connection failure (retried)."""
    if not isinstance(error, FileNotFoundError):
        return False
    cause = error.__cause__
    status = getattr(cause, "status", None)
    if status is not None:
        return 400 <= status < 500 and status not in (408, 429)
    return not isinstance(cause, transient_errors())


def transient_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, TimeoutError)
    try:
        import aiohttp

        errors += (aiohttp.ClientError,)
    except ImportError:
        pass
    return errors


def retried(url: str, call: Callable[[], T], after_failure: Callable[[], None] = lambda: None) -> T:
    """`call()`, retried FETCH_TRIES times with doubling waits; a missing file is a DataError at once."""
    wait, last = FIRST_WAIT, None
    for attempt in range(FETCH_TRIES):
        try:
            return call()
        except transient_errors() as error:
            if not_found(error):
                raise DataError(f"input {shown(url)} not found", "check the URL") from None
            last = error
            after_failure()
            if attempt + 1 < FETCH_TRIES:
                time.sleep(wait)
                wait *= 2
    raise FetchError(
        f"could not read {shown(url)}: {FETCH_TRIES} tries failed (last: {failure(last)})",
        "check the URL, the network and the store's credentials (taken from its usual environment, e.g. AWS_* "
        "for s3://); then rerun the same command: the shards finished so far are kept and it resumes",
    )


def failure(error: BaseException | None) -> str:
    """What went wrong, by kind and HTTP status: not the error's text, which may quote the URL with its
    credentials or signature."""
    cause = error.__cause__ if isinstance(error, FileNotFoundError) and error.__cause__ else error
    status = getattr(cause, "status", None)
    return type(cause).__name__ + (f", HTTP {status}" if status is not None else "")


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec file system of `url` and the path inside it; a missing package or scheme is a DataError."""
    try:
        import fsspec
    except ImportError:
        raise DataError(
            f"reading {shown(url)} needs the fsspec package", "pip install 'forge-lm[remote]' (or fsspec[http])"
        ) from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise DataError(f"reading {shown(url)} needs another package: {e}", "install the package it names") from None
    except ValueError as e:
        raise DataError(f"{shown(url)}: {e}", "use an s3://, gs://, http(s):// or other fsspec URL") from None


@dataclass(frozen=True)
class RemoteFile:
    """One file in a store: where, how large, and a version (ETag, modification time…) so reruns can tell."""

    fs: Any
    path: str
    url: str  # as shown
    size: int
    version: str

    @property
    def suffix(self) -> str:
        return suffix_of(self.url)

    def identity(self) -> list:
        return [self.url, self.size, self.version]

    def open(self) -> io.BufferedReader:
        return io.BufferedReader(RemoteReader(self), buffer_size=READ_BLOCK)


def remote_files(url: str, suffixes: tuple[str, ...], formats_hint: str) -> list[RemoteFile]:
    """The file `url` names, or the files with a known suffix under the folder it names (sorted, hidden skipped)."""
    fs, path = filesystem(url)
    info = retried(url, lambda: fs.info(path))
    if info.get("type") == "directory":
        found = retried(url, lambda: fs.find(path, detail=True))
        entries = [
            entry
            for name, entry in sorted(found.items())
            if suffix_of(name) in suffixes and entry.get("type") == "file" and not hidden(name, path)
        ]
        if not entries:
            raise DataError(f"no documents found: no .txt, .jsonl or .parquet files under {shown(url)}", formats_hint)
    elif suffix_of(url) not in suffixes:
        suffix = suffix_of(url) or "(none)"
        raise DataError(f"input {shown(url)} has an unknown extension {suffix!r}", formats_hint)
    else:
        entries = [info]
    return [remote_file(fs, url, path, entry) for entry in entries]


def suffix_of(url: str) -> str:
    """The file type a URL (or a store's path) names, whatever query string follows it."""
    return PurePosixPath(urlsplit(url).path).suffix


def hidden(name: str, root: str) -> bool:
    relative = PurePosixPath(name.removeprefix(root.rstrip("/")).lstrip("/"))
    return any(part.startswith(".") for part in relative.parts)


def remote_file(fs: Any, url: str, root: str, entry: dict) -> RemoteFile:
    """The file of listing `entry`, shown as the URL given plus its path under the folder that URL names."""
    name = str(entry["name"])
    relative = name.removeprefix(root.rstrip("/")).lstrip("/")
    shown_url = shown(url).rstrip("/") + "/" + relative if relative else shown(url)
    if entry.get("size") is None:
        raise DataError(
            f"{shown_url}: the store does not say how large the file is", "serve it with a Content-Length header"
        )
    version = next((str(entry[key]) for key in VERSION_FIELDS if entry.get(key) is not None), "")
    return RemoteFile(fs, name, shown_url, int(entry["size"]), version)


class RemoteReader(io.RawIOBase):
    """A remote file as a seekable binary stream that reopens itself at the offset reached when a read fails."""

    def __init__(self, file: RemoteFile) -> None:
        self.file, self.offset, self.handle = file, 0, None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.offset

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.offset, io.SEEK_END: self.file.size}[whence]
        self.offset = base + offset
        if self.handle is not None:
            try:
                self.handle.seek(self.offset)
            except transient_errors():
                self.drop()  # reopened at the new offset by the next read
        return self.offset

    def readinto(self, buffer: Any) -> int:
        if self.offset >= self.file.size:
            return 0
        want = min(len(buffer), self.file.size - self.offset)

        def read() -> bytes:
            if self.handle is None:
                self.handle = self.file.fs.open(self.file.path, "rb", block_size=READ_BLOCK)
                self.handle.seek(self.offset)
            data = self.handle.read(want)
            if not data:
                raise OSError(f"the store ended the file at byte {self.offset} of {self.file.size}")
            return data

        data = retried(self.file.url, read, after_failure=self.drop)
        buffer[: len(data)] = data
        self.offset += len(data)
        return len(data)

    def drop(self) -> None:
        if self.handle is not None:
            with contextlib.suppress(Exception):  # a broken connection may fail to close; it is dropped either way
                self.handle.close()
            self.handle = None

    def close(self) -> None:
        self.drop()
        super().close()
