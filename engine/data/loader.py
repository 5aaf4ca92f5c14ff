"""Token shards → micro-batches for the training loop, through a torch DataLoader.

`open_train_data` / `open_eval_data` do every check up front (manifest, shard files, tokenizer fingerprint,
vocabulary against the model) and raise DataError before a run writes anything. A sample is a window of
`train.seq_len + 1` tokens (inputs = the first seq_len, labels = the last seq_len); windows do not overlap
and never cross a shard boundary. Which samples each micro-step gets is decided in `engine.data.sampler`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from fnmatch import fnmatch
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from engine.config import JobConfig
from engine.data.batch_plan import batch_plan
from engine.data.embedded import cache_dir, embedded_corpus
from engine.data.mixture import Phase, SourceDraws, mixture_phases
from engine.data.sampler import BatchLayout, EpochOrder, EvalBatchSampler, MixtureBatchSampler, TrainBatchSampler
from engine.data.shards import MANIFEST, TOKENIZER_FILE, Manifest, ShardInfo, open_shard, read_manifest
from engine.data.source_kinds import SourceSpec, parse_source, section_source, source_directory, train_sources
from engine.data.tokenizer import file_sha256
from engine.errors import DataError

SLOW_KINDS = ("remote", "hf")  # source kinds that fetch or tokenize on first use
IDENTITY_SAMPLE_TOKENS = 4096  # tokens at each end of a shard that its identity covers

Batch = tuple[torch.Tensor, ...]  # (inputs, labels), and for a mixture the rows' sources (SourceWindows)


class TokenWindows(Dataset[Batch]):
    """Sample i = the i-th window of `seq_len + 1` tokens, counting shard by shard.

    Holds memory maps, never token data: pickling it to DataLoader workers sends only the paths, and each
    worker maps the files itself.
    """

    def __init__(self, arrays: Sequence[np.ndarray], paths: Sequence[Path], seq_len: int, vocab_size: int) -> None:
        self.paths, self.window, self.vocab_size = list(paths), seq_len + 1, vocab_size
        self._arrays: list[np.ndarray] | None = list(arrays)
        self.starts = np.concatenate([[0], np.cumsum([len(a) // self.window for a in arrays])])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> Batch:
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        offset = (index - int(self.starts[shard])) * self.window
        window = self.arrays[shard][offset : offset + self.window]
        if window.max() >= self.vocab_size:  # a shard of the right size whose bytes were damaged
            raise DataError(
                f"{self.paths[shard]} holds token id {int(window.max())}, outside its tokenizer's "
                f"vocabulary of {self.vocab_size}: the shard is corrupt",
                "re-run forge tokenize for this data set",
            )
        tokens = torch.from_numpy(window.astype(np.int64))
        return tokens[:-1], tokens[1:]

    @property
    def arrays(self) -> list[np.ndarray]:
        if self._arrays is None:
            self._arrays = [np.load(p, mmap_mode="r") for p in self.paths]
        return self._arrays

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}


class SourceWindows(TokenWindows):
    """A mixture's windows, source after source (source i owns samples offsets[i] … offsets[i+1]-1): a sample
    is (inputs, labels, source index), so a step knows which source each row came from and can report each
    source's loss (engine/train/source_losses.py)."""

    def __init__(self, windows: Sequence[TokenWindows], seq_len: int, vocab_size: int) -> None:
        arrays, paths = [a for w in windows for a in w.arrays], [p for w in windows for p in w.paths]
        super().__init__(arrays, paths, seq_len, vocab_size)
        self.offsets = tuple(int(x) for x in np.cumsum([0, *(len(w) for w in windows)]))

    def __getitem__(self, index: int) -> Batch:
        source = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return (*super().__getitem__(index), torch.tensor(source))


