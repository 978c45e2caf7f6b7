"""What a new user tripped on (issue 46, item 6): the demo's time in --help and README agreeing, the preview's
trained tokens marked where colours are lost, control bytes of an untrained model shown as symbols, and the skip
reasons that pyproject and the docs give matching the tests'."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from rocktune.cli import DEMO_TIME
from rocktune.data.preview import build_preview
from rocktune.report.preview_view import CLOSE, OPEN, plain_runs, print_preview
from rocktune.tasks.causal.samples import _markdown, _short, visible
from tests.conftest import write_jsonl

ROOT = Path(__file__).resolve().parents[1]


def test_demo_help_and_readme_give_the_same_time():
    figure = re.match(r"about (\d+) s", DEMO_TIME).group(0)
    assert figure in (ROOT / "README.md").read_text(encoding="utf-8")


def test_control_bytes_are_shown_as_symbols():
    assert visible("A\x14b\nc\td\x7f\u200b") == "A␔b⏎c→d␡�"
    assert _short("x\x14[bold]") == "x␔\\[bold]"  # and rich markup in a sample is escaped, not applied
    assert "\x14" not in _markdown([{"prompt": "p", "output": "\x14\x15", "expected": "E"}])


def test_preview_marks_trained_tokens_outside_a_terminal(tmp_path, tokenizer, capsys):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "reverse abc =", "completion": " cba"}])
    pv = build_preview(str(f), "auto", tokenizer, 64, False, n_show=1)
    print_preview(pv)  # captured: not a terminal, so rich drops every colour
    out = capsys.readouterr().out
    assert f"reverse abc ={OPEN} cba<|endoftext|>{CLOSE}" in out
    assert f"{OPEN}trained{CLOSE} not trained" in out


def test_plain_runs_close_every_trained_stretch():
    runs = [["a", False, False], ["b", True, False], ["<s>", True, True], ["c", False, False], ["d", True, False]]
    assert plain_runs(runs) == f"a{OPEN}b<s>{CLOSE}c{OPEN}d{CLOSE}"


def test_pyproject_describes_the_real_model_skip_as_the_test_does():
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    [real] = [m for m in markers if m.startswith("real_model:")]
    source = (ROOT / "tests" / "test_demo_real.py").read_text()
    assert "run with -m real_model" in source and "-m real_model" in real
    assert "needs the demo-real extra" in source and "the extra is absent" in real


# (what is missing, the test file that skips without it, words of its reason, the docs' words for it)
OPTIONAL = [("Go", "test_ollama_templates.py", "apt-get install golang", "apt-get install golang"),
            ("Chromium", "test_report.py", "apt-get install chromium", "apt-get install chromium"),
            ("llama.cpp", "test_export_llama_cpp.py", "make llama-cpp builds it", "make llama-cpp builds")]


def test_every_optional_tool_a_skip_needs_is_named_in_the_docs():
    testing = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name, test_file, reason, docs in OPTIONAL:
        assert reason in (ROOT / "tests" / test_file).read_text(), test_file
        assert f"**{name}**" in testing and docs in testing, name
    assert "docs/testing.md" in readme


def test_readme_first_screen_a_ten_line_config_and_commands_that_run():
    """Item 7: the two commands, then a my.yaml a config loader accepts and the commands after it, each a real
    subcommand with real options."""
    import shlex

    import yaml

    from rocktune.cli import build_parser
    from rocktune.config import config_from_dict

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = readme[:readme.index("\n## ")]
    assert "make demo" in first and "make test" in first
    block = re.search(r"```yaml\n(.*?)```", first, re.S).group(1)
    assert len(block.strip().splitlines()) <= 10
    cfg = config_from_dict(yaml.safe_load(block))
    assert cfg.data.train_file and cfg.output.dir == "runs/my-chat"
    commands = re.findall(r"^(rocktune [^#\n]*?)\s*(?:#.*)?$", first, re.M)
    assert len(commands) == 4
    parser = build_parser()
    for line in commands:
        parser.parse_args(shlex.split(line)[1:])  # argparse exits on an unknown option or subcommand
