"""Chunked cross-entropy equals plain cross-entropy (loss and gradients), z-loss is PaLM's, and the
chunked loss never holds the [tokens, vocab] logits. The equalities are checked in float64 (parity.FP64_TOL):
the two losses are one function summed in another order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config.train import TrainConfig
from engine.train.losses import StageCrossEntropy, build_loss, chunked_cross_entropy, cross_entropy
from tests.helpers.parity import FP64_TOL

BATCH, SEQ, DIM, VOCAB = 3, 13, 16, 97  # 39 tokens: chunks of 8 leave a short last one


def inputs(seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, DIM, generator=g, dtype=dtype, requires_grad=True)
    weight = (torch.randn(VOCAB, DIM, generator=g, dtype=dtype) * 0.5).requires_grad_()
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return hidden, weight, labels


def loss_and_grads(loss_of, z: float, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    hidden, weight, labels = inputs(dtype=dtype)
    loss = loss_of(hidden, weight, labels, z)
    (loss * 1.7).backward()  # a non-unit upstream gradient
    return loss.detach(), hidden.grad, weight.grad


def plain(hidden, weight, labels, z):
    return cross_entropy(hidden @ weight.T, labels, z)


def test_plain_cross_entropy_and_z_loss_formulas(parity):
    hidden, weight, labels = inputs()
    logits = (hidden @ weight.T).flatten(0, 1)
    expected = F.cross_entropy(logits, labels.flatten()) + 1e-2 * (torch.logsumexp(logits, -1) ** 2).mean()
    parity.close(plain(hidden, weight, labels, 1e-2), expected, atol=FP64_TOL, what="loss")


@pytest.mark.parametrize("z", [0.0, 1e-2])
@pytest.mark.parametrize("chunk", [8, 39, 1000])
def test_chunked_equals_plain(z, chunk, parity):
    expected = loss_and_grads(plain, z)
    got = loss_and_grads(lambda h, w, y, z: chunked_cross_entropy(h, w, y, chunk, z), z)
    assert got[0].dtype == torch.float64
    for what, a, b in zip(("loss", "hidden gradient", "head gradient"), got, expected):
        parity.close(a, b, atol=FP64_TOL, what=what)


def test_chunked_under_bf16_autocast_is_close_to_plain(parity):
    """Both losses take bf16 logits (a product over DIM = 16 rounded once to bf16, U = 2^-8 ≈ 3.9e-3) and
    round their gradients' products to bf16 again, in other orders: ≈ 2 roundings each side, a relative
    deviation up to 4U ≈ 1.6e-2 (rtol 2e-2); atol 2e-3 covers entries that cancel to near 0, whose
    deviation is U times the size of their terms (≤ 0.5 here)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = loss_and_grads(plain, 1e-3, torch.float32)
        got = loss_and_grads(lambda h, w, y, z: chunked_cross_entropy(h, w, y, 8, z), 1e-3, torch.float32)
    assert got[0].dtype == torch.float32
    for what, a, b in zip(("loss", "hidden gradient", "head gradient"), got, expected):
        parity.close(a, b, rtol=2e-2, atol=2e-3, what=what)


def test_chunked_does_the_plain_losss_matmuls_once_and_none_without_grad(parity):
    """Training: exactly the plain loss's matmul FLOPs (forward + the two gradient products; the logits
    are not recomputed). Evaluation (no grad): the forward product only."""
    from torch.utils.flop_counter import FlopCounterMode

    in_place = {torch.ops.aten.addmm_: lambda out, a, b, *args, **kwargs: 2 * a[0] * a[1] * b[1]}  # not in torch's
    flops = {}
    for name, loss_of in (("plain", plain), ("chunked", lambda h, w, y, z: chunked_cross_entropy(h, w, y, 8, z))):
        with FlopCounterMode(display=False, custom_mapping=in_place) as counter:
            loss_of(*inputs(), 1e-2).backward()
        flops[name] = counter.get_total_flops()
    assert flops["chunked"] == flops["plain"] == 3 * 2 * BATCH * SEQ * DIM * VOCAB
    hidden, weight, labels = inputs()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        loss = chunked_cross_entropy(hidden, weight, labels, 8, 1e-2)
    assert counter.get_total_flops() == 2 * BATCH * SEQ * DIM * VOCAB
    parity.close(loss, plain(hidden, weight, labels, 1e-2).detach(), atol=FP64_TOL, what="evaluation loss")


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_never_holds_all_logits():
    hidden, weight, labels = inputs()
    with LargestTensor() as seen:
        chunked_cross_entropy(hidden, weight, labels, 8, 1e-2).backward()
    assert seen.largest <= max(8 * VOCAB, weight.numel(), hidden.numel())
    with LargestTensor() as plain_seen:
        plain(*inputs(), 1e-2).backward()
    assert plain_seen.largest == BATCH * SEQ * VOCAB  # the check above would see them


