"""What a model family tells the rest of Forge, as data and small functions, without torch.

A family is one folder under `engine/model/families/` whose `__init__.py` builds one `ModelSpec` and registers
it under its `model_type` with the family's config class (`config.py`: the `[model]` fields only it reads), in
one line: `MODELS.register(NAME, spec=SPEC)(NAMEConfig)`. What the family supports follows from that class (a
mixture of experts: it derives from `ExpertFields`, engine/model/moe_config.py; multi-token prediction or μP: it
declares `mtp_depth` or `parametrization`) and from the spec (its tensor-parallel plan, its pipeline cut points,
LoRA). Everything outside the folder reads the spec, never
the family by name: the analytic counts (`engine/model/estimate.py`) and the memory estimate
(`engine/parallel/memory.py`) call its functions; tensor parallelism (`engine/parallel/tp.py`) turns its plan
of `TPStyle`s into DTensor styles, so the model code never meets sharding code; pipeline parallelism
(`engine/parallel/pipeline.py`) cuts the model where `ModelParts` says, and FSDP, activation checkpointing,
compile, context and expert parallelism, FP8, the optimizers' parameter groups, extraction, evaluation and
generation find the modules they act on there too (with the model's own methods, `LanguageModel`: outside
engine/model/ no code imports a family's modules, tests/model/test_model_contract.py checks it); `forge
convert` (`engine/checkpoint/hf_mapping.py`) reads `HFMapping`. This module and the spec's functions stay torch-free
(`forge validate-config` reads them); only `build` imports the family's torch module, when a model is built.

What a family must keep so that the layouts apply to it: the model holds its `[model]` section as `cfg`
(the layouts find the spec through it); parameter names that say their owner (the blocks
under `ModelParts.blocks`, a ModuleDict keyed "0", "1", …, each block's parameters named
`{blocks}.{i}.…`); the modules of `ModelParts.first` (embeddings) and `ModelParts.last` (final norm, head)
may be set to None on a pipeline stage that does not own them, and the forward then takes or returns
hidden states [batch, seq, dim].
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from engine.config.model import ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of the model: its name in `named_parameters()`, full shape, owner ("embedding"
    (held by the first pipeline stage), "head", "norm" or "mtp" (the last stage's), or the block index), the
    dimension tensor parallelism shards (None = replicated over tp), and whether expert parallelism splits
    its dim 0 (packed experts [experts, …])."""

    name: str
    shape: tuple[int, ...]
    owner: str | int
    tp_dim: int | None = None
    expert_parallel: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def kind(self) -> str:
        """ "hidden_matrix" for a 2-D weight inside a block (what Muon orthogonalizes, as
        ModelParts.is_hidden_matrix tells them in a built model), else "other": optimizers whose state
        differs by kind say so in their `OptimizerState`."""
        return "hidden_matrix" if isinstance(self.owner, int) and len(self.shape) == 2 else "other"


class LanguageModel(Protocol):
    """What a family's model (an `nn.Module`) is to the rest of Forge besides its `ModelParts`: the type that
    annotations outside engine/model/ name, so that no room depends on one family's class.

    - `cfg`: its `[model]` section (the layouts find the spec through it, `spec_for(model.cfg)`);
    - called as `model(tokens, cache=None, *, return_hidden=False, doc_ids=None, ...)`: token ids [batch,
      seq] (or, on a pipeline stage after the first, hidden states) → logits [batch, seq, vocab], or with
      `return_hidden` the final-normed states the head takes; `doc_ids`: packed documents' ids per token;
      `cache`: the KV cache of generation;
    - `new_kv_cache(batch, capacity)`: the empty cache generation passes its forwards (engine/generate.py);
      a family without attention has none, and generation then refuses the model;
    - `reset_rope_tables()`: recompute what a model built on the meta device derives from its config after
      `to_empty` (nothing, for a family without such tables).

    A model with experts (`model.num_experts` > 0) also keeps what the MoE training reads
    (engine/train/balancing.py, losses.py, moe_load.py; engine/model/routing_metrics.py): `moe_layers()` (block
    name → its expert layer, whose `metrics(stats, window)` reports its routing), `moe_routers()` (block name →
    router), `last_moe_stats` (block name → the stats of the last forward, with the `load` per expert) and
    `moe_loss()` (the auxiliary losses of the last forward, or None).
    """

    cfg: ModelConfig

    def __call__(self, tokens: torch.Tensor, cache: Any = None, **options: Any) -> torch.Tensor: ...

    def new_kv_cache(self, batch: int, capacity: int) -> Any: ...

    def reset_rope_tables(self) -> None: ...


