"""Model families and optimizers reach the rest of Forge only through their registrations (issue 29): the
generic rooms name none of them, every optimizer the config allows has a registered state size, and a name
nobody registered is refused at the CLI with the registered ones listed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import typing

from tests.conftest import REPO

GENERIC = [
    "engine/parallel/memory.py",
    "engine/model/estimate.py",
    "engine/parallel/tp.py",
    "engine/checkpoint/hf_mapping.py",
]


def registered_names() -> list[str]:
    import engine.model  # (registers the families)
    import engine.train.optim  # noqa: F401  (registers the optimizer builders)
    from engine.config.registry import MODELS, OPTIMIZERS

    return sorted({*MODELS.names(), *OPTIMIZERS.names()})


def mentions(text: str, name: str) -> list[str]:
    """The words of `text` that are `name` (any case; `transformers`, the library, is another word)."""
    return re.findall(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", text, flags=re.IGNORECASE)


def test_the_generic_rooms_name_no_family_and_no_optimizer():
    names = registered_names()
    assert {"transformer", "adamw", "muon", "lion", "schedule_free_adamw"} <= set(names)
    found = {(path, name): len(mentions((REPO / path).read_text(), name)) for path in GENERIC for name in names}
    assert len(found) == len(GENERIC) * len(names)
    assert not {key: count for key, count in found.items() if count}
    # The same search finds the names where they belong (so an edit naming one in a generic room would fail).
    assert mentions((REPO / "engine/model/families/transformer/__init__.py").read_text(), "transformer")
    assert mentions((REPO / "engine/train/optim/muon_config.py").read_text(), "muon")


def test_every_optimizer_the_config_allows_has_a_builder_and_a_state_size():
    from engine.config.optimizer import OptimizerConfig, OptimizerState
    from engine.config.registry import OPTIMIZERS

    registered_names()
    allowed = sorted(typing.get_args(OptimizerConfig.model_fields["name"].annotation))
    assert OPTIMIZERS.names() == allowed
    for name in allowed:
        assert callable(OPTIMIZERS.get(name).implementation()), name
        own = OPTIMIZERS.chosen(OptimizerConfig(name=name))
        assert isinstance(own.state(), OptimizerState), name


def test_an_unknown_model_type_or_optimizer_exits_2_listing_the_registered_ones():
    """The CLI refuses both at once, exit 2, naming each field and every name registered for it."""
    from engine.config.registry import MODELS, OPTIMIZERS

    registered_names()
    bad = ["--model.model_type=gpt9", "--optimizer.name=sgd"]
    result = subprocess.run(
        [sys.executable, "-m", "forgecli.app", "validate-config", "presets/debug.toml", "--json", *bad],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    errors = {row["field"]: row["problem"] for row in json.loads(result.stdout)["errors"]}
    assert set(errors) == {"model.model_type", "optimizer.name"}
    assert "gpt9" in errors["model.model_type"] and "sgd" in errors["optimizer.name"]
    assert len(MODELS.names()) >= 1 and len(OPTIMIZERS.names()) >= 4
    assert all(f"'{name}'" in errors["model.model_type"] for name in MODELS.names())
    assert all(f"'{name}'" in errors["optimizer.name"] for name in OPTIMIZERS.names())


def test_every_tensor_parallel_kind_a_plan_may_name_becomes_a_dtensor_style():
    from torch.distributed.tensor.parallel import ParallelStyle

    from engine.model.spec import TP_KINDS, TPStyle
    from engine.parallel.tp import parallel_style

    styles = [parallel_style(TPStyle(kind), loss_parallel) for kind in TP_KINDS for loss_parallel in (False, True)]
    assert len(styles) == 2 * len(TP_KINDS) == 24
    assert all(isinstance(style, ParallelStyle) for style in styles)