@dataclass
class TokenData:
    """One verified data set and how this rank batches it."""

    directory: Path
    manifest: Manifest
    tokenizer_file: Path | None  # the tokenizer.json the shards were made with, if known
    dataset: TokenWindows
    layout: BatchLayout
    loader_options: dict[str, Any] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return len(self.dataset)

    def loader(self, batch_sampler: TrainBatchSampler | EvalBatchSampler, **extra: Any) -> DataLoader:
        # Its own generator: a DataLoader otherwise draws its workers' base seed from the global torch RNG,
        # so iterating data would shift the random stream a resumed run must reproduce.
        return DataLoader(
            self.dataset, batch_sampler=batch_sampler, generator=torch.Generator(), **self.loader_options, **extra
        )


@dataclass
class TrainData(TokenData):
    seed: int = 0
    names: tuple[str, ...] = ()  # a mixture's sources, whose index each batch row carries; () for one data set

    def metrics(self, steps_done: int) -> dict[str, float]:
        """What a logged step reports about the data after `steps_done` steps: nothing for one source."""
        return {}

    def batches(self, start_step: int = 0) -> Iterator[Batch]:
        """Endless micro-batches `(inputs, labels)`, int64 [batch_size, seq_len], from optimizer step
        `start_step` on: grad_accum_steps micro-batches per step, the same global batch for any layout."""
        order = EpochOrder(self.num_samples, self.seed)
        return iter(self.loader(TrainBatchSampler(order, self.layout, start_step)))

    def identity(self) -> str:
        """The training data as a resume must find it again: the tokenizer, and for every shard training reads
        its length and first and last IDENTITY_SAMPLE_TOKENS tokens (so reordered or replaced text of the same
        length is caught without reading the whole data set). Where the text came from, the file format and
        the file names are left out: tokenized again from the same text, or moved, it is the same data."""
        m = self.manifest
        digest = hashlib.sha256(json.dumps([m.tokenizer_sha256, m.vocab_size, m.eos_id, m.dtype]).encode())
        for tokens in self.dataset.arrays:
            digest.update(len(tokens).to_bytes(8, "little"))
            digest.update(np.ascontiguousarray(tokens[:IDENTITY_SAMPLE_TOKENS]).tobytes())
            digest.update(np.ascontiguousarray(tokens[-IDENTITY_SAMPLE_TOKENS:]).tobytes())
        return digest.hexdigest()[:16]


@dataclass
class MixtureData(TrainData):
    """Several sources behind one `SourceWindows` (source i owns windows offsets[i] … offsets[i+1]-1), drawn
    from by `engine.data.mixture`; `directory` and `manifest` are the first source's (all share a tokenizer)."""

    offsets: tuple[int, ...] = ()
    phases: tuple[Phase, ...] = ()

    @property
    def source_windows(self) -> list[int]:
        return [b - a for a, b in zip(self.offsets, self.offsets[1:])]

    @cached_property
    def _counter(self) -> SourceDraws:
        return SourceDraws(self.phases, self.layout.step_sequences, self.seed)

    def batches(self, start_step: int = 0) -> Iterator[Batch]:
        # Each source's own endless shuffled stream, seeded apart from the others and from the source draws.
        orders = [EpochOrder(n, (self.seed, i)) for i, n in enumerate(self.source_windows)]
        draws = SourceDraws(self.phases, self.layout.step_sequences, self.seed)
        return iter(self.loader(MixtureBatchSampler(draws, orders, self.offsets, self.layout, start_step)))

    def metrics(self, steps_done: int) -> dict[str, float]:
        """Per source, over the whole run so far (every rank's draws, known without communication): the
        tokens drawn (`data/tokens/NAME`, input tokens) and the passes over the source (`data/epochs/NAME`;
        above 1 means it ran out and is being reused in a new shuffled epoch)."""
        drawn = self._counter.before(steps_done)
        seq_len = self.dataset.window - 1
        metrics: dict[str, float] = {}
        for name, count, windows in zip(self.names, drawn.tolist(), self.source_windows):
            metrics[f"data/tokens/{name}"] = count * seq_len
            metrics[f"data/epochs/{name}"] = count / windows
        return metrics


