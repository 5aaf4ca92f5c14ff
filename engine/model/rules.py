"""The cross-section rules of the model (engine/model/): sequences within its RoPE table, MoE fields only
for a model with experts and routing that can work, what LoRA adapters (model/lora.py) cannot be combined
with yet, RoPE scaling fields that agree, a sliding window on a kernel that takes its mask, sinks on the
kernel that takes them, and no field
the model's family has no use for; and the warning for a capacity factor of 0.

Torch-free, like every room's rules module: it imports engine.config's sections and helpers only (`JobConfig`
for its types alone), and engine/plan/checks.py runs these functions in the order it lists.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

from engine.config.fields import changed_fields, unread_field_issues
from engine.config.lora import LoraConfig
from engine.config.model import ModelConfig
from engine.config.registry import MODELS
from engine.errors import ConfigIssue
from engine.model.families.transformer.config import ROPE_SCALING_FIELDS
from engine.model.moe_config import MOE_FIELDS, ExpertFields
from engine.model.spec import spec_for

if TYPE_CHECKING:
    from engine.config.job import JobConfig


def length_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """Training sequences fit the model's position table."""
    m, t = cfg.model, cfg.train
    if t.seq_len > m.max_seq_len:
        return [
            ConfigIssue(
                "train.seq_len",
                f"{t.seq_len} exceeds model.max_seq_len ({m.max_seq_len})",
                "lower train.seq_len or raise model.max_seq_len",
            )
        ]
    return []


def moe_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """MoE fields only when the model has experts, and routing that can work. (What compiling an MoE model
    allows is a layout rule: engine/parallel/rules.py.) A family without experts (whose config class does not
    derive from `ExpertFields`) refuses them all in `family_issues`, once."""
    m = cfg.model
    if not issubclass(MODELS.get(m.model_type).config, ExpertFields):
        return []
    if not m.is_moe:
        return [
            ConfigIssue(
                f"model.{field}",
                "is set, but the model is dense (model.num_experts = 0)",
                "set model.num_experts > 0 for a mixture of experts, or remove it",
            )
            for field in changed_fields(m, MOE_FIELDS)
        ]
    sigmoid_only = ("sigmoid_topk",)
    issues = unread_field_issues(
        "model",
        m,
        m.moe_router,
        {
            "moe_bias_schedule": sigmoid_only,
            "moe_bias_update": sigmoid_only,
            "moe_n_group": sigmoid_only,
            "moe_topk_group": sigmoid_only,
        },
    )
    if m.moe_top_k > m.num_experts:
        issues.append(
            ConfigIssue(
                "model.moe_top_k",
                f"{m.moe_top_k} exceeds model.num_experts ({m.num_experts})",
                "route each token to at most num_experts experts",
            )
        )
    if m.moe_frequency > m.n_layers:
        issues.append(
            ConfigIssue(
                "model.moe_frequency",
                f"{m.moe_frequency} > model.n_layers ({m.n_layers}) leaves no MoE block",
                "use a frequency <= n_layers (1 = every block)",
            )
        )
    return issues + (expert_group_issues(m) if m.moe_router in sigmoid_only else [])


