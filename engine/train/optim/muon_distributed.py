"""Each of a step's Muon matrices orthogonalized once in the job, by one rank, however the matrices are sharded.

Newton–Schulz needs the whole matrix. A sharded matrix (an FSDP2, HSDP or TP DTensor, or FSDP over TP on a
2-D mesh) is one matrix held by all the ranks of its mesh. Gathering it on every rank and iterating there,
as the first Muon did, does the same work N times and all-gathers every matrix N times. Here the matrices
on one mesh are divided among its ranks instead (`assign_owners`: largest Newton–Schulz cost first, each
to the least loaded rank, the longest-processing-time rule). Then per step:

1. one all-to-all over the mesh's ranks (flattened) sends each matrix's local blocks to its owner: every
   rank's block lies at an offset DTensor computes for any rank's coordinate (`Blocks`), a rectangle for
   FSDP's, HSDP's and TP's shards and for FSDP over TP; of replicas (HSDP) only one sends;
2. each owner places its matrices' blocks, orthogonalizes each whole matrix, and a second all-to-all sends
   every rank (replicas too) its block of each result, which becomes a DTensor of the matrix's own
   placements without any redistribution.

So each matrix costs one Newton–Schulz run in the job, and a rank receives (N − 1)/N of the matrices it
owns and 1/N of the others (against (N − 1)/N of every matrix when each rank gathers all). The exchange
runs in rounds of one matrix per owner (`orthogonalize_owned`): two collectives per N matrices, and an
owner holds one whole matrix at a time. A rank's Newton–Schulz work is at most its fair share
of the total plus the largest matrix. (`_compute_local_shape_and_global_offset` is DTensor's private helper
behind its public `compute_local_shape_and_global_offset`, which answers for the calling rank only.) The result is exactly the one-process update: the same function of the same full
matrix, computed once (tests/train/test_muon_distributed.py, float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> int:
    """The matmul FLOPs of `steps` Newton–Schulz iterations on a matrix of `shape` (on its wide orientation,
    m ≤ n): X·Xᵀ (2m²n), A·A (2m³) and B·X (2m²n) each time."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m**3)


def assign_owners(costs: list[int], ranks: int) -> list[int]:
    """The owner rank of each matrix: largest cost first (ties: the earlier matrix), each to the rank with
    the least work so far (ties: the lower rank). Every rank computes the same assignment from the same
    list. Each rank then holds at most total / ranks + the largest cost (Graham's bound for this rule)."""
    load = [0] * ranks
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        owners[j] = owner
        load[owner] += costs[j]
    return owners


def coordinates(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every rank's coordinate in a mesh of `mesh_shape`, in the flattened group's order (row-major)."""
    coords = [()]
    for size in mesh_shape:
        coords = [(*c, i) for c in coords for i in range(size)]
    return coords


@dataclass(frozen=True)
class Blocks:
    """Where each rank's local tensor of one DTensor lies in the whole matrix (a rectangle: FSDP's, HSDP's and
    TP's shards and FSDP over TP all are), by DTensor's own offset arithmetic for any rank's coordinate, and
    which ranks send it to the owner: one per distinct block (coordinate 0 on every replicated mesh dim)."""

    shapes: list[tuple[int, int]]
    offsets: list[tuple[int, int]]
    senders: list[bool]

    @classmethod
    def of(cls, update: DTensor) -> Blocks:
        mesh_shape = tuple(update.device_mesh.shape)
        replicated = [d for d, placement in enumerate(update.placements) if placement.is_replicate()]
        shapes, offsets, senders = [], [], []
        for coordinate in coordinates(mesh_shape):
            shape, offset = _compute_local_shape_and_global_offset(
                update.shape, mesh_shape, list(coordinate), update.placements
            )
            shapes.append(tuple(shape))
            offsets.append(tuple(offset))
            senders.append(all(coordinate[d] == 0 for d in replicated))
        sent = sum(rows * cols for (rows, cols), send in zip(shapes, senders) if send)
        if sent != update.numel():  # a placement whose local tensor is not one rectangle of the matrix
            raise ValueError(f"Muon cannot place the blocks of a {tuple(update.shape)} DTensor {update.placements}")
        return cls(shapes, offsets, senders)

    def rows_cols(self, r: int) -> tuple[slice, slice]:
        (rows, cols), (row, col) = self.shapes[r], self.offsets[r]
        return slice(row, row + rows), slice(col, col + cols)

    def numel(self, r: int) -> int:
        return self.shapes[r][0] * self.shapes[r][1]


@dataclass(frozen=True)
class MeshGroup:
    """The ranks of one mesh as one process group (the mesh flattened), for the owners' all-to-alls."""

    mesh: DeviceMesh
    group: dist.ProcessGroup

    @classmethod
    def of(cls, mesh: DeviceMesh) -> MeshGroup:
        """Made when the optimizer is built, by every rank at the same point (flattening a mesh is collective)."""
        flat = mesh if mesh.ndim == 1 else mesh._flatten()
        return cls(mesh, flat.get_group())

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)


