"""A `forge tokenize` output in a store (`s3://`, `gs://`, `https://`, `memory://`…) as training or evaluation data.

Training memory-maps its shards and draws windows from anywhere in them, so a remote data set is fetched
once into the Forge cache and then read like local shards (the same samples, the same `TrainData.identity()`,
the same losses as the local copy). The entry is `$FORGE_CACHE_DIR/remote/<digest>/`, the digest being the URL
(as shown: no credentials) and the remote manifest's bytes, so a data set replaced in the store makes a new
entry. Every rank asks for the entry; a record lock lets one fetch it while the others wait.

Each file is streamed through `engine.data.remote` (every read retried, a failed read reopened at the byte it
reached) into a temporary name and moved into place only once complete and checked against the manifest:
the tokenizer by its sha256, each shard by its byte length in the store, its dtype and its token count. The
manifest is written last, so an entry with a manifest is complete; a fetch that keeps failing is a
`FetchError` naming the URL and the config field, leaving no partial file and no manifest (the files already
checked are kept, and the next run fetches only the rest).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.data.embedded import cache_entry
from engine.data.hub_cache import built_once, say
from engine.data.remote import FetchError, RemoteFile, filesystem, remote_file, retried, shown
from engine.data.shards import MANIFEST, TOKENIZER_FILE, Manifest, manifest_from_json, open_shard
from engine.data.tokenizer import file_sha256
from engine.durable import atomic_write
from engine.errors import DataError
from engine.safe_paths import file_in

COPY_BLOCK = 1 << 20  # bytes per write into the cache


def remote_manifest(url: str, field: str) -> tuple[Manifest, bytes]:
    """The manifest of the data set at `url`, parsed, and its bytes; read without fetching any shard."""
    fs, root = filesystem(url)
    path = root.rstrip("/") + "/" + MANIFEST
    try:
        raw = retried(f"{shown(url).rstrip('/')}/{MANIFEST}", lambda: fs.cat_file(path))
    except FetchError as e:
        raise FetchError(f"{field}: {e.message}", e.hint) from None
    except DataError:
        raise DataError(
            f"{field} {shown(url)} has no {MANIFEST}: not a `forge tokenize` output",
            f"tokenize into it first (forge tokenize INPUT… --out DIR, then copy DIR there) or fix {field}",
        ) from None
    try:
        return manifest_from_json(json.loads(raw)), raw
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{field}: {shown(url)}/{MANIFEST} is not a readable manifest ({e})", "tokenize it again"
        ) from None


def fetched_shards(url: str, field: str) -> Path:
    """The cache entry holding the data set at `url`, fetched on first use; errors name `field`."""
    manifest, raw = remote_manifest(url, field)
    entry = cache_entry("remote", hashlib.sha256(shown(url).encode() + b"\0" + raw).hexdigest()[:16])

    def build() -> None:
        say(f"fetching {shown(url)} into {entry} (once: later runs reuse it)")
        try:
            fetch_files(url, manifest, entry)
        except FetchError as e:
            raise FetchError(f"{field}: {e.message}", e.hint) from None
        except DataError as e:
            raise DataError(f"{field}: {e.message}", e.hint) from None
        atomic_write(entry / MANIFEST, lambda f: f.write(raw))

    return built_once(entry, f"{shown(url)} is being fetched into {entry} by another process", build)


def fetch_files(url: str, manifest: Manifest, entry: Path) -> None:
    """Every shard the manifest lists, and the tokenizer beside them where the store has one, into `entry`."""
    fs, root = filesystem(url)
    root = root.rstrip("/")
    entry.mkdir(parents=True, exist_ok=True)
    tokenizer, kept = root + "/" + TOKENIZER_FILE, file_in(entry, TOKENIZER_FILE, entry)
    if kept.is_file() and file_sha256(kept) == manifest.tokenizer_sha256:
        pass  # fetched and checked by an earlier, interrupted run
    elif retried(url, lambda: fs.exists(tokenizer)):
        digest = fetch(remote(fs, url, root, tokenizer), kept)
        if digest != manifest.tokenizer_sha256:
            kept.unlink()
            raise DataError(
                f"{shown(url)}/{TOKENIZER_FILE} is not the tokenizer the manifest names "
                f"(sha256 {digest[:12]}… ≠ {manifest.tokenizer_sha256[:12]}…)",
                "upload the tokenizer.json written beside the shards",
            )
    for info in manifest.shards:
        target = file_in(entry, info.file, f"{shown(url)}/{MANIFEST}")  # a plain name, checked with the manifest
        if not target.is_file():  # a file fetched by an earlier, interrupted run was checked before it was kept
            fetch(remote(fs, url, root, root + "/" + info.file), target)
        try:
            open_shard(entry, info, manifest.dtype)
        except DataError as e:
            target.unlink()
            raise DataError(f"{shown(url)}/{info.file} does not match its manifest ({e.message})", e.hint) from None


def remote(fs, url: str, root: str, path: str) -> RemoteFile:
    return remote_file(fs, url, root, retried(url, lambda: fs.info(path)))


def fetch(file: RemoteFile, target: Path) -> str:
    """Stream `file` into `target` (complete or not at all) and return its sha256."""
    digest = hashlib.sha256()

    def copy(out) -> None:
        with file.open() as stream:
            while block := stream.read(COPY_BLOCK):
                digest.update(block)
                out.write(block)

    atomic_write(target, copy)
    return digest.hexdigest()
