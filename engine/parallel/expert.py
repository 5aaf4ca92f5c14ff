"""Expert parallelism: the experts of every MoE layer are split over the `ep` ranks, and each token's hidden
state travels to the rank that holds its expert and back.

Layout (as in torchtitan): the ep ranks are data-parallel ranks — each trains on its own data — carved out of
dp_shard. Each holds num_experts / ep experts and runs them on the tokens routed to them by every rank of
its ep group:

    sort own assignments by expert → all_to_all_single (uneven splits) → regroup by local expert → local
    experts → ungroup → all_to_all_single back → weight and add at the owning tokens

Routing, capacity, auxiliary losses and load statistics stay on the token's own rank, so each rank computes
exactly what plain data parallelism (ep = 1) computes for its data.

The exchange lives in PyTorch's own seam, as torchtitan's `ExpertParallel` does it: a `ParallelStyle` applied
to each block's routed-experts module (the family's `ModelParts.experts`) with `parallelize_module`, whose
`distribute_module` shards the module's parameters, sends the rows in a forward pre-hook on that module and
sends the outputs back in its forward hook. The family's MoE code (the transformer's: engine/model/moe.py) is
that of one device: it sorts its assignments by expert, calls the experts module on the sorted rows and their
counts per expert, and combines what comes back.

Expert parameters become DTensors sharded on the expert dimension over the ep mesh (`Shard(0)`): the state
dict keeps the full [num_experts, …] tensors under the same names, so a DCP checkpoint loads under any ep.
The module computes with this rank's shards as plain tensors, which the pre-hook passes it.

Gradients. With data parallelism over D ranks the step uses (1/D) Σ_r ∇L_r, L_r being rank r's mean loss.
An expert's local gradient already sums the contributions of the losses of all ep ranks of its group (the
backward of the exchange brings them back), so averaging it over the D/ep ranks that hold the same experts
(FSDP over the dp ranks outside ep, `fully_shard_experts`) gives ep/D Σ_r ∇L_r. The exchange therefore
scales expert weight gradients by 1/ep in the graph (the experts module's per-expert `grad_factor`); gradients
of the tokens themselves are left alone.
Non-expert parameters are averaged over all D data-parallel ranks as usual.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from engine.errors import UserError
from engine.model.spec import LanguageModel, spec_for


def expert_modules(model: LanguageModel) -> dict[str, nn.Module]:
    """Full name → routed-experts module of every block of `model` (a whole model or a pipeline stage) that
    has one, where its family's `ModelParts.experts` says, in model order."""
    parts = spec_for(model.cfg).parts
    return {f"{parts.blocks}.{name}.{parts.experts}": m for name, m in parts.in_blocks(model, parts.experts).items()}


def packed(experts: nn.Module) -> bool:
    """Whether the experts module holds its parameters itself, one [num_experts, …] tensor per projection (what
    the contract asks for sharding: `ModelParts.experts`), rather than in one module per expert."""
    own = list(experts.parameters(recurse=False))
    return bool(own) and len(own) == len(list(experts.parameters()))


def check_expert_parallel(model: LanguageModel, experts: nn.Module, ep: int) -> None:
    """What expert parallelism needs of a block's experts; each failure is a configuration the user chose."""
    cfg = model.cfg
    if cfg.num_experts % ep:
        raise UserError(
            f"model.num_experts = {cfg.num_experts} is not divisible by distributed.ep = {ep}",
            "choose an ep that divides the number of experts",
        )
    if not packed(experts):
        raise UserError(
            "distributed.ep > 1 needs model.moe_packed_experts = true: per-expert parameters cannot "
            "be sharded over the expert dimension",
            "set model.moe_packed_experts = true",
        )
    if cfg.moe_gradient_scale:
        raise UserError(
            "model.moe_gradient_scale is not supported with distributed.ep > 1 yet: each expert's "
            "gradient would need the load of every rank that sent it tokens",
            "set model.moe_gradient_scale = false, or distributed.ep = 1",
        )


