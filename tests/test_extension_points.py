"""docs/architecture.md says where a newcomer adds an optimizer or a model variant: a registered builder, found
by the name a config gives. These add toy ones exactly that way and check that the code paths training uses
(`build_optimizer`, `build_model`, the job's initial model) pick them up, with nothing else edited."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config.loader import load_job_config
from engine.config.registry import MODELS, OPTIMIZERS
from engine.model import build_model
from engine.model.transformer import Transformer
from engine.train.job import initial_model
from engine.train.optim import build_optimizer, param_groups

TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=64", "model.max_seq_len=16"]


@pytest.fixture
def registries(monkeypatch):
    """Registrations made by a test are undone after it."""
    for registry in (OPTIMIZERS, MODELS):
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
