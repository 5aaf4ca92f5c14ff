"""Context parallelism: every sequence split over the `cp` ranks, attention computed across the pieces.

Long sequences do not fit one device's activation memory; under cp each rank holds `seq_len / cp` positions
of every sequence of its data-parallel batch, so everything but attention (embedding, norms, MLP, head,
loss) works on a cp-th of the activations. Three parts, applied from outside the model:

- **The split** (`ContextParallel.shard`): the sequence is cut into 2·cp chunks and rank r keeps chunks r and
  2·cp−1−r (the "head-tail" or zig-zag split). Under a causal mask position p attends to p+1 keys, so a plain
  split would give the last rank almost twice the average attention work; head-tail pairs an early chunk with
  a late one, and every rank does the same work. The labels are split with the inputs, so each rank's loss is
  the mean over its positions; all ranks hold the same number, so the mean over the cp ranks (what FSDP's
  gradient reduction and the logged loss compute) is the whole sequence's mean.
- **The positions**: a forward pre-hook on the model passes the positions this rank holds (its `positions`
  argument), so RoPE or a position embedding places each token by its place in the whole sequence.
- **Packed documents** (`data.pack_sequences`): the trainer computes the document ids from the whole window,
  before the split, and passes them whole (`doc_ids` [batch, seq]). The hook turns them into this rank's RoPE
  positions (each token's place in its document, `document_positions` of the whole window, then split) and
  hands the cores the method's window mask (`window_mask`): the whole window's document ids, from which
  allgather and ring build the mask of each piece they compute (same document and key position ≤ query
  position) at the positions they already know, or for ulysses, which attends over the whole window in
  natural order, the one-process packed mask itself (a dense [batch, 1, seq, seq] mask, or on CUDA a
  FlexAttention BlockMask), built once per forward.
- **The attention** (`CP_CORES`): each block's attention core (the family's `ModelParts.attention`: SDPA on
  (batch, heads, seq, head_dim), after RoPE) is replaced by a module that attends this rank's queries to the
  keys of the whole sequence, chosen by `distributed.cp_method`, which keeps the family's core as `local`:
    `allgather`  gather K and V from the cp group (Llama 3's choice): one collective of the K/V size, then an
                 SDPA call per local chunk over the keys up to its end, causal at the bottom-right
                 (packed: a [chunk, end] boolean mask of the chunk's documents).
                 Memory: the whole sequence's K/V per layer.
    `ring`       pass K/V blocks around the ring; each step's transfer is started before the current block is
                 computed (functional collectives wait on first use), and the blocks' results merge through
                 their log-sum-exp; a block's attention weights are recomputed in backward, not saved.
                 Memory: the K/V blocks received, no [seq, seq] weights. On CUDA, PyTorch's own
                 `context_parallel` ring (flash/efficient kernels) runs instead where it applies; it takes
                 no mask, so packed windows always run this one. A query whose document starts after a
                 whole block (packed) sees none of it: the block's log-sum-exp is MASKED-sized there and
                 gets zero weight in the merge (finite, so no NaN in values or gradients).
    `ulysses`    all-to-all from sequence-sharded, all heads to whole-sequence, heads/cp heads, a plain causal
                 SDPA (packed: the one-process document mask and kernel), and back (DeepSpeed-Ulysses).
                 Needs the (query and key/value) heads divisible by cp.
  Backward goes through PyTorch's differentiable functional collectives (all_gather_single_autograd,
  all_to_all_single_autograd), which also trace under torch.compile.

What does not compose yet is refused: pipeline parallelism and MoE models by config validation
(engine/parallel/rules.py), a KV cache (generation) by the positions hook.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

from engine.errors import UserError
from engine.model.documents import document_positions, packed_attention_mask
from engine.model.spec import LanguageModel, inside, spec_for

MASKED = -1e30  # finite: a query that sees no key of a ring block must give zero weight, not NaN gradients


def head_tail_indices(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions of a `seq_len` sequence that cp rank `rank` holds, in order: chunk `rank` and chunk
    `2·cp − 1 − rank` of the 2·cp equal chunks (the caller checks that 2·cp divides seq_len)."""
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([head, tail])


def all_positions(local_len: int, cp: int, device: torch.device) -> torch.Tensor:
    """The whole sequence's positions in the order the cp ranks hold them, rank after rank: what gathering a
    sequence-sharded tensor over the cp group lines up."""
    return torch.cat([head_tail_indices(local_len * cp, cp, r, device) for r in range(cp)])


WindowMask = Callable[[torch.Tensor, int], object]
"""(whole window's doc_ids [batch, seq], head_dim) → what a cp core takes as its `mask` for packed windows."""