@dataclass(frozen=True)
class ActivationLayout:
    """What the saved activations of a block depend on besides the model, as the memory estimate works it
    out from the job (engine/parallel/memory.py): bytes per element of matmul inputs/outputs (`compute`) and
    of the residual stream (`residual`: fp32 under autocast, the compute dtype under FSDP), whether autocast
    casts each projection's input separately (`casts`), the tensor and context parallel degrees, the
    context-parallel method, the sequence length of a micro-batch, whether windows are packed with
    documents (whose masks engine/parallel/memory.py counts), whether the loss is chunked
    (`train.loss_fn = "chunked_cross_entropy"`, which keeps gradients instead of log-probabilities) and the
    vocabulary entries per rank it computes over (`loss_vocab`: the head's shard under tensor parallelism, the
    whole vocabulary when a pipeline gathers the logits; 0: the head's shard)."""

    compute: int
    residual: int
    casts: bool
    tp: int
    cp: int
    cp_method: str
    seq_len: int
    packed: bool = False
    chunked_loss: bool = False
    loss_vocab: int = 0


@dataclass(frozen=True)
class TPStyle:
    """How tensor parallelism treats one module, as data (engine/parallel/tp.py makes the DTensor style):

    - "colwise": a linear sharded by output features (rows of its weight);
    - "rowwise": a linear sharded by input features, its output reduce-scattered to the sequence-sharded
      residual stream; "rowwise_replicate": the same, its output all-reduced to the full tokens;
    - "sequence_parallel": a norm applied to this rank's positions (weight replicated);
    - "head_sharded_norm": a norm over head_dim of head-sharded q or k [batch, seq, heads, head_dim];
    - "head_sharded_vector": a module whose `weight` holds one value per query head (attention sinks),
      sharded with the heads; it returns this rank's shard;
    - "gather_sequence": the module's first of `inputs` positional inputs all-gathered over the sequence
      (the others pass through);
    - "vocab_embedding": a token embedding with vocabulary-sharded rows, its output reduce-scattered over
      the sequence;
    - "vocab_head": the output head, sharded over the vocabulary (loss parallel keeps the logits sharded);
    - "full_tokens": a module (an MoE layer) run on the whole sequence on every rank: input gathered,
      output cut back to this rank's positions;
    - "replicated_router": a router whose weight is replicated and used as a local tensor;
    - "sequence_linear": a linear on the sequence-sharded stream, sharded by output features: its input
      all-gathered over the sequence, its output redistributed back to this rank's positions.
    """

    kind: str
    inputs: int = 1

    def __post_init__(self) -> None:
        if self.kind not in TP_KINDS:
            raise ValueError(f"unknown tensor-parallel style {self.kind!r} (known: {', '.join(TP_KINDS)})")


TP_KINDS = (
    "colwise",
    "rowwise",
    "rowwise_replicate",
    "sequence_parallel",
    "head_sharded_norm",
    "head_sharded_vector",
    "gather_sequence",
    "vocab_embedding",
    "vocab_head",
    "full_tokens",
    "replicated_router",
    "sequence_linear",
)


@dataclass(frozen=True)
class TPPlan:
    """Tensor parallelism of a family: `outer` (module name → style, for the modules outside the blocks; a
    pipeline stage skips those it does not hold), `block(cfg, layer)` (module name inside block `layer` →
    style, applied in order), `tied` (a (head, embedding) pair whose head weight is pointed at the
    embedding's sharded weight again after the plan, when the config ties them) and `mtp` (module name inside
    a multi-token-prediction module → style, for the families that have them: engine/model/mtp.py)."""

    outer: dict[str, TPStyle]
    block: Callable[[ModelConfig, int], dict[str, TPStyle]]
    tied: tuple[str, str] | None = None
    mtp: Callable[[ModelConfig], dict[str, TPStyle]] | None = None


