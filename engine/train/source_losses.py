"""A mixture's training loss per source: the mean cross-entropy of each source's tokens in one optimizer step.

Every row of a mixture's micro-batch is a window of one source (engine/data/loader.py: SourceWindows), so the
loss function's per-token cross-entropy (`on_token_losses`, engine/train/losses.py) is summed per row and
added into its source's slot with one `index_add_`, together with the row's token count, over all the step's
micro-batches. At a logged step the sums and counts of all ranks are added with one all-reduce and divided:
the global mean over the step's whole batch, whatever the layout. Data-parallel (and expert-parallel) ranks
add their own rows; context-parallel ranks their own positions of the same rows; tensor-parallel ranks hold
equal copies, which multiply a source's sum and its count alike and so leave the mean unchanged; with
pipeline parallelism only the ranks of the last stage compute losses, the others add zeros.

The value is plain cross-entropy, as `eval_loss/NAME` is: without z-loss and the MoE auxiliary losses, so
with neither the token-weighted mean of the sources' losses is the step's `loss`.
"""

from __future__ import annotations

import torch

from engine.resilience.collectives import distributed


class SourceLosses:
    """Per-source sums of token losses and token counts over one step's micro-batches (on this rank)."""

    def __init__(self, names: tuple[str, ...], device: torch.device) -> None:
        self.names = names
        # [loss sum, tokens], float64: a big run's step passes 2^24 tokens of a source (global batch × tp
        # copies), past which fp32 no longer counts by ones
        self.totals = torch.zeros(2, len(names), dtype=torch.float64, device=device)

    def add(self, token_losses: torch.Tensor, sources: torch.Tensor) -> None:
        """token_losses [rows, seq] (this rank's positions of each row), sources int64 [rows]."""
        rows, seq = token_losses.shape
        assert sources.shape == (rows,), (sources.shape, token_losses.shape)
        per_row = torch.stack(
            [
                token_losses.float().sum(dim=1).double(),
                torch.full((rows,), float(seq), dtype=torch.float64, device=token_losses.device),
            ]
        )
        self.totals.index_add_(1, sources.to(self.totals.device), per_row.to(self.totals.device))

    def recorder(self, sources: torch.Tensor):
        """The `on_token_losses` callback of a micro-batch whose rows come from `sources`."""
        return lambda token_losses: self.add(token_losses, sources)

    def metrics(self) -> dict[str, float]:
        """`loss/NAME` for every source with tokens in the step, over all ranks (a collective: every rank calls
        it at the same steps)."""
        totals = self.totals.clone()
        if distributed():
            torch.distributed.all_reduce(totals)
        sums, tokens = totals.tolist()
        return {f"loss/{name}": s / n for name, s, n in zip(self.names, sums, tokens) if n > 0}
