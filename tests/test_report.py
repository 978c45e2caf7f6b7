"""rocktune report: a demo-like run, a resumed run, a run with incidents, several runs; the page in a real browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess

import pytest

from rocktune.cli import main
from rocktune.config import config_from_dict
from rocktune.report.run_report import write_report
from rocktune.report.rundata import load_run
from tests.conftest import tiny_run_config, write_jsonl
from rocktune.train.request import RunOptions

pytest.importorskip("matplotlib", reason="the report extra (matplotlib) is not installed")
PNG = b"\x89PNG\r\n\x1a\n"


def _config(model_dir, tmp, out, **training):
    from rocktune.demo.task import make_task

    tr, ev = make_task(n_train=64, n_eval=8, seed=1)
    t = dict(max_steps=6, micro_batch_size=4, grad_accum=1, eval_every=3, sample_count=2, sample_max_new_tokens=3)
    t.update(training)
    cfg = tiny_run_config(model_dir, write_jsonl(tmp / "train.jsonl", tr), write_jsonl(tmp / "eval.jsonl", ev), out,
                          **t)
    cfg["reliability"] = {"save_every": 3}
    return cfg


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    from rocktune.tasks import train

    tmp = tmp_path_factory.mktemp("report")
    return train(config_from_dict(_config(tiny_model_dir, tmp, tmp / "run")), quiet=True)


def _images(html: str) -> list[str]:
    return re.findall(r'<img class="plot" alt="([^"]+)" src="data:image/png;base64,', html)


def test_report_of_a_run(run, capsys):
    assert main(["report", str(run.run_dir)]) == 0
    out = run.run_dir / "report.html"
    assert capsys.readouterr().out.strip() == f"report: {out}"
    html = out.read_text()
    # CPU: no device memory; the process's RSS over the steps
    assert _images(html) == ["Train and eval loss", "Learning rate", "Gradient norm", "Throughput",
                             "Memory over the run"]
    steps = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps and all(r["rss_bytes"] > 2**20 for r in steps)  # what that plot draws, measured at every step
    for name in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert (run.run_dir / "report_plots" / f"{name}.png").read_bytes().startswith(PNG)
    # self-contained: nothing is fetched, nothing runs
    assert not re.search(r'(src|href)="(?!data:)', html) and "<script" not in html
    assert f"<td>final train loss</td><td>{run.losses[-1]:.4f}</td>" in html
    assert f"{run.eval_loss_before:.4f} → {run.eval_loss_after:.4f}" in html
    assert "<td>checkpoints</td><td>3, 6</td>" in html
    assert "step 0</th><th>step 6</th>" in html  # samples before / after
    assert "None: no restart, no skipped update, no OOM split." in html
    assert "lora:" in html and "max_steps: 6" in html  # the resolved config
    assert "<td>train examples</td><td class=\"num\">64</td>" in html  # data statistics from run_info.json


def test_resumed_run_reports_one_series_and_the_same_losses(run, tiny_model_dir, tmp_path):
    from rocktune.train.faults import Faults
    from rocktune.tasks import train

    class InterruptAfter4(Faults):
        def after_update(self, step):  # as Ctrl-C would: the loop checkpoints step 4 and returns
            if step == 4:
                os.kill(os.getpid(), signal.SIGINT)

    cfg = config_from_dict(_config(tiny_model_dir, tmp_path, tmp_path / "run"))
    assert train(cfg, quiet=True, faults=InterruptAfter4({})).interrupted
    resumed = train(cfg, RunOptions(resume=True), quiet=True)
    data = load_run(resumed.run_dir)
    steps, losses = data.series("loss")
    assert steps == [1, 2, 3, 4, 5, 6]
    assert losses == pytest.approx(run.losses, abs=1e-6)  # sampling at eval points leaves resume exact
    assert data.sample_steps() == [0, 3, 6] and len(data.samples) == 3 * 2
    html = write_report([data]).read_text()
    assert f"{run.losses[-1]:.4f}" in html and len(_images(html)) == 5


def test_run_with_incidents(run, tmp_path):
    crashed = tmp_path / "crashed"
    shutil.copytree(run.run_dir, crashed)
    rows = [json.loads(x) for x in (crashed / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if "loss" in r and r["step"] == 2:
            r["loss"] = float("nan")  # a skipped update
        if "loss" in r and r["step"] >= 3:
            r["pieces"] = 2  # micro-batches split after an OOM from step 3 on
        if "loss" in r:
            r["peak_mem_bytes"] = 2**29 + r["step"] * 2**20  # as a GPU run logs it
    write_jsonl(crashed / "metrics.jsonl", rows)
    info = json.loads((crashed / "run_info.json").read_text())
    (crashed / "run_info.json").write_text(json.dumps({**info, "predicted_peak_bytes": 3 * 2**28}))
    write_jsonl(crashed / "incidents.jsonl", [{"time": 0, "cause": "signal SIGKILL", "last_logged_step": 5,
                                               "restart": 1, "max_restarts": 3}])
    data = load_run(crashed)
    assert (data.skipped_steps(), data.oom_splits(), data.incident_steps()) == ([2], [(3, 2)], [(5, "signal SIGKILL")])
    html = write_report([data]).read_text()
    assert "<td>restart after crash</td><td>signal SIGKILL; restart 1/3</td>" in html
    assert "<td>update skipped</td>" in html and "micro-batches split in 2" in html
    assert "<td>restarts / skipped / OOM splits</td><td>1 / 1 / 1</td>" in html
    assert "<td>peak memory (measured / planned)</td><td>0.51 / 0.75 GiB</td>" in html
    assert _images(html)[-2:] == ["Device memory", "Memory over the run"]


def test_several_runs_overlay_and_show_config_differences(run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(run.run_dir, other)
    (other / "config.yaml").write_text((other / "config.yaml").read_text().replace("lr: 0.003", "lr: 0.001"))
    out = tmp_path / "cmp" / "compare.html"
    assert main(["report", str(run.run_dir), str(other), "--out", str(out)]) == 0
    html = out.read_text()
    assert "<td>training.lr</td><td>0.003</td><td>0.001</td>" in html
    assert len(_images(html)) == 5 and (tmp_path / "cmp" / "compare_plots" / "loss.png").is_file()


def test_not_a_run_dir(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def _browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _load_in_browser(browser: str, page, shot) -> tuple[str, str]:
    """Load ``page`` headless; return (DOM after load, browser log). A copy gets a probe that counts the images the
    browser decoded; the page itself has no script."""
    probe = page.with_name("probe-" + page.name)
    probe.write_text(page.read_text().replace("</body>", "<script>addEventListener('load', () => document.body."
                     "setAttribute('data-loaded', [...document.images].filter(i => i.complete && i.naturalWidth > 0)"
                     ".length + '/' + document.images.length));</script></body>"))
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
            "--virtual-time-budget=5000"]
    dom = subprocess.run(args + ["--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    subprocess.run(args + ["--window-size=1200,2400", f"--screenshot={shot}", page.as_uri()], capture_output=True,
                   timeout=120)
    return dom.stdout, dom.stderr


@pytest.mark.skipif(_browser() is None, reason="no headless browser: apt-get install chromium (see README)")
def test_report_in_a_real_browser(run, tmp_path):
    page = write_report([load_run(run.run_dir)], tmp_path / "report.html")
    dom, log = _load_in_browser(_browser(), page, tmp_path / "shot.png")
    assert 'data-loaded="5/5"' in dom, dom[-500:]
    assert [line for line in log.splitlines() if ":CONSOLE" in line] == []
    assert (tmp_path / "shot.png").read_bytes().startswith(PNG)
    # the check can fail: a page with a script error and a broken image is caught
    bad = tmp_path / "bad.html"
    bad.write_text(page.read_text().replace("</body>", "<script>notDefined()</script></body>")
                   .replace("data:image/png;base64,iVBOR", "data:image/png;base64,XXXXX", 1))
    dom, log = _load_in_browser(_browser(), bad, tmp_path / "bad.png")
    assert 'data-loaded="4/5"' in dom and "notDefined is not defined" in log
