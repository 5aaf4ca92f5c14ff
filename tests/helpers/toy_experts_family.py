"""A toy language model that is not Forge's transformer, with attention and routed experts of its own, added through
its `ModelSpec` alone (tests/parallel/test_model_contract.py trains it under FSDP, resumes it, and runs it with
expert and context parallelism, with nothing in engine/ edited for it).

The model: token + learned position embeddings → n_layers × [x + mixer(norm(x)); x + ffn(norm(x))] → norm → head.
Its names are its own (`mixer`, `ffn`, `gate`, `up`/`down`), so every room that acts on it must find them
through `ModelParts`: the attention core at `mixer.core` (context parallelism swaps it, extraction hooks it),
the routed experts at `ffn.experts` (expert parallelism shards and feeds them). Its gate returns plain logits, not
the `experts`/`weights` a `ModelParts.router` returns, so it declares no router.

- attention: causal multi-head, no bias; its core (`ToyCore`) calls SDPA with the mask it is handed (packed
  documents' or a context-parallel hook's) or the causal flag, and offers `kernel()` (PyTorch's own choice);
- experts: top-1 routing by a softmax gate; the experts module holds `up` [E, dim, hidden] and `down`
  [E, hidden, dim] itself and runs each expert on its rows, sorted by expert, in a loop (the contract's call:
  `experts(rows, counts, implementation, grad_factor, weights)`), an expert with no rows included (see
  `ToyExperts.forward`); `grad_factor` scales each expert's weight
  gradients (expert parallelism passes 1/ep), through `ScaleGrad`;
- the MoE training protocol (`LanguageModel`'s `moe_layers`, `moe_routers`, `last_moe_stats`, `moe_loss`): the
  toy keeps no routing statistics and has no auxiliary loss, so the metrics report nothing for it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.model import ModelConfig, NormChoice
from engine.config.registry import MODELS
from engine.model.moe_config import ExpertFields
from engine.model.spec import ActivationLayout, ModelParts, ModelSpec, ParamSpec, TPPlan

NAME = "toy_experts"
FP32 = 4


class ToyCore(nn.Module):
    """softmax(qkᵀ/√d + mask)v on (batch, heads, seq, head_dim): the module the contract's `attention` names."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object = None, causal: bool = True
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)

    def kernel(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class ToyMixer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))
        self.core = ToyCore()

    def forward(self, x: torch.Tensor, mask: object = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = self.core(q, k, v, mask, mask is None)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies expert e's weight gradient by factor[e]."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(factor)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (factor,) = ctx.saved_tensors
        return grad * factor.view(-1, *([1] * (grad.dim() - 1))).to(grad.dtype), None


class ToyExperts(nn.Module):
    """Each expert x → relu(x @ up[e]) @ down[e]; the parameters [E, …] are the module's own."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, h = cfg.num_experts, cfg.dim, cfg.expert_ffn_dim
        self.up = nn.Parameter(torch.randn(e, d, h) * cfg.init_std)
        self.down = nn.Parameter(torch.randn(e, h, d) * cfg.init_std)

    def forward(
        self,
        rows: torch.Tensor,
        counts: torch.Tensor,
        implementation: str = "loop",
        grad_factor: torch.Tensor | None = None,
        weights: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        up, down = (self.up, self.down) if weights is None else weights
        if grad_factor is not None:
            up, down = ScaleGrad.apply(up, grad_factor), ScaleGrad.apply(down, grad_factor)
        # Every expert runs, an empty one on its 0 rows: its weights stay in the graph, so each rank's backward
        # reaches every FSDP group in the same order (skipping one deadlocked FSDP + ep on the expert's rank).
        return torch.cat([torch.relu(part @ up[e]) @ down[e] for e, part in enumerate(rows.split(counts.tolist()))])


class ToyFFN(nn.Module):
    """Top-1 routing: each token goes to its gate's best expert, its output weighted by that softmax probability."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = ToyExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, 1)
        probs = torch.softmax(self.gate(tokens).float(), dim=-1)
        weight, expert = probs.max(dim=-1)
        order = expert.argsort(stable=True)
        counts = torch.bincount(expert, minlength=self.num_experts)
        y = self.experts(tokens[order], counts, "loop", None)
        out = torch.zeros_like(tokens).index_add(0, order, y * weight[order, None].to(y.dtype))
        return out.view_as(x)


class ToyBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.mixer_norm = nn.LayerNorm(cfg.dim)
        self.mixer = ToyMixer(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim)
        self.ffn = ToyFFN(cfg)

    def forward(self, x: torch.Tensor, mask: object = None) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x), mask=mask)
        return x + self.ffn(self.ffn_norm(x))


class ToyExpertsLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleDict({str(i): ToyBlock(cfg) for i in range(cfg.n_layers)})
        self.final_norm: nn.Module | None = nn.LayerNorm(cfg.dim)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.last_moe_stats: dict[str, Any] = {}  # the toy keeps no routing statistics
        for table in (self.tok_embeddings, self.pos_embeddings):
            nn.init.normal_(table.weight, std=cfg.init_std)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: None = None,
        *,
        return_hidden: bool = False,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attention_mask: object = None,
    ) -> torch.Tensor:
        assert cache is None and doc_ids is None, "the toy has no KV cache and takes no packed documents"
        if self.tok_embeddings is None:
            h = tokens
        else:
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.tok_embeddings(tokens) + self.pos_embeddings(
                positions if positions.dim() == 2 else positions[None]
            )
        for block in self.blocks.values():
            h = block(h, mask=attention_mask)
        if self.lm_head is None:
            return h
        h = self.final_norm(h)
        return h if return_hidden else self.lm_head(h)

    def reset_rope_tables(self) -> None:
        """The toy derives no tables from its config."""

    def moe_layers(self) -> dict[str, nn.Module]:
        return {name: block.ffn for name, block in self.blocks.items()}

    def moe_routers(self) -> dict[str, nn.Module]:
        return {}  # no router keeps a balancing state

    def moe_loss(self) -> None:
        return None  # no auxiliary loss