def apply_expert_parallel(model: LanguageModel, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None) -> None:
    """Shard the routed experts of every block of `model` that has them over the 1-D `ep_mesh` (and within each expert over
    `tp_mesh`, see `shard_experts`) and route tokens between its ranks. The model is either on the meta
    device (the trainer fills the shards afterwards from rank 0) or holds the same weights on every rank (the
    shards are then taken from rank 0's). Call after tensor parallelism and before FP8, activation
    checkpointing, compile and FSDP."""
    assert ep_mesh.ndim == 1, "expert parallelism takes a 1-D mesh"
    ep = ep_mesh.size()
    layers = expert_modules(model)
    if not layers:
        raise UserError(
            f"distributed.ep = {ep} needs a mixture-of-experts model, but this one has no MoE layer",
            "set model.num_experts > 0, or distributed.ep = 1",
        )
    for experts in layers.values():
        check_expert_parallel(model, experts, ep)
    shard_experts(model, ep_mesh, tp_mesh)


def shard_experts(model: LanguageModel, ep_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None) -> None:
    """The routed experts of every block of `model` (a whole model or a pipeline stage, which may have
    none) over expert parallelism (`ep_mesh`: whole experts per rank, tokens exchanged) and/or tensor
    parallelism (`tp_mesh`: each expert's hidden units split, Megatron-style within the expert).

    Why within each expert under TP: the tensor-parallel ranks see the same tokens (the MoE layer's input is
    gathered over the sequence, engine/parallel/tp.py), so they route identically and need no exchange;
    splitting the hidden units divides every expert's weights and FLOPs by tp at the price of one
    all-reduce of the experts' output rows, the same collective a dense MLP pays. Splitting whole experts over
    the tp ranks instead would need a token exchange and leave the ranks with uneven work. With ep > 1 both
    apply: whole experts over ep, their hidden units over tp, as 2-D DTensors on the (ep, tp) mesh. Which
    dimension of each parameter holds the hidden units is the family's `ParamSpec.tp_dim`."""
    layers = expert_modules(model)
    if not layers or (ep_mesh is None and tp_mesh is None):
        return
    for experts in layers.values():
        if tp_mesh is not None and not packed(experts):
            raise UserError(
                "distributed.tp > 1 with an MoE model needs model.moe_packed_experts = true: the experts' "
                "hidden units are split over the tensor-parallel ranks as one tensor per projection",
                "set model.moe_packed_experts = true",
            )
    if ep_mesh is not None and tp_mesh is not None:
        mesh = ep_mesh._get_root_mesh()[("ep", "tp")]  # both are named dimensions of the run's one mesh
    else:
        mesh = ep_mesh if ep_mesh is not None else tp_mesh
    hidden = {p.name: p.tp_dim for p in spec_for(model.cfg).param_specs(model.cfg) if p.expert_parallel}
    for name, experts in layers.items():
        dims = {param: hidden[f"{name}.{param}"] for param, _ in experts.named_parameters(recurse=False)}
        parallelize_module(experts, mesh, ExpertParallel(ep_mesh, tp_mesh, dims))


class Exchange(NamedTuple):
    """How the rows of one call of the experts module travel: how many this rank sends to each ep rank and
    receives from each, and the permutation that groups the received rows by local expert."""

    send: list[int]
    receive: list[int]
    regroup: torch.Tensor


