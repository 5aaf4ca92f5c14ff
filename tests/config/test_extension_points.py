"""docs/architecture.md says where a newcomer adds an optimizer or a model variant: a registered builder, found
by the name a config gives. These add toy ones exactly that way and check that the code paths training uses
(`build_optimizer`, `build_model`, the job's initial model) pick them up, with nothing else edited."""

from __future__ import annotations

import ast
import dataclasses
import json
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.checkpoint.hf import load_hf_weights
from engine.checkpoint.hf_mapping import hf_config, hf_layout, model_config_from_hf, to_hf
from engine.config.job import JobConfig
from engine.config.loader import load_job_config
from engine.config.optimizer import OptimizerFields
from engine.config.registry import METRICS_SINKS, MODELS, OPTIMIZERS, SCHEDULERS, SOURCE_KINDS
from engine.errors import ConfigError
from engine.model import build_model
from engine.model.estimate import param_counts, training_flops_per_token
from engine.model.transformer import Transformer
from engine.parallel.memory import estimate_memory, param_specs
from engine.plan import check_config
from engine.train.job import initial_model
from engine.train.losses import build_loss
from engine.train.optim import build_optimizer, param_groups
from tests.conftest import REPO
from tests.helpers.torchrun import torchrun

TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=64", "model.max_seq_len=16"]


@pytest.fixture
def registries():
    """Registrations made by a test are undone after it (and the sections composed of them recomposed)."""
    with (
        OPTIMIZERS.restored(),
        SCHEDULERS.restored(),
        MODELS.restored(),
        SOURCE_KINDS.restored(),
        METRICS_SINKS.restored(),
    ):
        yield


def test_a_registered_optimizer_is_what_optimizer_name_builds(registries):
    def toy_sgd(model, cfg):
        return torch.optim.SGD(param_groups(model, cfg.weight_decay), lr=cfg.lr)

    @OPTIMIZERS.register("toy_sgd", build=toy_sgd)
    class ToySGDConfig(OptimizerFields):
        pass

    cfg = load_job_config(None, [*TINY, "--optimizer.name=toy_sgd", "--optimizer.lr=0.5"])  # the name is accepted
    optimizer_cfg = cfg.optimizer
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, optimizer_cfg)
    assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["lr"] == 0.5
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


def test_a_registered_model_type_is_what_every_builder_makes(registries):
    class ToyTransformer(Transformer):
        """The transformer with its output head scaled down: a variant by subclassing, registered by name with
        the transformer family's spec (same shapes, plans and mapping) building it."""

        def forward(self, tokens, cache=None, *, return_hidden=False):
            out = super().forward(tokens, cache, return_hidden=return_hidden)
            return out if return_hidden or self.output is None else out * 0.5

    transformer = MODELS.get("transformer")
    MODELS.register("toy", spec=dataclasses.replace(transformer.spec, build=ToyTransformer))(transformer.config)
    cfg = load_job_config(None, TINY)
    toy = cfg.model_copy(update={"model": cfg.model.model_copy(update={"model_type": "toy"})})
    assert type(build_model(toy.model)) is ToyTransformer
    model = initial_model(toy, True)  # what training starts from: seeded, so the weights equal the plain model's
    plain = initial_model(cfg, True)
    assert type(model) is ToyTransformer and type(plain) is Transformer
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model(tokens), plain(tokens) * 0.5, rtol=0, atol=0)


# ---------------------------------------------------------------- a toy family and optimizer (tests/helpers/toy_family.py)

ACTIVATION_TOLERANCE = 0.05  # what tests/parallel/test_memory_estimate.py allows the built-in family


@pytest.fixture
def toy(registries):
    from tests.helpers import toy_family

    toy_family.register()
    return toy_family


def toy_job(toy, optimizer: str = "adamw", **train) -> JobConfig:
    """A job of the toy family: validated as the config allows (its layout rules), then the toy's [model]
    and optimizer put in."""
    cfg = check_config(
        JobConfig(
            model={"dim": 32, "n_layers": 4, "n_heads": 1, "vocab_size": 64, "ffn_hidden_dim": 48},
            train={"batch_size": 2, "seq_len": 8, "mixed_precision": "fp32", **train},
        ),
        1,
    )
    model = toy.toy_config(norm_type="layernorm")
    return cfg.model_copy(update={"model": model, "optimizer": cfg.optimizer.model_copy(update={"name": optimizer})})