# ---------------------------------------------------------------- the spec (torch-free functions)


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    d, e, h = cfg.dim, cfg.num_experts, cfg.expert_ffn_dim
    specs = [
        ParamSpec("tok_embeddings.weight", (cfg.vocab_size, d), "embedding"),
        ParamSpec("pos_embeddings.weight", (cfg.max_seq_len, d), "embedding"),
    ]
    for i in range(cfg.n_layers):
        p = f"blocks.{i}"
        specs += [ParamSpec(f"{p}.mixer_norm.{n}", (d,), i) for n in ("weight", "bias")]
        specs += [ParamSpec(f"{p}.mixer.{w}.weight", (d, d), i) for w in ("wq", "wk", "wv", "wo")]
        specs += [ParamSpec(f"{p}.ffn_norm.{n}", (d,), i) for n in ("weight", "bias")]
        specs += [
            ParamSpec(f"{p}.ffn.gate.weight", (e, d), i),
            ParamSpec(f"{p}.ffn.experts.up", (e, d, h), i, 2, expert_parallel=True),
            ParamSpec(f"{p}.ffn.experts.down", (e, h, d), i, 1, expert_parallel=True),
        ]
    specs += [ParamSpec(f"final_norm.{n}", (d,), "norm") for n in ("weight", "bias")]
    specs.append(ParamSpec("lm_head.weight", (cfg.vocab_size, d), "head"))
    return specs


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    specs = param_specs(cfg)
    embedding = sum(s.numel for s in specs if s.owner == "embedding")
    head = sum(s.numel for s in specs if s.owner == "head")
    total = sum(s.numel for s in specs)
    inactive = cfg.n_layers * (cfg.num_experts - 1) * 2 * cfg.dim * cfg.expert_ffn_dim  # top-1 routing
    return {
        "embedding": embedding,
        "output_head": head,
        "blocks": total - embedding - head,
        "non_embedding": total - embedding,
        "total": total,
        "active": total - inactive,
    }


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """6 × the active matmul weights, plus causal attention's two [seq, seq] products per layer."""
    d, h = cfg.dim, cfg.expert_ffn_dim
    weights = cfg.n_layers * (4 * d * d + cfg.num_experts * d + 2 * d * h) + cfg.vocab_size * d
    return 6 * weights + 6 * cfg.n_layers * seq_len * d


def norm_bytes(cfg: ModelConfig, lay: ActivationLayout) -> int:
    """LayerNorm keeps its input, mean and 1/std."""
    return lay.residual * cfg.dim + 2 * FP32


def block_activation_bytes(cfg: ModelConfig, lay: ActivationLayout, layer: int, tokens: int) -> int:
    """Per token: two norms; q, k, v, the attention output and wo's input; the gate's fp32 logits and
    probabilities; each token's expert row in, hidden and out (top-1)."""
    d, h, c = cfg.dim, cfg.expert_ffn_dim, lay.compute
    per_token = 2 * norm_bytes(cfg, lay) + 5 * c * d + 2 * FP32 * cfg.num_experts + c * (2 * d + h)
    return tokens * per_token // lay.cp


def checkpointed_block_bytes(cfg: ModelConfig, lay: ActivationLayout, layer: int, tokens: int, mode: str) -> int:
    """full: the block's input; selective: also every matmul's output."""
    kept = lay.residual * cfg.dim + (0 if mode == "full" else lay.compute * (5 * cfg.dim + cfg.expert_ffn_dim))
    return tokens * kept // lay.cp


SPEC = ModelSpec(
    build=ToyExpertsLM,
    param_specs=param_specs,
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    block_activation_bytes=block_activation_bytes,
    checkpointed_block_bytes=checkpointed_block_bytes,
    norm_bytes=norm_bytes,
    position_table_width=lambda cfg: 0,
    parts=ModelParts(
        blocks="blocks",
        first=("tok_embeddings", "pos_embeddings"),
        last=("final_norm", "lm_head"),
        embedding="tok_embeddings",
        head="lm_head",
        attention="mixer.core",
        experts="ffn.experts",
        high_precision=("*.ffn.gate",),
    ),
    tp_plan=TPPlan(outer={}, block=lambda cfg, layer: {}),
    lora_adapters=False,
)


class ToyExpertsConfig(ExpertFields, NormChoice):
    """The toy's `[model]` fields: the shared ones, the experts' (num_experts, the expert width) and its norm."""


def register() -> None:
    """Register the toy family (a test undoes it with a registries fixture, or it lives in a torchrun script)."""
    MODELS.register(NAME, spec=SPEC)(ToyExpertsConfig)


def toy_config(**fields: Any) -> ModelConfig:
    """A small `[model]` of the toy family: 2 blocks of 4 experts each."""
    base = {
        "dim": 32,
        "n_layers": 2,
        "n_heads": 2,
        "vocab_size": 256,
        "max_seq_len": 16,
        "num_experts": 4,
        "moe_top_k": 1,
        "moe_packed_experts": True,
        "tie_embeddings": False,
        "norm_type": "layernorm",
    }
    cfg = ModelConfig(**{**base, **fields})
    # A real family adds its name to ModelConfig.model_type's Literal; model_copy stands in for that edit.
    return cfg.model_copy(update={"model_type": NAME})