def orthogonalize_owned(
    updates: list[DTensor], mesh: MeshGroup, orthogonalize, steps: int, dtype: torch.dtype
) -> list[DTensor]:
    """`orthogonalize(full, steps, dtype)` of each of `updates` (DTensors on `mesh`, of one dtype), each
    computed on its owner only, returned in each update's own placements (the module docstring's steps).
    In rounds: round k exchanges each owner's k-th matrix, so that an owner holds one whole matrix at a time
    (what the memory estimate's `step_copies` counts), in two collectives per round for N matrices."""
    n = mesh.size
    blocks = [Blocks.of(u) for u in updates]
    owners = assign_owners([newton_schulz_flops(tuple(u.shape), steps) for u in updates], n)
    by_owner = [[j for j in range(len(updates)) if owners[j] == o] for o in range(n)]
    out: list[DTensor | None] = [None] * len(updates)
    for k in range(max(map(len, by_owner))):
        exchange_round([js[k : k + 1] for js in by_owner], updates, blocks, mesh, orthogonalize, steps, dtype, out)
    return out


def exchange_round(
    by_owner: list[list[int]],
    updates: list[DTensor],
    blocks: list[Blocks],
    mesh: MeshGroup,
    orthogonalize,
    steps: int,
    dtype: torch.dtype,
    out: list[DTensor | None],
) -> None:
    """One round: the matrices `by_owner[o]` of each owner o to it, orthogonalized there, their blocks back
    into `out`."""
    n, me = mesh.size, mesh.rank
    mine = by_owner[me]
    js = [j for owned in by_owner for j in owned]

    def sent_by(r: int, j: int) -> int:
        return blocks[j].numel(r) if blocks[j].senders[r] else 0

    # 1. to the owners: my block of owner 0's matrices, then of owner 1's, … (a replica sends nothing)
    to_owner = [sum(sent_by(me, j) for j in by_owner[o]) for o in range(n)]
    from_rank = [sum(sent_by(r, j) for j in mine) for r in range(n)]
    local = {j: updates[j].to_local() for j in js}
    pieces = [local[j].reshape(-1) for o in range(n) for j in by_owner[o] if blocks[j].senders[me]]
    send = torch.cat(pieces) if pieces else local[js[0]].new_empty(0)
    gathered = send.new_empty(sum(from_rank))
    dist.all_to_all_single(gathered, send, from_rank, to_owner, group=mesh.group)

    # 2. each owned matrix assembled from its blocks and orthogonalized, once in the job
    results = [local[j].new_empty(updates[j].shape) for j in mine]
    for r, chunk in enumerate(gathered.split(from_rank)):
        for i, piece in enumerate(chunk.split([sent_by(r, j) for j in mine])):
            if piece.numel():
                results[i][blocks[mine[i]].rows_cols(r)] = piece.view(blocks[mine[i]].shapes[r])
    results = [orthogonalize(full, steps, dtype).to(send.dtype) for full in results]

    # 3. back to every rank (replicas too): its block of each result
    to_rank = [sum(blocks[j].numel(r) for j in mine) for r in range(n)]
    from_owner = [sum(blocks[j].numel(me) for j in by_owner[o]) for o in range(n)]
    back = [results[i][blocks[j].rows_cols(r)].reshape(-1) for r in range(n) for i, j in enumerate(mine)]
    back = torch.cat(back) if back else send.new_empty(0)
    returned = send.new_empty(sum(from_owner))
    dist.all_to_all_single(returned, back, from_owner, to_rank, group=mesh.group)

    for o, chunk in enumerate(returned.split(from_owner)):
        for j, piece in zip(by_owner[o], chunk.split([blocks[j].numel(me) for j in by_owner[o]])):
            u = updates[j]
            out[j] = DTensor.from_local(
                piece.view(blocks[j].shapes[me]), u.device_mesh, u.placements, run_check=False, shape=u.shape,
                stride=u.stride(),
            )  # fmt: skip