def test_the_toy_family_builds_counts_and_estimates_through_its_spec(toy):
    """build_model, the parameter and FLOP counts, and the memory estimate's params, grads and optimizer state
    (the toy optimizer's registered size) equal what the real toy model and optimizer hold after a step."""
    cfg = toy_job(toy, optimizer=toy.OPTIMIZER)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    assert type(model) is toy.ToyLM
    real = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {s.name: s.shape for s in param_specs(cfg.model)} == real and len(
        real
    ) == 4 * 6 + 4  # per block: norm, up, down (weight + bias each)
    assert param_counts(cfg.model)["total"] == sum(p.numel() for p in model.parameters())
    # FLOPs: 6 per matmul weight element per token, counted here from the modules themselves.
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert training_flops_per_token(cfg.model, cfg.train.seq_len) == 6 * linears
    optimizer = build_optimizer(model, cfg.optimizer)
    assert type(optimizer) is toy.ToyMomentum
    tokens = torch.randint(0, 64, (2, 8))
    build_loss(cfg.train)(model, tokens, tokens).backward()
    optimizer.step()
    [stage] = estimate_memory(cfg, 1)
    assert stage.params == sum(p.nbytes for p in model.parameters())
    assert stage.grads == sum(p.grad.nbytes for p in model.parameters())
    held = sum(v.nbytes for state in optimizer.state.values() for v in state.values())
    assert stage.optimizer == held == 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_toy_familys_activation_estimate_matches_the_saved_tensors(toy, precision):
    """The estimate's activations (the toy spec's block count plus the generic embedding, final norm, head and
    loss terms) within the tolerance the built-in family's estimate has of what autograd saves."""
    cfg = toy_job(toy, mixed_precision=precision)
    [stage] = estimate_memory(cfg, 1)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    weights = {t.untyped_storage().data_ptr() for t in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        # autocast's low-precision weight copies are not activations (their input is a parameter)
        fn = t.grad_fn
        while fn is not None and fn.name() in ("TBackward0", "TransposeBackward0"):
            fn = fn.next_functions[0][0]
        copy = fn is not None and fn.name() == "ToCopyBackward0" and "AccumulateGrad" in fn.next_functions[0][0].name()
        if storage.data_ptr() not in weights and not copy:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, 64, (2, 8))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"),
    ):
        build_loss(cfg.train)(model, tokens, tokens.clone())
    measured = sum(seen.values())
    assert measured > 0
    assert abs(stage.activations / measured - 1) < ACTIVATION_TOLERANCE, (stage.activations, measured)


def test_the_toy_family_converts_to_its_declared_hf_names_and_back(toy, tmp_path):
    """Export by the generic mapping (the toy's HF names, its transposed block linears) and load back by the
    import path (config.json → the toy's [model], check, tensors): the same weights."""
    cfg = toy.toy_config(norm_type="layernorm")
    torch.manual_seed(0)
    model = build_model(cfg)
    state = model.state_dict()
    layout = hf_layout(cfg)
    assert "transformer.h.0.mlp.c_fc.weight" in layout and "lm_head.weight" in layout and len(layout) == len(state)
    tensors = {name: to_hf(piece, state, torch.float32) for name, piece in layout.items()}
    assert tensors["transformer.h.0.mlp.c_fc.weight"].shape == (32, 48)  # stored [in, out]
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file(tensors, hf_dir / "model.safetensors")
    (hf_dir / "config.json").write_text(json.dumps(hf_config(cfg, torch.float32, None, None)))
    assert model_config_from_hf(json.loads((hf_dir / "config.json").read_text()), "hf") == cfg
    torch.manual_seed(1)
    fresh = build_model(cfg)
    assert not torch.equal(fresh.layers["0"].mlp.up.weight, model.layers["0"].mlp.up.weight)
    loaded = load_hf_weights(fresh, hf_dir)
    assert loaded == sorted(state)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, state[name]), name


