"""A toy model family and a toy optimizer, defined outside engine/ and added through their registrations alone
(docs/architecture.md, "A model family" and "An optimizer"): tests/config/test_extension_points.py registers them and
checks that the memory estimate, the FLOP count, FSDP, tensor and pipeline parallelism and Hugging Face
conversion all work with them, with nothing in engine/ edited.

The toy is a token-wise language model (no attention, so no position tables): embedding → n_layers ×
[x + down(relu(up(norm(x))))] → norm → head. Unlike the transformer its linears have biases (up's is sharded
with its rows under tensor parallelism, down's replicated), and its Hugging Face names store the block's
linears input-major (transposed, as GPT-2's Conv1D does), so the spec's vocabulary is exercised beyond what
the built-in family uses. Its config class (`ToyConfig`) declares one field of its own, `toy_residual_scale`, which
becomes a key of `[model]` when it is registered. `register()` adds both; a real family would be a folder under
engine/model/families/ (its `config.py` and its spec) with the same one registration line.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from engine.config.model import ModelConfig, NormChoice
from engine.config.optimizer import OptimizerFields, OptimizerState
from engine.config.registry import MODELS, OPTIMIZERS
from engine.model.norms import build_norm
from engine.model.spec import (
    ActivationLayout,
    HFMapping,
    ModelParts,
    ModelSpec,
    ParamSpec,
    Piece,
    TPPlan,
    TPStyle,
)
from engine.train.optim import param_groups

NAME = "toy_mlp"
HF_CLASS, HF_TYPE = "ToyMlpForCausalLM", "toy_mlp"
OPTIMIZER = "toy_momentum"
FP32 = 4


class ToyMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class ToyBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = build_norm(cfg.norm_type, cfg.dim, cfg.norm_eps)
        self.mlp = ToyMLP(cfg)
        self.residual_scale = cfg.toy_residual_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.residual_scale * self.mlp(self.norm(x))


class ToyLM(nn.Module):
    """The toy model. A pipeline stage sets `tok_embeddings` or `norm`/`output` to None (ModelParts)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): ToyBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = build_norm(cfg.norm_type, cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        nn.init.normal_(self.tok_embeddings.weight, std=cfg.init_std)

    def forward(
        self, tokens: torch.Tensor, cache: None = None, *, return_hidden: bool = False, doc_ids: None = None
    ) -> torch.Tensor:
        assert cache is None and doc_ids is None, "the toy has no attention: no cache, no packed documents"
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        if self.output is None:
            return h
        h = self.norm(h)
        return h if return_hidden else self.output(h)


# ---------------------------------------------------------------- the spec (torch-free functions)


def norm_specs(cfg: ModelConfig, prefix: str, owner: str | int) -> list[ParamSpec]:
    specs = [ParamSpec(f"{prefix}.weight", (cfg.dim,), owner)]
    return specs + ([ParamSpec(f"{prefix}.bias", (cfg.dim,), owner)] if cfg.norm_type == "layernorm" else [])


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    d, f = cfg.dim, cfg.ffn_dim
    specs = [ParamSpec("tok_embeddings.weight", (cfg.vocab_size, d), "embedding", 0)]
    for i in range(cfg.n_layers):
        specs += norm_specs(cfg, f"layers.{i}.norm", i)
        specs += [
            ParamSpec(f"layers.{i}.mlp.up.weight", (f, d), i, 0),
            ParamSpec(f"layers.{i}.mlp.up.bias", (f,), i, 0),
            ParamSpec(f"layers.{i}.mlp.down.weight", (d, f), i, 1),
            ParamSpec(f"layers.{i}.mlp.down.bias", (d,), i),
        ]
    specs += norm_specs(cfg, "norm", "norm")
    if not cfg.tie_embeddings:
        specs.append(ParamSpec("output.weight", (cfg.vocab_size, d), "head", 0))
    return specs


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    specs = param_specs(cfg)
    embedding = cfg.vocab_size * cfg.dim
    output_head = sum(s.numel for s in specs if s.owner == "head")
    total = sum(s.numel for s in specs)
    return {
        "embedding": embedding,
        "output_head": output_head,
        "blocks": total - embedding - output_head,
        "non_embedding": total - embedding,
        "total": total,
        "active": total,
    }


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """6 × the matmul weights (up, down, head): no attention, so nothing grows with the sequence."""
    return 6 * (cfg.n_layers * 2 * cfg.dim * cfg.ffn_dim + cfg.vocab_size * cfg.dim)


def norm_bytes(cfg: ModelConfig, lay: ActivationLayout) -> int:
    """RMSNorm keeps its input and 1/rms (fp32), LayerNorm its input, mean and 1/std."""
    return lay.residual * cfg.dim + (FP32 if cfg.norm_type == "rmsnorm" else 2 * FP32)


def block_activation_bytes(cfg: ModelConfig, lay: ActivationLayout, layer: int, tokens: int) -> int:
    """Per token: the norm's saved tensors; the normed input `up` reads (gathered over the sequence under
    tp, so whole); relu's output, which `down` reads too (÷ tp: hidden units are sharded)."""
    h, f, c = cfg.dim, cfg.ffn_dim, lay.compute
    return tokens * c * h + tokens * (norm_bytes(cfg, lay) + c * f) // lay.tp


def checkpointed_block_bytes(cfg: ModelConfig, lay: ActivationLayout, layer: int, tokens: int, mode: str) -> int:
    """full: the block's input; selective: also the outputs of up and down."""
    kept = lay.residual * cfg.dim + (0 if mode == "full" else lay.compute * (cfg.ffn_dim + cfg.dim))
    return tokens * kept // lay.tp


def block_plan(cfg: ModelConfig, layer: int) -> dict[str, TPStyle]:
    return {
        "norm": TPStyle("sequence_parallel"),
        "mlp": TPStyle("gather_sequence"),
        "mlp.up": TPStyle("colwise"),
        "mlp.down": TPStyle("rowwise"),
    }


# Hugging Face side: GPT-2-like names, the block's linears stored [in, out].
def hf_layout(cfg: ModelConfig) -> dict[str, Piece]:
    layout = {"transformer.wte.weight": Piece("tok_embeddings.weight")}
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        layout[f"{theirs}.ln.weight"] = Piece(f"{ours}.norm.weight")
        if cfg.norm_type == "layernorm":
            layout[f"{theirs}.ln.bias"] = Piece(f"{ours}.norm.bias")
        for forge, hf in (("up", "c_fc"), ("down", "c_proj")):
            layout[f"{theirs}.mlp.{hf}.weight"] = Piece(f"{ours}.mlp.{forge}.weight", transpose=True)
            layout[f"{theirs}.mlp.{hf}.bias"] = Piece(f"{ours}.mlp.{forge}.bias")
    layout["transformer.ln_f.weight"] = Piece("norm.weight")
    if cfg.norm_type == "layernorm":
        layout["transformer.ln_f.bias"] = Piece("norm.bias")
    if not cfg.tie_embeddings:
        layout["lm_head.weight"] = Piece("output.weight")
    return layout


def hf_config(cfg: ModelConfig, dtype_name: str, eos_id: int | None, bos_id: int | None) -> dict[str, Any]:
    return {
        "architectures": [HF_CLASS],
        "model_type": HF_TYPE,
        "n_embd": cfg.dim,
        "n_inner": cfg.ffn_dim,
        "n_layer": cfg.n_layers,
        "vocab_size": cfg.vocab_size,
        "norm": cfg.norm_type,
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype_name,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def model_config(config: dict[str, Any], source: str) -> ModelConfig:
    cfg = ModelConfig(
        dim=config["n_embd"],
        n_heads=1,
        n_layers=config["n_layer"],
        vocab_size=config["vocab_size"],
        ffn_hidden_dim=config["n_inner"],
        norm_type=config["norm"],
        norm_eps=config["layer_norm_epsilon"],
        tie_embeddings=config["tie_word_embeddings"],
        model_type=NAME,
    )
    return cfg


SPEC = ModelSpec(
    build=ToyLM,
    param_specs=param_specs,
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    block_activation_bytes=block_activation_bytes,
    checkpointed_block_bytes=checkpointed_block_bytes,
    norm_bytes=norm_bytes,
    position_table_width=lambda cfg: 0,
    parts=ModelParts(
        blocks="layers",
        first=("tok_embeddings",),
        last=("norm", "output"),
        embedding="tok_embeddings",
        head="output",
        tied=("tok_embeddings", "output"),
    ),
    tp_plan=TPPlan(
        outer={
            "tok_embeddings": TPStyle("vocab_embedding"),
            "norm": TPStyle("sequence_parallel"),
            "output": TPStyle("vocab_head"),
        },
        block=block_plan,
        tied=("output", "tok_embeddings"),
    ),
    hf=HFMapping(
        model_types={HF_CLASS: HF_TYPE},
        architecture=lambda cfg: HF_CLASS,
        config=hf_config,
        model_config=model_config,
        layout=hf_layout,
        architecture_fields=("dim", "n_layers", "vocab_size", "ffn_dim", "norm_type", "tie_embeddings"),
        tied_head="lm_head.weight",
    ),
)


# ---------------------------------------------------------------- the toy optimizer


class ToyMomentum(torch.optim.Optimizer):
    """SGD with heavy-ball momentum, one fp32 buffer per parameter (what its OptimizerState declares)."""

    def __init__(self, params: list[dict], lr: float, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p, dtype=torch.float32))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


def build_toy_momentum(model: nn.Module, cfg) -> torch.optim.Optimizer:
    return ToyMomentum(param_groups(model, cfg.weight_decay), lr=cfg.lr)


TOY_STATE = OptimizerState(FP32)


class ToyMomentumConfig(OptimizerFields):
    """The toy optimizer's config: the shared fields, and the state it keeps."""

    def state(self) -> OptimizerState:
        return TOY_STATE


class ToyConfig(NormChoice):
    """The toy family's `[model]` fields: the shared ones, the choice of norm, and one of its own."""

    toy_residual_scale: float = Field(
        1.0, gt=0, description="toy_mlp only: each block adds its MLP's output times this to the residual stream"
    )


def register() -> None:
    """Register the toy family and the toy optimizer (a test undoes it with the `registries` fixture)."""
    MODELS.register(NAME, spec=SPEC)(ToyConfig)
    OPTIMIZERS.register(OPTIMIZER, build=build_toy_momentum)(ToyMomentumConfig)


def toy_config(**fields: Any) -> ModelConfig:
    """A small `[model]` of the toy family."""
    return ModelConfig(
        **{"model_type": NAME, "dim": 32, "n_layers": 4, "n_heads": 1, "vocab_size": 64, "ffn_hidden_dim": 48, **fields}
    )
