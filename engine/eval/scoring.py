"""Log-likelihoods of continuations, many requests per forward.

A request is (context ids, continuation ids): the log-probability the model gives the continuation after the
context, and whether greedy decoding would have produced it. Each request is first cut as lm-evaluation-harness
cuts it for a decoder-only model: the last `max_len + 1` tokens of context + continuation are kept (a request
longer than the model's context loses its oldest tokens, never an error) and the last one is not fed.

Requests are then laid out to waste as little compute as possible while computing exactly what one request
alone would:
  - requests that share their (cut) context — the choices of a multiple-choice question — become one
    *segment*: the context once, then each continuation as a branch that attends to the context and to its own
    earlier tokens only, at the positions it would have had alone;
  - segments are packed side by side into rows (first fit, longest first); a row's attention mask keeps every
    segment to itself, so nothing is padded per request, only each row to the batch's longest;
  - one forward per batch of rows returns hidden states; the output head and the log-softmax run only at the
    positions that are scored (a continuation's tokens), not at every position of every row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.errors import UserError
from engine.eval.split import ALONE, WorkSplit
from engine.model.spec import LanguageModel, spec_for

Request = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids); the context is never empty


@dataclass
class Branch:
    """One distinct continuation of a segment: the tokens it feeds after the context (all but its last) and
    the tokens it is scored on; `requests` are the indices of every request that asked for exactly it."""

    fed: tuple[int, ...]
    targets: tuple[int, ...]
    requests: list[int] = field(default_factory=list)


@dataclass
class Segment:
    """A context and the continuations scored after it, laid out in one stretch of a row."""

    context: tuple[int, ...]
    branches: list[Branch] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.context) + sum(len(b.fed) for b in self.branches)


def cut(context: Sequence[int], continuation: Sequence[int], max_len: int) -> tuple[tuple[int, ...], Branch]:
    """The harness's cut: of context + continuation, the last max_len + 1 tokens, of which all but the last are
    fed; the continuation's tokens are predicted from the fed context's last token and its own earlier ones."""
    if not continuation:
        raise UserError("a request has an empty continuation", "every choice of a task needs some text")
    if len(continuation) > max_len:
        raise UserError(
            f"a continuation of {len(continuation)} tokens is longer than the model's context ({max_len} tokens)",
            "shorten the task's choices, or use a model with a larger model.max_seq_len",
        )
    whole = (*context, *continuation)[-(max_len + 1) :]
    fed = whole[:-1]
    split = len(fed) - len(continuation) + 1  # the fed context: everything before the continuation's own tokens
    return fed[:split], Branch(fed[split:], tuple(continuation))


def segments(requests: Sequence[Request], max_len: int, width: int) -> list[Segment]:
    """Requests grouped by their cut context into segments of at most `width` tokens (a context with more
    continuations than fit is split into several segments); identical requests share one branch."""
    by_context: dict[tuple[int, ...], dict[tuple, Branch]] = {}
    for index, (context, continuation) in enumerate(requests):
        kept, branch = cut(context, continuation, max_len)
        branches = by_context.setdefault(kept, {})
        branches.setdefault((branch.fed, branch.targets), branch).requests.append(index)
    out = []
    for context, branches in by_context.items():
        segment = Segment(context)
        for branch in branches.values():
            if segment.branches and len(segment) + len(branch.fed) > width:
                out.append(segment)
                segment = Segment(context)
            segment.branches.append(branch)
        out.append(segment)
    return out


def pack(items: list[Segment], width: int) -> list[list[Segment]]:
    """Rows of segments, each row at most `width` tokens: first fit, longest segment first."""
    rows: list[list[Segment]] = []
    room: list[int] = []
    for segment in sorted(items, key=len, reverse=True):
        size = len(segment)
        slot = next((i for i, left in enumerate(room) if left >= size), None)
        if slot is None:
            rows.append([segment])
            room.append(width - size)
        else:
            rows[slot].append(segment)
            room[slot] -= size
    return rows


@dataclass
class Layout:
    """A batch of rows as tensors: tokens, each token's position in its own request, the attention mask, and
    for every (request, scored token) the flat index of the hidden state that predicts it and the target."""

    tokens: torch.Tensor  # [rows, width] int64
    positions: torch.Tensor  # [rows, width] int64
    mask: torch.Tensor  # [rows, 1, width, width] bool: query i may attend to key j
    scored: torch.Tensor  # [n] int64 indices into the flattened [rows * width] hidden states
    targets: torch.Tensor  # [n] int64
    owners: list[tuple[list[int], int, int]]  # per branch: (its requests, start and end in scored/targets)


def layout(rows: list[list[Segment]], device: torch.device) -> Layout:
    """Lay out `rows` side by side. A token carries its segment and branch (0: the context); query i sees key j
    when j ≤ i in the same segment and j is in the context or in i's own branch. Padding sees only itself."""
    width = max(sum(len(s) for s in row) for row in rows)
    tokens, positions, segment_ids, branch_ids = ([[0] * width for _ in rows] for _ in range(4))
    scored, targets, owners = [], [], []
    next_segment = 1
    for r, row in enumerate(rows):
        at = 0
        for segment in row:
            n = len(segment.context)
            tokens[r][at : at + n] = segment.context
            positions[r][at : at + n] = range(n)
            segment_ids[r][at : at + n] = [next_segment] * n
            last_context = r * width + at + n - 1
            at += n
            for b, branch in enumerate(segment.branches, start=1):
                m = len(branch.fed)
                tokens[r][at : at + m] = branch.fed
                positions[r][at : at + m] = range(n, n + m)
                segment_ids[r][at : at + m] = [next_segment] * m
                branch_ids[r][at : at + m] = [b] * m
                start = len(scored)
                scored += [last_context, *range(r * width + at, r * width + at + m)]
                targets += branch.targets
                owners.append((branch.requests, start, len(scored)))
                at += m
            next_segment += 1
        for pad in range(at, width):  # each padding token is a segment of its own
            positions[r][pad] = pad - at
            segment_ids[r][pad] = -(pad + 1)
    seg = torch.tensor(segment_ids, device=device)
    branch = torch.tensor(branch_ids, device=device)
    index = torch.arange(width, device=device)
    causal = index[None, :] <= index[:, None]
    same_segment = seg[:, :, None] == seg[:, None, :]
    visible_branch = (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
    mask = (causal & same_segment & visible_branch)[:, None]
    return Layout(
        torch.tensor(tokens, device=device),
        torch.tensor(positions, device=device),
        mask,
        torch.tensor(scored, device=device),
        torch.tensor(targets, device=device),
        owners,
    )


@torch.no_grad()
def score(
    model: LanguageModel,
    requests: Sequence[Request],
    batch_size: int,
    progress: Callable[[int], None] | None = None,
    split: WorkSplit = ALONE,
) -> list[tuple[float, bool]]:
    """(log-probability of the continuation, whether greedy decoding gives it) for every request, in order.

    A forward holds at most `batch_size` rows as wide as the longest single request (after the cut): the
    memory of the harness's own first batch, holding many more requests when they are short or share contexts.
    `progress` is called with the number of requests each forward finished. Under a `split`, every process
    lays out the same batches from all the requests (so a bad request fails on every process alike), computes
    its share of them and gathers the rest: each answer is the one a single process computes."""
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size} must be at least 1")
    if not requests:
        return []
    max_len = model.cfg.max_seq_len
    width = max(min(len(c) + len(t), max_len + 1) - 1 for c, t in requests)
    rows = pack(segments(requests, max_len, width), width)
    parts = spec_for(model.cfg).parts
    device = parts.embedding_of(model).weight.device
    results: dict[int, tuple[float, bool]] = {}
    batches = range(0, len(rows), batch_size)
    for first in (batches[i] for i in split.mine(len(batches))):
        batch = layout(rows[first : first + batch_size], device)
        hidden = model(batch.tokens, positions=batch.positions, attention_mask=batch.mask, return_hidden=True)
        picked = hidden.flatten(0, 1)[batch.scored]
        logits = parts.head_of(model)(picked)  # log-softmax in fp32 at least (in fp64 for an fp64 model)
        logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        chosen = logprobs.gather(1, batch.targets[:, None])[:, 0]
        greedy = logprobs.argmax(dim=-1) == batch.targets
        done = 0
        for owners, start, end in batch.owners:
            value = (float(chosen[start:end].sum()), bool(greedy[start:end].all()))
            for index in owners:
                results[index] = value
            done += len(owners)
        if progress is not None:
            progress(done)
    results = split.gather(results)
    return [results[index] for index in range(len(requests))]