TOY_PARALLEL_SCRIPT = """
import copy, json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, sys.argv[2])
from tests.helpers import toy_family

toy_family.register()
from engine.config.optimizer import OptimizerConfig
from engine.model import build_model
from engine.parallel.apply import apply_fsdp
from engine.parallel.launch import end_process
from engine.parallel.pipeline import StageShapes, build_pipeline
from engine.parallel.tp import apply_tensor_parallel
from engine.train.losses import cross_entropy
from engine.train.optim import build_optimizer

dist.init_process_group("gloo")
rank, cpu = dist.get_rank(), torch.device("cpu")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
cfg = toy_family.toy_config(tie_embeddings=bool(int(sys.argv[3])))
torch.manual_seed(0)
base = build_model(cfg)
data = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(1))
x, y = data[:, :-1], data[:, 1:]
opt_cfg = OptimizerConfig(name="adamw").model_copy(update={"name": toy_family.OPTIMIZER, "lr": 0.1})


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def after_step(model, loss_of):
    # One step of the toy optimizer: the loss, every gradient, every weight after the update (full tensors).
    opt = build_optimizer(model, opt_cfg)
    loss = loss_of(model)
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    opt.step()
    return loss, grads, {n: full(p) for n, p in model.named_parameters()}


def ref_loss(model):
    loss = cross_entropy(model(x), y)
    loss.backward()
    return loss.item()


ref = after_step(copy.deepcopy(base), ref_loss)


def tp_loss(model):
    loss = cross_entropy(model(x), y)
    loss.backward()
    return loss.item()


def fsdp_loss(model):
    loss = cross_entropy(model(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2])
    loss.backward()
    value = loss.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value.item()


out = {}
layouts = (
    ("tp", lambda m: apply_tensor_parallel(m, mesh["x"], loss_parallel=False), tp_loss),
    ("fsdp", lambda m: apply_fsdp(m, mesh["x"], torch.float32), fsdp_loss),
)
for name, parallelize, loss_of in layouts:
    model = copy.deepcopy(base)
    parallelize(model)
    loss, grads, weights = after_step(model, loss_of)
    rloss, rgrads, rweights = ref
    out[name] = {
        "loss": abs(loss - rloss),
        "names": sorted(grads) == sorted(rgrads),
        "grad": max((grads[n] - rgrads[n]).abs().max().item() for n in grads),
        "weight": max((weights[n] - rweights[n]).abs().max().item() for n in weights),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
    }

# Pipeline: two stages (rank 0 the embedding and first blocks, rank 1 the rest and the head), two microbatches.
shapes = StageShapes(2, 8, 8, cfg.dim, cfg.vocab_size, torch.float32, torch.float32)
pipe = build_pipeline(copy.deepcopy(base), mesh["x"], "1f1b", 2, cross_entropy, cpu, shapes)
# The last stage's copy of a tied matrix is the one process's embedding (the gradients are summed across ranks).
same = {"output.weight": "tok_embeddings.weight"} if cfg.tie_embeddings else {}
params = {same.get(n, n): p for part in pipe.model_parts for n, p in part.named_parameters()}
opt = build_optimizer(pipe.model_parts[0], opt_cfg)
loss = pipe.step_loss(pipe.step(x, y), cpu).item()
grads = {n: p.grad.detach().clone() for n, p in params.items()}
opt.step()
rloss, rgrads, rweights = ref
out["pp"] = {
    "loss": abs(loss - rloss),
    "names": bool(params) and set(params) < set(rgrads),
    "grad": max((grads[n] - rgrads[n]).abs().max().item() for n in grads),
    "weight": max((p.detach() - rweights[n]).abs().max().item() for n, p in params.items()),
    "blocks": sorted(pipe.model_parts[0].layers),
}
json.dump(out, open(f"{sys.argv[1]}.{rank}", "w"))
dist.barrier()
dist.destroy_process_group()
end_process(0)
"""


def test_the_toy_family_trains_under_tp_fsdp_and_pp_like_one_process(tmp_path):
    """Tensor parallelism (the toy's plan: biased column/row linears), FSDP2 (each block a unit) and a two-stage
    pipeline (its ModelParts), each on 2 gloo processes: the loss, every gradient and every weight after one
    step of the toy optimizer equal one process's. Bound 1e-5: fp32 sums of a few hundred terms of O(1)
    values (loss ≈ ln 64), reordered across ranks, differ by ~1e-6 at most. Tied embeddings, so the plan's and
    the pipeline's tied pairs are exercised too (one run: the untied head is the same style on its own weight)."""
    script = tmp_path / "toy_parallel.py"
    script.write_text(TOY_PARALLEL_SCRIPT)
    out = tmp_path / "out.json"
    done = torchrun(script, 2, str(out), str(REPO), "1")
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    assert len(ranks) == 2
    for rank, result in enumerate(ranks):
        for layout in ("tp", "fsdp", "pp"):
            measured = result[layout]
            assert measured["names"], (rank, layout)
            assert measured["loss"] < 1e-5 and measured["grad"] < 1e-5 and measured["weight"] < 1e-5, (
                rank,
                layout,
                measured,
            )
        assert result["tp"]["sharded"] and result["fsdp"]["sharded"]
    assert ranks[0]["pp"]["blocks"] != ranks[1]["pp"]["blocks"]  # each rank held only its stage's blocks


