"""`JobConfig`: one TOML file, one sub-model per section, plus the rules that span sections."""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import Field

from engine.config import optimizer as optimizer_fields
from engine.config import scheduler as scheduler_fields
from engine.config.base import Section
from engine.config.checkpoint import CheckpointConfig
from engine.config.data import DataConfig, HubDatasetFields, MixtureSource
from engine.config.distributed import DistributedConfig
from engine.config.eval import EvalConfig
from engine.config.lora import LoraConfig, lora_issues
from engine.config.metrics import MetricsConfig
from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.config.profiling import ProfilingConfig
from engine.config.scheduler import SchedulerConfig
from engine.config.train import TrainConfig
from engine.data.batch_plan import global_sequences
from engine.errors import ConfigError, ConfigIssue
from engine.parallel.stages import stages_per_rank
from engine.train import length_rules
from engine.train.length import with_derived_length as derived


class JobConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    def validate(self, world_size: int = 1) -> JobConfig:  # type: ignore[override]
        """Check the rules that span sections once the world size is known; raise every problem at once."""
        issues = length_rules.issues(self, world_size) or cross_section_issues(derived(self, world_size), world_size)
        if issues:
            raise ConfigError(issues)
        return self

    def warnings(self, world_size: int = 1) -> list[ConfigIssue]:
        """What the run does that the user may not expect, but which is not an error (validate-config and
        `forge train` print them, `--json` lists them): a config that runs elsewhere runs here too."""
        if length_rules.issues(self, world_size):  # the lengths cannot be derived: validate() says why
            return []
        return config_warnings(derived(self, world_size), world_size) + length_rules.warnings(
            derived(self, world_size), world_size
        )

    def tokens_per_step(self, world_size: int = 1) -> int:
        """Tokens one optimizer step trains on, summed over the data-parallel ranks (the full global batch's, after
        any ramp)."""
        return global_sequences(self, world_size) * self.train.seq_len


def cross_section_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    m, t = cfg.model, cfg.train

    if t.seq_len > m.max_seq_len:
        issues.append(
            ConfigIssue(
                "train.seq_len",
                f"{t.seq_len} exceeds model.max_seq_len ({m.max_seq_len})",
                "lower train.seq_len or raise model.max_seq_len",
            )
        )
    own_data = cfg.data.dataset_path is not None or cfg.data.hf_dataset_name is not None
    own_data = own_data or any(source.embedded is None for source in cfg.data.datasets)
    if cfg.eval.enabled and cfg.eval.dataset_path is None and cfg.eval.hf_dataset_name is None and own_data:
        issues.append(
            ConfigIssue(
                "eval.dataset_path",
                "eval is enabled but has no data source",
                "set eval.dataset_path to held-out shards (or eval.hf_dataset_name), or eval.enabled = false",
            )
        )
    issues += hub_data_issues(cfg)
    if cfg.profiling.enable and cfg.profiling.start_step > t.max_steps:
        issues.append(
            ConfigIssue(
                "profiling.start_step",
                f"{cfg.profiling.start_step} is after train.max_steps ({t.max_steps})",
                "profile a window inside the run",
            )
        )
    issues += optimization_issues(cfg)
    issues += ema_issues(cfg)
    issues += moe_issues(cfg)
    issues += layout_issues(cfg, world_size)
    issues += lora_issues(cfg, world_size)
    issues += mixture_issues(cfg)
    return issues


