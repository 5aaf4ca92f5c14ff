"""What the rooms' rules (engine/*/rules.py) share: which fields a config set away from their defaults, and an
issue for each such field that the chosen component does not read, so that no setting is silently ignored."""

from __future__ import annotations

from collections.abc import Iterable

from engine.config.base import Section
from engine.errors import ConfigIssue


def changed_fields(values: Section, fields: Iterable[str]) -> list[str]:
    """Those of `fields` that differ from their defaults: what the config set, which the rules refuse where
    nothing would read it."""
    defaults = {name: info.get_default(call_default_factory=True) for name, info in type(values).model_fields.items()}
    return [field for field in fields if getattr(values, field) != defaults[field]]


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
