"""docs/architecture.md says where a newcomer adds an optimizer or a model variant: a registered builder, found
by the name a config gives. These add toy ones exactly that way and check that the code paths training uses
(`build_optimizer`, `build_model`, the job's initial model) pick them up, with nothing else edited."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.checkpoint.hf import load_hf_weights
from engine.checkpoint.hf_mapping import hf_config, hf_layout, model_config_from_hf, to_hf
from engine.config.job import JobConfig
from engine.config.loader import load_job_config
from engine.config.registry import MODELS, OPTIMIZER_STATES, OPTIMIZERS
from engine.model import build_model
from engine.model.estimate import param_counts, training_flops_per_token
from engine.model.transformer import Transformer
from engine.parallel.memory import estimate_memory, param_specs
from engine.train.job import initial_model
from engine.train.losses import build_loss
from engine.train.optim import build_optimizer, param_groups
from tests.conftest import REPO
from tests.helpers.torchrun import torchrun

TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=64", "model.max_seq_len=16"]


@pytest.fixture
def registries(monkeypatch):
    """Registrations made by a test are undone after it."""
    for registry in (OPTIMIZERS, MODELS, OPTIMIZER_STATES):
        monkeypatch.setattr(registry, "_builders", dict(registry._builders))


def test_a_registered_optimizer_is_what_optimizer_name_builds(registries):
    @OPTIMIZERS.register("toy_sgd")
    def toy_sgd(model, cfg):
        return torch.optim.SGD(param_groups(model, cfg.weight_decay), lr=cfg.lr)

    cfg = load_job_config(None, TINY)
    # The name is also added to OptimizerName in a real change; model_copy stands in for that edit here.
    optimizer_cfg = cfg.optimizer.model_copy(update={"name": "toy_sgd", "lr": 0.5})
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

    MODELS.register("toy")(dataclasses.replace(MODELS.get("transformer"), build=ToyTransformer))
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
    and optimizer put in, as a real family's name in the `model_type` Literal would allow directly."""
    cfg = JobConfig(
        model={"dim": 32, "n_layers": 4, "n_heads": 1, "vocab_size": 64, "ffn_hidden_dim": 48},
        train={"batch_size": 2, "seq_len": 8, "mixed_precision": "fp32", **train},
    ).validate(1)
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
