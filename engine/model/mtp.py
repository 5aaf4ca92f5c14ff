"""Multi-token prediction (DeepSeek-V3, `model.mtp_depth` = D): D modules after the main model, module k
predicting the token k + 1 positions ahead of each position (the main model predicts the next one).

Module k takes, at position i, module k − 1's output state at i (the main model's last block output, before
its final norm, for k = 1) and the embedding of token i + k (the shared `tok_embeddings`), normalises each
(RMSNorm or LayerNorm, `model.norm_type`), concatenates them and projects 2·dim → dim, runs one transformer
block (causal attention over its positions, a dense gated MLP: DeepSeek-V3's MTP block has the MoE of its
layers, these are dense, so routing and balancing stay the main model's), and its own final norm; the shared
output head then gives its logits. Module k predicts at positions 0 … seq − k − 1 (token i + k must exist in
the window) and its targets are labels[:, k:]; it runs over the whole window (Transformer.mtp_outputs) and
the loss cuts the rest (engine/train/losses.py, `with_mtp_loss`), so that under tensor parallelism it runs on
the main model's sequence-sharded stream (the family's `TPPlan.mtp`), and under pipeline parallelism the
last stage sends its outputs with the main model's as one tensor (engine/parallel/pipeline.py).

Training adds `model.mtp_loss_weight` × the mean of the modules' losses to the main loss
(engine/train/losses.py); evaluation, generation and Hugging Face export use the main model only.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config.model import ModelConfig
from engine.model.norms import build_norm


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        from engine.model.transformer import Block  # the transformer builds these modules: import at use

        super().__init__()
        self.hidden_norm = build_norm(cfg.norm_type, cfg.dim, cfg.norm_eps)
        self.embed_norm = build_norm(cfg.norm_type, cfg.dim, cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg, 0, moe=False)
        self.norm = build_norm(cfg.norm_type, cfg.dim, cfg.norm_eps)

    def forward(
        self, hidden: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, embedded [batch, n, dim] → (this module's states [batch, n, dim] for the next module, the
        same after its final norm, for the head)."""
        x = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(embedded)], dim=-1))
        x, _ = self.block(x, cos, sin)
        return x, self.norm(x)


def build_mtp(cfg: ModelConfig) -> nn.ModuleDict | None:
    """The modules, keyed "1" … "D" (their depth), or None without multi-token prediction."""
    if not cfg.mtp_depth:
        return None
    return nn.ModuleDict({str(k): MTPModule(cfg) for k in range(1, cfg.mtp_depth + 1)})
