"""Training losses, chosen by `train.loss_fn`. Computed in fp32 whatever the compute dtype (in float64 for a
float64 model, as the parity tests run them).

A registered loss is built from `[train]` and called as `loss(model, tokens, labels)`: it runs the model
itself, because chunked cross-entropy needs the hidden states before the output head, not the logits.
Both losses are the mean next-token cross-entropy plus, with `train.z_loss_weight` = w > 0, the z-loss
w · mean(logsumexp(logits)²) (PaLM, Chowdhery et al. 2022), which keeps the softmax normaliser near 1
and the logits from drifting. A mixture-of-experts model adds the weighted auxiliary losses of its
routers (balance, sequence balance, router z-loss; `Transformer.moe_loss()`) of the same forward.
Evaluation calls them with `z_loss=False`, so eval loss is plain CE: neither z-loss nor MoE losses.
A model with multi-token prediction (`model.mtp_depth` = D > 0, engine/model/mtp.py) adds, in training,
`model.mtp_loss_weight` × the mean over its D modules of their cross-entropy (module k against labels[:, k:],
computed like the main loss, without z-loss); the main loss and each module's are summed, detached, in the
model's `mtp_loss_window` for the logged metrics (`mtp_metrics`).

Given `on_token_losses`, a loss also hands it each token's cross-entropy ([batch, seq] fp32, detached), a
by-product of the loss it computes anyway (the log-probabilities' gather, the chunks' per-token values): a
mixture's step sums them per source (engine/train/source_losses.py). The returned loss is bitwise the same
with or without it.

Loss parallelism: under tensor parallelism `cross_entropy` reduces vocabulary-sharded DTensor logits inside
`loss_parallel()` (engine/parallel/tp.py), and `chunked_cross_entropy` takes the head's own vocabulary shard
(`VocabShard`): each rank computes its shard's logits chunk by chunk, and only per-token values (the max, the
sum of exponentials, the target logit) and, once, the hidden states' gradient cross the tensor-parallel group.
Under pipeline parallelism the last stage computes either loss (`StageCrossEntropy`); for the chunked one it
returns the final-normed hidden states instead of logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from engine.config.registry import LOSSES
from engine.config.train import TrainConfig
from engine.model.spec import spec_for

TokenLosses = Callable[[torch.Tensor], None]  # receives each token's cross-entropy, [batch, seq] fp32, detached


class ModelLoss(Protocol):
    def __call__(
        self,
        model: torch.nn.Module,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        *,
        z_loss: bool = True,
        doc_ids: torch.Tensor | None = None,
        on_token_losses: TokenLosses | None = None,
    ) -> torch.Tensor: ...


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float = 0.0, on_token_losses: TokenLosses | None = None
) -> torch.Tensor:
    """Mean next-token cross-entropy (+ z-loss); logits [batch, seq, vocab], labels [batch, seq].

    Written as log_softmax then nll_loss, which is exactly how F.cross_entropy computes it (same kernels,
    same autograd graph), so that the log-probabilities are there to gather each token's loss from."""
    shape = labels.shape
    # fp32 at least: bf16 logits are upcast, float64 ones (the parity tests' models) kept
    logits, labels = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)), labels.flatten()
    log_probs = F.log_softmax(logits, dim=-1)
    loss = F.nll_loss(log_probs, labels)
    if on_token_losses is not None:
        on_token_losses(plain_tensor(F.nll_loss(log_probs.detach(), labels, reduction="none")).reshape(shape))
    if z_loss_weight:
        loss = loss + z_loss_weight * logsumexp(logits).square().mean()
    return loss


