"""One table of exit statuses (rocktune/exits.py): the docs list the same statuses, and the processes return no
bare numbers of their own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rocktune import exits

ROOT = Path(__file__).parent.parent
PROCESSES = ["process/supervisor.py", "process/worker.py", "process/launch.py", "cli.py"]


def test_the_docs_table_lists_exactly_the_statuses_of_the_code():
    text = (ROOT / "docs" / "reliability.md").read_text()
    section = text.split("## Exit statuses of `rocktune train`", 1)[1].split("\n## ", 1)[0]
    documented = {int(m) for m in re.findall(r"(?m)^\| (\d+) \|", section)}
    assert documented == set(exits.MEANING)


def test_every_status_has_a_meaning_and_the_final_ones_are_statuses():
    names = {k: v for k, v in vars(exits).items() if k.isupper() and isinstance(v, int)}
    assert set(names.values()) == set(exits.MEANING)
    assert set(exits.FINAL) <= set(exits.MEANING)


def test_processes_return_statuses_by_name():
    """``return 2`` in a process would be a second table; only 0 (success in small helpers) is left alone."""
    bare = []
    for rel in PROCESSES:
        tree = ast.parse((ROOT / "src" / "rocktune" / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, int) and not isinstance(node.value.value, bool) and \
                    node.value.value in set(exits.MEANING) - {0}:
                bare.append(f"{rel}:{node.lineno} returns {node.value.value}")
    assert not bare, bare