# ---------------------------------------------------------------- components with fields of their own
#
# docs/architecture.md ("Where a newcomer adds…"): an optimizer or a schedule is one config class with its own
# fields and one registration. These toys are defined here and nowhere else: their fields become keys of
# [optimizer] / [scheduler], accepted when they are chosen, refused naming them when another one is.


def validate(*overrides: str, preset: Path = REPO / "presets/debug.toml") -> tuple[int, dict]:
    """`forge validate-config PRESET OVERRIDES --json` in this process (where the toys are registered): the exit
    code and the JSON report."""
    from typer.testing import CliRunner

    from forgecli.app import app

    result = CliRunner().invoke(app, ["validate-config", str(preset), *overrides, "--json"])
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture
def toy_components(registries):
    """A toy optimizer (SGD with a dampening of its own) and a toy schedule (a step down to a level of its own)."""
    from pydantic import Field

    from engine.config.optimizer import FP32, OptimizerState
    from engine.config.scheduler import SchedulerFields

    def build(model, cfg):
        groups = param_groups(model, cfg.weight_decay)
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.5, dampening=cfg.toy_dampening)

    @OPTIMIZERS.register("toy_sgd", build=build)
    class ToySGDConfig(OptimizerFields):
        toy_dampening: float = Field(0.0, ge=0, lt=1, description="toy_sgd only: dampening of its momentum")

        def state(self) -> OptimizerState:
            return OptimizerState(FP32)  # a momentum buffer

    @SCHEDULERS.register("toy_step")
    class ToyStepConfig(SchedulerFields):
        toy_level: float = Field(0.5, gt=0, le=1, description="toy_step only: the multiplier after half the decay")

        def decay(self, steps: int, decay_steps: int) -> float:
            return 1.0 if steps < decay_steps / 2 else self.toy_level

    return ToySGDConfig, ToyStepConfig


def test_a_toy_optimizers_own_field_is_accepted_shown_and_read(toy_components):
    code, report = validate("--optimizer.name=toy_sgd", "--optimizer.toy_dampening=0.25")
    assert code == 0 and report["valid"], report
    assert report["config"]["optimizer"]["name"] == "toy_sgd"
    assert report["config"]["optimizer"]["toy_dampening"] == 0.25
    cfg = load_job_config(REPO / "presets/debug.toml", ["--optimizer.name=toy_sgd", "--optimizer.toy_dampening=0.25"])
    model = build_model(load_job_config(None, TINY).model)
    optimizer = build_optimizer(model, cfg.optimizer)  # the builder gets the toy's own config
    assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["dampening"] == 0.25
    before = [p.detach().clone() for p in model.parameters()]
    build_loss(cfg.train)(model, *[torch.randint(0, 64, (2, 8))] * 2).backward()
    optimizer.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # Its state size is what the memory estimate counts.
    toy_cfg = load_job_config(
        None, [*TINY, "--optimizer.name=toy_sgd", "--train.mixed_precision=fp32", "--train.seq_len=8"]
    )
    [stage] = estimate_memory(check_config(toy_cfg, 1), 1)
    assert stage.optimizer == FP32_BYTES * sum(p.numel() for p in model.parameters())


FP32_BYTES = 4


def test_a_toy_optimizers_field_is_refused_under_another_and_another_ones_under_it(toy_components):
    code, report = validate("--optimizer.toy_dampening=0.25")
    assert code == 2 and not report["valid"]
    [error] = report["errors"]
    assert error["field"] == "optimizer.toy_dampening" and "only toy_sgd do" in error["problem"]
    assert "'adamw' does not use it" in error["problem"]
    code, report = validate("--optimizer.name=toy_sgd", "--optimizer.muon_momentum=0.9", "--optimizer.eps=1e-6")
    assert code == 2
    errors = {e["field"]: e["problem"] for e in report["errors"]}
    assert set(errors) == {"optimizer.muon_momentum", "optimizer.eps"}  # every error at once
    assert "only muon do" in errors["optimizer.muon_momentum"]
    assert "only adamw, muon, schedule_free_adamw do" in errors["optimizer.eps"]
    code, report = validate("--optimizer.name=toy_sgd", "--optimizer.toy_dampening=1.5")  # its own bounds
    assert code == 2 and report["errors"][0]["field"] == "optimizer.toy_dampening"


