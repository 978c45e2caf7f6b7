"""Issue 52, item 2: a task is a plug-in. A toy task written into a temporary folder (its own module, its own config
section) plus ONE row of task_registry.TASKS, and nothing else changed, is picked up by the config, the CLI's
``--task`` choices, ``data preview``, ``plan``, ``demo``, ``train``, resume, ``report`` and ``export``.

What a plug-in must refresh after adding its row, and why:

- ``config.RunConfig``: the config model is composed from the registry once, at import (``config.compose()``),
  because pydantic needs a class; a new row's sections and its ``task:`` value exist only in a model composed after
  it: ``config.RunConfig = config.compose()``. config.py's own functions (load_config, config_from_dict,
  inapplicable, the error paths) read the module's ``RunConfig`` when called, so that one assignment is enough.
- Nothing else: task_registry's derived tuples (NAMES, TEXT, VISION, DIFFUSION) are computed from TASKS at each
  access, the CLI builds its ``--task`` choices from TASKS / ``demos()`` when the parser is built, and every hook is
  reached through ``task_registry.load`` when it runs.
- A supervised child or torchrun's workers are new processes: they see only the rows of task_registry.py itself
  (this test trains with ``--no-supervise``). A shipped task is a row in that file.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

import pytest
import yaml

from tests.conftest import tiny_run_config
from rocktune import config, task_registry
from rocktune.cli import build_parser, main
from rocktune.errors import UserError
from rocktune.task_registry import TaskSpec

TOY_MODULE = '''
"""A toy task: the SFT task with its own section, whose run writes toy.json beside its adapter."""
import json

from pydantic import BaseModel, ConfigDict, Field

from rocktune.task_registry import ReportHooks
from rocktune.tasks.lm.task import LMTask

CALLS = []


class ToyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    note: str = Field("plain", description="what toy.json says")
    loss_scale: float = Field(1.0, gt=0, description="unused by the engine: only recorded")


class ToyTask(LMTask):
    kind = "toy"

    def final_files(self, run_dir):
        def write():
            (run_dir / "toy.json").write_text(json.dumps({"note": self.cfg.toy.note,
                                                          "loss_scale": self.cfg.toy.loss_scale}))
        return [("toy.json", write), *super().final_files(run_dir)]

    def outputs(self, run_dir):
        return [f"toy: {run_dir / 'toy.json'}"]


def preview(cfg, n_show, as_json, html):
    CALLS.append(("preview", cfg.toy.note))
    from rocktune.report.preview_view import run_config_preview

    return run_config_preview(cfg, n_show, as_json, html)


def plan(args):
    CALLS.append(("plan", args.model))
    print(json.dumps({"toy_plan": args.model}))
    return 0


def demo(args):
    CALLS.append(("demo", args.steps))
    return 0


def card(base, run_dir, data):
    from rocktune.train.model_card import load_lm

    return "Trained by the toy task.\\n\\n" + load_lm(base, run_dir)


def toy_plots(runs):
    from rocktune.report.plots import figure, png

    fig, ax = figure("the toy's own plot", "step")
    ax.plot([1, 2], [1, 2])
    return {"toy_steps": ("Toy steps", png(fig))}


def toy_summary(run):
    return {"toy note": run.config["toy"]["note"]}


REPORT = ReportHooks(loss_label="toy loss", no_samples="<h2>Samples</h2><p>The toy logs no samples: {run}</p>",
                     plots="toytask:toy_plots", summary="toytask:toy_summary")
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy module on sys.path, its one registry row, and the config model recomposed (the docstring's list)."""
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "toytask.py").write_text(textwrap.dedent(TOY_MODULE), encoding="utf-8")
    monkeypatch.syspath_prepend(str(plugin))
    monkeypatch.delitem(sys.modules, "toytask", raising=False)
    monkeypatch.setitem(task_registry.TASKS, "toy", TaskSpec(
        "toy", "the SFT task, writing toy.json", frozenset({"lm", "sft", "toy"}), "toytask:ToyTask",
        "rocktune.tasks.causal.launch", sections=("toy=toytask:ToyConfig",), preview="toytask:preview",
        plan="toytask:plan", demo="toytask:demo", report="toytask:REPORT", card="toytask:card"))
    monkeypatch.setattr(config, "RunConfig", config.compose())
    import toytask

    toytask.CALLS.clear()
    return toytask