@dataclass(frozen=True)
class ModelParts:
    """The parts of a family's model that the rest of Forge may reach, by attribute name or by path inside a
    block (dotted, as `nn.Module.get_submodule` takes it): the one place where `parallel/`, `train/`,
    `interp/`, `eval/` and generation learn where things are, so none of them names a family's classes.

    - `blocks`: the ModuleDict of blocks: what FSDP shards unit by unit, activation checkpointing wraps and
      compile compiles, each one's parameters the hidden matrices (`is_hidden_matrix`), and what pipeline
      parallelism splits (engine/parallel/stages.py);
    - `first` / `last`: the modules only the first pipeline stage holds (embeddings) and only the last
      (final norm, head); with tied embeddings `tied` is the (embedding, head) pair each end keeps a copy of;
    - `embedding`: the token embedding, whose weight tells where and in which dtype the model computes
      (generation's KV cache and evaluation's inputs are made there); `head`: the output head (a linear
      from hidden states to the vocabulary), which the chunked loss and evaluation's scoring call on the
      final-normed states themselves, and which FP8 leaves in high precision;
    - `mtp`: the family's multi-token-prediction modules (engine/model/mtp.py), which run after the head on
      the last stage and look tokens up in the embedding (`tied[0]`): that stage then keeps a copy of it too;
    - `attention`: inside a block, its attention core: a parameterless module called as `core(q, k, v,
      mask, causal)`, or `core(q, k, v, mask, causal, sinks)` with per-head sink logits, on queries, keys and values (batch, heads, seq, head_dim) after position encoding, with
      a `kernel()` context manager that picks its SDPA kernel. Context parallelism replaces it by a core that
      attends across the cp ranks (and keeps the original as `local`), and `forge extract --attention`
      recomputes the weights from its inputs. A family whose model also takes `positions` and
      `attention_mask` in its forward (where context parallelism's hook passes them) gets context
      parallelism through it. None: no attention to reach;
    - `experts`: inside a block, its routed-experts module where the block has one (a dense block of an MoE
      model has none): the seam of expert parallelism (engine/parallel/expert.py), called as
      `experts(rows, counts, implementation, grad_factor)` on the rows sorted by expert and the rows per expert,
      accepting `weights=` (this rank's shards as plain tensors, which the exchange passes it); its parameters
      are held by the module itself, each [num_experts, …] (`ParamSpec.expert_parallel`, with the hidden
      dimension tensor parallelism splits as `tp_dim`). Its output must depend on every weight it holds, an
      expert handed no rows included: a weight left out of one rank's graph reorders that rank's FSDP
      collectives against the others' and the job hangs. None: no experts;
    - `router`: inside a block, the router of its experts, whose output has `experts` and `weights`
      [tokens, k] (what `forge extract --routing` stores);
    - `compile_regions`: inside a block with experts, the modules compiled on their own when its routed
      experts must run eagerly (engine/parallel/apply.py: `compiled_regions`); a path whose module is None in
      a block (no shared experts) is skipped;
    - `high_precision`: fnmatch patterns of module names (`layers.3.feed_forward.router.gate`) that FP8 leaves
      unconverted besides the head (a router whose gate runs through the weight, not the module).
    """

    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    embedding: str
    head: str
    tied: tuple[str, str] | None = None
    mtp: str | None = None
    attention: str | None = None
    experts: str | None = None
    router: str | None = None
    compile_regions: tuple[str, ...] = ()
    high_precision: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.mtp is None or self.tied is not None, "ModelParts.mtp looks tokens up in tied[0]: name it"
        assert self.router is None or self.experts is not None, "ModelParts.router routes the blocks' experts"

    def block_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """Block name ("0", "1", …) → block of `model` (a whole model or a pipeline stage's), in model order."""
        return dict(getattr(model, self.blocks).items())

    def in_blocks(self, model: nn.Module, path: str | None) -> dict[str, nn.Module]:
        """Block name → the module at `path` inside it (`inside`), for the blocks that have one (none for path
        None), in model order."""
        found = {name: inside(block, path) for name, block in self.block_modules(model).items()}
        return {name: module for name, module in found.items() if module is not None}

    def embedding_of(self, model: nn.Module) -> nn.Module:
        """`model`'s token embedding (None on a pipeline stage that does not hold it)."""
        return getattr(model, self.embedding)

    def head_of(self, model: nn.Module) -> nn.Module:
        """`model`'s output head (None on a pipeline stage that does not hold it)."""
        return getattr(model, self.head)

    def is_hidden_matrix(self, name: str, ndim: int) -> bool:
        """A 2-D parameter inside the blocks (attention and MLP projections), by its name in
        `named_parameters()` (the blocks' prefix survives activation checkpointing, compile and FSDP): what Muon
        orthogonalizes, as `ParamSpec.kind` counts them. Embeddings, the head, norms and biases are not."""
        return ndim == 2 and name.startswith(f"{self.blocks}.")