@dataclass
class EvalData(TokenData):
    steps: int | str = 1
    per_source: dict[str, EvalData] = field(default_factory=dict)  # mixture sources' own held-out sets by name

    @cached_property
    def sampler(self) -> EvalBatchSampler:
        return EvalBatchSampler(self.num_samples, self.layout, self.steps)

    @cached_property
    def _loader(self) -> DataLoader:
        persistent = {"persistent_workers": True} if self.loader_options.get("num_workers") else {}
        return self.loader(self.sampler, **persistent)

    @property
    def whole(self) -> bool:
        """eval.steps = "all": every held-out window once, weighted by its tokens (`sampler.weights`)."""
        return self.steps == "all"

    def batches(self) -> Iterator[Batch]:
        """Exactly `eval.steps` micro-batches (or this rank's share of the whole set), the same on every call."""
        return iter(self._loader)


def open_train_data(cfg: JobConfig, dp_rank: int = 0, dp_size: int = 1) -> TrainData:
    """The training shards of `cfg.data` (the embedded corpus when no data set is named), verified; a mixture
    when `data.datasets` lists sources."""
    ramp = cfg.train.batch_ramp_start is not None  # the layout takes the plan only where steps differ in size
    plan = batch_plan(cfg, dp=dp_size)
    layout = BatchLayout(cfg.train.batch_size, plan.full // plan.unit, dp_size, dp_rank, plan if ramp else None)
    if cfg.data.datasets:
        return open_mixture(cfg, layout)
    spec = train_sources(cfg)[0]
    directory = source_directory(cfg, spec, lambda: train_tokenizer(cfg))
    parts = verified(directory, spec.field, cfg.data.file_pattern, "data.file_pattern", cfg)
    return TrainData(*parts, layout, loader_options(cfg), seed=cfg.train.effective_data_seed)


def open_mixture(cfg: JobConfig, layout: BatchLayout) -> MixtureData:
    """Every `[[data.datasets]]` source verified like a single data set, all with one tokenizer. The sources
    that already have shards are opened first, so a mistake in any of them (another tokenizer, say) stops the
    run before a Hugging Face source is tokenized or a remote one fetched, which can take hours; the mixture
    keeps the config's order."""
    sources, specs = cfg.data.datasets, train_sources(cfg)
    order = sorted(range(len(sources)), key=lambda i: specs[i].kind in SLOW_KINDS)  # stable: config order
    opened: dict[int, tuple[Path, Manifest, Path | None, TokenWindows]] = {}
    for i in order:
        field = specs[i].field
        directory = source_directory(cfg, specs[i], lambda: train_tokenizer(cfg))
        opened[i] = verified(directory, field, cfg.data.file_pattern, "data.file_pattern", cfg)
        first = order[0]
        if opened[i][1].tokenizer_sha256 != opened[first][1].tokenizer_sha256:
            raise DataError(
                f"{field} {directory} was tokenized with a different tokenizer than {opened[first][0]} "
                f"(data.datasets.{first}, {sources[first].name!r})",
                "tokenize every source with the same tokenizer.json (forge tokenize --tokenizer)",
            )
    parts = [opened[i] for i in range(len(sources))]
    dataset = SourceWindows([p[3] for p in parts], cfg.train.seq_len, parts[0][1].vocab_size)
    return MixtureData(
        *parts[0][:3],
        dataset,
        layout,
        loader_options(cfg),
        seed=cfg.train.effective_data_seed,
        names=tuple(s.name for s in cfg.data.datasets),
        offsets=dataset.offsets,
        phases=tuple(mixture_phases(cfg.data)),
    )


def open_eval_data(
    cfg: JobConfig, dp_rank: int = 0, dp_size: int = 1, train: TokenData | None = None
) -> EvalData | None:
    """The held-out shards of `cfg.eval` (the embedded corpus's held-out works when training uses the embedded
    corpus and eval names no data set), verified; None when evaluation is off, or runs only eval.tasks and names
    no held-out data. `train`, the opened training
    data, saves finding it again."""
    if not cfg.eval.enabled:
        return None
    if train is not None:
        train_dir = train.directory
    else:
        train_dir = source_directory(cfg, train_sources(cfg)[0], lambda: train_tokenizer(cfg))
    d = cfg.data
    spec = section_source(cfg, "eval")
    tokenizer = Path(d.tokenizer_path) if d.tokenizer_path else train_dir / TOKENIZER_FILE
    if spec is not None:
        directory = source_directory(cfg, spec, lambda: tokenizer)
    elif all(source.kind == "embedded" for source in train_sources(cfg)):
        directory = embedded_corpus().val
    elif cfg.eval.tasks:
        return None  # downstream tasks only (engine/eval/in_training.py): no held-out loss
    else:
        raise DataError(
            "eval is enabled but eval.dataset_path is unset",
            "set eval.dataset_path to held-out shards written by forge tokenize (or eval.hf_dataset_name), "
            "or eval.enabled = false",
        )
    layout = BatchLayout(cfg.train.batch_size, 1, dp_size, dp_rank)
    per_source = {
        source.name: held_out(
            source_directory(cfg, parse_source(source.eval_path, f"data.datasets.{i}.eval_path"), lambda: tokenizer),
            f"data.datasets.{i}.eval_path",
            cfg,
            train_dir,
            layout,
        )
        for i, source in enumerate(d.datasets)
        if source.eval_path is not None
    }
    return held_out(directory, spec.field if spec else "eval.dataset_path", cfg, train_dir, layout, per_source)


def held_out(
    directory: Path,
    path_field: str,
    cfg: JobConfig,
    train_dir: Path,
    layout: BatchLayout,
    per_source: dict[str, EvalData] | None = None,
) -> EvalData:
    parts = verified(directory, path_field, cfg.eval.file_pattern, "eval.file_pattern", cfg)
    check_same_tokenizer(parts[1], directory, train_dir, path_field)
    return EvalData(*parts, layout, loader_options(cfg), steps=cfg.eval.steps, per_source=per_source or {})


def train_tokenizer(cfg: JobConfig) -> Path:
    """What a training source on the Hugging Face Hub is tokenized with: data.tokenizer_path, else (a mixture)
    the tokenizer.json beside its first source that has shards (every source must share it; validation
    requires data.tokenizer_path for a flat data.hf_dataset_name, and a source with shards otherwise)."""
    if cfg.data.tokenizer_path is not None:
        return Path(cfg.data.tokenizer_path)
    first: SourceSpec = next(spec for spec in train_sources(cfg) if spec.kind != "hf")
    return source_directory(cfg, first, lambda: train_tokenizer(cfg)) / TOKENIZER_FILE


def loader_options(cfg: JobConfig) -> dict[str, Any]:
    options: dict[str, Any] = {"num_workers": cfg.data.num_workers, "pin_memory": cfg.data.pin_memory}
    if cfg.data.prefetch_factor is not None:
        options["prefetch_factor"] = cfg.data.prefetch_factor
    return options


def verified(
    directory: Path, path_field: str, pattern: str, pattern_field: str, cfg: JobConfig
) -> tuple[Path, Manifest, Path | None, TokenWindows]:
    """Everything a data set must satisfy before training starts; each failure names the file and field.
    Returns the first four fields of a `TokenData`."""
    if not directory.is_dir():
        raise DataError(
            f"{path_field} {directory} is not a directory",
            f"tokenize text into it first (forge tokenize INPUT… --out {directory}) or fix {path_field}",
        )
    with rebuilt_if_cache(directory):
        manifest = read_manifest(directory)
    if manifest.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"the tokenizer of {directory / MANIFEST} has {manifest.vocab_size} tokens, "
            f"more than model.vocab_size = {cfg.model.vocab_size}",
            f"set model.vocab_size to at least {manifest.vocab_size}",
        )
    with rebuilt_if_cache(directory) if cfg.data.tokenizer_path is None else nullcontext():
        tokenizer_file = matching_tokenizer(directory, manifest, cfg.data.tokenizer_path)
    shards = selected_shards(directory, manifest, pattern, pattern_field)
    with rebuilt_if_cache(directory):
        arrays = [open_shard(directory, info, manifest.dtype) for info in shards]
    dataset = TokenWindows(arrays, [directory / s.file for s in shards], cfg.train.seq_len, manifest.vocab_size)
    if len(dataset) == 0:
        longest = max(s.tokens for s in shards)
        raise DataError(
            f"no shard of {directory} holds train.seq_len + 1 = {cfg.train.seq_len + 1} tokens "
            f"(the longest has {longest})",
            "lower train.seq_len or tokenize more text",
        )
    return directory, manifest, tokenizer_file, dataset


