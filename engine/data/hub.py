"""A Hugging Face dataset as a `forge tokenize` source: `hf:NAME` on the command line.

NAME is what `datasets.load_dataset` takes (a Hub id such as `HuggingFaceFW/fineweb-edu`, or a local
folder of data files), or a folder written by `save_to_disk`. Eager mode has `datasets` download and convert
the configuration to Arrow once (every split of it, into the `datasets` cache), then reads the split in
batches; `streaming` reads rows as they are tokenized, so a corpus larger than the disk can be tokenized. A
document is one row, addressed by its row index, so an interrupted run resumes by skipping the rows already
tokenized (a streaming rerun reads through them again without encoding them).

A rerun resumes only when the data is the same: the source's fingerprint is the eager dataset's own
(`datasets` derives it from the data files), a saved folder's, or for a stream the hash `datasets` gives the
builder (it follows the data files' modification for local folders and the resolved commit for the Hub).

`datasets` is an optional dependency (`pip install 'forge-lm[hf]'`), imported only when such a source is used.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.data.sources import Document
from engine.errors import DataError

if TYPE_CHECKING:
    from engine.data.tokenize import DatasetOptions

PREFIX = "hf:"
READ_BATCH_ROWS = 1024
DEFAULT_SPLIT = "train"


def open_input(name: str, options: DatasetOptions) -> HubSource:
    """`forge tokenize hf:NAME` with its options: how the `hf` kind (engine/data/kinds.py) opens documents."""
    return HubSource(name, options.config, options.split, options.streaming, options.revision)


class HubSource:
    """One split of a Hugging Face dataset; progress is counted in rows (unknown total for some streams)."""

    unit = "rows"

    def __init__(
        self,
        name: str,
        config: str | None = None,
        split: str | None = None,
        streaming: bool = False,
        revision: str | None = None,
    ) -> None:
        if not name:
            raise DataError("hf: names no dataset", "write hf:NAME, e.g. hf:HuggingFaceFW/fineweb-edu")
        self.name, self.config, self.streaming, self.revision = name, config, streaming, revision
        self.dataset, self.fingerprint, self.split = load(name, config, split, streaming, revision)
        self.total: int | None = rows_of(self.dataset, self.split)

    def check(self, text_field: str) -> None:
        columns = self.dataset.column_names
        if columns is None:  # a stream that does not declare its features: look at its first row
            first = next(self.guarded(iter(self.dataset.take(1)), 0), None)
            columns = list(first) if first is not None else [text_field]
        if text_field not in columns:
            raise DataError(
                f"{self} has no column {text_field!r} (columns: {', '.join(columns)})",
                "pass --text-field with the name of the column that holds the text",
            )
        kind = (self.dataset.features or {}).get(text_field)
        if kind is not None and getattr(kind, "dtype", None) not in ("string", "large_string"):
            raise DataError(
                f"{self}: column {text_field!r} has type {kind}, not string", "pass --text-field naming a string column"
            )
        if self.total == 0:
            raise DataError(f"no documents found: {self} has no rows", "check the dataset, --hf-config and --split")

    def identity(self) -> dict:
        """What a rerun must match to resume: which split, read how, and the data's fingerprint."""
        return {
            "hf": {
                "name": self.name,
                "config": self.config,
                "split": self.split,
                "streaming": self.streaming,
                "revision": self.revision,
                "fingerprint": self.fingerprint,
            }
        }

    def describe(self) -> list[str]:
        return [str(self)]

    def documents(self, text_field: str, start: tuple[int, int] = (0, 0)) -> Iterator[Document]:
        """Every non-empty row from row `start[1]` on (`start[0]` is always 0: one source, one 'file')."""
        assert start[0] == 0, start
        row = start[1]
        rows = self.dataset.select_columns([text_field])
        if row:
            rows = rows.skip(row)
        for batch in self.guarded(rows.iter(batch_size=READ_BATCH_ROWS), row):
            for text in batch[text_field]:
                if text is None:
                    raise DataError(
                        f"{self} row {row}: column {text_field!r} is null",
                        "drop or fill the null rows, or pass --text-field naming another column",
                    )
                if not isinstance(text, str):
                    raise DataError(
                        f"{self} row {row}: column {text_field!r} is {type(text).__name__}, not a string",
                        "pass --text-field naming a text column",
                    )
                if text and not text.isspace():
                    yield Document(0, row, text, row + 1)
                row += 1

    def guarded(self, items: Iterator[dict], row: int) -> Iterator[dict]:
        """`items` (rows, or batches of rows from row `row` on), with data that cannot be parsed (a stream reads
        its files only now) turned into a DataError; network failures are not, so an interrupted download
        leaves the output to resume from."""
        import datasets
        import pyarrow as pa

        while True:
            try:
                item = next(items)
            except StopIteration:
                return
            except (KeyError, ValueError, pa.ArrowInvalid, datasets.exceptions.DatasetGenerationError) as e:
                raise DataError(
                    f"{self}: could not read the rows from row {row} on ({type(e).__name__}: {e})",
                    "check the dataset's files and --text-field",
                ) from None
            values = next(iter(item.values()), None)
            row += len(values) if isinstance(values, list) else 1
            yield item

    def position(self, doc: Document) -> int:
        return doc.consumed

    def start_at(self, position: int) -> tuple[int, int]:
        """Row `position`: the rows before it end at or before it (a row's position is its index + 1)."""
        return 0, position

    def __str__(self) -> str:
        config = f" ({self.config})" if self.config else ""
        split = f" split {self.split!r}" if self.split is not None else ""
        return f"{PREFIX}{self.name}{config}{split}"