class ExpertParallel(ParallelStyle):
    """The experts module of one block over the ep ranks and/or within each expert over the tp ranks.
    Its input, (rows sorted by expert, rows per expert [num_experts], implementation, grad_factor), are this
    rank's assignments; `hidden_dims`: each of its parameters' dimension of hidden units (split over tp).

    With ep: the pre-hook sends each row to the rank holding its expert and gives the module instead the
    rows every rank sent to this rank's experts; the hook sends each output back to where its row came from,
    in the order it was sent, so the module's caller gets what one device computes.
    With tp: every tp rank has the same rows (and, after the ep exchange, receives the same rows), runs them
    through its slice of each expert's hidden units, and the hook sums the partial outputs over the tp ranks
    (an all-reduce); in backward the rows' gradient is summed over the tp ranks likewise. Both are DTensor
    redistributions (Replicate rows whose gradient is Partial; Partial outputs made Replicate).
    Either way the module runs on this rank's shards of the weights, passed to it as plain tensors.

    One instance per module: the exchange of the call in flight is kept from the pre-hook to the hook (a
    recomputation under activation checkpointing calls both again, in the same order)."""

    def __init__(
        self, ep_mesh: DeviceMesh | None = None, tp_mesh: DeviceMesh | None = None, hidden_dims: dict | None = None
    ) -> None:
        super().__init__()
        self.ep_mesh, self.tp_mesh, self.hidden_dims = ep_mesh, tp_mesh, hidden_dims or {}
        self.exchange: Exchange | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self.shard_experts, self.dispatch, self.return_outputs)

    def shard_experts(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        """Each parameter as a DTensor over `mesh` ((ep), (tp) or (ep, tp)): sharded on the expert dimension
        over ep (rank r holds experts r·E/ep, …) and on the hidden units over tp."""
        for param_name, param in list(module.named_parameters(recurse=False)):
            placements = [Shard(0)] if self.ep_mesh is not None else []
            if self.tp_mesh is not None:
                placements.append(Shard(self.hidden_dims[param_name]))
            sharded = distribute_tensor(param.detach(), mesh, placements, src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def dispatch(self, experts: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        """Forward pre-hook: with ep, this rank's rows out to their experts' ranks, the rows for this rank's
        experts in, grouped by local expert, and expert weight gradients scaled by 1/ep (see the module
        docstring); with tp, the rows as replicated over the tp ranks. The module then runs on them with its
        local weights. Under `fully_shard_experts`, FSDP's pre-hook (which runs first: it is registered to)
        has gathered the weights and cast the rows by then."""
        rows, counts, implementation, grad_factor = inputs
        weights = tuple(w.to_local() for w in experts.parameters(recurse=False))  # in registration order
        if self.ep_mesh is not None:
            assert grad_factor is None, "moe_gradient_scale is rejected under expert parallelism"
            group, ep = self.ep_mesh.get_group(), self.ep_mesh.size()
            received_counts = exchange_counts(counts, group)  # [ep, local experts]: what each rank sends me
            send = counts.view(ep, -1).sum(dim=1).tolist()
            receive = received_counts.sum(dim=1).tolist()
            received = all_to_all(rows, receive, send, group)
            regroup = local_expert_order(received_counts)
            self.exchange = Exchange(send, receive, regroup)
            rows, counts = received[regroup], received_counts.sum(dim=0)
            grad_factor = torch.full((weights[0].shape[0],), 1.0 / ep, dtype=weights[0].dtype, device=rows.device)
        if self.tp_mesh is not None:
            # Identity forward; in backward the rows' partial gradients (one per slice of the hidden units)
            # are summed over the tp ranks.
            replicated = DTensor.from_local(rows, self.tp_mesh, [Replicate()], run_check=False)
            rows = replicated.to_local(grad_placements=[Partial()])
        return rows, counts, implementation, grad_factor, weights

    def return_outputs(self, experts: nn.Module, outputs: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """Forward hook: with tp, the partial outputs summed over the tp ranks (their gradient is replicated,
        no collective in backward); with ep, the outputs of the received rows back to their ranks, in the
        order the rows left."""
        if self.tp_mesh is not None:
            partial = DTensor.from_local(outputs, self.tp_mesh, [Partial()], run_check=False)
            outputs = partial.redistribute(self.tp_mesh, [Replicate()]).to_local()
        if self.ep_mesh is None:
            return outputs
        assert self.exchange is not None, "the experts module's pre-hook did not run"
        send, receive, regroup = self.exchange
        self.exchange = None
        return all_to_all(outputs[regroup.argsort()], send, receive, self.ep_mesh.get_group())


def fully_shard_experts(model: LanguageModel, mesh: DeviceMesh, **fsdp_kwargs) -> None:
    """FSDP for the routed experts of every block over `mesh`: the data-parallel ranks that hold the same
    experts (dp_shard / ep of them, from the same root mesh as the ep mesh). Call before `fully_shard` on
    the blocks (over all dp ranks), which then leave these already-sharded parameters to this group."""
    for experts in expert_modules(model).values():
        fully_shard(experts, mesh=mesh, **fsdp_kwargs)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """counts [num_experts] of this rank's assignments → [ep, local experts]: row s holds how many of rank
    s's assignments go to each of this rank's experts. A functional collective, like the token exchange, so
    that selective activation checkpointing keeps its output instead of exchanging again in backward."""
    received = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, group))
    return received.view(dist.get_world_size(group), -1)


def local_expert_order(received_counts: torch.Tensor) -> torch.Tensor:
    """Rows arrive grouped by source rank, then by local expert; the permutation that groups them by local
    expert (then source rank), as `sorted_experts` wants them."""
    ranks, experts = received_counts.shape
    expert_of_row = torch.arange(experts, device=received_counts.device).repeat(ranks)
    return expert_of_row.repeat_interleave(received_counts.flatten()).argsort(stable=True)


def all_to_all(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable all_to_all_single with uneven splits of rows [n, …] (its backward is the reverse
    exchange). The functional collective, waited for at once: the next step needs the rows."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, group))