def test_a_toy_schedule_is_accepted_shown_refused_elsewhere_and_runs(toy_components):
    code, report = validate("--scheduler.name=toy_step", "--scheduler.toy_level=0.25")
    assert code == 0 and report["config"]["scheduler"]["toy_level"] == 0.25, report
    code, report = validate("--scheduler.toy_level=0.25")
    assert code == 2 and report["errors"][0]["field"] == "scheduler.toy_level"
    assert "'cosine' does not use it (only toy_step do)" in report["errors"][0]["problem"]
    code, report = validate("--scheduler.name=toy_step", "--scheduler.rex_alpha=2.0")
    assert code == 2 and "only rex do" in report["errors"][0]["problem"]
    from engine.train.schedules import build_scheduler, lr_multiplier

    cfg = load_job_config(
        None, ["--scheduler.name=toy_step", "--scheduler.toy_level=0.25", "--scheduler.warmup_steps=1"]
    )
    multiplier = lr_multiplier(cfg.scheduler, 11)  # warmup 1, decay over the 9 steps after it
    assert [multiplier(s) for s in range(11)] == [0.5] + [1.0] * 5 + [0.25] * 5
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scheduler = build_scheduler(optimizer, cfg.scheduler, 11)
    lrs = []
    for _ in range(11):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == [multiplier(s) for s in range(11)]


def test_the_toys_are_offered_by_completion_and_documented_by_the_reference(toy_components):
    from engine.config import reference
    from forgecli.completion import complete_override

    offered = [item.value for item in complete_override("--optimizer.toy", [])]
    assert offered == ["--optimizer.toy_dampening="]
    assert "toy_sgd" in [item.value for item in complete_override("", ["--optimizer.name"])]
    table = reference.section_table("optimizer", JobConfig.model_fields["optimizer"].annotation)
    assert (
        "| `toy_dampening` | float | `0.0` | >= 0, < 1 | toy_sgd only: dampening of its momentum | `toy_sgd` |" in table
    )
    assert "toy_sgd" in table.splitlines()[2]  # the name field's choices
    # forge init drops the toy's field when another optimizer is chosen
    from engine.plan.writer import InitAnswers, build_preset

    written = build_preset(InitAnswers(optimizer="lion"))
    assert "toy_dampening" not in written.text


def test_the_toys_are_gone_after_the_test_that_registered_them():
    """`registries` undid the toys: the sections are composed of the built-in components again."""
    assert "toy_dampening" not in JobConfig.model_fields["optimizer"].annotation.model_fields
    assert "toy_step" not in typing.get_args(
        JobConfig.model_fields["scheduler"].annotation.model_fields["name"].annotation
    )
    with pytest.raises(ConfigError):
        load_job_config(None, ["--optimizer.name=toy_sgd"])


# ---------------------------------------------------------------- a source kind and a metrics sink of their own
#
# docs/architecture.md ("Adding a component"): a source kind is one config class of its own [data] fields and one
# registration in SOURCE_KINDS, which both `forge tokenize` (its KIND:NAME inputs) and training (a path field's
# KIND:LOCATION) resolve through; a metrics sink is one config class of its own [metrics] fields and one
# registration in METRICS_SINKS, started by build_trackers when its switch is on. Both toys live here only.

TOY_TEXT = "to be, or not to be, that is the question: whether tis nobler in the mind to suffer"


@pytest.fixture
def toy_source(registries, tmp_path):
    """`toy:N`: N documents, each `data.toy_text` (forge tokenize has no config: its documents hold the default).
    For training its shards are tokenized on first use into a folder of this test, like a Hub dataset's."""
    from pydantic import Field

    from engine.config.base import Section
    from engine.data.sources import FileSource
    from engine.data.tokenize import tokenize_texts
    from engine.data.tokenizer import Encoder
    from tests.helpers.data_fixtures import write_jsonl

    def directory(spec, cfg, tokenizer):
        out = tmp_path / "toy-shards" / f"{spec.location}-{abs(hash(cfg.data.toy_text))}"
        if not out.exists():
            texts = [cfg.data.toy_text] * int(spec.location)
            tokenize_texts(texts, out, Encoder.from_file(tokenizer()), {"toy": spec.location}, shard_tokens=4096)
        return out

    def documents(location, options):
        return FileSource([write_jsonl(tmp_path / f"toy-{location}.jsonl", [ToySource().toy_text] * int(location))])

    @SOURCE_KINDS.register(
        "toy", directory=directory, describe="a toy input (toy:N)", example="toy:8", prefixed=True, documents=documents
    )
    class ToySource(Section):
        toy_text: str = Field(TOY_TEXT, min_length=1, description="toy only: the text each document holds")

    return ToySource


