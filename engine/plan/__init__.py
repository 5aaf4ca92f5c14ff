"""The planning room (torch-free): what a config will do on a world size, resolved once per command: its checks
across sections (`checks.py`), the run's length and batch in a recipe's terms (`length.py`, `length_rules.py`),
the resolved job (`job.py`), what validate-config and train show of its size and cost (`summary.py`), and
docs/presets.md's table (`presets_table.py`)."""

from engine.plan.checks import check_config, config_warnings
from engine.plan.job import ResolvedJob, resolve

__all__ = ["ResolvedJob", "check_config", "config_warnings", "resolve"]