@contextmanager
def rebuilt_if_cache(directory: Path) -> Iterator[None]:
    """A damaged embedded-corpus cache (its manifest, tokenizer or shards) is Forge's to rebuild, so the fix
    is to delete it; a config that does not fit the corpus (vocab size, sequence length, file pattern) keeps
    its own fix, which never names the cache."""
    try:
        yield
    except DataError as e:
        if not is_embedded_cache(directory):
            raise
        raise DataError(
            e.message, f"delete {directory.parent} (the embedded corpus cache); Forge rebuilds it on the next run"
        ) from None


def is_embedded_cache(directory: Path) -> bool:
    return directory.parent.parent == cache_dir() / "corpus"


def matching_tokenizer(directory: Path, manifest: Manifest, tokenizer_path: str | None) -> Path | None:
    """data.tokenizer_path if set, else the tokenizer.json beside the shards; either must match the manifest."""
    if tokenizer_path is not None:
        path, name = Path(tokenizer_path), f"data.tokenizer_path {tokenizer_path}"
        if not path.is_file():
            raise DataError(f"{name} not found", f"fix the path, or unset it to use {directory / TOKENIZER_FILE}")
    else:
        path, name = directory / TOKENIZER_FILE, str(directory / TOKENIZER_FILE)
        if not path.is_file():
            return None
    if file_sha256(path) != manifest.tokenizer_sha256:
        raise DataError(
            f"{name} is not the tokenizer that {directory / MANIFEST} was tokenized with "
            f"(sha256 {file_sha256(path)[:12]}… ≠ {manifest.tokenizer_sha256[:12]}…)",
            "use the tokenizer.json written beside the shards, or re-tokenize with this tokenizer",
        )
    return path