class StageCrossEntropy:
    """The loss as a pipeline schedule calls it on the last stage (the stage's output and the labels, not the
    model): `cross_entropy` of the logits, or with `chunk_size` set, `chunked_cross_entropy` of the final-normed
    hidden states (`takes_hidden`: the pipeline then asks its stages for them) through the head of the module
    `bind_head` gave, the last stage's copy of `output`. Evaluation runs through the same schedule and reports
    plain CE, so it turns z-loss off for its pass. With multi-token prediction (`bind_predictions`) a
    training forward's stage output holds the modules' outputs after the main one along the batch, whose loss
    is added as one process adds it (`with_mtp_loss`); evaluation's stages run the main model alone."""

    def __init__(self, z_loss_weight: float, chunk_size: int | None = None) -> None:
        self.z_loss_weight, self.training, self.chunk_size = z_loss_weight, True, chunk_size
        self.head: torch.nn.Module | None = None  # chunked: the last stage's output module (weight looked up per call)
        self.predictions: torch.nn.Module | None = None  # the last stage, when it runs multi-token prediction
        self.token_losses: list[torch.Tensor] | None = None  # while `recording`: each microbatch's, in call order

    @property
    def takes_hidden(self) -> bool:
        return self.chunk_size is not None

    def bind_head(self, head: torch.nn.Module) -> None:
        """The output module whose weight the chunked loss projects through (on the rank of the last stage)."""
        self.head = head

    def bind_predictions(self, stage: torch.nn.Module) -> None:
        """The last stage of a model with multi-token prediction (on that stage's rank): its output carries
        `stage.cfg.mtp_depth` module outputs after the main one (engine/parallel/pipeline.py), and `stage` keeps
        the losses `mtp_metrics` reports."""
        self.predictions = stage

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.predictions is None or not self.training:  # evaluation's stages run the main model alone
            return self.main_loss(output, labels)
        main, *depth = output.chunk(1 + self.predictions.cfg.mtp_depth)
        return with_mtp_loss(self.predictions, self.main_loss(main, labels), depth, labels, self.depth_loss)

    def main_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        keep = self.token_losses.append if self.token_losses is not None else None
        z_weight = self.z_loss_weight if self.training else 0.0
        if self.chunk_size is None:
            return cross_entropy(output, labels, z_weight, keep)
        assert self.head is not None, "the chunked stage loss needs bind_head() on the last stage's rank"
        return head_cross_entropy(output, self.head.weight, labels, self.chunk_size, z_weight, keep)

    def depth_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A prediction module's loss: as the main one, without z-loss (as one process computes it)."""
        if self.chunk_size is None:
            return cross_entropy(output, labels)
        return head_cross_entropy(output, self.head.weight, labels, self.chunk_size)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Collects the per-token losses of every call inside the block (on the last stage), for a mixture's
        per-source losses: the schedule computes the microbatches' in order, after its one shape-inference
        call on its first step."""
        self.token_losses = []
        try:
            yield self.token_losses
        finally:
            self.token_losses = None

    @contextlib.contextmanager
    def plain(self) -> Iterator[None]:
        """Evaluation's pass: plain cross-entropy of the main output (no z-loss, no prediction modules' loss)."""
        self.training = False
        try:
            yield
        finally:
            self.training = True


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the per-token losses under loss parallel) as a plain tensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim from max, exp, sum and log: under loss parallelism (vocabulary-sharded
    logits) each of these reduces shard-locally plus one small all-reduce, where torch.logsumexp would
    first gather all the logits."""
    peak = logits.detach().amax(dim=-1, keepdim=True)
    return (logits - peak).exp().sum(dim=-1).log() + peak.squeeze(-1)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    z_loss_weight: float = 0.0,
    on_token_losses: TokenLosses | None = None,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """`cross_entropy(hidden @ weightᵀ, labels, z_loss_weight)` without ever holding all the logits.

    hidden [batch, seq, dim] (the final-normed states), weight [vocab, dim] (the output head). The logits
    of `chunk_size` tokens at a time are computed, reduced to their loss and, when gradients are wanted,
    turned in place into their gradient and from it into the gradients of the hidden states and of the head,
    then dropped. Peak extra memory is a few [chunk_size, vocab] fp32 buffers instead of several
    [tokens, vocab] ones, and the FLOPs are those of the plain loss (no recomputation); the separate
    log-softmax, its backward and their zero-fills over [tokens, vocab] never run. Under autocast the
    matmuls run in the autocast dtype, as the output Linear's would.

    With `shard` (loss parallelism), `weight` is this rank's rows of the head (`shard.start` on) and the
    chunks' logits those of its vocabulary; every rank of `shard.group` passes the same hidden states and
    labels and gets the same loss, and its gradient of its own rows."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    keep = on_token_losses is not None
    loss, token_losses = ChunkedCrossEntropy.apply(
        hidden.flatten(0, 1), weight, labels.flatten(), chunk_size, z_loss_weight, dtype, with_grads, keep, shard
    )
    if keep:
        on_token_losses(token_losses.reshape(labels.shape))
    return loss


def head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    z_loss_weight: float = 0.0,
    on_token_losses: TokenLosses | None = None,
) -> torch.Tensor:
    """`chunked_cross_entropy` of a model's final hidden states through its head, as they come: plain tensors,
    or under tensor parallelism a sequence-sharded DTensor and the vocabulary-sharded head. Then the hidden
    states are all-gathered over the sequence (every rank projects all tokens through its own rows; their
    gradient flows back as this rank's slice of the summed, replicated whole) and the head is never gathered."""
    shard = VocabShard.of(weight)
    if shard is not None:
        if isinstance(hidden, DTensor):
            hidden = hidden.redistribute(hidden.device_mesh, [Replicate()] * hidden.device_mesh.ndim).to_local()
        weight = weight.to_local()
    else:  # plain, or sharded other than by rows over one mesh dimension: the whole matrix, as on one device
        hidden, weight = (t.full_tensor() if isinstance(t, DTensor) else t for t in (hidden, weight))
    return chunked_cross_entropy(hidden, weight, labels, chunk_size, z_loss_weight, on_token_losses, shard)


class VocabShard:
    """Where this rank's rows of a vocabulary-sharded head lie, and the reductions over the group that holds
    the others: every per-token value of the softmax (its max, its sum, the target's logit) is the reduction
    of the ranks' values over their own columns."""

    def __init__(self, group: dist.ProcessGroup, start: int, rows: int) -> None:
        self.group, self.start, self.rows = group, start, rows

    @classmethod
    def of(cls, weight: torch.Tensor) -> VocabShard | None:
        """The shard of a head sharded by rows over a 1-D mesh (tensor parallelism's "vocab_head"), else None."""
        if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or weight.placements != (Shard(0),):
            return None
        shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        return cls(weight.device_mesh.get_group(), offset[0], shape[0])

    def max(self, value: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return value

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(value, group=self.group)
        return value


class ChunkedCrossEntropy(torch.autograd.Function):
    """Forward computes, chunk by chunk, each token's loss and (for training) d loss / d logits =
    (softmax · (1 + 2w·lse) − onehot(label)) / tokens, and from it the gradients of the hidden states
    and of the head; backward only scales those by the incoming gradient (a scalar: the loss is a mean).
    The gradients are computed before backward asks for them, which is what lets each chunk's logits be
    dropped as soon as it is done, without computing them again in backward. Its second output is each
    token's cross-entropy when `keep_tokens` (else empty), not differentiable.

    With a `VocabShard` the columns are this rank's vocabulary: two small all-reduces per chunk (the max,
    then the sum of exponentials with the target logit, which only its owner's shard holds), and one of the
    hidden states' gradient at the end (each rank's is the part through its own rows)."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        z_loss_weight: float,
        dtype: torch.dtype,
        with_grads: bool,
        keep_tokens: bool,
        shard: VocabShard | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = labels.numel()
        exact = torch.promote_types(weight.dtype, torch.float32)  # fp32, or float64 for a float64 model
        with torch.autocast(hidden.device.type, enabled=False):
            head = weight.to(dtype)
            # labels as columns of this rank's logits; `owned` marks the tokens whose label is among them
            columns, owned = labels, None
            if shard is not None:
                columns = labels - shard.start
                owned = (columns >= 0) & (columns < shard.rows)
                columns = columns.clamp(0, max(shard.rows - 1, 0))
            lse = torch.empty(labels.shape, dtype=exact, device=hidden.device)
            nll = torch.zeros((), dtype=exact, device=hidden.device)
            token_nll = torch.empty(labels.shape if keep_tokens else 0, dtype=exact, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if with_grads else None
            grad_head = torch.zeros(weight.shape, dtype=exact, device=weight.device) if with_grads else None
            for chunk in chunks(tokens, chunk_size):
                h = hidden[chunk].to(dtype)
                logits = (h @ head.T).to(exact)
                mine = None if owned is None else owned[chunk]
                grad_logits, lse[chunk], target = softmax_grad(logits, columns[chunk], z_loss_weight, shard, mine)
                if with_grads:
                    grad_logits = grad_logits.to(dtype)
                    grad_hidden[chunk] = grad_logits @ head
                    accumulate_product(grad_head, grad_logits.T, h)
                chunk_nll = lse[chunk] - target
                nll += chunk_nll.sum()
                if keep_tokens:
                    token_nll[chunk] = chunk_nll
            loss = (nll + z_loss_weight * lse.square().sum()) / tokens
            if with_grads and shard is not None:  # each rank's part: through its own rows of the head
                shard.sum(grad_hidden)
        if with_grads:  # the mean's 1/tokens last, in the gradients' own dtype: nothing small is rounded to bf16
            ctx.save_for_backward(grad_hidden.div_(tokens), grad_head.div_(tokens).to(weight.dtype))
        ctx.mark_non_differentiable(token_nll)
        return loss, token_nll

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_token_nll: torch.Tensor):
        grad_hidden, grad_head = ctx.saved_tensors
        scale = grad_loss.to(grad_hidden.dtype)
        grad_weight = grad_head * scale if ctx.needs_input_grad[1] else None
        grad_hidden = grad_hidden * scale if ctx.needs_input_grad[0] else None
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def softmax_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    z_loss_weight: float,
    shard: VocabShard | None = None,
    owned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens × d loss / d logits, logsumexp, the labels' logits) for one chunk, the gradient written over
    `logits` (fp32) in four passes (max, exp of the difference, sum, scale): the summed cross-entropy's
    softmax − onehot, with z-loss's 2w·lse·softmax added. Values in [-1, 1 + 2w·lse], safe to round to
    bf16/fp16. With a `shard`, `logits` are this rank's columns, `labels` the columns of the tokens it `owned`
    (clamped into range for the others), and the max and the sums are reduced over the shard's group."""
    target = logits.gather(1, labels[:, None]).squeeze(1)
    peak = logits.amax(dim=-1)
    if shard is not None:
        peak = shard.max(peak)
        target = target * owned
    grad = logits.sub_(peak[:, None]).exp_()
    total = grad.sum(dim=-1)
    if shard is not None:
        total, target = shard.sum(torch.stack([total, target])).unbind()
    lse = total.log() + peak
    scale = total.reciprocal()
    if z_loss_weight:
        scale = scale * (1 + 2 * z_loss_weight * lse)
    grad.mul_(scale[:, None])
    hit = torch.ones_like(target) if owned is None else owned.to(grad.dtype)
    grad.scatter_add_(1, labels[:, None], -hit[:, None])  # − onehot(label): only where this rank holds it
    return grad, lse, target


def accumulate_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, in place when the dtypes allow (fp32), else through one product in a's dtype."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total.add_(a @ b)


def chunks(total: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


def with_moe_loss(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """`loss` plus the MoE auxiliary losses of the forward that produced it (none for a dense model)."""
    moe_loss = model.moe_loss() if hasattr(model, "moe_loss") else None
    if moe_loss is None:
        return loss
    if isinstance(loss, DTensor):  # loss parallel: a replicated DTensor; the MoE losses are the same on every rank
        moe_loss = DTensor.from_local(
            moe_loss, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False
        )
    return loss + moe_loss


def uses_mtp(model: torch.nn.Module, training: bool) -> bool:
    """Whether this call adds the multi-token-prediction loss: in training, on a model that has the modules."""
    return training and getattr(model, "mtp", None) is not None


def with_mtp_loss(
    model: torch.nn.Module,
    main: torch.Tensor,
    outputs: list[torch.Tensor],
    labels: torch.Tensor,
    depth_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """main + mtp_loss_weight × mean_k depth_loss(outputs[k−1] at positions 0 … seq − k − 1, labels[:, k:]):
    module k's whole-window output (Transformer.mtp_outputs) predicts at its first seq − k positions. Adds every
    loss, detached ([1 + D], main first), to the model's `mtp_loss_window` (sum, forwards), which `mtp_metrics`
    empties."""
    seq = labels.shape[1]
    depth = [depth_loss(out[:, : seq - k], labels[:, k:]) for k, out in enumerate(outputs, start=1)]
    # plain tensors: under loss parallel the losses are replicated DTensors, and mtp_metrics all-reduces these
    losses = torch.stack([plain_tensor(value.detach()) for value in (main, *depth)])
    total, count = getattr(model, "mtp_loss_window", (0, 0))
    model.mtp_loss_window = (total + losses, count + 1)
    return main + model.cfg.mtp_loss_weight * torch.stack(depth).mean()


def mtp_metrics(model: torch.nn.Module, group: object = None) -> dict[str, float]:
    """`loss_main` and `mtp/loss_{k}`: the mean over the training forwards (micro-batches) since the last
    report, and over the data-parallel `group` (each rank runs as many), as `loss` is the step's mean."""
    total, count = getattr(model, "mtp_loss_window", (0, 0))
    if not count:
        return {}
    model.mtp_loss_window = (0, 0)
    losses = total / count
    if group is not None:
        torch.distributed.all_reduce(losses, group=group)
        losses /= torch.distributed.get_world_size(group)
    main, *depth = losses.tolist()
    return {"loss_main": main, **{f"mtp/loss_{k}": value for k, value in enumerate(depth, start=1)}}


@LOSSES.register("cross_entropy")
def full_logits_loss(cfg: TrainConfig) -> ModelLoss:
    def loss(
        model: torch.nn.Module,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        *,
        z_loss: bool = True,
        doc_ids: torch.Tensor | None = None,
        on_token_losses: TokenLosses | None = None,
    ) -> torch.Tensor:
        if uses_mtp(model, z_loss):
            logits, extra = model(tokens, doc_ids=doc_ids, mtp=True)
        else:
            logits, extra = model(tokens, doc_ids=doc_ids), []
        value = cross_entropy(logits, labels, cfg.z_loss_weight if z_loss else 0.0, on_token_losses)
        if extra:
            value = with_mtp_loss(model, value, extra, labels, cross_entropy)
        return with_moe_loss(model, value) if z_loss else value

    return loss


@LOSSES.register("chunked_cross_entropy")
def chunked_loss(cfg: TrainConfig) -> ModelLoss:
    def loss(
        model: torch.nn.Module,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        *,
        z_loss: bool = True,
        doc_ids: torch.Tensor | None = None,
        on_token_losses: TokenLosses | None = None,
    ) -> torch.Tensor:
        if uses_mtp(model, z_loss):
            hidden, extra = model(tokens, return_hidden=True, doc_ids=doc_ids, mtp=True)
        else:
            hidden, extra = model(tokens, return_hidden=True, doc_ids=doc_ids), []
        weight = spec_for(model.cfg).parts.head_of(model).weight
        z_weight = cfg.z_loss_weight if z_loss else 0.0
        value = head_cross_entropy(hidden, weight, labels, cfg.ce_chunk_size, z_weight, on_token_losses)
        if extra:  # each module's final-normed states, as the main model's (sequence-sharded under tp)
            value = with_mtp_loss(
                model, value, extra, labels, lambda h, y: head_cross_entropy(h, weight, y, cfg.ce_chunk_size)
            )
        return with_moe_loss(model, value) if z_loss else value

    return loss


def build_loss(cfg: TrainConfig) -> ModelLoss:
    return LOSSES.get(cfg.loss_fn)(cfg)