def config_warnings(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """Values that run, with a meaning worth saying out loud. Short benchmark presets keep their
    production warmup (the seed framework runs them), so a warmup as long as the run is not an error."""
    warnings = []
    t, s, m = cfg.train, cfg.scheduler, cfg.model
    if s.warmup_steps >= t.max_steps and s.name != "none" and s.unit == "steps":
        warnings.append(
            ConfigIssue(
                "scheduler.warmup_steps",
                f"{s.warmup_steps} >= train.max_steps ({t.max_steps}): the whole run warms up and the "
                f"learning rate never reaches optimizer.lr (it ends at {t.max_steps / (s.warmup_steps + 1):.3g} × lr)",
                "fine for a short benchmark; shorten the warmup or train longer for a real run",
            )
        )
    d = cfg.distributed
    if d.seed_ep_convention(world_size):
        warnings.append(
            ConfigIssue(
                "distributed.dp_shard",
                f"{d.dp_shard} × ep {d.ep} × the other degrees fill the world size {world_size}: read as the seed "
                f"schema's convention (ep a factor of the world size), i.e. FSDP over {d.dp_shard * d.ep} ranks "
                f"with the experts split over {d.ep} of them",
                f"write distributed.dp_shard = {d.dp_shard * d.ep} (or -1) to say it the Forge way",
            )
        )
    if m.is_moe and m.moe_capacity_factor == 0:
        warnings.append(
            ConfigIssue(
                "model.moe_capacity_factor",
                "0 means no capacity limit: dropless routing, every assignment is computed (as when unset)",
            )
        )
    return warnings


def mixture_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """Sources named once and used alone; phases in order, inside the run, naming only sources."""
    d, max_steps = cfg.data, cfg.train.max_steps
    if not d.datasets:
        fields = ("mix_temperature", "phases", "anneal_start_step", "anneal_weights")
        return [
            ConfigIssue(f"data.{field}", "is set, but data.datasets lists no sources", "add [[data.datasets]] entries")
            for field in changed_fields(d, fields)
        ]
    issues = [
        ConfigIssue(f"data.{field}", "and data.datasets are both set", "list the data set as a [[data.datasets]] entry")
        for field in ("dataset_path", "hf_dataset_name")
        if getattr(d, field) is not None
    ]
    issues += source_location_issues(d.datasets, d.tokenizer_path)
    names = [source.name for source in d.datasets]
    issues += [
        ConfigIssue(f"data.datasets.{i}.name", f"{name!r} names an earlier source too", "give each source its own name")
        for i, name in enumerate(names)
        if name in names[:i]
    ]
    if (d.anneal_start_step is None) != (d.anneal_weights is None):
        missing = "anneal_weights" if d.anneal_weights is None else "anneal_start_step"
        issues.append(ConfigIssue(f"data.{missing}", "is needed by the anneal shorthand", f"set data.{missing}"))
    if d.phases and d.anneal_start_step is not None:
        issues.append(
            ConfigIssue("data.anneal_start_step", "and data.phases are both set", "write the anneal as a last phase")
        )
    declared = [(f"data.phases.{i}", p.start_step, p.dataset_weights) for i, p in enumerate(d.phases)]
    if d.anneal_start_step is not None and d.anneal_weights is not None:
        declared.append(("data.anneal", d.anneal_start_step, d.anneal_weights))
    for k, (where, start, weights) in enumerate(declared):
        start_field = "data.anneal_start_step" if where == "data.anneal" else f"{where}.start_step"
        weights_field = "data.anneal_weights" if where == "data.anneal" else f"{where}.dataset_weights"
        if k and start <= declared[k - 1][1]:
            issues.append(
                ConfigIssue(
                    start_field,
                    f"{start} is not after the previous phase's {declared[k - 1][1]}",
                    "sort the phases by start_step",
                )
            )
        if start >= max_steps:
            issues.append(
                ConfigIssue(
                    start_field,
                    f"{start} is not before train.max_steps ({max_steps})",
                    "start the phase inside the run",
                )
            )
        unknown = sorted(set(weights) - set(names))
        if unknown:
            issues.append(
                ConfigIssue(
                    weights_field,
                    f"names unknown source(s) {', '.join(unknown)}",
                    f"use names of data.datasets: {', '.join(names)}",
                )
            )
        if not weights:
            issues.append(ConfigIssue(weights_field, "is empty", "give at least one source a weight"))
    return issues


def source_location_issues(sources: list[MixtureSource], tokenizer_path: str | None) -> list[ConfigIssue]:
    """Each source in exactly one place (shards, the embedded corpus, a Hugging Face dataset), the Hugging
    Face fields only beside hf_name, and a tokenizer to encode the Hugging Face sources with."""
    issues = []
    for i, source in enumerate(sources):
        where = f"data.datasets.{i}"
        given = [field for field in MixtureSource.LOCATIONS if getattr(source, field) is not None]
        if len(given) != 1:
            issues.append(
                ConfigIssue(
                    f"{where}.{given[-1] if given else 'path'}",
                    f"and {where}.{given[0]} are both set" if given else "is unset, and so are embedded and hf_name",
                    "give exactly one of path (forge tokenize output), embedded (a corpus split) or hf_name "
                    "(a Hugging Face dataset)",
                )
            )
        if source.hf_name is None:
            issues += [
                ConfigIssue(f"{where}.{field}", f"is set, but {where}.hf_name is unset", "remove it, or set hf_name")
                for field in changed_fields(source, MixtureSource.HUB_FIELDS)
            ]
    hub = [i for i, source in enumerate(sources) if source.hf_name is not None]
    if hub and tokenizer_path is None and all(source.hf_name is not None for source in sources):
        issues.append(
            ConfigIssue(
                "data.tokenizer_path",
                f"is needed to tokenize data.datasets.{hub[0]}.hf_name (no source has shards with a tokenizer)",
                "point it at a tokenizer.json (e.g. one written by forge tokenize)",
            )
        )
    return issues


def hub_data_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """A Hugging Face dataset replaces shards, needs a tokenizer to be encoded with, and its fields mean
    nothing without it. (Like eval.dataset_path, the eval ones may stay set while evaluation is off.)"""
    issues: list[ConfigIssue] = []
    fields = [field for field in HubDatasetFields.model_fields if field != "hf_dataset_name"]
    for section, values in (("data", cfg.data), ("eval", cfg.eval)):
        if values.hf_dataset_name is None:
            issues += [
                ConfigIssue(
                    f"{section}.{field}",
                    f"is set, but {section}.hf_dataset_name is unset",
                    f"set {section}.hf_dataset_name, or remove it",
                )
                for field in changed_fields(values, fields)
            ]
        elif values.dataset_path is not None:
            issues.append(
                ConfigIssue(
                    f"{section}.hf_dataset_name",
                    f"and {section}.dataset_path are both set",
                    "train (or evaluate) on one of them",
                )
            )
    named = cfg.data.hf_dataset_name is not None or cfg.eval.hf_dataset_name is not None
    streamed = named or any(source.hf_name is not None for source in cfg.data.datasets)
    readers = {
        "hf_dataset_text_field": (named, "neither data.hf_dataset_name nor eval.hf_dataset_name is"),
        "hf_streaming": (streamed, "no dataset is named (data.hf_dataset_name, eval.hf_dataset_name, hf_name)"),
    }
    issues += [
        ConfigIssue(f"data.{field}", f"is set, but {readers[field][1]}", "name a dataset, or remove it")
        for field in changed_fields(cfg.data, readers)
        if not readers[field][0]
    ]
    if cfg.data.hf_dataset_name is not None and cfg.data.tokenizer_path is None:
        issues.append(
            ConfigIssue(
                "data.tokenizer_path",
                "is needed to tokenize data.hf_dataset_name",
                "point it at a tokenizer.json (e.g. one written by forge tokenize)",
            )
        )
    return issues


MOE_FIELDS = (
    "moe_top_k",
    "moe_frequency",
    "moe_router",
    "moe_shared_experts",
    "moe_aux_loss_weight",
    "moe_capacity_factor",
    "moe_sequence_aux_loss_weight",
    "moe_gradient_scale",
    "moe_bias_schedule",
    "moe_packed_experts",
    "moe_expert_ffn_multiplier",
    "moe_router_z_loss_weight",
)


def moe_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """MoE fields only when the model has experts, and routing that can work."""
    m = cfg.model
    if not m.is_moe:
        return [
            ConfigIssue(
                f"model.{field}",
                "is set, but the model is dense (model.num_experts = 0)",
                "set model.num_experts > 0 for a mixture of experts, or remove it",
            )
            for field in changed_fields(m, MOE_FIELDS)
        ]
    issues = unread_field_issues("model", m, m.moe_router, {"moe_bias_schedule": ("sigmoid_topk",)})
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
    t = cfg.train
    # "auto" is bf16 on the GPUs a layout is planned for; engine.parallel.apply checks again where it runs.
    bf16 = t.mixed_precision in ("bf16", "fp8", "auto")
    if t.compile_model and t.activation_checkpointing != "none" and moe_compiled_in_regions(cfg, bf16):
        issues.append(
            ConfigIssue(
                "train.activation_checkpointing",
                f"= {t.activation_checkpointing!r} with train.compile_model = true is not supported for an MoE model "
                "compiled around its routed experts (ep > 1, or compute other than bf16): a checkpointed block "
                "would recompute them differently from its forward",
                'set it to "none", or train.compile_model = false',
            )
        )
    return issues


def moe_compiled_in_regions(cfg: JobConfig, compute_bf16: bool) -> bool:
    """Whether torch.compile takes an MoE block in regions around its routed experts instead of whole
    (engine/parallel/apply.py): whenever the experts' call holds what does not trace into one graph — expert
    parallelism's token exchange, grouped_mm outside bf16."""
    return cfg.distributed.ep > 1 or not compute_bf16


def optimization_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """Optimizer, schedule and loss fields that the chosen components would not read, and combinations
    that do not work together."""
    o, s, t = cfg.optimizer, cfg.scheduler, cfg.train
    issues = unread_field_issues("optimizer", o, o.name, optimizer_fields.READ_BY)
    issues += unread_field_issues("scheduler", s, s.name, scheduler_fields.READ_BY)
    issues += unread_field_issues("train", t, t.loss_fn, {"ce_chunk_size": ("chunked_cross_entropy",)})
    issues += unread_field_issues("train", t, t.mixed_precision, {"fp8_recipe": ("fp8",)})
    if o.name == "schedule_free_adamw" and s.name not in ("constant", "none"):
        issues.append(
            ConfigIssue(
                "scheduler.name",
                f"schedule_free_adamw replaces the LR schedule; {s.name!r} would fight it",
                "set scheduler.name = 'constant' or 'none' (warm up with optimizer.schedule_free_warmup_steps)",
            )
        )
    if o.name == "schedule_free_adamw" and o.betas[0] == 0:
        issues.append(
            ConfigIssue(
                "optimizer.betas",
                "schedule_free_adamw needs betas[0] > 0 (it interpolates between "
                "its averaged and its gradient sequence with it)",
                "use e.g. betas = [0.9, 0.999]",
            )
        )
    if s.cycles is not None and max(s.cycles if isinstance(s.cycles, list) else [s.cycles]) >= t.max_steps:
        issues.append(
            ConfigIssue(
                "scheduler.cycles",
                f"{s.cycles} does not fit in train.max_steps = {t.max_steps}",
                "give fewer cycles, or boundaries below train.max_steps",
            )
        )
    if s.name == "wsd" and s.stable_steps and s.decay_steps is None:
        to_end = t.max_steps - s.warmup_steps - s.stable_steps - 1
        issues.append(
            ConfigIssue(
                "scheduler.decay_steps",
                "wsd with stable_steps needs the length of its decay",
                f"set scheduler.decay_steps (= {to_end} ends the decay on the last step)"
                if to_end > 0
                else "set scheduler.decay_steps, and train longer than warmup + stable steps",
            )
        )
    return issues


def ema_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """The EMA of the weights: its warm-up only with a decay, and not where it is not supported yet."""
    t = cfg.train
    if not t.ema_decay:
        if t.ema_warmup:
            return [ConfigIssue("train.ema_warmup", "is set, but the EMA is off", "set train.ema_decay (e.g. 0.999)")]
        return []
    issues = []
    if cfg.distributed.pp > 1:
        issues.append(
            ConfigIssue(
                "train.ema_decay",
                "an EMA of the weights is not supported with pipeline parallelism (distributed.pp > 1) yet",
                "set train.ema_decay = 0, or train without pipeline parallelism",
            )
        )
    if cfg.optimizer.name == "schedule_free_adamw":
        issues.append(
            ConfigIssue(
                "train.ema_decay",
                "schedule_free_adamw already averages its weights (it evaluates and ships the average)",
                "set train.ema_decay = 0, or use another optimizer",
            )
        )
    return issues


def unread_field_issues(
    section: str, values: Section, chosen: str, read_by: dict[str, tuple[str, ...]]
) -> list[ConfigIssue]:
    """One issue per field set away from its default although `chosen` does not read it."""
    readers = {field: ", ".join(names) for field, names in read_by.items() if chosen not in names}
    return [
        ConfigIssue(
            f"{section}.{field}",
            f"is set, but {chosen!r} does not use it (only {readers[field]} do)",
            f"remove it, or choose one of {readers[field]}",
        )
        for field in changed_fields(values, readers)
    ]


def changed_fields(values: Section, fields: Iterable[str]) -> list[str]:
    """Those of `fields` that differ from their defaults: what the config set, which the rules above refuse
    where nothing would read it."""
    defaults = {name: info.get_default(call_default_factory=True) for name, info in type(values).model_fields.items()}
    return [field for field in fields if getattr(values, field) != defaults[field]]


def layout_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """The parallel degrees against the world size and the model's shape."""
    m, d = cfg.model, cfg.distributed
    if world_size < 1:
        return [ConfigIssue("world_size", f"must be >= 1, got {world_size}")]
    issues: list[ConfigIssue] = []
    dp_shard = d.resolved_dp_shard(world_size)
    degrees = f"dp_replicate={d.dp_replicate} × dp_shard={d.dp_shard} × tp={d.tp} × pp={d.pp} × cp={d.cp}"
    # (ep is not a factor: the experts are split over ep of the dp_shard ranks)
    if d.dp_shard == 0 or d.dp_shard < -1:
        issues.append(ConfigIssue("distributed.dp_shard", f"must be -1 or >= 1, got {d.dp_shard}"))
    elif dp_shard == 0 or d.dp_replicate * dp_shard * d.tp * d.pp * d.cp != world_size:
        issues.append(
            ConfigIssue(
                "distributed",
                f"{degrees} does not multiply to the world size {world_size}",
                "make the product of the degrees equal the number of processes",
            )
        )
    if m.n_heads % d.tp or m.kv_heads % d.tp:
        issues.append(
            ConfigIssue(
                "distributed.tp",
                f"n_heads ({m.n_heads}) and n_kv_heads ({m.kv_heads}) must be divisible by tp ({d.tp})",
            )
        )
    if d.pp > m.n_layers:
        issues.append(ConfigIssue("distributed.pp", f"pp ({d.pp}) exceeds model.n_layers ({m.n_layers})"))
    if d.tp > 1:
        issues += tensor_parallel_issues(cfg)
    if d.pp > 1:
        issues += pipeline_issues(cfg)
    if d.ep > 1:
        issues += expert_parallel_issues(cfg, dp_shard)
    issues += context_parallel_issues(cfg)
    return issues


def context_parallel_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """Context parallelism splits every sequence into 2·cp chunks (head-tail), whose halves tensor
    parallelism splits again, and does not compose with pipelines or mixture-of-experts routing yet."""
    m, t, d = cfg.model, cfg.train, cfg.distributed
    if d.cp == 1:
        if "cp_method" in changed_fields(d, ["cp_method"]):
            return [ConfigIssue("distributed.cp_method", "is set, but distributed.cp = 1", "set distributed.cp > 1")]
        return []
    issues = []
    if t.seq_len % (2 * d.cp) or (t.seq_len // d.cp) % d.tp:
        issues.append(
            ConfigIssue(
                "train.seq_len",
                f"{t.seq_len} must be divisible by 2 × distributed.cp ({2 * d.cp}), and each rank's "
                f"{t.seq_len} / cp positions by distributed.tp ({d.tp}): the sequence is cut into 2·cp "
                "chunks, two per cp rank",
                f"use a multiple of {2 * d.cp * d.tp}",
            )
        )
    group = d.cp * d.tp
    if d.cp_method == "ulysses" and (m.n_heads % group or m.kv_heads % group):
        issues.append(
            ConfigIssue(
                "distributed.cp_method",
                f"ulysses splits the heads over the cp ranks: n_heads ({m.n_heads}) and n_kv_heads "
                f"({m.kv_heads}) must be divisible by tp × cp ({group})",
                'use cp_method = "allgather" or "ring", or change the heads',
            )
        )
    for applies, field, what in [
        (d.pp > 1, "distributed.pp", "pipeline parallelism (the stages would pass sequence-sharded activations)"),
        (m.is_moe, "model.num_experts", "MoE models (the routers' sequence statistics would see part of a sequence)"),
    ]:
        if applies:
            issues.append(
                ConfigIssue(
                    field,
                    f"context parallelism (distributed.cp = {d.cp}) does not support {what} yet",
                    "use distributed.cp = 1 for this run",
                )
            )
    return issues


def tensor_parallel_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """What tensor parallelism (with sequence parallelism) needs of the model and the run."""
    m, t, tp = cfg.model, cfg.train, cfg.distributed.tp
    issues = []
    if m.ffn_dim % tp:
        issues.append(
            ConfigIssue(
                "distributed.tp",
                f"the FFN width ({m.ffn_dim}) must be divisible by tp ({tp})",
                "set model.ffn_hidden_dim to a multiple of tp, or change tp",
            )
        )
    if t.seq_len % tp:
        issues.append(
            ConfigIssue(
                "train.seq_len",
                f"{t.seq_len} must be divisible by distributed.tp ({tp}): "
                "sequence parallelism splits the positions over the tensor-parallel ranks",
            )
        )
    if m.is_moe and m.expert_ffn_dim % tp:
        issues.append(
            ConfigIssue(
                "distributed.tp",
                f"the experts' width ({m.expert_ffn_dim}) must be divisible by tp ({tp}): each expert's "
                "hidden units are split over the tensor-parallel ranks",
                "change model.moe_expert_ffn_multiplier or model.ffn_hidden_dim, or tp",
            )
        )
    if m.is_moe and not m.moe_packed_experts:
        issues.append(
            ConfigIssue(
                "model.moe_packed_experts",
                "distributed.tp > 1 with an MoE model needs packed experts (one tensor per projection, "
                "split over the hidden units)",
                "set model.moe_packed_experts = true",
            )
        )
    if t.mixed_precision == "fp8" and t.fp8_recipe != "tensorwise":
        issues.append(
            ConfigIssue(
                "train.fp8_recipe",
                f"{t.fp8_recipe!r} with distributed.tp > 1 is not supported: a row-parallel layer's input is split "
                "along the rows its per-row scales would span, and no parity with one process was measured",
                'use fp8_recipe = "tensorwise" with tensor parallelism',
            )
        )
    return issues


def pipeline_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """What pipeline parallelism needs: a stage per layer at most, micro-batches its schedule accepts, and
    none of what it does not support yet."""
    m, t, d = cfg.model, cfg.train, cfg.distributed
    stages = d.pp * stages_per_rank(d.pp_schedule)
    issues = []
    if stages > m.n_layers:
        issues.append(
            ConfigIssue(
                "distributed.pp",
                f"pp = {d.pp} with pp_schedule = {d.pp_schedule!r} cuts the model "
                f"into {stages} stages, but model.n_layers = {m.n_layers}: every stage needs a layer",
                "lower distributed.pp, use gpipe or 1f1b, or add layers",
            )
        )
    if d.pp_schedule == "1f1b" and t.grad_accum_steps < d.pp:
        issues.append(
            ConfigIssue(
                "train.grad_accum_steps",
                f"{t.grad_accum_steps} pipeline micro-batches are fewer "
                f"than distributed.pp = {d.pp}, which pp_schedule = '1f1b' needs",
                f"set train.grad_accum_steps >= {d.pp} (and halve train.batch_size to keep the batch)",
            )
        )
    rounds = max(1, t.grad_accum_steps // d.pp)
    if d.pp_schedule == "interleaved_1f1b" and t.grad_accum_steps % rounds:
        issues.append(
            ConfigIssue(
                "train.grad_accum_steps",
                f"interleaved_1f1b runs the {t.grad_accum_steps} "
                f"micro-batches in {rounds} rounds (grad_accum_steps // distributed.pp), which "
                "must divide them evenly",
                f"use a multiple of {d.pp}, or fewer than {2 * d.pp}",
            )
        )
    if cfg.eval.enabled and isinstance(cfg.eval.steps, int) and cfg.eval.steps % t.grad_accum_steps:
        issues.append(
            ConfigIssue(
                "eval.steps",
                f"eval.steps = {cfg.eval.steps} must be a multiple of "
                f"train.grad_accum_steps = {t.grad_accum_steps}: evaluation runs through the "
                "pipeline schedule, one pass per grad_accum_steps batches (its micro-batches)",
                f"set eval.steps to a multiple of {t.grad_accum_steps}",
            )
        )
    if m.is_moe and m.moe_router == "sigmoid_topk" and t.activation_checkpointing == "full":
        issues.append(
            ConfigIssue(
                "train.activation_checkpointing",
                f"'full' with distributed.pp = {d.pp} and model.moe_router = 'sigmoid_topk' would route "
                "differently in backward than in forward: a pipeline stage runs later micro-batches' "
                "forwards, which move the routers' balancing bias, before an earlier one's backward, whose "
                "full recomputation would then choose experts with the new bias",
                'use train.activation_checkpointing = "selective" (it keeps the routing decisions) or "none"',
            )
        )
    unsupported = [
        (
            t.loss_fn == "chunked_cross_entropy",
            "train.loss_fn",
            "chunked cross-entropy: the last stage computes the loss from its logits",
            'set train.loss_fn = "cross_entropy" (the same loss, computed from the logits), or distributed.pp = 1',
        ),
        (
            t.mixed_precision == "fp16",
            "train.mixed_precision",
            "fp16 loss scaling",
            'use train.mixed_precision = "bf16", or distributed.pp = 1',
        ),
    ]
    for applies, field, what, fix in unsupported:
        if applies:
            issues.append(
                ConfigIssue(field, f"pipeline parallelism (distributed.pp = {d.pp}) does not support {what} yet", fix)
            )
    return issues


def expert_parallel_issues(cfg: JobConfig, dp_shard: int) -> list[ConfigIssue]:
    """Expert parallelism: experts split over ep of the dp_shard ranks, for MoE models in the layouts it is
    tested with."""
    m, d, ep = cfg.model, cfg.distributed, cfg.distributed.ep
    if not m.is_moe:
        return [
            ConfigIssue(
                "distributed.ep",
                f"ep = {ep} needs a mixture-of-experts model (model.num_experts > 0)",
                "set distributed.ep = 1, or model.num_experts",
            )
        ]
    issues = []
    if m.num_experts % ep:
        issues.append(
            ConfigIssue("distributed.ep", f"model.num_experts = {m.num_experts} is not divisible by ep = {ep}")
        )
    if dp_shard and dp_shard % ep:
        issues.append(
            ConfigIssue(
                "distributed.ep",
                f"ep = {ep} must divide dp_shard = {dp_shard}: the experts are split over data-parallel shard ranks",
                "choose ep among the divisors of dp_shard",
            )
        )
    if not m.moe_packed_experts:
        issues.append(
            ConfigIssue(
                "model.moe_packed_experts",
                "distributed.ep > 1 needs packed experts (one tensor per projection, split over the expert dimension)",
                "set model.moe_packed_experts = true",
            )
        )
    if m.moe_gradient_scale:
        issues.append(
            ConfigIssue(
                "model.moe_gradient_scale",
                "is not supported with distributed.ep > 1 yet",
                "set it to false, or distributed.ep = 1",
            )
        )
    if d.cp > 1:
        issues.append(
            ConfigIssue(
                "distributed.cp",
                "is not supported with expert parallelism (distributed.ep > 1) yet",
                "use distributed.ep = 1 for this",
            )
        )
    return issues
