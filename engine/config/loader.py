"""Reading a job: TOML preset < command-line overrides, validated into a `JobConfig`.

Overrides are `--section.key=value` (or `section.key=value`); the value is parsed as a TOML literal
(`[0.9,0.95]`, `false`, `3e-4`, `"text"`). For a text field, and wherever the value is not a valid
literal, it is taken as the text itself, so paths and names need no quoting (`--data.dataset_path=123`
stays "123", `--metrics.wandb_run_name=2024-01-01` stays a name, not a date).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import tomlkit
from pydantic import BaseModel, ValidationError
from tomlkit.exceptions import TOMLKitError

from engine.config.job import JobConfig
from engine.errors import ConfigError, ConfigIssue


def load_job_config(preset: str | Path | None, overrides: list[str] = ()) -> JobConfig:
    """Defaults < preset < overrides, validated per field and per section (not yet against a world size)."""
    raw = read_toml(preset) if preset is not None else {}
    source = str(preset) if preset is not None else "defaults"
    issues: list[ConfigIssue] = []
    for item in overrides:
        try:
            path, value = parse_override(item)
        except ValueError as e:
            issues.append(ConfigIssue(item, str(e), "write overrides as --section.key=value"))
            continue
        set_dotted(raw, path, value, issues)
    if issues:
        raise ConfigError(issues, source)
    return build_job_config(raw, source)


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([ConfigIssue(str(path), "preset file not found", "check the path")], str(path))
    try:
        return tomlkit.parse(path.read_text()).unwrap()
    except (TOMLKitError, UnicodeDecodeError) as e:
        raise ConfigError(
            [ConfigIssue(str(path), f"not valid TOML: {e}", "fix the syntax at the line shown")], str(path)
        ) from None


def parse_override(item: str) -> tuple[list[str], Any]:
    body = item[2:] if item.startswith("--") else item
    if "=" not in body:
        raise ValueError(f"override {item!r} has no '='")
    key, text = body.split("=", 1)
    path = key.strip().split(".")
    if len(path) != 2 or not all(path):
        raise ValueError(f"override key {key!r} must be section.key")
    text = text.strip()
    if is_text_field(path):
        value = parse_literal(text)
        return path, value if isinstance(value, str) else text
    return path, parse_literal(text)


def parse_literal(text: str) -> Any:
    try:
        return tomlkit.parse(f"v = {text}").unwrap()["v"]
    except TOMLKitError:
        return text


def is_text_field(path: list[str]) -> bool:
    section = JobConfig.model_fields.get(path[0])
    field = section.annotation.model_fields.get(path[1]) if section else None
    return field is not None and field.annotation in (str, str | None)


def set_dotted(raw: dict[str, Any], path: list[str], value: Any, issues: list[ConfigIssue]) -> None:
    section, key = path
    table = raw.setdefault(section, {})
    if not isinstance(table, dict):
        issues.append(ConfigIssue(section, "is not a table in the preset"))
        return
    table[key] = value


def build_job_config(raw: dict[str, Any], source: str = "") -> JobConfig:
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError([issue_from_pydantic(err) for err in e.errors()], source) from None


def issue_from_pydantic(err: dict[str, Any]) -> ConfigIssue:
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc) or "(root)"
    kind = err["type"]
    if kind == "extra_forbidden":
        valid = fields_at(JobConfig, loc[:-1])
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        hint = f"did you mean {'.'.join(loc[:-1] + [close[0]])!r}?" if close else f"valid keys: {', '.join(valid)}"
        return ConfigIssue(path, "unknown key", hint)
    message = err["msg"].removeprefix("Value error, ")
    if kind in {"literal_error", "enum"}:
        return ConfigIssue(path, f"{message}, got {err.get('input')!r}")
    if "input" in err and kind != "value_error" and not isinstance(err["input"], dict):
        return ConfigIssue(path, f"{message} (got {err['input']!r})")
    return ConfigIssue(path, message)


def fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    """Field names of the sub-model at `loc` (a path of section names)."""
    for name in loc:
        info = model.model_fields.get(name)
        annotation = getattr(info, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def dump_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML, loadable by `load_job_config`. Unset (None) fields are left out."""
    data = cfg.model_dump(mode="json", exclude_none=True)
    doc = tomlkit.document()
    doc.add(tomlkit.comment("Resolved Forge config: defaults < preset < overrides. Usable as a preset."))
    for section, fields in data.items():
        table = tomlkit.table()
        for key, value in fields.items():
            table.add(key, value)
        doc.add(section, table)
    return tomlkit.dumps(doc)
