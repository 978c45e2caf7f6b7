"""The README's family table and docs/families.md are what benchmarks/family_matrix.py renders from the recorded
results (docs/families.json), and those results cover every cell of tests/test_families.py."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "family_matrix", Path(__file__).parents[1] / "benchmarks" / "family_matrix.py")
fm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fm)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_families" name="test_train[llama3]" time="1.0"/>
<testcase classname="tests.test_families" name="test_gguf[llama3]" time="1.0">
  <properties><property name="cell" value="refused: GGUF export does not know the x architecture"/></properties>
</testcase>
<testcase classname="tests.test_families" name="test_llama_cpp[llama3]" time="0.0">
  <skipped type="pytest.skip" message="not run here (llama-cpp-python not installed)">tests/x.py:1: skip</skipped>
</testcase>
<testcase classname="tests.test_families" name="test_merged[llama3]" time="1.0">
  <failure message="AssertionError: logits differ&#10;more">trace</failure>
</testcase>
</testsuite></testsuites>"""


def recorded() -> dict:
    return json.loads(fm.RESULTS.read_text(encoding="utf-8"))


def test_junit_outcomes_reasons_and_refusals():
    results = fm.parse_junit(JUNIT)
    assert results["test_train[llama3]"] == {"outcome": "passed"}
    assert results["test_gguf[llama3]"]["cell"].startswith("refused")
    assert results["test_llama_cpp[llama3]"] == {"outcome": "skipped",
                                                 "reason": "not run here (llama-cpp-python not installed)"}
    assert results["test_merged[llama3]"] == {"outcome": "failed", "reason": "AssertionError: logits differ"}
    table = fm.render_table(results)
    row = next(line for line in table.splitlines() if line.startswith("| llama3 |"))
    assert "FAILS (" in row and "refused (" in row and "not run (" in row and "| yes |" in row
    assert re.search(r"^- \(\d\) refused: GGUF export does not know the x architecture$", table, re.M)


def test_recorded_results_cover_every_cell():
    from tests.family_fixtures import FAMILIES

    want = {f"{test}[{f.name}]" for _, test in fm.COLUMNS for f in FAMILIES}
    assert want <= set(recorded())


def test_readme_and_doc_match_the_recorded_results():
    results = recorded()
    readme = fm.README.read_text(encoding="utf-8")
    assert fm.splice(readme, fm.render_table(results)) == readme
    assert fm.DOC.read_text(encoding="utf-8") == fm.render_doc(results)
    assert not [k for k, v in results.items() if v["outcome"] == "failed"]
