"""The imports of a Python file, found by reading it (nothing is imported): module-level, lazy (inside a function)
and `importlib.import_module("literal")` alike, for the tests that check which room may import which."""

from __future__ import annotations

import ast


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `tree`, nested ones included; `from engine.model import x`
    counts as both `engine.model` and `engine.model.x`, and `importlib.import_module("name")` with a literal
    name as `name`."""
    return sorted({*import_names(tree), *import_names(tree, parents=True)})


def import_targets(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, the most specific dotted name) of every import in `source`: `from a.b import c` is `a.b.c` (which
    may be a module or a name in `a.b`), `import a.b` is `a.b`, `importlib.import_module("a.b")` is `a.b`."""
    return import_names(ast.parse(source, filename))


def import_names(tree: ast.AST, parents: bool = False) -> list[tuple[int, str]]:
    """The most specific names, or with `parents` each `from X import …`'s X alone."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and not parents:
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += (
                [(node.lineno, node.module)]
                if parents
                else [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
            )
        elif (
            not parents
            and isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found
