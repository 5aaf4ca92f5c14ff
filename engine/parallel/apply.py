"""Apply training transformations to a single-device model of any family, in a fixed order.

The full order is TP → CP → EP → FP8 → activation checkpointing → compile → FSDP2, one function per stage
(under TP, FP8 comes first: it swaps modules, and TP's hooks must be on the swapped ones). Each stage finds
what it acts on through the family's `ModelParts` (engine/model/spec.py), never by a family's classes:
- tensor parallelism first, because every later stage must see the sharded (DTensor) linears;
- context parallelism swaps each block's attention core before checkpointing and compile wrap the blocks,
  so recomputation and the compiled graph contain the cp collectives;
- activation checkpointing wraps each block *before* compile so that the compiled graph contains the
  recomputation instead of the checkpoint wrapper breaking the graph;
- FSDP2 last: `fully_shard` shards whatever parameters the earlier stages left (TP's DTensors become 2-D,
  FP8's linears gather in fp8), and per block, so its all-gathers overlap the neighbouring blocks' compute.
  With `distributed.cpu_offload` it also runs on one process and keeps the shards on the host (`fsdp_mesh`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from engine import precision
from engine.config.job import JobConfig
from engine.errors import UserError
from engine.model.spec import LanguageModel, ModelParts, inside, spec_for
from engine.parallel.activation_checkpoint import apply_activation_checkpointing
from engine.parallel.compile_plan import moe_compiled_in_regions
from engine.parallel.context import apply_context_parallel
from engine.parallel.expert import apply_expert_parallel, fully_shard_experts, shard_experts
from engine.parallel.float8 import convert_to_float8
from engine.parallel.mesh import ParallelMesh
from engine.parallel.tp import apply_tensor_parallel, uses_loss_parallel


def apply_compile(model: LanguageModel, moe_regions: bool = False) -> None:
    """Compile block by block: blocks are identical, so one compiled graph is reused n_layers times.

    A block compiles whole, as one graph (`fullgraph`), checkpoint wrapper included, so that the graph holds
    the recomputation and compile applies the selective policy when it partitions forward and backward. With
    `moe_regions` (`check_compilable`), an MoE block compiles in regions instead (`compiled_regions`), each
    one full graph as well."""
    parts = spec_for(model.cfg).parts
    for block in parts.block_modules(model).values():
        for region in compiled_regions(block, parts, moe_regions):
            region.compile(fullgraph=True)


def compiled_regions(block: nn.Module, parts: ModelParts, moe_regions: bool) -> list[nn.Module]:
    """What of one block compiles: the block itself, or with `moe_regions` in a block with routed experts
    (`parts.experts`) the family's `compile_regions` (the transformer's: its attention and the MoE layer's
    router and shared experts), while the rest runs eagerly: the
    routed experts with their sort and combine, the norms (torch's own modules, which compile only inside a
    caller) and the residual adds.

    Why the routed experts stay eager there: their call is where expert parallelism hooks in (an all-to-all
    whose splits are data-dependent host values), and compiled grouped_mm accepts only bf16 (fp32 fails while
    tracing). Inside a compiled block either breaks the graph, and the block then splits into a cascade of
    resumed frames, each hook compiled on its own, or, inside a checkpointed block, the whole block silently
    runs eagerly. Compiling the regions around the experts keeps every graph whole (`fullgraph`: a
    region that cannot compile fails loudly instead of running eagerly). The cost: the norms and the routed
    experts' elementwise work (their activation, the gather and weighted scatter of rows) run unfused; each
    grouped matmul is one kernel either way."""
    if not moe_regions:
        return [block]
    # regions refuse checkpointing (`check_compilable`): the block is not wrapped
    if inside(block, parts.experts) is None:  # a dense block of an MoE model (moe_frequency)
        return [block]
    regions = [inside(block, path) for path in parts.compile_regions]
    return [region for region in regions if region is not None]


def check_compilable(cfg: JobConfig, device: torch.device) -> bool:
    """Whether the MoE blocks compile in regions (`compiled_regions`) rather than whole: they do unless the
    routed experts trace, i.e. bf16 compute (the compute dtype on `device`, where the model trains) without
    ep. Regions refuse activation checkpointing: a checkpointed block must recompute in backward exactly the
    ops its forward ran, and PyTorch reruns compiled regions inside an eager checkpoint without dynamo: a
    different op sequence (the selective policy's cache fails) and different rounding (routing may differ)."""
    if not cfg.model.is_moe:
        return False
    bf16 = precision.compute_dtype(cfg.train.mixed_precision, device) == torch.bfloat16
    if not moe_compiled_in_regions(cfg, bf16):
        return False
    if cfg.train.activation_checkpointing != "none":
        dtype = "bf16" if bf16 else "fp32"
        raise UserError(
            f"train.activation_checkpointing = {cfg.train.activation_checkpointing!r} with train.compile_model = true "
            f"is not supported for this MoE model ({dtype} compute, distributed.ep = {cfg.distributed.ep}): its "
            "blocks compile around the routed experts, and a checkpointed block would recompute them differently "
            "from its forward",
            'set train.activation_checkpointing = "none", or train.compile_model = false '
            "(or bf16 compute without ep, where MoE blocks compile whole)",
        )
    return True


def apply_fsdp(
    model: LanguageModel,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    *,
    pipelined: bool = False,
    expert_mesh: DeviceMesh | None = None,
    head_read_after_forward: bool = False,
    offload: OffloadPolicy | None = None,
) -> None:
    """FSDP2 over `mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP), each block its own unit, then the rest.

    Parameters live sharded in fp32; forward and backward all-gather them in `param_dtype` (the compute
    dtype, so no autocast is needed) and gradients are reduce-scattered in fp32. Reshard after forward:
    every block frees its gathered weights after its forward and gathers them again in backward (memory
    over communication), except the last block, whose backward follows at once. Under pipeline
    parallelism nothing reshards: every micro-batch would gather each block again.

    `head_read_after_forward`: the loss takes `output.weight` itself after the model's forward (the chunked
    cross-entropy projects the final hidden states chunk by chunk). The root unit then stays gathered until
    its backward, so that attribute is the gathered parameter, whose gradient FSDP reduce-scatters over the
    data-parallel ranks; resharded, it would be the local shard, and a gradient reaching it directly would
    skip that reduction (each rank would keep its own batch's gradient of the head).

    `offload`: FSDP2's offload policy for every unit (`offload_policy`), `CPUOffloadPolicy` with
    `distributed.cpu_offload` (`offload_policy`), else none.
    """
    offload = offload or OffloadPolicy()
    # An fp32 run casts nothing (None: the parameters' own dtype), which also keeps a float64 model float64,
    # as the parity tests run it.
    cast = param_dtype != torch.float32
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype if cast else None, reduce_dtype=torch.float32 if cast else None
    )
    if expert_mesh is not None:  # expert-parallel experts: sharded over the ranks that hold the same experts
        fully_shard_experts(
            model, expert_mesh, mp_policy=policy, reshard_after_forward=not pipelined
        )  # (ep: no offload)
    blocks = list(spec_for(model.cfg).parts.block_modules(model).values())  # the family's blocks
    for index, block in enumerate(blocks):
        last = index == len(blocks) - 1
        fully_shard(
            block, mesh=mesh, mp_policy=policy, reshard_after_forward=not (pipelined or last), offload_policy=offload
        )
    root_reshards = not (pipelined or head_read_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=root_reshards, offload_policy=offload)


