"""`[train]`: the training loop's hyperparameters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config.base import Section


class TrainConfig(Section):
    batch_size: int = Field(8, gt=0, description="sequences per device per micro-step")
    seq_len: int = Field(512, gt=0, description="tokens per sequence")
    max_steps: int = Field(1000, gt=0, description="optimizer steps to train for")
    grad_accum_steps: int = Field(1, gt=0, description="micro-steps accumulated per optimizer step")
    grad_clip_norm: float = Field(1.0, ge=0, description="clip the global grad norm to this; 0 = no clipping")
    seed: int = Field(42, ge=0, description="seed for weights init and every RNG")
    data_seed: int | None = Field(None, ge=0, description="seed for the data order; None = seed")
    compile_model: bool = Field(False, description="torch.compile each transformer block")
    mixed_precision: Literal["auto", "bf16", "fp16", "fp32", "fp8"] = Field(
        "auto",
        description="compute dtype; auto = bf16 on a GPU with bf16 hardware, else fp32 (always fp32 on CPU); "
        "fp8 = bf16 compute with the linear layers' matmuls in float8 (torchao)",
    )
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise",
        description='float8 scaling, used only with mixed_precision = "fp8": tensorwise = one scale '
        "per tensor (fastest, float8 FSDP all-gather), rowwise = one per row (more accurate)",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="recompute activations in backward: full = each whole block, selective = keep matmul "
        "and attention outputs, recompute the pointwise ops (norms, activations, RoPE)",
    )
    loss_fn: Literal["cross_entropy", "chunked_cross_entropy"] = Field(
        "cross_entropy", description="chunked_cross_entropy never holds the full [tokens, vocab] logits (same loss)"
    )
    z_loss_weight: float = Field(0.0, ge=0, description="adds weight · mean(logsumexp(logits)²) to the loss; 0 = off")
    ce_chunk_size: int = Field(
        1024, gt=0, description="chunked_cross_entropy: tokens per chunk through the output head"
    )
    shutdown_timeout_sec: float = Field(
        300.0, gt=0, description="after SIGTERM/SIGUSR1, force the process to exit if the emergency save takes longer"
    )
    nccl_health_check_interval: int = Field(
        0, ge=0, description="every N steps time a small all-reduce across ranks and stop if it hangs; 0 = off"
    )
    spike_sigma: float = Field(
        6.0, ge=0, description="skip a step whose loss is this many standard deviations above the recent mean; 0 = off"
    )
    spike_window: int = Field(128, ge=2, description="accepted steps the loss mean and deviation are taken over")
    max_bad_steps: int = Field(
        5,
        gt=0,
        description="consecutive skipped steps (non-finite or spike) before rolling back to the last checkpoint",
    )
    max_rollbacks: int = Field(3, ge=0, description="rollbacks allowed before the run stops as diverged")

    @property
    def effective_data_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed
