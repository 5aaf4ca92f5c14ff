"""docs/architecture.md's import table against the code: every import under engine/ (module-level, lazy, and
`importlib.import_module("literal")`) from one room into another must be an arrow the table lists, and every
arrow it lists must be used by some file, so the table cannot drift either way.

The table's grammar: `room → entries`, continued on indented lines; an entry is a room (`data`) or a module of
one (`train.length`), matching every import of it or below it; `X.py alone: entries` allows those for the room's
file X.py only; `*/rules.py` is what every room's rules module (`rules.py`, `length_rules.py`, …; config's
excepted) may import besides its room's row; text in parentheses is commentary. The leaves the paragraph above
the table names (errors, durable, …) may be imported by every room, and imports inside a room are free."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO
from tests.helpers.imports import import_targets

ENGINE = REPO / "engine"
LEAVES = {"errors", "durable", "safe_paths", "run_files", "precision"}
RULES_ROW = "*/rules.py"


@dataclass(frozen=True)
class Arrow:
    row: str  # the table's row: a room, or */rules.py
    entry: str  # a room or room.module, as written
    only: str | None  # the file name it is limited to (`X.py alone:`), or None


def table_of(text: str) -> list[Arrow]:
    block = text.split("Arrows point at", 1)[1].split("```", 2)[1]
    rows: dict[str, str] = {}
    current = ""
    for line in block.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            rows[current] += " " + line.strip()
        else:
            current, rest = (part.strip() for part in line.split("→", 1))
            rows[current] = rest
    arrows = []
    for row, rest in rows.items():
        if row == "forgecli":
            continue  # any room: outside engine/
        for segment in re.sub(r"\([^()]*\)", "", rest).split(";"):
            head, _, entries = segment.rpartition(":")
            named = re.search(r"(\w+\.py) alone", head)
            only = named.group(1) if named else None
            arrows += [Arrow(row, e.strip(), only) for e in re.split(r",| and ", entries) if e.strip()]
    return arrows


def room_of(relative: Path) -> str:
    return relative.parts[0].removesuffix(".py")


def is_rules_module(relative: Path) -> bool:
    return relative.name.endswith("rules.py") and room_of(relative) != "config"


def check(engine: Path, arrows: list[Arrow]) -> tuple[list[str], list[Arrow]]:
    """(imports no arrow allows, as `engine/path:line module`; arrows no import uses)."""
    unlisted, used = [], set()
    for path in sorted(engine.rglob("*.py")):
        relative = path.relative_to(engine)
        room = room_of(relative)
        rows = {room, RULES_ROW} if is_rules_module(relative) else {room}
        allowed = [a for a in arrows if a.row in rows and a.only in (None, path.name)]
        for line, module in import_targets(path.read_text(), str(path)):
            parts = module.split(".")
            if parts[0] != "engine" or len(parts) < 2 or parts[1] in LEAVES | {room}:
                continue
            matching = [a for a in allowed if parts[1 : 1 + len(a.entry.split("."))] == a.entry.split(".")]
            used.update(matching)
            if not matching:
                unlisted.append(f"engine/{relative}:{line} {module}")
    return unlisted, [a for a in arrows if a not in used]


def test_the_import_table_lists_every_arrow_and_only_those():
    arrows = table_of((REPO / "docs" / "architecture.md").read_text())
    unlisted, unused = check(ENGINE, arrows)
    assert not unlisted, "imports docs/architecture.md's table does not list:\n" + "\n".join(unlisted)
    assert not unused, f"arrows of docs/architecture.md's table no import uses: {unused}"


def test_an_arrow_added_in_the_code_or_the_table_alone_fails(tmp_path):
    """The check itself, on a small engine/: an import the table lacks is named with its file and line, an
    arrow nothing uses is named, `X.py alone:` covers that file only, and a rules module may use the rules row."""
    doc = """Arrows point at
```
parallel   → config; memory.py alone: train.length
*/rules.py → config, parallel.stages
data       → config, model
```
"""
    for name, text in {
        "parallel/memory.py": "from engine.train.length import with_derived_length\n",
        "parallel/apply.py": "def later():\n    from engine.train import length\n",
        "parallel/place.py": "import engine.config.distributed\nfrom engine.errors import UserError\n",
        "data/rules.py": "from engine.parallel.stages import stages_per_rank\nfrom engine.config import data\n",
    }.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    unlisted, unused = check(tmp_path, table_of(doc))
    assert unlisted == ["engine/parallel/apply.py:2 engine.train.length"]
    assert unused == [Arrow("data", "model", None)]
