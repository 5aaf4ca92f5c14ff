"""`forge validate-config` prints byte for byte what was recorded in tests/golden/validate/ (tests/helpers/validate_golden.py
lists the cases: every preset, every seed-framework preset, and configs that trip each cross-section rule), so
moving the rules between modules changes neither which errors and warnings come out, nor their order or text.

A change meant to alter the output re-records: `PYTHONPATH=$PWD python -m tests.helpers.validate_golden`."""

from __future__ import annotations

import pytest

from tests.helpers.validate_golden import CASES, GOLDEN, RULE_CASES, SUBPROCESS_CASES, output, run_subprocess

RERECORD = "if the change is meant: PYTHONPATH=$PWD python -m tests.helpers.validate_golden, and review the golden diff"


def test_every_case_has_its_golden_file_and_nothing_else():
    recorded = {path.stem for path in GOLDEN.glob("*.txt")}
    assert len(CASES) >= 120 and recorded == set(CASES), recorded ^ set(CASES)


def test_the_rule_cases_cover_errors_warnings_and_valid_configs():
    """The cases prove what they claim: some exit 2 with several errors, some pass with warnings."""
    texts = {name: (GOLDEN / f"{name}.txt").read_text(encoding="utf-8") for name in RULE_CASES}
    failing = [name for name, text in texts.items() if "exit code: 2" in text]
    warned = [name for name, text in texts.items() if "\nwarning: " in text]
    assert len(failing) >= 80 and len(warned) == 4, (len(failing), warned)
    assert "17 configuration error(s)" in texts["many-errors-moe-layout"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_validate_config_output_is_unchanged(name):
    expected = (GOLDEN / f"{name}.txt").read_text(encoding="utf-8")
    assert output(name) == expected, f"{name}: validate-config output changed ({RERECORD})"


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_the_forge_process_prints_the_same(name):
    """The in-process runs above stand for the real command: a `forge` process prints the same bytes."""
    expected = (GOLDEN / f"{name}.txt").read_text(encoding="utf-8")
    assert output(name, run=run_subprocess) == expected