def _task_choices(command: list[str]) -> tuple:
    parser = build_parser()
    for word in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return tuple(next(a for a in parser._actions if "--task" in a.option_strings).choices)


def test_the_registry_and_config_take_the_toy_row(toy, tiny_model_dir, task_files, tmp_path):
    assert "toy" in task_registry.NAMES and "toy" in task_registry.TEXT and "toy" not in task_registry.VISION
    cfg = tiny_run_config(tiny_model_dir, *task_files, tmp_path / "run")
    run = config.config_from_dict({**cfg, "task": "toy", "toy": {"note": "hi", "loss_scale": 2}})
    assert run.toy.note == "hi" and run.toy.loss_scale == 2 and run.spec.builder == "toytask:ToyTask"
    config.refuse_inapplicable(run)  # the LM's own keys apply to the toy (its tags include lm)
    with pytest.raises(UserError, match="unknown key 'toy.colour'; allowed here: note, loss_scale"):
        config.config_from_dict({**cfg, "task": "toy", "toy": {"colour": "red"}})
    lm = config.config_from_dict({**cfg, "task": "lm", "toy": {"note": "hi"}})
    with pytest.raises(UserError, match=r"toy\.note=hi: only for task=toy"):
        config.refuse_inapplicable(lm)
    assert "toy:" in config.dump_config(run) and "note: hi" in config.dump_config(run)


def test_the_cli_offers_the_toy_and_runs_its_hooks(toy, tiny_model_dir, task_files, tmp_path, capsys):
    assert "toy" in _task_choices(["plan"]) and "toy" in _task_choices(["demo"])
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "image-lora,toy}" in capsys.readouterr().out
    assert main(["plan", "Qwen2.5-0.5B", "--vram", "8GiB", "--task", "toy"]) == 0
    assert json.loads(capsys.readouterr().out) == {"toy_plan": "Qwen2.5-0.5B"}
    assert main(["demo", "--task", "toy", "--steps", "3"]) == 0
    cfg = {**tiny_run_config(tiny_model_dir, *task_files, tmp_path / "run"), "task": "toy", "toy": {"note": "pv"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["data", "preview", "-c", str(tmp_path / "c.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_records"] == 256
    assert toy.CALLS == [("plan", "Qwen2.5-0.5B"), ("demo", 3), ("preview", "pv")]


def test_the_toy_trains_resumes_reports_and_exports(toy, tiny_model_dir, task_files, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = {**tiny_run_config(tiny_model_dir, *task_files, run_dir, max_steps=4), "task": "toy",
           "toy": {"note": "from the toy", "loss_scale": 0.5}}
    cfg["reliability"] = {"save_every": 2}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "-c", str(tmp_path / "c.yaml"), "--no-supervise"]) == 0
    err = capsys.readouterr().err
    assert f"toy: {run_dir / 'toy.json'}" in err  # the toy's summary lines (its outputs hook)
    assert json.loads((run_dir / "toy.json").read_text()) == {"note": "from the toy", "loss_scale": 0.5}
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["task"] == "toy" and saved["toy"]["note"] == "from the toy"
    assert "Trained by the toy task." in (run_dir / "adapter" / "README.md").read_text()

    (run_dir / "toy.json").unlink()
    assert main(["train", "-c", str(tmp_path / "c.yaml"), "--no-supervise", "--resume-force",
                 "training.max_steps=6"]) == 0
    assert "resumed from step-0000004 (step 4 of 6)" in capsys.readouterr().err  # continued, not redone
    steps = [json.loads(line).get("step") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 6
    assert (run_dir / "toy.json").exists()  # the resumed run ends through the toy's hooks too

    assert main(["report", str(run_dir)]) == 0
    html = (run_dir / "report.html").read_text()
    assert "The toy logs no samples" in html  # the toy's ReportHooks (and its loss label, drawn into the plot)
    assert "toy note" in html and "from the toy" in html  # its summary line
    assert "<h2>Toy steps</h2>" in html and (run_dir / "report_plots" / "toy_steps.png").exists()  # its own plot
    from rocktune.report import plots

    assert plots.report_hooks("toy") is toy.REPORT

    assert main(["export", str(run_dir), "--to", "merged", "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").exists()