def inside(module: nn.Module, path: str | None) -> nn.Module | None:
    """The module at dotted `path` inside `module` (a block), or None where the path is None, ends at an
    attribute that is None (no shared experts) or is missing (a dense block has no routed experts). Wrappers
    around a block (activation checkpointing) pass attribute lookups on to it."""
    if path is None:
        return None
    for attribute in path.split("."):
        module = getattr(module, attribute, None)
        if module is None:
            return None
    return module


@dataclass(frozen=True)
class Piece:
    """How one HF tensor is made from the Forge state dict: the tensor `source` (a Forge FQN), or one expert
    of it (`expert`, for packed experts), transposed (Forge stores expert weights input-major, HF as
    nn.Linear [out, in]; GPT-2's Conv1D stores every linear [in, out]); or, when source is None, zeros of
    `shape` (a tensor the HF model must hold and Forge's has no counterpart of, such as a zero-width expert).
    `fp32` tensors are written in fp32 whatever the export dtype (a routing bias, which transformers keeps in
    fp32). `fused`: further Forge tensors of source's shape that follow it along dim 0 in one HF tensor (a
    fused projection, GPT-2's c_attn = q, k and v): the HF tensor is their concatenation on dim 0 (then
    transposed), and importing splits it into equal parts again. `scale` multiplies the tensor on export: a μP
    model's query and logit multipliers folded into the weights (engine/model/mup.py); an import reads folders
    of sp configs, whose pieces all have scale 1."""

    source: str | None
    expert: int | None = None
    transpose: bool = False
    shape: tuple[int, ...] = ()
    fp32: bool = False
    fused: tuple[str, ...] = ()
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.fused and (self.source is None or self.expert is not None):
            raise ValueError("a fused Piece concatenates whole Forge tensors: it needs a source and no expert")

    @property
    def sources(self) -> tuple[str, ...]:
        """The Forge tensors this HF tensor is made of, in order (none for zeros)."""
        return () if self.source is None else (self.source, *self.fused)


