"""`[train]`: the training loop's hyperparameters."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from engine.config.base import Section

ALTERNATIVES = {
    "length": ("train.max_steps", "train.max_epochs", "train.max_tokens"),
    "batch": ("train.grad_accum_steps", "train.global_batch_size"),
}
"""Fields that say the same thing in different ways: a preset layer or override that sets one of a group drops
what earlier layers set of the others (engine/config/loader.py)."""

# Upper bounds of the fields that size a step's tensors or the run's length: far beyond any run so far, and low
# enough that a slip (`max_steps = 10^30`) is refused by name rather than accepted as a run that never ends.
MAX_BATCH = 2**20  # batch_size, global_batch_size, grad_accum_steps
MAX_SEQ_LEN = 2**24  # as model.max_seq_len's bound (engine/config/model.py)
MAX_STEPS = 10**12
MAX_EPOCHS = 10**6
MAX_TOKENS = 10**18


class HookSpec(Section):
    """One `[[train.hooks]]` entry: a `TrainingHook` subclass (engine/train/hooks.py) to run in the loop."""

    target: str = Field(
        ...,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description='"package.module:Class", importable in the training processes (e.g. on PYTHONPATH)',
    )
    every: int = Field(1, gt=0, description="on_step_end runs every this many steps (the other call points always)")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the class's constructor")


class TrainConfig(Section):
    batch_size: int = Field(8, gt=0, le=MAX_BATCH, description="sequences per device per micro-step")
    seq_len: int = Field(512, gt=0, le=MAX_SEQ_LEN, description="tokens per sequence")
    max_steps: int | None = Field(
        None,
        gt=0,
        le=MAX_STEPS,
        description="optimizer steps to train for; unset = derived from max_epochs or max_tokens, or 1000 "
        "when neither is set",
    )
    max_epochs: int | None = Field(
        None,
        gt=0,
        le=MAX_EPOCHS,
        description="instead of max_steps: passes over the training windows (one data set; the steps are "
        "derived from its window count and the batch, shown by validate-config)",
    )
    max_tokens: int | None = Field(
        None,
        gt=0,
        le=MAX_TOKENS,
        description="instead of max_steps: train until this many tokens are seen (the steps are derived "
        "from the batch and its ramp, rounded up)",
    )
    global_batch_size: int | None = Field(
        None,
        gt=0,
        le=MAX_BATCH,
        description="sequences per optimizer step over all data-parallel ranks; grad_accum_steps is derived "
        "from it (= global_batch_size / (batch_size × data-parallel ranks), which must divide)",
    )
    grad_accum_steps: int | None = Field(
        None,
        gt=0,
        le=MAX_BATCH,
        description="micro-steps accumulated per optimizer step; unset = derived from global_batch_size, or 1",
    )
    batch_ramp_start: int | None = Field(
        None,
        gt=0,
        description="batch ramp: the global batch (sequences) of the first step; it grows linearly to "
        "global_batch_size over batch_ramp_steps or batch_ramp_tokens, rounded down to batch_ramp_increment",
    )
    batch_ramp_increment: int | None = Field(
        None,
        gt=0,
        description="batch ramp: sequences added at each rise (a multiple of batch_size × data-parallel ranks); "
        "unset = batch_ramp_start",
    )
    batch_ramp_steps: int | None = Field(None, gt=0, description="batch ramp: its length in optimizer steps")
    batch_ramp_tokens: int | None = Field(
        None, gt=0, description="batch ramp: its length in tokens trained on (instead of batch_ramp_steps)"
    )
    grad_clip_norm: float = Field(
        1.0, ge=0, description="clip the global grad norm to this; 0 = no clipping (the norm is still reported)"
    )
    seed: int = Field(42, ge=0, description="seed for weights init and every RNG")
    data_seed: int | None = Field(None, ge=0, description="seed for the data order; unset = seed")
    compile_model: bool = Field(False, description="torch.compile each transformer block")
    mixed_precision: Literal["auto", "bf16", "fp16", "fp32", "fp8"] = Field(
        "auto",
        description="compute dtype; auto = bf16 on a GPU with bf16 hardware, else fp32 (always fp32 on CPU); "
        "fp8 = bf16 compute with the linear layers' matmuls in float8 (torchao)",
    )
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise",
        description='float8 scaling, only with mixed_precision = "fp8": tensorwise = one scale per '
        "tensor (fastest, float8 FSDP all-gather), rowwise = one per row (more "
        "accurate)",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="recompute activations in backward: full = each whole block, selective = keep matmul "
        "and attention outputs, recompute the pointwise ops (norms, activations, RoPE)",
    )
    activation_offload: bool = Field(
        False,
        description="keep the activations saved for backward in host memory (torch.autograd.graph.save_on_cpu, "
        "pinned on CUDA) and copy them back in backward: the same gradients, less device memory, more "
        "host traffic; with activation_checkpointing the checkpoints move and one block's recomputation stays",
    )
    loss_fn: Literal["cross_entropy", "chunked_cross_entropy"] = Field(
        "cross_entropy",
        description="the training loss; chunked_cross_entropy gives the same loss without ever "
        "holding the [tokens, vocab] logits",
    )
    z_loss_weight: float = Field(
        0.0,
        ge=0,
        description="adds z_loss_weight · mean(logsumexp(logits)²) to the "
        "training loss (PaLM uses 1e-4); 0 = off; never in eval loss",
    )
    ce_chunk_size: int = Field(
        1024,
        gt=0,
        description="chunked_cross_entropy only: tokens per chunk through the "
        "output head; peak extra memory is a few [ce_chunk_size, vocab] fp32 buffers",
    )
    shutdown_timeout_sec: float = Field(
        300.0,
        gt=0,
        description="after SIGTERM/SIGUSR1 the run saves and exits with code 75; if that takes "
        "longer, a watchdog ends the process with code 76",
    )
    nccl_health_check_interval: int = Field(
        0,
        ge=0,
        description="multi-process runs: every N steps a timed all-reduce (deadline "
        "distributed.nccl_timeout_sec); a hung rank stops the run with a message naming "
        "it; 0 = off",
    )
    spike_sigma: float = Field(
        6.0,
        ge=0,
        description="skip a step whose loss is this many standard deviations above the mean of the last "
        "spike_window accepted steps; 0 = off",
    )
    spike_window: int = Field(
        128,
        ge=2,
        description="accepted steps the spike rule's mean and deviation are taken "
        "over; the rule starts once half of it is filled",
    )
    max_bad_steps: int = Field(
        5,
        gt=0,
        description="consecutive skipped steps (non-finite loss or gradient norm, or a spike) before "
        "rolling back to the last checkpoint",
    )
    max_rollbacks: int = Field(3, ge=0, description="rollbacks allowed before the run stops as diverged (exit code 1)")
    ema_decay: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="keep an exponential moving average of the weights (fp32, sharded like them, checkpointed, "
        "evaluated as eval_loss_ema): after each applied step s, ema ← d·ema + (1 − d)·weights with "
        "d = ema_decay (e.g. 0.999); 0 = off",
    )
    ema_warmup: bool = Field(
        False,
        description="with ema_decay: d = min(ema_decay, (1 + s) / (10 + s)) at step s, so the first weights "
        "do not dominate the average early on",
    )
    hooks: list[HookSpec] = Field(
        default_factory=list,
        description="[[train.hooks]] {target, every, args}: research code called on step end, eval, checkpoint "
        "and run end (docs/training.md#hooks); a failing hook stops the run after a checkpoint (exit code 1)",
    )

    @model_validator(mode="before")
    @classmethod
    def _length_defaults(cls, data: Any) -> Any:
        """Today's defaults where nothing derives them: 1000 steps unless max_epochs or max_tokens says how
        long, one micro-step unless global_batch_size sets the accumulation (engine/plan/length.py derives
        both once the world size and the data are known)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if all(data.get(key) is None for key in ("max_steps", "max_epochs", "max_tokens")):
            data["max_steps"] = 1000
        if data.get("global_batch_size") is None and data.get("grad_accum_steps") is None:
            data["grad_accum_steps"] = 1
        return data

    @property
    def effective_data_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed
