"""Reading a job: TOML preset < command-line overrides, validated into a `JobConfig`.

Overrides are `--section.key=value` (or `section.key=value`); the value is parsed as a TOML literal
(`[0.9,0.95]`, `false`, `3e-4`, `"text"`). For a text field, and wherever the value is not a valid
literal, it is taken as the text itself, so paths and names need no quoting (`--data.dataset_path=123`
stays "123", `--metrics.wandb_run_name=2024-01-01` stays a name, not a date).

A preset may start with `include = ["base.toml", …]`: those files are read first (paths relative to the
including file, recursively), in order, and then the including file itself; a later one overrides an earlier
one, tables merge key by key, and anything else (a value, an array, an array of tables) replaces what was
there. `read_preset` also says which file set each field; the resolved config (`dump_toml`) has no include.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomlkit
from pydantic import BaseModel, ValidationError
from tomlkit.exceptions import TOMLKitError

from engine.config.data import DataConfig, MixtureSource, other_spellings
from engine.config.eval import EvalConfig
from engine.config.job import JobConfig
from engine.config.train import ALTERNATIVES
from engine.errors import ConfigError, ConfigIssue


def load_job_config(preset: str | Path | None, overrides: list[str] = ()) -> JobConfig:
    """Defaults < preset < overrides, validated per field and per section (not yet against a world size)."""
    raw = read_preset(preset).raw if preset is not None else {}
    source = str(preset) if preset is not None else "defaults"
    issues: list[ConfigIssue] = []
    parsed: list[tuple[list[str], Any]] = []
    for item in overrides:
        try:
            parsed.append(parse_override(item))
        except ValueError as e:
            issues.append(ConfigIssue(item, str(e), "write overrides as --section.key=value"))
    drop_replaced(raw, [path for path, _ in parsed])
    for path, value in parsed:
        set_dotted(raw, path, value, issues)
    if issues:
        raise ConfigError(issues, source)
    one_spelling(raw, source)  # an override's [[data.datasets]] entries
    return build_job_config(raw, source)


SOURCE_SECTIONS: dict[str, type[BaseModel]] = {"data": DataConfig, "eval": EvalConfig}


def one_spelling(raw: dict[str, Any], origin: str) -> None:
    """Read the other spelling of each source key (engine/config/data.py: SPELLINGS) of `[data]`, `[eval]` and
    the `[[data.datasets]]` entries as the table's own key; both spellings of one key in a table is an error."""
    issues: list[ConfigIssue] = []
    for section, model in SOURCE_SECTIONS.items():
        table = raw.get(section)
        if not isinstance(table, dict):
            continue
        respell(table, section, model, issues)
        entries = table.get("datasets") if section == "data" else None
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            if isinstance(entry, dict):
                respell(entry, f"data.datasets.{i}", MixtureSource, issues)
    if issues:
        raise ConfigError(issues, origin)


def respell(table: dict[str, Any], where: str, model: type[BaseModel], issues: list[ConfigIssue]) -> None:
    for other, own in other_spellings(model.model_fields).items():
        if other not in table:
            continue
        if own in table:
            issues.append(
                ConfigIssue(
                    f"{where}.{other}",
                    f"and {where}.{own} are two spellings of one key, and both are set",
                    f"keep one of them ({other} = {table[other]!r} or {own} = {table[own]!r})",
                )
            )
        else:
            table[own] = table.pop(other)


def own_key(section: str, key: str) -> str:
    """The field an override's key means in its section: itself, or the section's own spelling of it."""
    model = SOURCE_SECTIONS.get(section)
    return other_spellings(model.model_fields).get(key, key) if model is not None else key


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


INCLUDE = "include"


@dataclass
class Preset:
    """A preset with its includes resolved: the merged tables, and the file that set each dotted field."""

    raw: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def merge(self, table: dict[str, Any], origin: str) -> None:
        merge_tables(self.raw, self.sources, table, origin, "")