def test_model_losses_agree_and_eval_drops_z_loss(parity):
    from engine.config.model import ModelConfig
    from engine.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=97, max_seq_len=16)).double()
    tokens = torch.randint(0, 97, (2, 16))
    results = []
    for name in ("cross_entropy", "chunked_cross_entropy"):
        cfg = TrainConfig(loss_fn=name, z_loss_weight=1e-2, **({"ce_chunk_size": 5} if "chunked" in name else {}))
        loss_fn = build_loss(cfg)
        model.zero_grad()
        loss = loss_fn(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append(
            (
                loss.detach(),
                [p.grad.clone() for p in model.parameters()],
                loss_fn(model, tokens[:, :-1], tokens[:, 1:], z_loss=False).detach(),
            )
        )
    (plain_loss, plain_grads, plain_ce), (chunked_loss, chunked_grads, chunked_ce) = results
    parity.close(chunked_loss, plain_loss, atol=FP64_TOL, what="training loss")
    assert len(chunked_grads) == len(plain_grads) > 0
    parity.close(chunked_grads, plain_grads, atol=FP64_TOL, what="gradients")
    expected_ce = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    parity.close(plain_ce, expected_ce.detach(), atol=FP64_TOL, what="plain eval loss")
    parity.close(chunked_ce, expected_ce.detach(), atol=FP64_TOL, what="chunked eval loss")
    assert plain_loss > plain_ce


def test_the_pipeline_stage_loss_leaves_z_loss_out_for_evaluation():
    logits, labels = torch.randn(2, 5, 11) * 4, torch.randint(0, 11, (2, 5))
    stage_loss = StageCrossEntropy(z_loss_weight=0.1)
    assert torch.equal(stage_loss(logits, labels), cross_entropy(logits, labels, 0.1))
    with stage_loss.plain():
        assert torch.equal(stage_loss(logits, labels), cross_entropy(logits, labels))
    assert torch.equal(stage_loss(logits, labels), cross_entropy(logits, labels, 0.1))


@pytest.mark.parametrize("z", [0.0, 1e-3])
def test_token_losses_leave_the_loss_bitwise_unchanged(z, parity):
    """Asking for the per-token losses (a mixture's per-source accounting) changes neither loss nor gradients
    by a bit, for both losses; the plain loss stays bitwise F.cross_entropy; the tokens' values are torch's
    reduction='none' cross-entropy."""
    hidden, weight, labels = inputs()
    reference = F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten(), reduction="none")
    for loss_of in (
        lambda keep: cross_entropy(hidden @ weight.T, labels, z, keep),
        lambda keep: chunked_cross_entropy(hidden, weight, labels, 8, z, keep),
    ):
        results = []
        for keep in (None, []):
            hidden.grad = weight.grad = None
            loss = loss_of(None if keep is None else keep.append)
            loss.backward()
            results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
        assert all(torch.equal(a, b) for a, b in zip(*results))
        assert len(keep) == 1 and keep[0].shape == labels.shape and not keep[0].requires_grad
        parity.close(keep[0].flatten(), reference.detach(), atol=FP64_TOL, what="token losses")
    logits = (hidden @ weight.T).detach()
    assert torch.equal(cross_entropy(logits, labels), F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    stage_loss = StageCrossEntropy(z)
    with stage_loss.recording() as recorded:
        stage_loss(logits[:2], labels[:2])
        stage_loss(logits[2:], labels[2:])
    assert stage_loss.token_losses is None and [t.shape for t in recorded] == [(2, SEQ), (1, SEQ)]
    parity.close(torch.cat(recorded).flatten(), reference.detach(), atol=FP64_TOL, what="recorded token losses")