def offload_policy(cfg: JobConfig, device: torch.device) -> OffloadPolicy | None:
    """`distributed.cpu_offload`: FSDP2 keeps the sharded weights, their gradients and so the optimizer's state
    in host memory, and the optimizer steps there; each unit's all-gather copies its weights to the device,
    and its reduce-scatter's result goes back to the host. Host memory is pinned on CUDA (asynchronous
    copies); a CPU device has none to pin (there the copies are no-ops and the tests check the values)."""
    if not cfg.distributed.cpu_offload:
        return None
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def fsdp_mesh(cfg: JobConfig, mesh: ParallelMesh | None, device: torch.device) -> DeviceMesh | None:
    """What FSDP2 shards over: the layout's FSDP mesh, or with `distributed.cpu_offload` on one process a mesh of
    that one rank (FSDP2 is what offloads; the job joins a process group of one for it, engine/train/job.py)."""
    if mesh is not None and mesh.fsdp is not None:
        return mesh.fsdp
    if cfg.distributed.cpu_offload:
        return init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
    return None


def float8_all_gather(cfg: JobConfig, mesh: ParallelMesh | None, device: torch.device) -> bool:
    """FSDP all-gathers float8 weights (half the bytes of bf16) with the tensorwise recipe on GPUs."""
    return (
        cfg.train.mixed_precision == "fp8"
        and cfg.train.fp8_recipe == "tensorwise"
        and device.type == "cuda"
        and mesh is not None
        and mesh.fsdp is not None
    )


def parallelize(
    model: LanguageModel,
    cfg: JobConfig,
    mesh: ParallelMesh | None = None,
    *,
    device: torch.device | None = None,
    pipelined: bool = False,
) -> LanguageModel:
    """The model (or one pipeline stage of it) ready to train on this rank's part of the mesh; `device`,
    where it will train, when the model is still on the meta device.

    The order matters and is pinned by tests/parallel/test_apply_order.py: see the module docstring."""
    device = device or next(model.parameters()).device  # where the model is (any family)
    tp_mesh = mesh.get("tp") if mesh is not None else None
    fp8 = cfg.train.mixed_precision == "fp8"
    if fp8 and tp_mesh is not None:
        # FP8 swaps modules, which would drop the hooks TP registers on them: under TP it comes first, and
        # TP then shards the Float8Linear modules (their float8 casts of DTensors take global scales).
        convert_to_float8(model, cfg.train.fp8_recipe, device=device)
    if tp_mesh is not None:
        apply_tensor_parallel(
            model, tp_mesh, loss_parallel=uses_loss_parallel(tp_mesh.size(), cfg.train.loss_fn, cfg.distributed.pp)
        )
    cp_mesh = mesh.get("cp") if mesh is not None else None
    if cp_mesh is not None:
        apply_context_parallel(model, cp_mesh, cfg.distributed.cp_method, device, cfg.data.pack_sequences)
    ep_mesh = mesh.get("ep") if mesh is not None else None
    if ep_mesh is not None:
        apply_expert_parallel(model, ep_mesh, tp_mesh)
    elif tp_mesh is not None:
        shard_experts(model, None, tp_mesh)  # the routed experts' hidden units over tp (a no-op when dense)
    if fp8 and tp_mesh is None:
        convert_to_float8(
            model, cfg.train.fp8_recipe, fsdp_float8_all_gather=float8_all_gather(cfg, mesh, device), device=device
        )
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if cfg.train.compile_model:
        apply_compile(model, check_compilable(cfg, device))
    shard_mesh = fsdp_mesh(cfg, mesh, device)
    if shard_mesh is not None:
        apply_fsdp(
            model,
            shard_mesh,
            precision.compute_dtype(cfg.train.mixed_precision, device),
            pipelined=pipelined,
            expert_mesh=mesh.expert_fsdp if mesh is not None else None,
            head_read_after_forward=cfg.train.loss_fn == "chunked_cross_entropy",
            offload=offload_policy(cfg, device),
        )
    return model
