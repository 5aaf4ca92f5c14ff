"""Input files for `forge tokenize`: finding them, and reading documents out of them.

A `.txt` file is one document; a `.jsonl` file holds one document per line (a JSON object with a text
field); a `.parquet` file one document per row of its text column, read in record batches so a large file
never has to fit in memory. Documents are addressed by (file index, record index) so a rerun can skip
exactly the documents that are already tokenized.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path, PurePath, PurePosixPath
from typing import BinaryIO
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.parquet as pq

from engine.data.remote import RemoteFile, is_url, remote_files
from engine.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".parquet")
FORMATS_HINT = "forge tokenize reads .txt (one document per file), .jsonl and .parquet files, or directories of them"
PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class InputFile:
    path: PurePath  # a local file's path, or the path part of a remote file's URL
    size: int
    mtime_ns: int
    remote: RemoteFile | None = None

    @classmethod
    def at(cls, path: Path) -> InputFile:
        st = path.stat()
        return cls(path.resolve(), st.st_size, st.st_mtime_ns)

    @classmethod
    def of(cls, remote: RemoteFile) -> InputFile:
        return cls(PurePosixPath(urlsplit(remote.url).path), remote.size, 0, remote)

    @property
    def name(self) -> str:
        """What messages and manifests call the file: its path, or its URL without credentials."""
        return self.remote.url if self.remote else str(self.path)

    def identity(self) -> list:
        """What decides whether a rerun sees the same input: path, size and modification time (a remote file:
        its URL, size and version)."""
        return self.remote.identity() if self.remote else [str(self.path), self.size, self.mtime_ns]

    def open(self) -> BinaryIO:
        return self.remote.open() if self.remote else open(self.path, "rb")


@dataclass(frozen=True)
class Document:
    file: int  # index into the input file list
    record: int  # line (.jsonl), row (.parquet) or 0 (.txt) inside the file
    text: str
    consumed: int  # bytes of the file (rows of a dataset) read up to and including this document, for progress


def find_input_files(inputs: Sequence[Path | str]) -> list[InputFile]:
    """Expand directories (recursively, sorted, hidden entries skipped) and check every named file; URLs are
    listed through `engine.data.remote`."""
    if not inputs:
        raise DataError("no input given", FORMATS_HINT)
    paths: list[Path] = []
    remote: list[InputFile] = []
    for given in inputs:
        if is_url(str(given)):
            remote += [InputFile.of(f) for f in remote_files(str(given), SUFFIXES, FORMATS_HINT)]
            continue
        item = Path(given)
        if not item.exists():
            raise DataError(f"input {item} not found", "check the path")
        if item.is_dir():
            paths += files_under(item)
        elif item.suffix not in SUFFIXES:
            raise DataError(f"input {item} has an unknown extension {item.suffix or '(none)'!r}", FORMATS_HINT)
        else:
            paths.append(item)
    if remote and paths:
        raise DataError("local files and URLs were given together", "tokenize them into separate directories")
    if remote:
        return list({f.name: f for f in remote}.values())
    unique = dict.fromkeys(p.resolve() for p in paths)
    return [InputFile.at(p) for p in unique]


def visible_files(directory: Path) -> list[Path]:
    """The files under `directory`, recursively and sorted, hidden entries skipped."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and not hidden(p, directory))


def files_under(directory: Path) -> list[Path]:
    found = [p for p in visible_files(directory) if p.suffix in SUFFIXES]
    if not found:
        raise DataError(f"no documents found: no .txt, .jsonl or .parquet files under {directory}", FORMATS_HINT)
    return found


def skipped_under(inputs: Sequence[Path | str]) -> list[Path]:
    """The files under the local directories of `inputs` that `find_input_files` leaves out for their extension
    (a README.md beside the .txt files), hidden ones aside: the command says it skipped them."""
    skipped: list[Path] = []
    for given in inputs:
        item = Path(given)
        if not is_url(str(given)) and item.is_dir():
            skipped += [p for p in visible_files(item) if p.suffix not in SUFFIXES]
    return skipped


def hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def check_text_field(file: InputFile, text_field: str) -> None:
    """Fail before writing anything when the first record of a JSONL file or a Parquet schema lacks the field."""
    if file.path.suffix == ".jsonl":
        next(iter_jsonl(file, 0, text_field), None)  # parsing the first record runs every check on it
    elif file.path.suffix == ".parquet":
        parquet_column(open_parquet(file), file.name, text_field)


def iter_documents(files: Sequence[InputFile], text_field: str, start: tuple[int, int] = (0, 0)) -> Iterator[Document]:
    """Every non-empty document in file order, from record `start[1]` of file `start[0]` on."""
    first_file, first_record = start
    for index in range(first_file, len(files)):
        skip = first_record if index == first_file else 0
        for record, text, consumed in read_file(files[index], text_field, skip):
            if text and not text.isspace():
                yield Document(index, record, text, consumed)