def expert_group_issues(m: ModelConfig) -> list[ConfigIssue]:
    """Group-limited routing (sigmoid_topk's moe_n_group / moe_topk_group) that can be computed: equal groups
    of at least two experts (a group's score is its two best), no more groups kept than there are, and
    enough experts inside the kept groups for top-k."""
    groups, kept = m.moe_n_group, m.moe_topk_group
    if groups == 1 and kept == 1:
        return []
    if m.num_experts % groups or m.num_experts // groups < 2:
        return [
            ConfigIssue(
                "model.moe_n_group",
                f"{groups} does not split model.num_experts ({m.num_experts}) into equal groups of at least 2 "
                "experts (a group is ranked by the sum of its two best scores)",
                "use a divisor of num_experts that is at most num_experts / 2",
            )
        ]
    if kept > groups:
        return [
            ConfigIssue(
                "model.moe_topk_group",
                f"{kept} exceeds model.moe_n_group ({groups})",
                "keep at most moe_n_group groups per token",
            )
        ]
    inside = kept * (m.num_experts // groups)
    if m.moe_top_k > inside:
        return [
            ConfigIssue(
                "model.moe_top_k",
                f"{m.moe_top_k} exceeds the {inside} experts of the moe_topk_group = {kept} groups a token keeps",
                "raise model.moe_topk_group, or lower model.moe_top_k",
            )
        ]
    return []


def mtp_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """Multi-token prediction (`model.mtp_depth`): its weight only with modules, a window long enough, and what it does not run under yet: context parallelism (its modules read the tokens
    k positions further on, which a rank's share of the sequence does not hold at its ends), packed documents
    (the modules attend across the window), LoRA (its adapters would leave the modules frozen) and μP (no
    multipliers derived for the modules). A family without the modules (whose config class does not declare
    mtp_depth) refuses its fields in `family_issues`."""
    m, d = cfg.model, cfg.distributed
    if "mtp_depth" not in MODELS.get(m.model_type).config.model_fields:
        return []
    if not m.mtp_depth:
        return [
            ConfigIssue(
                f"model.{field}",
                "is set, but model.mtp_depth = 0 (no multi-token prediction)",
                "set model.mtp_depth > 0, or remove it",
            )
            for field in changed_fields(m, ("mtp_loss_weight",))
        ]
    issues = []
    if m.mtp_depth >= cfg.train.seq_len:
        issues.append(
            ConfigIssue(
                "model.mtp_depth",
                f"{m.mtp_depth} leaves no position to predict from in a window of train.seq_len = {cfg.train.seq_len}",
                "use an mtp_depth below train.seq_len",
            )
        )
    if d.cp > 1:
        issues.append(
            ConfigIssue(
                "distributed.cp",
                f"= {d.cp}: multi-token prediction (model.mtp_depth = {m.mtp_depth}) runs under FSDP/HSDP, tensor, "
                "pipeline and expert parallelism, not with cp > 1 yet",
                "set distributed.cp = 1, or model.mtp_depth = 0",
            )
        )
    if cfg.data.pack_sequences:
        issues.append(
            ConfigIssue(
                "data.pack_sequences",
                f"document-aware packing is not supported with multi-token prediction (model.mtp_depth = "
                f"{m.mtp_depth}) yet: its modules would attend across documents",
                "set data.pack_sequences = false, or model.mtp_depth = 0",
            )
        )
    if cfg.lora.enabled:
        issues.append(
            ConfigIssue(
                "lora.enabled",
                f"LoRA is not supported with multi-token prediction (model.mtp_depth = {m.mtp_depth}) yet",
                "set model.mtp_depth = 0 to fine-tune with adapters",
            )
        )
    if m.parametrization == "mup":
        issues.append(
            ConfigIssue(
                "model.parametrization",
                f"= 'mup' with multi-token prediction (model.mtp_depth = {m.mtp_depth}): μP's multipliers "
                "(engine/model/mup.py) are not derived for the prediction modules' projections yet",
                "use parametrization = 'sp' with mtp_depth > 0, or mtp_depth = 0 with mup",
            )
        )
    return issues


def moe_warnings(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """A capacity factor of 0 is the seed schema's way of saying dropless."""
    m = cfg.model
    if m.is_moe and m.moe_capacity_factor == 0:
        return [
            ConfigIssue(
                "model.moe_capacity_factor",
                "0 means no capacity limit: dropless routing, every assignment is computed (as when unset)",
            )
        ]
    return []


def lora_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """What `[lora]` cannot be combined with yet, each refused with the fix (never silently ignored)."""
    lora = cfg.lora
    if not lora.enabled:
        defaults = LoraConfig()
        return [
            ConfigIssue(f"lora.{name}", "is set, but lora.enabled = false", "set lora.enabled = true, or remove it")
            for name in LoraConfig.model_fields
            if name != "enabled" and getattr(lora, name) != getattr(defaults, name)
        ]
    issues = []

    def refuse(field: str, problem: str, fix: str) -> None:
        issues.append(ConfigIssue(field, problem, fix))

    if not spec_for(cfg.model).lora_adapters:
        refuse(
            "lora.enabled",
            f"model.model_type = {cfg.model.model_type!r} has biased linears, and LoRA adapts bias-free ones only "
            "(model/lora.py) yet",
            "train the whole model (lora.enabled = false), or a model_type LoRA adapts",
        )
    d = cfg.distributed
    for degree in ("tp", "pp", "cp"):
        if getattr(d, degree) > 1:
            refuse(
                f"distributed.{degree}",
                f"= {getattr(d, degree)}: LoRA adapters are supported under FSDP/HSDP only, not with {degree} > 1 yet",
                f"set distributed.{degree} = 1 (shard with distributed.dp_shard), or lora.enabled = false",
            )
    if cfg.train.ema_decay:
        refuse(
            "train.ema_decay",
            "an EMA of the weights is not supported with LoRA yet (it would average the frozen base too)",
            "set train.ema_decay = 0 with lora.enabled = true",
        )
    if cfg.train.mixed_precision == "fp8":
        refuse(
            "train.mixed_precision",
            '= "fp8": float8 training converts nn.Linear layers, which the adapted ones no longer are',
            'use "bf16" with LoRA',
        )
    if lora.quantize_base is not None:
        if world_size > 1:
            refuse(
                "lora.quantize_base",
                f"a 4-bit base trains in one process only (world size here: {world_size})",
                "train QLoRA in one process, or unset lora.quantize_base and shard the fp32 base with FSDP",
            )
        if not lora.save_adapters_only:
            refuse(
                "lora.quantize_base",
                "the NF4 base cannot go into a checkpoint, so checkpoints must hold the adapters only",
                "set lora.save_adapters_only = true (a resume re-quantizes the base from checkpoint.load_path)",
            )
        if lora.merge_interval is not None:
            refuse(
                "lora.merge_interval",
                "cannot merge into a 4-bit base without re-quantizing it (losing what the adapter learned)",
                "unset lora.merge_interval, or lora.quantize_base",
            )
    if lora.merge_interval is not None:
        if lora.save_adapters_only:
            refuse(
                "lora.merge_interval",
                "merging changes the base weights, which lora.save_adapters_only leaves out of checkpoints",
                "set lora.save_adapters_only = false, or unset lora.merge_interval",
            )
        if cfg.optimizer.name == "schedule_free_adamw":
            refuse(
                "lora.merge_interval",
                "schedule_free_adamw's averaged weights would not follow a merge",
                "use adamw, or unset lora.merge_interval",
            )
    if lora.reset_optimizer_on_merge and lora.merge_interval is None:
        refuse("lora.reset_optimizer_on_merge", "is set, but lora.merge_interval is not", "set lora.merge_interval")
    return issues


def family_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """The `[model]` fields the chosen family has no use for (fields only other families' config classes declare,
    e.g. RoPE, QK-norm or expert fields with gpt2), set away from their defaults: refused, naming the field and
    the family."""
    m = cfg.model
    return [
        ConfigIssue(
            f"model.{field}",
            f"is set, but model.model_type = {m.model_type!r} has no such setting (the field belongs to other "
            "model families)",
            f"remove model.{field}, or choose a model_type that uses it",
        )
        for field in changed_fields(m, MODELS.foreign_fields(m.model_type))
    ]


def attention_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """RoPE scaling fields only for the scaling that reads them (engine/model/rope.py), consistent with each
    other; a sliding window only with a kernel that takes its mask; sinks only with sdpa_backend "auto", as no
    SDPA kernel runs them. (Context parallelism refuses a sliding window and sinks: engine/parallel/rules.py.)"""
    m = cfg.model
    issues = [
        ConfigIssue(
            f"model.{field}",
            f"is set, but model.rope_scaling = {m.rope_scaling!r} does not read it "
            f"(only {' and '.join(ROPE_SCALING_FIELDS[field])} do)",
            f"remove it, or set model.rope_scaling to {' or '.join(map(repr, ROPE_SCALING_FIELDS[field]))}",
        )
        for field in changed_fields(m, ROPE_SCALING_FIELDS)
        if m.rope_scaling not in ROPE_SCALING_FIELDS[field]
    ]
    if m.rope_scaling == "llama3":
        if m.rope_original_max_seq_len is None:
            issues.append(
                ConfigIssue(
                    "model.rope_original_max_seq_len",
                    "is unset, but model.rope_scaling = 'llama3' scales by wavelength against it",
                    "set it to the context length the model was first trained at (8192 for Llama 3.1)",
                )
            )
        if m.rope_high_freq_factor <= m.rope_low_freq_factor:
            issues.append(
                ConfigIssue(
                    "model.rope_high_freq_factor",
                    f"{m.rope_high_freq_factor} must exceed model.rope_low_freq_factor ({m.rope_low_freq_factor}): "
                    "llama3 keeps wavelengths below original / high, divides those above original / low, and "
                    "blends in between",
                    "use e.g. rope_low_freq_factor = 1 and rope_high_freq_factor = 4 (Llama 3.1)",
                )
            )
    if m.attention_qkv_bias and (biased := lora_biased_targets(cfg)):
        issues.append(
            ConfigIssue(
                "lora.target_modules",
                f"selects {', '.join(biased)}, which have biases (model.attention_qkv_bias), and an adapted "
                "linear has none (engine/model/lora.py)",
                "target other linears (e.g. 'layers.*.attention.wo', 'layers.*.feed_forward.*'), or unset "
                "model.attention_qkv_bias",
            )
        )
    if m.sliding_window is not None and m.sdpa_backend == "flash":
        issues.append(
            ConfigIssue(
                "model.sliding_window",
                f"= {m.sliding_window} with model.sdpa_backend = 'flash': the flash kernel takes no mask, and a "
                "sliding window is one",
                "set model.sdpa_backend to 'auto', 'efficient' or 'math', or unset model.sliding_window",
            )
        )
    if m.attention_sinks and m.sdpa_backend != "auto":
        issues.append(
            ConfigIssue(
                "model.attention_sinks",
                f"with model.sdpa_backend = {m.sdpa_backend!r}: no SDPA kernel takes a sink logit in the softmax's "
                "denominator, so sink attention runs its own eager kernel (FlexAttention for packed windows on CUDA)",
                "leave model.sdpa_backend at 'auto' (a pinned SDPA kernel would be read by nothing), or unset "
                "model.attention_sinks",
            )
        )
    return issues


def lora_biased_targets(cfg: JobConfig) -> list[str]:
    """The q/k/v projections LoRA would adapt (enabled, matched by a target glob and by no exclude glob), the
    first three to name them: with model.attention_qkv_bias they have biases, which an adapted linear drops."""
    lora = cfg.lora
    if not lora.enabled:
        return []
    names = [f"layers.{i}.attention.{w}" for i in range(cfg.model.n_layers) for w in ("wq", "wk", "wv")]

    def matches(name: str, globs: list[str]) -> bool:
        return any(fnmatch.fnmatchcase(name, glob) for glob in globs)

    chosen = [n for n in names if matches(n, lora.target_modules) and not matches(n, lora.exclude_modules)]
    return chosen[:3]
