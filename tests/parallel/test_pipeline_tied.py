"""Pipeline parallelism with tied embeddings, as a user starts it (`forge train --nproc-per-node 2`, gloo on
CPU): pp = 2 (1F1B) against one process on the same global batch — per-step losses, gradient norms,
evaluation and the final weights within 1e-5 — and its checkpoint resumes in one process with the
uninterrupted run's next loss. The embedding (first stage) and the head (last stage) are two copies of one
matrix whose gradients are summed after each step (engine/parallel/pipeline.py): without that sum, or with
the head copy decayed like a plain head, the runs part within two steps."""

from __future__ import annotations

import pytest
import torch

from engine.config import load_job_config
from engine.parallel.memory import estimate_memory
from engine.plan import check_config
from tests.helpers.layouts import PIPELINE, assert_same_run, forge, records, tolerance, weights

pytestmark = pytest.mark.slow

TIED = ["--model.tie_embeddings=true", "--train.loss_fn=cross_entropy"]  # both runs: the loss a pipeline takes


def test_tied_embeddings_pipelined_match_one_process_and_resume_in_one(tmp_path, parity):
    single, piped = tmp_path / "single", tmp_path / "pp2"
    result = forge(single, *TIED)
    assert result.returncode == 0, result.stderr[-3000:]
    result = forge(piped, *TIED, *PIPELINE, "--distributed.pp_schedule=1f1b", nproc=2, batch_size=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(piped, single, parity)
    final = weights(piped)  # both copies were saved (one per stage) and are still equal
    torch.testing.assert_close(final["output.weight"], final["tok_embeddings.weight"], rtol=0, atol=0)
    # Step 7 in one process, from each run's step-6 checkpoint.
    for run_dir in (single, piped):
        result = forge(run_dir, *TIED, "--train.max_steps=7")
        assert result.returncode == 0, result.stderr[-3000:]
    gap = abs(records(piped)[7]["loss"] - records(single)[7]["loss"])
    parity.within("loss step 7", gap, tolerance(single).loss_at(7))


def test_the_copy_of_a_tied_head_is_in_the_memory_estimate():
    base = ["--distributed.pp=2", "--train.grad_accum_steps=2"]
    tied = estimate_memory(check_config(load_job_config(None, [*base, "--model.tie_embeddings=true"]), 2), 2)
    untied = estimate_memory(check_config(load_job_config(None, base), 2), 2)
    assert [s.params for s in tied] == [s.params for s in untied]  # the last stage holds the head either way
