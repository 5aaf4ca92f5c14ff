"""Outside engine/model/, code reaches a model only through the contract (engine/model/spec.py: `ModelParts`,
`LanguageModel`): no module imports a family's code — the transformer, its attention, MLP, MoE, routers and
multi-token prediction, or a family's folder — at module level or lazily, by `import`, `from … import` or
`importlib.import_module("…")`. Families are registered inside engine/model/ (engine/model/families/__init__.py),
so the allowed set outside it is empty."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.imports import imported_modules

ENGINE = Path(__file__).resolve().parents[2] / "engine"
FAMILY_CODE = ("transformer", "attention", "moe", "routers", "mlp", "mtp", "families")
# The modules outside engine/model/ allowed to import a family: the one that registers them all. `[model]` is
# composed of the families' config classes, so engine/config/model.py imports engine.model.families (whose
# __init__ files are torch-free: config classes, specs, shapes) before it binds the section.
REGISTRATIONS = {"engine/config/model.py"}


def family_imports(root: Path) -> set[str]:
    """`path:line module` for every import of a family's code in the .py files under `root` outside engine/model/."""
    hits = set()
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] == "model":
            continue
        for line, module in imported_modules(ast.parse(path.read_text(), str(path))):
            parts = module.split(".")
            if parts[:2] == ["engine", "model"] and len(parts) > 2 and parts[2] in FAMILY_CODE:
                hits.add(f"engine/{relative}:{line} {module}")
    return hits


def test_no_room_outside_engine_model_imports_a_familys_code():
    hits = family_imports(ENGINE)
    assert {hit.split(":")[0] for hit in hits} <= REGISTRATIONS, "\n".join(sorted(hits))


def test_the_scan_finds_module_level_lazy_and_importlib_imports(tmp_path):
    """The scan itself: each way of importing the transformer is found, and the contract's own modules are not."""
    room = tmp_path / "parallel"
    room.mkdir()
    (room / "eager.py").write_text("from engine.model.transformer import Transformer\n")
    (room / "lazy.py").write_text("def f():\n    from engine.model import moe\n    return moe\n")
    (room / "named.py").write_text("import importlib\nimportlib.import_module('engine.model.families.gpt2.model')\n")
    (room / "plain.py").write_text("import engine.model.attention\n")
    (room / "allowed.py").write_text("from engine.model.spec import spec_for\nfrom engine.model import build_model\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "inside.py").write_text("from engine.model.transformer import Transformer\n")
    files = {hit.split(":")[0] for hit in family_imports(tmp_path)}
    assert files == {f"engine/parallel/{name}.py" for name in ("eager", "lazy", "named", "plain")}
