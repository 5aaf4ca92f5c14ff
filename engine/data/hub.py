"""A Hugging Face dataset as a `forge tokenize` source: `hf:NAME` on the command line.

NAME is what `datasets.load_dataset` takes (a Hub id such as `HuggingFaceFW/fineweb-edu`, or a local
folder of data files), or a folder written by `Dataset.save_to_disk`. Eager mode downloads and converts the
split to Arrow once (the `datasets` cache), then reads it in batches; `streaming` reads rows over the network
as they are tokenized, so a corpus larger than the disk can be tokenized. A document is one row; it is
addressed by its row index, so an interrupted run resumes by skipping the rows already tokenized (a
streaming rerun reads through them again without encoding them).

`datasets` is an optional dependency (`pip install 'forge-lm[hf]'`), imported only when such a source is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from engine.data.sources import Document
from engine.errors import DataError

PREFIX = "hf:"
READ_BATCH_ROWS = 1024


def is_hub_input(text: str) -> bool:
    return text.startswith(PREFIX)


class HubSource:
    """One split of a Hugging Face dataset; progress is counted in rows (unknown total for some streams)."""

    unit = "rows"

    def __init__(self, name: str, config: str | None = None, split: str = "train", streaming: bool = False,
                 revision: str | None = None) -> None:
        if not name:
            raise DataError("hf: names no dataset", "write hf:NAME, e.g. hf:HuggingFaceFW/fineweb-edu")
        self.name, self.config, self.split, self.streaming, self.revision = name, config, split, streaming, revision
        self.dataset = load(name, config, split, streaming, revision)
        self.total: int | None = rows_of(self.dataset, split)

    def check(self, text_field: str) -> None:
        columns = self.dataset.column_names
        if columns is not None and text_field not in columns:
            raise DataError(f"{self} has no column {text_field!r} (columns: {', '.join(columns)})",
                            "pass --text-field with the name of the column that holds the text")
        kind = (self.dataset.features or {}).get(text_field)
        if kind is not None and getattr(kind, "dtype", None) not in ("string", "large_string"):
            raise DataError(f"{self}: column {text_field!r} has type {kind}, not string",
                            "pass --text-field naming a string column")
        if self.total == 0:
            raise DataError(f"no documents found: {self} has no rows", "check the dataset, --hf-config and --split")

    def identity(self) -> dict:
        """What a rerun must match to resume. An eager dataset's fingerprint follows its content; a stream has
        none, so only its name, configuration, split and revision (pin --revision to resume a moving dataset)."""
        fingerprint = None if self.streaming else self.dataset._fingerprint
        return {"hf": {"name": self.name, "config": self.config, "split": self.split, "streaming": self.streaming,
                       "revision": self.revision, "fingerprint": fingerprint}}

    def describe(self) -> list[str]:
        return [str(self)]

    def documents(self, text_field: str, start: tuple[int, int] = (0, 0)) -> Iterator[Document]:
        """Every non-empty row from row `start[1]` on (`start[0]` is always 0: one source, one 'file')."""
        assert start[0] == 0, start
        row = start[1]
        rows = self.dataset.select_columns([text_field])
        if row:
            rows = rows.skip(row)
        for batch in rows.iter(batch_size=READ_BATCH_ROWS):
            for text in batch[text_field]:
                if text is None:
                    raise DataError(f"{self} row {row}: column {text_field!r} is null",
                                    "drop or fill the null rows, or pass --text-field naming another column")
                if not isinstance(text, str):
                    raise DataError(f"{self} row {row}: column {text_field!r} is {type(text).__name__}, not a string",
                                    "pass --text-field naming a text column")
                if text and not text.isspace():
                    yield Document(0, row, text, row + 1)
                row += 1

    def position(self, doc: Document) -> int:
        return doc.consumed

    def __str__(self) -> str:
        config = f" ({self.config})" if self.config else ""
        return f"{PREFIX}{self.name}{config} split {self.split!r}"


def load(name: str, config: str | None, split: str, streaming: bool, revision: str | None) -> Any:
    """The split as a `datasets.Dataset` (eager) or `IterableDataset` (streaming); any failure to find or
    read it is a DataError that names the dataset."""
    try:
        import datasets
    except ImportError:
        raise DataError("reading a Hugging Face dataset (hf:NAME) needs the datasets package",
                        "pip install 'forge-lm[hf]' (or pip install datasets)") from None
    where = f"Hugging Face dataset {name!r}" + (f" ({config})" if config else "")
    try:
        if saved_to_disk(Path(name)):
            if config is not None or revision is not None:
                raise DataError(f"{name} was written by save_to_disk: it has no configurations or revisions",
                                "drop --hf-config and --revision")
            dataset = one_split(datasets.load_from_disk(name), split, name)
            return dataset.to_iterable_dataset() if streaming else dataset
        return datasets.load_dataset(name, config, split=split, streaming=streaming, revision=revision)
    except DataError:
        raise
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise DataError(f"could not load {where}: {e}",
                        "check the name (a Hub id or a local folder), --hf-config and --split; for a gated or "
                        "private dataset log in first (`hf auth login`); offline (HF_HUB_OFFLINE=1), only "
                        "datasets already in the cache load") from None


def saved_to_disk(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` (dataset_dict.json)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def one_split(saved: Any, split: str, name: str) -> Any:
    """A saved DatasetDict's split, or a saved single Dataset whose split (if it records one) is `split`."""
    if not hasattr(saved, "keys"):
        if saved.split is not None and str(saved.split) != split:
            raise DataError(f"{name} holds the split {str(saved.split)!r}, not {split!r}",
                            f"pass --split {saved.split}")
        return saved
    if split not in saved:
        raise DataError(f"{name} has no split {split!r} (splits: {', '.join(saved.keys())})",
                        "pass --split naming one of them")
    return saved[split]


def rows_of(dataset: Any, split: str) -> int | None:
    """Rows in the split: exact for an eager dataset, from the dataset card's split sizes for a stream (if any)."""
    if hasattr(dataset, "num_rows") and dataset.num_rows is not None:
        return int(dataset.num_rows)
    splits = getattr(dataset.info, "splits", None) or {}
    info = splits.get(split)
    return int(info.num_examples) if info is not None and info.num_examples else None