def document_ids_mask(doc_ids: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The window mask of allgather and ring: the whole window's document ids themselves, which each core
    indexes at the query and key positions of the pieces it computes (`document_causal_mask`)."""
    return doc_ids


class ContextParallel:
    """This rank's place in the cp group: what it keeps of each sequence, and where those positions are.
    `window_mask`: what the method's cores take for packed windows (`ContextParallelCore.window_mask`)."""

    def __init__(self, mesh: DeviceMesh, window_mask: WindowMask = document_ids_mask) -> None:
        self.mesh, self.size, self.rank = mesh, mesh.size(), mesh.get_local_rank()
        self.window_mask = window_mask

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a [batch, seq, ...] tensor (inputs or labels), in head-tail order."""
        return tensor.index_select(1, head_tail_indices(tensor.shape[1], self.size, self.rank, tensor.device))

    def positions_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook of the model: the positions of its (sharded) input in the whole sequence; for
        packed windows (`doc_ids` of the whole window) the positions in their documents, and the cores' mask."""
        if (args[1] if len(args) > 1 else kwargs.get("cache")) is not None:
            raise UserError(
                "context parallelism (distributed.cp > 1) is for training: generation with a KV cache holds "
                "the whole sequence on one process",
                "generate from the checkpoint in one process (distributed.cp = 1)",
            )
        tokens = args[0] if args else kwargs["tokens"]
        held = head_tail_indices(tokens.shape[1] * self.size, self.size, self.rank, tokens.device)
        doc_ids = kwargs.get("doc_ids")
        if doc_ids is None:
            return args, {**kwargs, "positions": held}
        assert doc_ids.shape[1] == tokens.shape[1] * self.size, (
            "under cp, doc_ids are the whole window's (computed before the split)"
        )
        mask = self.window_mask(doc_ids, module.cfg.head_dim)
        positions = document_positions(doc_ids).index_select(1, held)
        return args, {**kwargs, "doc_ids": None, "positions": positions, "attention_mask": mask}


class ContextParallelCore(nn.Module):
    """SDPA across the cp group for queries, keys and values of this rank's positions, (batch, heads,
    local seq, head_dim). Parameterless like the family's core it replaces (`ModelParts.attention`), which it
    keeps as `local`: its kernel choice for every SDPA call here, and (ulysses) its one-process attention.
    Causal attention, or for packed windows (`mask`: what `window_mask` made of the whole window's document
    ids, passed by the positions hook) attention inside each document."""

    window_mask: WindowMask = staticmethod(document_ids_mask)

    def __init__(self, core: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        self.local = core
        self.mesh, self.size, self.rank = mesh, mesh.size(), mesh.get_local_rank()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object = None, causal: bool = True
    ) -> torch.Tensor:
        # `causal` is the model's flag (False exactly when a mask is given: the mask holds causality)
        return self.attend(q, k, v, mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: object) -> torch.Tensor:
        """The method's attention over the whole sequence: each `cp_method` is a subclass that defines it
        (AllGatherCore, UlyssesCore, RingCore); this base is never instantiated (CP_CORES maps the names)."""
        raise NotImplementedError(f"{type(self).__name__} does not define attend()")

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
        with self.local.kernel():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1], **options)

    def causal_mask(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """[q, k] True where the query may attend the key (key position ≤ query position)."""
        return k_positions[None, :] <= q_positions[:, None]


def document_causal_mask(doc_ids: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """[batch, 1, q, k] True where the query may attend the key in a packed window: key position ≤ query
    position, both in the same document. `doc_ids` [batch, seq] are the whole window's; the positions index it."""
    same = doc_ids.index_select(1, q_positions)[:, :, None] == doc_ids.index_select(1, k_positions)[:, None, :]
    return (same & (k_positions[None, :] <= q_positions[:, None]))[:, None]


class AllGatherCore(ContextParallelCore):
    """K and V gathered from the whole cp group and put in sequence order; then each of this rank's two
    chunks of queries attends the keys up to its own end, causal at the bottom-right (its last keys are its
    own positions). No [local, seq] mask is built: on CUDA the memory-efficient kernel applies the lower-right
    causal mask itself (without GQA; with GQA, and on CPU, PyTorch materializes the chunk's mask)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        local = q.shape[2]
        kv = funcol.all_gather_single_autograd(torch.stack([k, v]).contiguous(), 3, self.mesh)
        natural = torch.argsort(all_positions(local, self.size, q.device))  # position → gathered index
        k, v = kv.index_select(3, natural).unbind(0)  # (batch, kv heads, seq, head_dim) in sequence order
        chunk = local // 2
        ends = ((self.rank + 1) * chunk, (2 * self.size - self.rank) * chunk)  # each chunk's last position + 1
        outs = [
            self.sdpa(part, k[:, :, :end], v[:, :, :end], attn_mask=self.chunk_mask(chunk, end, documents, q.device))
            for part, end in zip(q.split(chunk, dim=2), ends)
        ]
        return torch.cat(outs, dim=2)

    def chunk_mask(
        self, chunk: int, end: int, documents: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor | object:
        """The mask of the `chunk` queries just before `end` over the keys before `end`: lower-right causal, or
        for packed windows causal inside each document."""
        if documents is None:
            return lower_right_causal(chunk, end, device)
        return document_causal_mask(
            documents, torch.arange(end - chunk, end, device=device), torch.arange(end, device=device)
        )


def lower_right_causal(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """The causal mask of `rows` queries that are the last `rows` of `cols` keys: PyTorch's CausalBias, which
    CUDA's memory-efficient kernel applies without building it; under torch.compile, which cannot trace
    CausalBias, the same mask built as a tensor."""
    if torch.compiler.is_compiling():
        return torch.arange(cols, device=device)[None, :] <= torch.arange(cols - rows, cols, device=device)[:, None]
    return causal_lower_right(rows, cols)


class UlyssesCore(ContextParallelCore):
    """All-to-all to whole sequences of heads/cp heads, a causal SDPA in natural order, all-to-all back. Packed
    windows: the whole sequence in natural order is what one process attends over, so the mask and kernel are
    the one-process ones (`packed_attention_mask`, applied by the family's own core, `local`)."""

    window_mask: WindowMask = staticmethod(packed_attention_mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: object) -> torch.Tensor:
        local = q.shape[2]
        order = all_positions(local, self.size, q.device)  # gathered order → position
        natural = torch.argsort(order)  # position → gathered index
        q, k, v = (self.to_heads(t).index_select(2, natural) for t in (q, k, v))
        if documents is None:
            out = self.sdpa(q, k, v, is_causal=True)
        else:
            out = self.local(q, k, v, documents, causal=False)
        return self.to_sequence(out.index_select(2, order))

    def to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, heads, local, d) → (batch, heads/cp, cp·local, d): head group g goes to rank g."""
        batch, heads, local, dim = t.shape
        groups = t.reshape(batch, self.size, heads // self.size, local, dim).movedim(1, 0).contiguous()
        received = funcol.all_to_all_single_autograd(groups, None, None, self.mesh)  # [i] = rank i's positions
        return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.size, self.size * local, dim)

    def to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_heads`: (batch, heads/cp, cp·local, d) → (batch, heads, local, d)."""
        batch, group, length, dim = t.shape
        local = length // self.size
        parts = t.reshape(batch, group, self.size, local, dim).permute(2, 0, 1, 3, 4).contiguous()
        received = funcol.all_to_all_single_autograd(parts, None, None, self.mesh)  # [i] = head group i
        return received.movedim(0, 1).reshape(batch, self.size * group, local, dim)


class RingCore(ContextParallelCore):
    """K/V blocks passed around the ring, cp steps; each step's transfer overlaps the current block's
    attention, and the blocks merge by their log-sum-exp (the online softmax of flash attention).

    Under the head-tail split only the own block needs a mask. Another rank's block is seen whole by part of
    the queries and not at all by the rest: a rank s < r holds chunks s and 2cp−1−s, and all of this rank's
    queries see chunk s and none sees chunk 2cp−1−s; a rank s > r holds positions that only this rank's late
    chunk (2cp−1−r) sees, all of them. Those blocks cost half the attention and no mask (packed windows: the
    mask of their documents, `piece_mask`)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        half, seq = q.shape[2] // 2, q.shape[2] * self.size
        q_pos = head_tail_indices(seq, self.size, self.rank, q.device)
        block = torch.stack([k, v]).contiguous()
        out = lse = None
        for step in range(self.size):
            source = (self.rank - step) % self.size  # whose K/V `block` holds
            following = self.pass_on(block) if step < self.size - 1 else None  # in flight during the compute
            k, v = block.unbind(0)
            k_pos = head_tail_indices(seq, self.size, source, q.device)
            if out is None:  # step 0: this rank's own block, causal (packed: inside each document)
                own = self.causal_mask(q_pos, q_pos) if documents is None else piece_mask(documents, q_pos, k_pos)
                out, lse = attention_piece(q, k, v, own)
            elif source < self.rank:
                mask = piece_mask(documents, q_pos, k_pos[:half])
                out, lse = merge(out, lse, *attention_piece(q, k[:, :, :half], v[:, :, :half], mask))
            else:
                mask = piece_mask(documents, q_pos[half:], k_pos)
                late = merge(out[:, :, half:], lse[:, :, half:], *attention_piece(q[:, :, half:], k, v, mask))
                out, lse = (torch.cat([whole[:, :, :half], part], dim=2) for whole, part in zip((out, lse), late))
            block = following
        return out.to(q.dtype)

    def pass_on(self, block: torch.Tensor) -> torch.Tensor:
        """Send `block` to the next rank and receive the previous rank's (an all-to-all with one non-empty
        split each way, so its backward sends the gradient back along the same edge)."""
        send, receive = [0] * self.size, [0] * self.size
        send[(self.rank + 1) % self.size] = receive[(self.rank - 1) % self.size] = block.shape[0]
        return funcol.all_to_all_single_autograd(block, receive, send, self.mesh)


def piece_mask(
    documents: torch.Tensor | None, q_positions: torch.Tensor, k_positions: torch.Tensor
) -> torch.Tensor | None:
    """A ring piece's mask: none for plain windows (the piece is wholly visible), or for packed windows
    causality and documents from the whole window's ids."""
    return None if documents is None else document_causal_mask(documents, q_positions, k_positions)


def attention_piece(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_attention`, recomputed in backward as a flash kernel does: only its inputs and results stay
    saved, not the [queries, keys] weights."""
    return checkpoint(block_attention, q, k, v, mask, use_reentrant=False)


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(qkᵀ/√d)v over one key block, in fp32 at least, and each query's log-sum-exp over the block (MASKED-sized
    where the block holds no key the query sees, so that block gets zero weight in `merge`). Autocast is off
    here: under a bf16 run it would run both matmuls, and so the scores the blocks' merge weighs, in bf16."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves heads/kv_heads queries
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    dtype = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, MASKED)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        return torch.exp(scores - lse) @ v.to(dtype), lse


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax-attention results over disjoint key sets → the result over their union."""
    total = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - total) + block_out * torch.exp(block_lse - total), total


CP_CORES: dict[str, type[ContextParallelCore]] = {
    "allgather": AllGatherCore,
    "ring": RingCore,
    "ulysses": UlyssesCore,
}


def apply_context_parallel(
    model: LanguageModel, cp_mesh: DeviceMesh, method: str, device: torch.device, packed: bool = False
) -> None:
    """Give every block a cp attention core in place of the family's (`ModelParts.attention`) and the model
    its positions hook. On CUDA, `ring` uses PyTorch's own context-parallel SDPA (flash kernels,
    load-balanced like our split) where it applies. `packed`: the run trains on packed windows
    (data.pack_sequences), which PyTorch's ring cannot mask."""
    parts = spec_for(model.cfg).parts
    if parts.attention is None:
        raise UserError(
            f"context parallelism (distributed.cp > 1) swaps each block's attention core, and the "
            f"{model.cfg.model_type} family declares none (ModelParts.attention)",
            "set distributed.cp = 1",
        )
    owner_path, _, name = parts.attention.rpartition(".")
    core = CP_CORES[method]
    cp = ContextParallel(cp_mesh, core.window_mask)
    model.register_forward_pre_hook(cp.positions_hook, with_kwargs=True)
    for block in parts.block_modules(model).values():
        owner = inside(block, owner_path) if owner_path else block
        if method == "ring" and torch_ring_applies(model, device, packed):
            torch_ring(owner, name, cp_mesh)
        else:
            setattr(owner, name, core(getattr(owner, name), cp_mesh))


def torch_ring_applies(model: LanguageModel, device: torch.device, packed: bool = False) -> bool:
    """PyTorch's ring runs the CUDA flash/efficient/cuDNN kernels, which need one key/value head per query
    head (no GQA through its sharding rules) and take no attention mask (it raises "attn_bias is not
    supported"): packed windows run RingCore, whose blocks compute their [local, block] scores in fp32
    (recomputed in backward, not saved), slower than a fused kernel at long context."""
    return device.type == "cuda" and model.cfg.kv_heads == model.cfg.n_heads and not packed


def torch_ring(owner: nn.Module, core: str, cp_mesh: DeviceMesh) -> None:
    """PyTorch's `_ContextParallel` style on the SDPA core (`owner`'s module `core`): q/k/v become DTensors sequence-sharded over the
    cp mesh, and its dispatcher runs the ring (head-tail load balancing, the same split as ours)."""
    from torch.distributed.tensor.experimental._context_parallel import (
        _ContextParallel,
        _enable_context_parallel_dispatcher,
        set_rotate_method,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    set_rotate_method("alltoall")  # pass K/V blocks to the next rank (its default gathers them all at once)
    _enable_context_parallel_dispatcher()
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    parallelize_module(owner, cp_mesh, {core: style})