def read_file(file: InputFile, text_field: str, start: int) -> Iterator[tuple[int, str, int]]:
    suffix = file.path.suffix
    if suffix == ".txt":
        return iter_txt(file, start)
    if suffix == ".jsonl":
        return iter_jsonl(file, start, text_field)
    assert suffix == ".parquet", suffix
    return iter_parquet(file, start, text_field)


def iter_txt(file: InputFile, start: int) -> Iterator[tuple[int, str, int]]:
    if start > 0:
        return
    with file.open() as f:
        data = f.read()
    try:
        yield 0, data.decode("utf-8"), file.size
    except UnicodeDecodeError as e:
        raise DataError(f"{file.name} is not UTF-8 text (byte {e.start})", "convert it to UTF-8 first") from None


def iter_jsonl(file: InputFile, start: int, text_field: str) -> Iterator[tuple[int, str, int]]:
    consumed = 0
    with file.open() as f:
        for line_no, line in enumerate(f):
            consumed += len(line)
            if line_no < start or not line.strip():
                continue
            yield line_no, jsonl_text(line, file.name, line_no + 1, text_field), consumed


def jsonl_text(line: bytes, path: str, line_no: int, text_field: str) -> str:
    where = f"{path} line {line_no}"
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where} is not valid JSON ({e})", "write one JSON object per line") from None
    if not isinstance(record, dict):
        raise DataError(f"{where} is a JSON {type(record).__name__}, not an object", "write one JSON object per line")
    if text_field not in record:
        raise DataError(
            f"{where} has no field {text_field!r} (fields: {', '.join(record) or 'none'})",
            "pass --text-field with the name of the field that holds the text",
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(
            f"{where}: field {text_field!r} is {type(text).__name__}, not a string",
            "pass --text-field naming a text field, or fix the record",
        )
    return text


def open_parquet(file: InputFile) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(file.open() if file.remote else file.path)
    except (pa.ArrowException, OSError) as e:  # a store's own failures were retried and raised as FetchError
        raise DataError(
            f"{file.name} is not a readable Parquet file ({e})", "check the file, or export it again"
        ) from None


def parquet_column(parquet: pq.ParquetFile, path: str, text_field: str) -> None:
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise DataError(
            f"{path} has no column {text_field!r} (columns: {', '.join(schema.names)})",
            "pass --text-field with the name of the column that holds the text",
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(
            f"{path}: column {text_field!r} has type {kind}, not string", "pass --text-field naming a string column"
        )


def iter_parquet(file: InputFile, start: int, text_field: str) -> Iterator[tuple[int, str, int]]:
    """Rows from `start` on, skipping whole row groups that lie before it."""
    parquet = open_parquet(file)
    parquet_column(parquet, file.name, text_field)
    meta = parquet.metadata
    first_group, row = 0, 0
    while first_group < meta.num_row_groups and row + meta.row_group(first_group).num_rows <= start:
        row += meta.row_group(first_group).num_rows
        first_group += 1
    groups = list(range(first_group, meta.num_row_groups))
    total = max(meta.num_rows, 1)
    for batch in parquet.iter_batches(PARQUET_BATCH_ROWS, row_groups=groups, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if row >= start:
                if text is None:
                    raise DataError(
                        f"{file.name} row {row}: column {text_field!r} is null",
                        "drop or fill the null rows, or pass --text-field naming another column",
                    )
                yield row, text, file.size * (row + 1) // total
            row += 1


class FileSource:
    """Files as a tokenize source: progress is counted in bytes of input read."""

    unit = "bytes"

    def __init__(self, inputs: Sequence[Path | str]) -> None:
        self.files = find_input_files(inputs)
        self.offsets = [0, *accumulate(f.size for f in self.files)]
        self.total: int | None = self.offsets[-1]

    def check(self, text_field: str) -> None:
        if self.total == 0:
            raise DataError(
                f"no documents found: the input files are empty ({self.files[0].name}…)", "check the inputs"
            )
        for file in self.files:
            check_text_field(file, text_field)

    def identity(self) -> dict:
        return {"files": [f.identity() for f in self.files]}

    def describe(self) -> list[str]:
        return [f.name for f in self.files]

    def documents(self, text_field: str, start: tuple[int, int] = (0, 0)) -> Iterator[Document]:
        return iter_documents(self.files, text_field, start)

    def position(self, doc: Document) -> int:
        return self.offsets[doc.file] + doc.consumed

    def start_at(self, position: int) -> tuple[int, int]:
        """The first file that holds input past `position`: the files before it end at or before it."""
        return bisect.bisect_right(self.offsets, position) - 1, 0