@pytest.fixture
def toy_sink(registries):
    """A sink that keeps what it receives, its keys prefixed by a field of its own."""
    from pydantic import Field

    from engine.config.base import Section

    received: list[tuple[int, dict]] = []

    class KeptMetrics:
        def __init__(self, prefix: str) -> None:
            self.prefix, self.closed = prefix, False

        def log(self, step, metrics) -> None:
            received.append((step, {self.prefix + key: value for key, value in metrics.items()}))

        def close(self) -> None:
            self.closed = True

    @METRICS_SINKS.register("kept", build=lambda own, context: KeptMetrics(own.kept_prefix), switch="enable_kept")
    class KeptFields(Section):
        enable_kept: bool = Field(False, description="keep every logged step in memory (a test's sink)")
        kept_prefix: str = Field("", description="kept only: put before every metric's name")

    return received


def embedded_tokenizer() -> Path:
    from engine.data.embedded import embedded_corpus
    from engine.data.shards import TOKENIZER_FILE

    return embedded_corpus().split("train") / TOKENIZER_FILE


def test_a_toy_source_kind_is_what_forge_tokenize_opens(toy_source, tmp_path):
    from typer.testing import CliRunner

    from engine.data.shards import read_manifest
    from forgecli.app import app

    runner = CliRunner()
    out = tmp_path / "tokenized"
    result = runner.invoke(app, ["tokenize", "toy:5", "--tokenizer", str(embedded_tokenizer()), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert sum(shard.documents for shard in read_manifest(out).shards) == 5
    # A flag of another kind (the Hugging Face kind's --split) is refused naming that kind.
    args = ["tokenize", "toy:5", "--split", "test", "--tokenizer", str(embedded_tokenizer()), "--out", str(out) + "2"]
    refused = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert refused.exit_code == 2 and "--split applies only to a Hugging Face dataset input" in refused.output


def test_a_toy_source_kinds_field_is_accepted_shown_and_refused_without_it(toy_source):
    tokenizer = f"--data.tokenizer_path={embedded_tokenizer()}"
    toy = ["--data.dataset_path=toy:40", "--data.toy_text=what light through yonder window breaks", tokenizer]
    code, report = validate(*toy, "--eval.enabled=false")
    assert code == 0 and report["valid"], report
    assert report["config"]["data"]["toy_text"] == "what light through yonder window breaks"
    code, report = validate("--data.toy_text=hello")  # the embedded corpus: no toy source reads it
    assert code == 2
    [error] = report["errors"]
    assert error["field"] == "data.toy_text" and "no source is of kind toy" in error["problem"], error
    code, report = validate(*toy, "--eval.enabled=false", "--data.hf_dataset_split=test")  # the hf kind's field
    assert code == 2 and [e["field"] for e in report["errors"]] == ["data.hf_dataset_split"]
    assert "data.hf_dataset_name is unset" in report["errors"][0]["problem"]
    code, report = validate(*toy, "--eval.enabled=false", "--data.toy_text=")  # its own bounds
    assert code == 2 and report["errors"][0]["field"] == "data.toy_text"
    from engine.config import reference

    table = reference.section_table("data", JobConfig.model_fields["data"].annotation)
    assert "| `toy_text` | str |" in table and table.splitlines()[-1].endswith("| `toy` |")


def test_a_toy_sinks_field_is_accepted_and_refused_while_it_is_off(toy_sink):
    code, report = validate("--metrics.enable_kept=true", "--metrics.kept_prefix=kept/")
    assert code == 0 and report["config"]["metrics"]["kept_prefix"] == "kept/", report
    code, report = validate("--metrics.kept_prefix=kept/")
    assert code == 2
    [error] = report["errors"]
    assert error["field"] == "metrics.kept_prefix" and "the kept sink is off" in error["problem"]
    assert "metrics.enable_kept = true" in error["hint"]


def test_training_reads_a_toy_source_and_a_toy_sink_receives_its_metrics(toy_source, toy_sink, tmp_path):
    """Two steps on `toy:` shards (tokenized from data.toy_text on first use), the toy sink on beside metrics.jsonl:
    it receives every record metrics.jsonl holds, the same steps and the same values (JSON keeps a float exactly)."""
    from engine.data.shards import read_manifest
    from engine.train.trainer import train
    from tests.helpers.trainer import TINY as TINY_RUN

    overrides = [
        *TINY_RUN,
        "train.max_steps=2",
        "data.dataset_path=toy:40",
        "data.toy_text=what light through yonder window breaks",
        f"data.tokenizer_path={embedded_tokenizer()}",
        "metrics.enable_kept=true",
        "metrics.kept_prefix=kept/",
    ]
    cfg = load_job_config(REPO / "presets/debug.toml", [f"--{o}" for o in overrides])
    train(cfg, tmp_path / "run")
    [built] = list((tmp_path / "toy-shards").iterdir())
    assert sum(shard.documents for shard in read_manifest(built).shards) == 40  # the toy's shards were trained on
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    kept = [(step, {key.removeprefix("kept/"): value for key, value in metrics.items()}) for step, metrics in toy_sink]
    assert all(key.startswith("kept/") for _, metrics in toy_sink for key in metrics)
    assert kept == [(r["step"], {k: v for k, v in r.items() if k != "time"}) for r in records]  # time: JSONL's own


# ---------------------------------------------------------------- a toy family with a field of its own
#
# The toy family of tests/helpers/toy_family.py registers its config class (`ToyConfig`: the shared fields, the
# choice of norm and `toy_residual_scale`) with its spec, in one line; `[model]` is then composed of it.

TOY_PRESET = """
[model]
model_type = "toy_mlp"
dim = 32
n_layers = 2
n_heads = 1
vocab_size = 4096
max_seq_len = 16
ffn_hidden_dim = 48
norm_type = "layernorm"

[train]
batch_size = 2
seq_len = 16
max_steps = 2
mixed_precision = "fp32"

[eval]
enabled = false

[metrics]
log_interval = 1
"""


@pytest.fixture
def toy_preset(toy, tmp_path) -> Path:
    path = tmp_path / "toy.toml"
    path.write_text(TOY_PRESET)
    return path


def test_a_toy_familys_own_field_is_accepted_shown_and_trains(toy, toy_preset, tmp_path):
    code, report = validate("--model.toy_residual_scale=0.5", preset=toy_preset)
    assert code == 0 and report["valid"], report
    assert report["config"]["model"]["model_type"] == "toy_mlp"
    assert report["config"]["model"]["toy_residual_scale"] == 0.5
    code, report = validate("--model.toy_residual_scale=0", preset=toy_preset)  # its own bounds
    assert code == 2 and report["errors"][0]["field"] == "model.toy_residual_scale"

    from engine.train.trainer import train

    cfg = load_job_config(toy_preset, ["--model.toy_residual_scale=0.5"])
    assert build_model(cfg.model).layers["0"].residual_scale == 0.5  # the model reads its own field
    train(cfg, tmp_path / "run")
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "loss" in r]
    assert len(losses) == 2 and all(loss == loss and loss > 0 for loss in losses), steps


def test_another_familys_field_is_refused_with_the_toy_and_the_toys_elsewhere(toy, toy_preset):
    """Fields only the transformer declares (RoPE, an expert field, multi-token prediction) refused with the toy
    chosen, each naming the field and the family (exit 2, every error at once); the toy's own field refused with
    the transformer chosen; and gpt2, which declares neither, refuses both."""
    code, report = validate(
        "--model.rope_theta=500000", "--model.num_experts=4", "--model.mtp_depth=1", preset=toy_preset
    )
    assert code == 2 and not report["valid"]
    errors = {e["field"]: e["problem"] for e in report["errors"]}
    assert set(errors) == {"model.rope_theta", "model.num_experts", "model.mtp_depth"}, errors
    assert all("model.model_type = 'toy_mlp' has no such setting" in problem for problem in errors.values())
    code, report = validate("--model.toy_residual_scale=0.5")
    assert code == 2
    [error] = report["errors"]
    assert error["field"] == "model.toy_residual_scale"
    assert "model.model_type = 'transformer' has no such setting" in error["problem"]
    gpt2 = REPO / "presets/gpt2_124m.toml"
    code, report = validate(
        "--world-size=8", "--model.toy_residual_scale=0.5", "--model.norm_type=layernorm", preset=gpt2
    )
    assert code == 2
    assert {e["field"] for e in report["errors"]} == {"model.toy_residual_scale", "model.norm_type"}


def test_the_toy_family_is_offered_documented_and_dropped_by_init(toy):
    from engine.config import reference
    from engine.plan.writer import InitAnswers, apply_model
    from forgecli.completion import complete_override

    assert "toy_mlp" in [item.value for item in complete_override("", ["--model.model_type"])]
    assert [item.value for item in complete_override("--model.toy", [])] == ["--model.toy_residual_scale="]
    table = reference.section_table("model", JobConfig.model_fields["model"].annotation)
    assert "toy_mlp" in table.splitlines()[[row.startswith("| `model_type`") for row in table.splitlines()].index(True)]
    assert "| `toy_residual_scale` | float | `1.0` | > 0 |" in table and table.count("`toy_mlp` |") >= 2
    # norm_type is read by the transformer and the toy (one mixin), rope_theta by the transformer alone
    norm_row = next(row for row in table.splitlines() if row.startswith("| `norm_type`"))
    assert norm_row.endswith("| `transformer`, `toy_mlp` |")
    # forge init drops the fields the base's family does not read
    raw = {"model": {"model_type": "gpt2", "dim": 64, "rope_theta": 1e6, "toy_residual_scale": 0.5}}
    apply_model(raw, InitAnswers(), {})
    assert raw["model"] == {"model_type": "gpt2", "dim": 64}
    raw = {"model": {"model_type": "toy_mlp", "dim": 64, "rope_theta": 1e6, "toy_residual_scale": 0.5}}
    apply_model(raw, InitAnswers(), {})
    assert raw["model"] == {"model_type": "toy_mlp", "dim": 64, "toy_residual_scale": 0.5}


def test_the_toy_family_is_gone_after_the_test_that_registered_it():
    assert "toy_residual_scale" not in JobConfig.model_fields["model"].annotation.model_fields
    assert "toy_mlp" not in typing.get_args(
        JobConfig.model_fields["model"].annotation.model_fields["model_type"].annotation
    )
    with pytest.raises(ConfigError):
        load_job_config(None, ["--model.model_type=toy_mlp"])


# ---------------------------------------------------------------- what engine/config/ may not hold


CONVERTED = {"MODELS": 2, "OPTIMIZERS": 4, "SCHEDULERS": 4, "SOURCE_KINDS": 4, "METRICS_SINKS": 3}
"""The registries whose components own their fields, and how many components each has at least."""


def literal_options(source: str) -> list[tuple[int, set[str]]]:
    """(line, the string options) of every `Literal[...]` written in a module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Subscript)
            and getattr(node.value, "id", getattr(node.value, "attr", None)) == "Literal"
        ):
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            found.append(
                (node.lineno, {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)})
            )
    return found


def test_no_literal_in_engine_config_lists_a_registrys_names():
    from engine.config import registry

    for name, least in CONVERTED.items():
        names = set(getattr(registry, name).names())
        assert len(names) >= least, name
        for path in sorted((REPO / "engine/config").glob("*.py")):
            for line, options in literal_options(path.read_text()):
                assert not (len(options) >= 2 and options <= names), f"{path.name}:{line} lists {name}: {options}"
    # The check can fail: the Literal the optimizer section used to have would be caught.
    [(_, old)] = literal_options('OptimizerName = Literal["adamw", "lion", "muon", "schedule_free_adamw"]')
    assert old <= set(registry.OPTIMIZERS.names())
    [(_, old)] = literal_options('model_type: Literal["transformer", "gpt2"] = Field("transformer")')
    assert old <= set(registry.MODELS.names())


IMPORT_EVERY_CONFIG_MODULE = """
import importlib, json, pkgutil, sys
import engine.config
for m in pkgutil.iter_modules(engine.config.__path__):
    importlib.import_module("engine.config." + m.name)
from engine.config import registry
builds = [c.build for r in (registry.OPTIMIZERS, registry.SCHEDULERS, registry.METRICS_SINKS) for c in r.components()]
builds += [b for k in registry.SOURCE_KINDS.components() for b in (k.build, k.documents, k.manifest, k.rule)]
builds += [c.spec.build for c in registry.MODELS.components()]
modules = sorted({b.partition(":")[0] for b in builds if isinstance(b, str)})
print(json.dumps({"torch": "torch" in sys.modules, "implementations": modules,
                  "loaded": sorted(m for m in modules if m in sys.modules),
                  "build": "engine.train.optim.build" in sys.modules}))
"""


def test_engine_config_imports_no_components_implementation():
    """Importing every module of engine/config/ (which registers every optimizer, schedule and model family) loads
    no torch and none of the modules the components build from (their builders are named, imported only when
    built)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_CONFIG_MODULE], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert "engine.train.optim.muon" in report["implementations"]
    assert {"engine.data.hub", "engine.data.source_kinds", "engine.metrics.trackers"} <= set(report["implementations"])
    assert {"engine.model.transformer", "engine.model.families.gpt2.model"} <= set(report["implementations"])
    assert report == {**report, "torch": False, "loaded": [], "build": False}