def read_preset(path: str | Path, chain: tuple[Path, ...] = ()) -> Preset:
    """`path` after its includes (and theirs): a cycle or a missing included file names the whole chain."""
    path = Path(path)
    chain = (*chain, path)
    if path.resolve() in {link.resolve() for link in chain[:-1]}:
        raise include_error(path, "include cycle", chain, "remove one of the includes that close the loop")
    if len(chain) > 1 and not path.is_file():
        raise include_error(path, "included file not found", chain, "include paths are relative to the file")
    own = read_toml(path)
    one_spelling(own, str(path))
    includes = own.pop(INCLUDE, [])
    if not isinstance(includes, list) or not all(isinstance(entry, str) for entry in includes):
        issue = ConfigIssue(INCLUDE, f"must be a list of file paths, got {includes!r}", 'include = ["base.toml"]')
        raise ConfigError([issue], str(path))
    preset = Preset()
    for entry in includes:
        included = read_preset(path.parent / entry, chain)
        preset.merge(included.raw, "")
        preset.sources.update(included.sources)
    own_fields = [[section, key] for section, table in own.items() if isinstance(table, dict) for key in table]
    drop_replaced(preset.raw, own_fields, preset.sources)
    preset.merge(own, str(path))
    return preset


def drop_replaced(raw: dict[str, Any], given: list[list[str]], sources: dict[str, str] | None = None) -> None:
    """A later layer (an override, or a file over its includes) that says how long the run is, or how big its
    batch, in one way replaces what earlier layers said in another (`ALTERNATIVES`): `--train.max_epochs=2` on a
    preset with max_steps trains for two epochs. Within one layer, both are a config error."""
    for fields in ALTERNATIVES.values():
        named = {key for section, key in (p for p in given if len(p) == 2) if f"{section}.{key}" in fields}
        if not named:
            continue
        for field_path in fields:
            section, key = field_path.split(".")
            if key not in named and isinstance(raw.get(section), dict):
                raw[section].pop(key, None)
                if sources is not None:
                    sources.pop(field_path, None)


def include_error(path: Path, problem: str, chain: tuple[Path, ...], hint: str) -> ConfigError:
    links = " → ".join(str(link) for link in chain)
    return ConfigError([ConfigIssue(INCLUDE, f"{problem}: {links}", hint)], str(chain[0]))


def merge_tables(
    into: dict[str, Any], sources: dict[str, str], table: dict[str, Any], origin: str, prefix: str
) -> None:
    """Merge `table` over `into`: tables key by key, anything else replaces; record `origin` per field set
    (an empty origin keeps the sources the caller copies in)."""
    for key, value in table.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            if not isinstance(into.get(key), dict):
                into[key] = {}
            merge_tables(into[key], sources, value, origin, f"{path}.")
            continue
        into[key] = value
        for stale in [name for name in sources if name.startswith(f"{path}.")]:
            del sources[stale]
        if origin:
            sources[path] = origin


def field_sources(cfg: JobConfig, preset: str | Path | None, overrides: list[str] = ()) -> dict[str, str]:
    """Where each field of `cfg` got its value: the preset file that set it (one of its includes, or the preset
    itself), "override" for a command-line override, or "default"."""
    given = read_preset(preset).sources if preset is not None else {}
    given.update({".".join(parse_override(item)[0]): "override" for item in overrides})
    return {
        name: source_of(name, given) for name in (f"{s}.{k}" for s, fields in cfg.model_dump().items() for k in fields)
    }


def source_of(name: str, given: dict[str, str]) -> str:
    """The file that set field `name`, or one of its keys when the field is a table (the last one listed)."""
    inner = [origin for key, origin in given.items() if key.startswith(f"{name}.")]
    return given.get(name) or (inner[-1] if inner else "default")


def parse_override(item: str) -> tuple[list[str], Any]:
    body = item[2:] if item.startswith("--") else item
    if "=" not in body:
        raise ValueError(f"override {item!r} has no '='")
    key, text = body.split("=", 1)
    path = key.strip().split(".")
    if len(path) != 2 or not all(path):
        raise ValueError(f"override key {key!r} must be section.key")
    path[1] = own_key(*path)
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
        hint = f"did you mean {'.'.join([*loc[:-1], close[0]])!r}?" if close else f"valid keys: {', '.join(valid)}"
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
