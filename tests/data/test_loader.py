"""Reading shards: checks before training, sample windows, the deterministic order and its layout independence."""

from __future__ import annotations

import json
import shutil
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from engine.data.loader import open_eval_data, open_train_data
from engine.data.sampler import BatchLayout, EpochOrder
from engine.errors import DataError
from tests.helpers.data_fixtures import all_tokens, corpus_texts, job_config, tokenized, tokenizer_file


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 documents, ~18k tokens in shards of 1000 (so windows of 17 leave remainders in every shard)."""
    return tokenized(tmp_path_factory.mktemp("loader"))


@pytest.fixture
def data_copy(data: Path, tmp_path: Path) -> Path:
    """A private copy, for tests that damage it."""
    shutil.copytree(data, tmp_path / "data")
    shutil.copy(data.parent / "tokenizer" / "tokenizer.json", tmp_path / "tokenizer.json")
    return tmp_path / "data"


def micro_batches(
    cfg_overrides: tuple[str, ...], data: Path, dp_size: int = 1, start_step: int = 0, count: int = 8
) -> list[list[torch.Tensor]]:
    """`count` micro-batches of inputs for each rank."""
    cfg = job_config(data, *cfg_overrides)
    ranks = [open_train_data(cfg, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    return [[x for x, _ in islice(rank.batches(start_step), count)] for rank in ranks]


def global_batches(batch_size: int, grad_accum: int, dp_size: int, data: Path, steps: int = 6) -> list[torch.Tensor]:
    """The samples of each optimizer step, in order: micro-step by micro-step, rank by rank."""
    per_rank = micro_batches(
        (f"train.batch_size={batch_size}", f"train.grad_accum_steps={grad_accum}"),
        data,
        dp_size,
        count=steps * grad_accum,
    )
    return [
        torch.cat([per_rank[r][s * grad_accum + m] for m in range(grad_accum) for r in range(dp_size)])
        for s in range(steps)
    ]


def test_samples_are_non_overlapping_windows_within_shards(data: Path):
    train = open_train_data(job_config(data))
    shards = [np.load(data / s.file) for s in train.manifest.shards]
    expected = [s[i * 17 : (i + 1) * 17] for s in shards for i in range(len(s) // 17)]
    assert train.num_samples == len(expected) == sum(len(s) // 17 for s in shards)
    for index in (0, 57, 58, len(expected) - 1):
        x, y = train.dataset[index]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
        assert x.tolist() == expected[index][:-1].tolist() and y.tolist() == expected[index][1:].tolist()


def test_batches_have_the_configured_shape(data: Path):
    x, y = next(open_train_data(job_config(data)).batches())
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_order_is_a_fresh_seeded_permutation_every_epoch():
    order = EpochOrder(50, seed=7)
    stream = order.take(0, 150)
    epochs = stream.reshape(3, 50)
    assert all(sorted(e.tolist()) == list(range(50)) for e in epochs)
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    assert np.array_equal(EpochOrder(50, seed=7).take(0, 150), stream)
    assert np.array_equal(EpochOrder(50, seed=7).take(37, 40), stream[37:77])  # crossing an epoch boundary
    assert not np.array_equal(EpochOrder(50, seed=8).take(0, 50), epochs[0])


def test_micro_batch_positions_follow_the_layout():
    layout = BatchLayout(batch_size=2, grad_accum_steps=3, dp_size=2, dp_rank=1)
    assert layout.global_batch == 12
    assert [layout.micro_batch_start(5, m) for m in range(3)] == [62, 66, 70]


def test_global_batch_does_not_depend_on_the_layout(data: Path):
    reference = global_batches(4, 1, 1, data)
    assert all(b.shape == (4, 16) for b in reference)
    for batch_size, grad_accum, dp_size in ((2, 1, 2), (2, 2, 1), (1, 2, 2)):
        assert all(torch.equal(a, b) for a, b in zip(reference, global_batches(batch_size, grad_accum, dp_size, data)))


def test_data_seed_decides_the_order(data: Path):
    first = micro_batches(("train.data_seed=1",), data)[0]
    assert all(torch.equal(a, b) for a, b in zip(first, micro_batches(("train.data_seed=1",), data)[0]))
    assert not torch.equal(torch.stack(first), torch.stack(micro_batches(("train.data_seed=2",), data)[0]))
    seed_only = micro_batches(("train.seed=1",), data)[0]
    assert all(torch.equal(a, b) for a, b in zip(first, seed_only))  # data_seed unset = seed


def test_start_step_resumes_the_same_sequence(data: Path):
    overrides = ("train.grad_accum_steps=2",)
    full = micro_batches(overrides, data, count=12)[0]
    resumed = micro_batches(overrides, data, start_step=4, count=4)[0]
    assert all(torch.equal(a, b) for a, b in zip(full[8:], resumed))


def test_the_order_runs_on_past_the_end_of_the_data(data: Path):
    train = open_train_data(job_config(data, "train.batch_size=64"))
    seen = torch.cat([x for x, _ in islice(train.batches(), 2 * train.num_samples // 64 + 1)])
    assert len(seen) > 2 * train.num_samples  # two full epochs and more, no StopIteration


def test_worker_processes_give_the_same_batches(data: Path):
    inline = micro_batches((), data, count=6)[0]
    workers = micro_batches(("data.num_workers=2", "data.prefetch_factor=2"), data, count=6)[0]
    assert len(inline) == len(workers) == 6
    assert all(torch.equal(a, b) for a, b in zip(inline, workers))
    batches = open_train_data(job_config(data, "data.num_workers=2")).batches()
    assert isinstance(batches, _MultiProcessingDataLoaderIter) and batches._num_workers == 2  # not read inline


def test_eval_batches_are_fixed_and_counted(data: Path, tmp_path: Path):
    held_out = tokenized(tmp_path, corpus_texts()[:2], name="heldout")
    cfg = job_config(data, "eval.enabled=true", f"eval.dataset_path={held_out}", "eval.steps=50")
    evaluation = open_eval_data(cfg)
    first, second = list(evaluation.batches()), list(evaluation.batches())
    assert len(first) == 50 and all(torch.equal(a[0], b[0]) for a, b in zip(first, second))
    windows = all_tokens(held_out)[: 17 * (len(all_tokens(held_out)) // 17)]
    assert first[0][0][0].tolist() == windows[:16].tolist()  # the first samples, in file order
    n = evaluation.num_samples
    assert n == sum(s.tokens // 17 for s in evaluation.manifest.shards) < 50 * 4  # fewer than asked for: wrap around
    assert torch.equal(first[n // 4][0][n % 4], first[0][0][0])
    ranks = [open_eval_data(cfg, dp_rank=r, dp_size=2) for r in range(2)]
    merged = [torch.cat([next(islice(r.batches(), m, None))[0] for r in ranks]) for m in range(2)]
    assert torch.equal(merged[0], torch.cat([first[0][0], first[1][0]]))
    assert open_eval_data(job_config(data)) is None


def expect_data_error(cfg, *fragments: str) -> None:
    with pytest.raises(DataError) as err:
        open_train_data(cfg)
    text = f"{err.value.message} {err.value.hint}"
    for fragment in fragments:
        assert fragment in text, text


def test_missing_and_empty_directories(tmp_path: Path):
    expect_data_error(job_config(tmp_path / "nowhere"), "data.dataset_path", "nowhere", "forge tokenize")
    (tmp_path / "empty").mkdir()
    expect_data_error(job_config(tmp_path / "empty"), "empty", "forge tokenize")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.npy").write_bytes(b"")
    expect_data_error(job_config(tmp_path / "other"), "manifest.json not found")


def test_corrupt_manifest(data_copy: Path):
    manifest = data_copy / "manifest.json"
    manifest.write_text(manifest.read_text()[:100])
    expect_data_error(job_config(data_copy), str(manifest), "corrupt", "forge tokenize again")
    raw = json.loads(json.dumps({"format": "forge-token-shards", "version": 1}))
    manifest.write_text(json.dumps(raw))
    expect_data_error(job_config(data_copy), "corrupt", "tokenizer")


def test_missing_truncated_or_retyped_shards(data_copy: Path):
    shard = data_copy / "shard-00003.npy"
    original = shard.read_bytes()
    shard.write_bytes(original[:-10])
    expect_data_error(job_config(data_copy), str(shard), "truncated")
    np.save(shard, np.load(data_copy / "shard-00004.npy").astype(np.uint32))
    expect_data_error(job_config(data_copy), str(shard), "uint32", "the manifest says")
    shard.write_bytes(original + b"\0\0")
    expect_data_error(job_config(data_copy), str(shard), "trailing bytes")
    shard.unlink()
    expect_data_error(job_config(data_copy), str(shard), "missing")


def test_shard_files_must_match_the_manifest_and_pattern(data_copy: Path):
    expect_data_error(job_config(data_copy, "data.file_pattern=part-*.npy"), "data.file_pattern", "part-*.npy")
    subset = open_train_data(job_config(data_copy, "data.file_pattern=shard-0000[0-2].npy"))
    assert subset.num_samples == 3 * (1000 // 17)
    shutil.copy(data_copy / "shard-00000.npy", data_copy / "shard-00500.npy")
    expect_data_error(job_config(data_copy), "shard-00500.npy", "not listed")


def test_tokenizer_vocabulary_must_fit_the_model(data: Path):
    expect_data_error(
        job_config(data, "model.vocab_size=300"),
        "400 tokens",
        "model.vocab_size = 300",
        "set model.vocab_size to at least 400",
    )


def test_tokenizer_path_must_be_the_one_that_made_the_shards(data_copy: Path, tmp_path: Path):
    own = tmp_path / "tokenizer.json"
    train = open_train_data(job_config(data_copy, f"data.tokenizer_path={own}"))
    assert train.tokenizer_file == own
    assert open_train_data(job_config(data_copy)).tokenizer_file == data_copy / "tokenizer.json"
    other = tokenizer_file(tmp_path / "other", vocab_size=450)
    expect_data_error(
        job_config(data_copy, f"data.tokenizer_path={other}"), "data.tokenizer_path", "is not the tokenizer"
    )
    expect_data_error(job_config(data_copy, f"data.tokenizer_path={tmp_path / 'none.json'}"), "none.json", "not found")


def test_sequence_longer_than_every_shard(data: Path):
    expect_data_error(job_config(data, "train.seq_len=1000", "model.max_seq_len=1000"), "1001", "lower train.seq_len")


def test_eval_data_must_share_the_training_tokenizer(data: Path, tmp_path: Path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"text": corpus_texts()[0]}) + "\n")
    from engine.data.tokenize import tokenize_files

    other = tokenize_files([source], tmp_path / "other", train_vocab_size=300).directory
    cfg = job_config(data, "eval.enabled=true", f"eval.dataset_path={other}")
    with pytest.raises(DataError, match="different tokenizer"):
        open_eval_data(cfg)


def test_device_batches_take_the_next_micro_batch_one_ahead_in_the_loaders_order():
    """engine.data.device_batches: `prefetch()` takes exactly one batch ahead (the step calls it before its
    sync), `next()` hands that one out, and the order and the end are the loader's. (On CPU the tensors are
    used where they are; the CUDA side stream is for GPUs.)"""
    from engine.data.device_batches import DeviceBatches

    taken: list[int] = []

    def loader():
        for i in range(3):
            taken.append(i)
            yield torch.tensor([i]), torch.tensor([i + 1]), torch.tensor([7])

    batches = DeviceBatches(loader(), torch.device("cpu"))
    assert [t.tolist() for t in next(batches)] == [[0], [1], [7]] and taken == [0]
    batches.prefetch()
    batches.prefetch()  # one ahead at most
    assert taken == [0, 1]
    assert next(batches)[0].tolist() == [1] and taken == [0, 1]
    assert next(batches)[0].tolist() == [2] and taken == [0, 1, 2]
    batches.prefetch()  # the loader is done: nothing ahead, and the next next() ends as the loader does
    with pytest.raises(StopIteration):
        next(batches)