def load(
    name: str, config: str | None, split: str | None, streaming: bool, revision: str | None
) -> tuple[Any, str, str | None]:
    """The split as a `datasets.Dataset` (eager) or `IterableDataset` (streaming), its fingerprint, and the
    split's name. Any failure to find or read it is a DataError that names the dataset."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading a Hugging Face dataset (hf:NAME) needs the datasets package",
            "pip install 'forge-lm[hf]' (or pip install datasets)",
        ) from None
    where = f"Hugging Face dataset {name!r}" + (f" ({config})" if config else "")
    local = Path(name).is_dir()
    if local and revision is not None:
        raise DataError(f"--revision names a version of a Hub dataset; {name} is a local folder", "drop --revision")
    try:
        if saved_to_disk(Path(name)):
            if config is not None:
                raise DataError(f"{name} was written by save_to_disk: it has no configurations", "drop --hf-config")
            dataset = one_split(datasets.load_from_disk(name), split, name)
            chosen = split if split is not None else dataset.split and str(dataset.split)
            return (dataset.to_iterable_dataset() if streaming else dataset), dataset._fingerprint, chosen
        split = split or DEFAULT_SPLIT
        dataset = datasets.load_dataset(name, config, split=split, streaming=streaming, revision=revision)
        if streaming:  # a stream has no fingerprint of its own; the builder's hash follows the data files
            return dataset, datasets.load_dataset_builder(name, config, revision=revision).hash, split
        return dataset, dataset._fingerprint, split
    except DataError:
        raise
    except (OSError, ValueError, RuntimeError, datasets.exceptions.DatasetsError) as e:
        raise DataError(
            f"could not load {where}: {e}",
            "check the name (a Hub id or a local folder), --hf-config and --split; for a gated or "
            "private dataset log in first (`hf auth login`); offline (HF_HUB_OFFLINE=1), only "
            "datasets already in the cache load",
        ) from None


def saved_to_disk(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` (dataset_dict.json)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def one_split(saved: Any, split: str | None, name: str) -> Any:
    """A saved DatasetDict's split (default: train), or a saved single Dataset, which must be the split asked
    for when a split is asked for."""
    if hasattr(saved, "keys"):
        split = split or DEFAULT_SPLIT
        if split not in saved:
            raise DataError(
                f"{name} has no split {split!r} (splits: {', '.join(saved.keys())})", "pass --split naming one of them"
            )
        return saved[split]
    if split is not None and (saved.split is None or str(saved.split) != split):
        held = f"the split {str(saved.split)!r}" if saved.split is not None else "one data set without a split name"
        raise DataError(f"{name} holds {held}, not {split!r}", "drop --split")
    return saved


def rows_of(dataset: Any, split: str | None) -> int | None:
    """Rows in the split: exact for an eager dataset, from the dataset card's split sizes for a stream (if any)."""
    if getattr(dataset, "num_rows", None) is not None:
        return int(dataset.num_rows)
    splits = getattr(dataset.info, "splits", None) or {}
    info = splits.get(split) if split is not None else None
    return int(info.num_examples) if info is not None and info.num_examples else None