def selected_shards(directory: Path, manifest: Manifest, pattern: str, pattern_field: str) -> list[ShardInfo]:
    """The manifest's shards whose names match the pattern; a matching file the manifest does not list
    means shards of different runs were mixed, so it is an error rather than silently ignored."""
    listed = {s.file for s in manifest.shards}
    strays = sorted(p.name for p in directory.glob(pattern) if p.name not in listed and p.is_file())
    if strays:
        raise DataError(
            f"{directory / strays[0]} matches {pattern_field} {pattern!r} but is not listed in {directory / MANIFEST}",
            f"remove it (and any other strays: {len(strays)}) or narrow {pattern_field}",
        )
    shards = [s for s in manifest.shards if fnmatch(s.file, pattern)]
    if not shards:
        raise DataError(
            f"no shard of {directory / MANIFEST} matches {pattern_field} {pattern!r}",
            f"use the default '*.npy' or a pattern matching names like {manifest.shards[0].file}",
        )
    return shards


def check_same_tokenizer(
    eval_manifest: Manifest, eval_directory: Path, train_directory: Path, path_field: str = "eval.dataset_path"
) -> None:
    train_manifest = read_manifest(train_directory)
    if train_manifest.tokenizer_sha256 != eval_manifest.tokenizer_sha256:
        raise DataError(
            f"{path_field} {eval_directory} was tokenized with a different tokenizer than "
            f"data.dataset_path {train_directory}",
            "tokenize the held-out text with the training data's tokenizer.json (forge tokenize --tokenizer)",
        )
