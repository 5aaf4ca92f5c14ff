"""Typed configuration: one pydantic section per TOML table, loaded with overrides, validated in two stages."""

from engine.config.job import JobConfig
from engine.config.loader import dump_toml, load_job_config

__all__ = ["JobConfig", "dump_toml", "load_job_config"]