@dataclass(frozen=True)
class HFMapping:
    """A family's correspondence with Hugging Face `transformers` models, both ways.

    - `model_types`: HF architecture class → its config.json `model_type`, for every class it reads or writes;
    - `architecture(cfg)`: the class that computes exactly what `cfg` does, or a UserError naming the field;
    - `config(cfg, dtype_name, eos_id, bos_id)`: that class's config.json (dtype_name e.g. "bfloat16");
    - `model_config(config_json, source)`: the `[model]` section of a config.json of one of `model_types`;
    - `layout(cfg)`: HF tensor name → `Piece`, every tensor an HF folder of `cfg` stores, in model order;
    - `architecture_fields`: the ModelConfig fields a checkpoint and an HF folder must agree on;
    - `unstored_state`: name suffixes of Forge state entries HF folders do not hold (training state, such as
      a router's balancing counters), set to zeros on import;
    - `ignored_suffixes`: HF tensors some folders store that are derived, not learned (skipped on import);
    - `tied_head`: the HF name of the head, which a folder of a tied model may store besides the embedding
      (skipped on import: the embedding is the head);
    - `base_model_prefix`: the prefix of the base model's tensor names (GPT-2: "transformer."), which some
      folders store without, as transformers' own loading allows (OpenAI's GPT-2 checkpoints were saved from
      the base model: `wte.weight`, `h.0.attn.c_attn.weight`); the import reads such a name as the prefixed one.
    """

    model_types: dict[str, str]
    architecture: Callable[[ModelConfig], str]
    config: Callable[[ModelConfig, str, int | None, int | None], dict[str, Any]]
    model_config: Callable[[dict[str, Any], str], ModelConfig]
    layout: Callable[[ModelConfig], dict[str, Piece]]
    architecture_fields: tuple[str, ...]
    unstored_state: tuple[str, ...] = ()
    ignored_suffixes: tuple[str, ...] = ()
    tied_head: str | None = None
    base_model_prefix: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer, the layouts, the estimates and conversion need of one model family.

    - `build`: "module:attribute" of the nn.Module class (or function) taking a ModelConfig, imported when a
      model is built (so that registering stays torch-free), or that class itself;
    - `param_specs(cfg)`: every parameter tensor, in registration order (a tied head is the embedding's);
    - `param_counts(cfg)`: embedding, output_head, blocks, non_embedding, total, active (see estimate.py);
    - `flops_per_token(cfg, seq_len)`: training (forward + backward) FLOPs of one token;
    - `block_activation_bytes(cfg, layout, layer, tokens)`: what autograd saves for block `layer` over
      `tokens` tokens on one rank, without activation checkpointing; `checkpointed_block_bytes` the same
      with activation checkpointing (`mode` "full" or "selective");
    - `norm_bytes(cfg, layout)`: saved per token by one of its norms (the final norm's, before the head);
    - `position_table_width(cfg)`: width of the per-position tables (RoPE's cos and sin) that packed
      documents give every sequence its own copy of; 0 for a family without such tables;
    - `parts`: the parts of the model the other rooms reach (blocks, embedding and head, pipeline cuts, the
      modules context and expert parallelism, FP8 and extraction act on); `tp_plan`: tensor-parallel plan; `hf`: conversion, None when the
      family has no Hugging Face counterpart;
    - `lora_adapters`: whether `[lora]` can adapt the family's linears (engine/model/lora.py adapts
      bias-free ones only; a family with biased linears says False, and config validation refuses LoRA).
    - `head_extra_bytes(cfg, layout, tokens)`: what autograd saves beyond the final norm, head and loss on the
      rank that computes the loss, over `tokens` tokens (the transformer's multi-token-prediction modules);
      0 for a family without any.

    The `[model]` fields the family reads, and the sizes they derive (head width, FFN width, expert layers), are
    its config class's, registered beside the spec: a field only other families declare is refused with it
    (engine/model/rules.py: family_issues).
    """

    build: str | Callable[[ModelConfig], nn.Module]
    param_specs: Callable[[ModelConfig], list[ParamSpec]]
    param_counts: Callable[[ModelConfig], dict[str, int]]
    flops_per_token: Callable[[ModelConfig, int], int]
    block_activation_bytes: Callable[[ModelConfig, ActivationLayout, int, int], int]
    checkpointed_block_bytes: Callable[[ModelConfig, ActivationLayout, int, int, str], int]
    norm_bytes: Callable[[ModelConfig, ActivationLayout], int]
    position_table_width: Callable[[ModelConfig], int]
    parts: ModelParts
    tp_plan: TPPlan
    hf: HFMapping | None = None
    lora_adapters: bool = True
    head_extra_bytes: Callable[[ModelConfig, ActivationLayout, int], int] = lambda cfg, layout, tokens: 0

    def model_class(self) -> Callable[[ModelConfig], nn.Module]:
        """The builder named by `build`, imported now (this imports torch)."""
        if callable(self.build):
            return self.build
        module, _, attribute = self.build.partition(":")
        return getattr(importlib.import_module(module), attribute)


def spec_for(cfg: ModelConfig) -> ModelSpec:
    """The registered spec of `cfg.model_type` (every family registers when engine.config.model is imported)."""
    from engine.config.registry import MODELS

    return MODELS.get(cfg.model_type).spec
