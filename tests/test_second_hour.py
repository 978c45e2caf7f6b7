"""Issue 28, the second hour: what a new user still trips on after the demo works (each test fails without its fix)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_run_config

SRC = Path(__file__).parent.parent / "src"


@pytest.mark.skipif(sys.platform == "win32", reason="a POSIX venv layout")
def test_next_commands_work_as_printed_without_an_activated_venv(tmp_path, monkeypatch):
    from rocktune.train import summary

    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").touch()
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(summary, "_installed", lambda m: True)
    monkeypatch.setenv("PATH", "/nonexistent")
    # Not installed (a source tree on PYTHONPATH): only the module form works.
    assert summary.rocktune_command() == f"{bin_dir / 'python'} -m rocktune"
    script = bin_dir / "rocktune"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    # Installed, venv not activated: the script's path, relative to where the user stands.
    assert summary.rocktune_command() == ".venv/bin/rocktune"
    first = summary.next_commands(tmp_path / "run")[1]
    assert first.startswith(f"  .venv/bin/rocktune generate {tmp_path / 'run'} --chat")
    # Activated: the bare name.
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + "/usr/bin")
    assert summary.rocktune_command() == "rocktune"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert summary.rocktune_command() == str(script)


def _train_into_closed_pipe(cfg_file, *extra) -> int:
    """``rocktune train ... 2>&1 | head -1``: the reader takes one line and closes the pipe."""
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "rocktune", "train", "-c", str(cfg_file), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    proc.stdout.readline()
    proc.stdout.close()
    return proc.wait(timeout=600)


def test_a_closed_pipe_is_not_a_crash(tiny_model_dir, data, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_run_config(tiny_model_dir, data[0], data[1], run, max_steps=3, micro_batch_size=4, grad_accum=1)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    assert _train_into_closed_pipe(cfg_file) == 0
    assert (run / "adapter" / "adapter_model.safetensors").is_file()  # training went on to the end
    assert not (run / "incidents.jsonl").exists()
    final = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["peak_rss_bytes"] > 2**20  # a CPU run records its memory for the summary and the report
    assert _train_into_closed_pipe(cfg_file, "--resume") == 0  # a finished run's summary into a closed pipe
    assert not (run / "incidents.jsonl").exists()


def test_threads_follow_the_cgroup_quota_the_ranks_and_the_user(tmp_path):
    from rocktune.platform.threads import choose_threads, rank_environment

    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: two threads can run at once
    choice = choose_threads({}, cpus=8, cgroup=tmp_path)
    assert choice.threads == 2 and "cgroup CPU quota of 1.5" in choice.note
    assert choose_threads({}, ranks=2, cpus=8, cgroup=tmp_path).threads == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert choose_threads({"LOCAL_WORLD_SIZE": "2"}, cpus=8, cgroup=tmp_path).threads == 4
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert choose_threads({}, cpus=8, cgroup=v1).threads == 3
    kept = choose_threads({"OMP_NUM_THREADS": "6"}, cpus=1, cgroup=tmp_path)
    assert kept.threads is None and "your OMP_NUM_THREADS=6" in kept.note
    ours = rank_environment(2, {})
    assert ours["OMP_NUM_THREADS"] == ours["ROCKTUNE_OMP_NUM_THREADS"]
    assert choose_threads({**ours, "LOCAL_WORLD_SIZE": "2"}).threads == int(ours["OMP_NUM_THREADS"])  # ours, not kept
    assert rank_environment(2, {"OMP_NUM_THREADS": "3"}) == {}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="affinity masks are Linux's")
def test_a_run_limited_to_one_cpu_uses_one_thread(tiny_model_dir, data, tmp_path):
    """Under ``taskset -c 0``, a real run's context sets one torch thread and says why in its notes."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    cfg = tiny_run_config(tiny_model_dir, data[0], data[1], tmp_path / "run")
    code = ("import json, sys, torch\n"
            "from rocktune.config import config_from_dict\n"
            "from rocktune.train.context import resolve\n"
            "from rocktune.train.request import RunOptions\n"
            "ctx = resolve(config_from_dict(json.loads(sys.argv[1])), RunOptions(), 'auto', quiet=True)\n"
            "print(json.dumps([torch.get_num_threads(), ctx.notes]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(SRC)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], env=env, capture_output=True, text=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {cpu}), timeout=300)
    assert out.returncode == 0, out.stderr
    threads, notes = json.loads(out.stdout.splitlines()[-1])
    assert threads == 1
    assert any(n.startswith("torch threads: 1 (1 CPU in this process's affinity mask") for n in notes), notes


def test_doctor_says_the_thread_choice(capsys, monkeypatch):
    from rocktune.doctor.main import run_doctor

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert run_doctor(as_json=True, no_device=True, run_checks=False) == 0
    assert json.loads(capsys.readouterr().out)["threads"] == "torch threads: your OMP_NUM_THREADS=3 (kept)"


def test_options_may_follow_overrides(tmp_path, capsys):
    from rocktune import cli

    cfg = tmp_path / "x.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name_or_path": str(tmp_path)}, "data": {"train_file": str(cfg)}}))
    assert cli.main(["train", "-c", str(cfg), "lora.r=4", "--print-config", "training.lr=0.5"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["lora"]["r"], printed["training"]["lr"]) == (4, 0.5)
    args = cli.parse(cli.build_parser(), ["--debug", "train", "-c", "x.yaml", "lora.r=8", "--nproc", "2", "a.b=1"])
    assert (args.debug, args.nproc, args.overrides, args.config) == (True, 2, ["lora.r=8", "a.b=1"], "x.yaml")
    args = cli.parse(cli.build_parser(), ["data", "preview", "-c", "x.yaml", "a=1", "-n", "5", "b=2"])
    assert (args.examples, args.overrides) == (5, ["a=1", "b=2"])
    with pytest.raises(SystemExit) as exc:  # an unknown option is still refused
        cli.parse(cli.build_parser(), ["train", "-c", "x.yaml", "lora.r=8", "--bogus", "a.b=1"])
    assert exc.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_mistyped_key_gets_a_suggestion_and_a_bare_train_names_c(tmp_path, capsys):
    from rocktune import cli

    cfg = tmp_path / "x.yaml"
    cfg.write_text("training:\n  micro_batchsize: 4\n")
    assert cli.main(["train", "-c", str(cfg)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{cfg}:2: unknown key 'training.micro_batchsize'; did you mean 'micro_batch_size'?" in err
    assert cli.main(["train"]) == 2
    assert "No config file was given: pass -c FILE.yaml" in " ".join(capsys.readouterr().err.split())


def test_torchrun_ranks_get_our_thread_count(monkeypatch):
    """With OMP_NUM_THREADS set for the ranks, torchrun does not print its 4-line warning about it."""
    import torch.distributed.run as torchrun

    from rocktune.process import launch
    from rocktune.train.request import Launch, RunOptions, RunRequest

    seen = {}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("ROCKTUNE_OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what the launcher sets stays in this test
    monkeypatch.setattr(torchrun, "run", lambda args: seen.update(os.environ))
    assert launch.run_launcher(RunRequest({}, RunOptions(), Launch(nproc=2))) == 0
    assert seen["OMP_NUM_THREADS"] == seen["ROCKTUNE_OMP_NUM_THREADS"]
    assert int(seen["OMP_NUM_THREADS"]) >= 1


SMOL_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                 "{% endif %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_console_samples_show_the_users_last_turn(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rocktune.tasks.causal.samples import Sampler, SampleSettings, UserTurn

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = SMOL_TEMPLATE
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "Please send two small red mugs"}]
    ids = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    assert UserTurn(tok, "messages")(tok.decode(ids)) == "Please send two small red mugs"
    assert UserTurn(tok, "text")(tok.decode(ids)) is None  # not a chat prompt: shown whole
    said: list[str] = []

    class Log:
        def text(self, *args):
            pass

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sampler = Sampler(tmp_path / "samples.jsonl", tok, [(ids, None)], [tok.eos_token_id],
                      SampleSettings(0, [], 2, "cpu", shape="messages"))
    sampler.at(0, model, Log(), said.append)
    assert said[0].startswith("[dim]sample @ step 0:[/] Please send two small red mugs [cyan]→"), said
    row = json.loads((tmp_path / "samples.jsonl").read_text())
    assert row["user"] == "Please send two small red mugs" and row["prompt"].startswith("<|im_start|>system")


def test_two_eval_points_are_markers_not_a_trend():
    pytest.importorskip("matplotlib")
    from rocktune.report import plots

    fig, ax = plots.figure("loss", "x")
    plots.eval_points(ax, [(0, 6.0), (800, 0.3)], "C0", "eval")
    plots.eval_points(ax, [(0, 6.0), (400, 1.0), (800, 0.3)], "C1", "eval")
    assert [line.get_linestyle() for line in ax.lines] == ["None", "--"]
    assert all(line.get_marker() == "o" for line in ax.lines)


def _lm_run_dir(path):
    rows = [{"step": 0, "eval_loss": 6.0},
            {"step": 1, "loss": 5.0, "tokens": 10, "step_s": 0.1, "peak_mem_bytes": None},
            {"step": 2, "eval_loss": 1.0, "peak_rss_bytes": int(0.48 * 2**30)}]
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text(yaml.safe_dump({"task": "lm", "lora": {"r": 8}, "diffusion": {"expert": "x"}}))
    (path / "run_info.json").write_text(json.dumps({"data": {"shape": "messages", "n_records": 200,
                                                             "cache_hit": True}}))
    prompt = ("<|im_start|>system\nYou are SmolLM<|im_end|>\n<|im_start|>user\nTwo mugs<|im_end|>\n"
              "<|im_start|>assistant\n")
    (path / "samples.jsonl").write_text("".join(json.dumps({"step": s, "prompt": prompt, "user": "Two mugs",
                                                            "output": "{}", "expected": "{}"}) + "\n" for s in (0, 2)))
    return path


def test_the_report_tells_no_small_untruths(tmp_path):
    from rocktune.report.rundata import load_run
    from rocktune.report.run_report import report_html

    page = report_html([load_run(_lm_run_dir(tmp_path / "run"))], {})
    assert "0.48 GiB process RSS (CPU run)" in page and "not measured" not in page
    assert "records read" in page and "n_records" not in page and "reused (hit)" in page
    assert "lora:" in page and "diffusion:" not in page  # an LM run's config has no diffusion section
    samples = page[page.index("<h2>Samples"):page.index("<h2>Data")]
    assert "Two mugs" in samples and "im_start" not in samples and "You are SmolLM" not in samples


def test_a_finished_runs_summary_shows_its_own_memory_not_this_process(tmp_path):
    from rocktune.train import summary

    run = _lm_run_dir(tmp_path / "run")
    out: list[str] = []
    summary.log_summary(run, out.append, None)  # --resume on a finished run: no wall time, not measured now
    assert "  peak memory     0.48 GiB process RSS (CPU run)" in out
    (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "eval_loss": 1.0}) + "\n")
    out.clear()
    summary.log_summary(run, out.append, None)
    assert "  peak memory     not recorded for this run" in out


def test_demo_real_table_shows_answers_without_the_end_of_turn_token(capsys):
    from rocktune.demo.real import _print_table

    fig = {"eval_loss_before": 2.0, "eval_loss_after": 0.1, "exact_match_before": 0.0, "exact_match": 1.0,
           "train_seconds": 1.0, "steps": 2, "device": "cpu", "total_seconds": 2.0, "report": "r/report.html",
           "samples": [{"prompt": "Two mugs", "before": "Sorry<|im_end|>", "after": '{"qty": 2}<|im_end|>',
                        "expected": '{"qty": 2}'}]}
    _print_table(fig, "<|im_end|>")
    out = capsys.readouterr().out
    assert "im_end" not in out and '{"qty": 2}' in out and "report: r/report.html" in out and "next:" not in out


def test_every_bad_line_of_a_file_is_reported_at_once(tmp_path):
    from rocktune.data.records import read_records
    from rocktune.errors import UserError

    good = json.dumps({"prompt": "a", "completion": "b"})
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join([good, "{bad", good, "nope"]) + "\n")
    with pytest.raises(UserError) as exc:
        read_records(f)
    assert f"{f}:2: malformed JSON" in str(exc.value) and f"{f}:4: malformed JSON" in str(exc.value)
    assert "2 lines of" in str(exc.value)
    f.write_text("\n".join(["{bad"] * 25) + "\n")
    with pytest.raises(UserError) as exc:
        read_records(f)
    assert f"{f}:20: malformed" in str(exc.value) and f"{f}:21:" not in str(exc.value)
    assert "and 5 more" in str(exc.value) and "25 lines of" in str(exc.value)


def _finished_run(tmp_path, model: str):
    from rocktune.config import config_from_dict
    from rocktune.train.rundir import write_config

    cfg = tiny_run_config(Path(model), tmp_path / "d.jsonl", None, tmp_path / "run")
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    (tmp_path / "run" / "adapter").mkdir(parents=True)
    (tmp_path / "run" / "adapter" / "adapter_config.json").write_text("{}")
    write_config(tmp_path / "run", config_from_dict(cfg).model_dump(mode="json"))
    return cfg


def test_a_finished_run_is_refused_before_any_model_is_touched_without_suggesting_resume(tmp_path, capsys,
                                                                                          monkeypatch):
    from rocktune import cli
    from rocktune.config import config_from_dict
    from rocktune.errors import UserError
    from rocktune.process import supervisor
    from rocktune.tasks import train

    (tmp_path / "empty-model").mkdir()  # no config.json: the task's checks would refuse it
    cfg = _finished_run(tmp_path, str(tmp_path / "empty-model"))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr(supervisor, "supervise", lambda *a: pytest.fail("a child was started"))
    assert cli.main(["train", "-c", str(tmp_path / "c.yaml")]) == 2  # refused in the parent: no child, no torch
    err = " ".join(capsys.readouterr().err.split())
    assert "already holds this run, finished" in err and "--resume " not in err and "--resume-force" in err
    # In the worker too, before the task's checks: the empty model directory would be named otherwise.
    with pytest.raises(UserError, match="already holds this run, finished"):
        train(config_from_dict(cfg), quiet=True)


def test_every_missing_path_is_named_with_its_line_and_the_working_directory(tmp_path, monkeypatch):
    from rocktune.config import load_config
    from rocktune.errors import UserError

    (tmp_path / "conf").mkdir()
    cfg = tmp_path / "conf" / "c.yaml"
    cfg.write_text("model:\n  name_or_path: ./models/base\ndata:\n  train_file: train.jsonl\n"
                   "  eval_file: /nowhere/eval.jsonl\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as exc:
        load_config("conf/c.yaml", ["lora.r=4"], require_paths=True)
    text = str(exc.value)
    assert f"conf/c.yaml:2: model path ./models/base does not exist in the working directory {tmp_path}" in text
    assert f"conf/c.yaml:4: data.train_file=train.jsonl does not exist in the working directory {tmp_path} " \
           f"(nor beside the config file, as conf/train.jsonl)" in text
    assert "conf/c.yaml:5: data.eval_file=/nowhere/eval.jsonl does not exist" in text
    load_config("conf/c.yaml")  # --print-config and preview: only the beside-the-config slip is refused
    cfg.write_text("model:\n  name_or_path: Qwen/Qwen2.5-0.5B\ndata:\n  train_file: c.yaml\n")  # a hub id is no path
    with pytest.raises(UserError, match="does not exist relative to the working directory"):
        load_config(str(cfg))


def test_the_adapter_names_an_absolute_base_and_describes_itself(tmp_path, monkeypatch):
    from rocktune.train.model_card import describe_adapter

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "base").mkdir(parents=True)
    run = tmp_path / "runs" / "run"
    (run / "adapter").mkdir(parents=True)
    cfg = {"model": {"name_or_path": "runs/base"}, "lora": {"r": 8, "alpha": 16, "dropout": 0.0,
                                                             "target_modules": "all-linear"},
           "data": {"train_file": "d.jsonl", "eval_file": "e.jsonl"},
           "training": {"max_steps": 2, "lr": 0.001, "micro_batch_size": 4, "grad_accum": 1, "precision": "fp32"}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "adapter" / "rocktune_config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "runs/base", "r": 8}))
    (run / "adapter" / "README.md").write_text("---\nlibrary_name: peft\n---\n# Model Card for Model ID\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 0, "eval_loss": 3.0}, {"step": 2, "loss": 1.0}, {"step": 2, "eval_loss": 0.5})))
    describe_adapter(run / "adapter", Path("runs/run"))
    base = str(tmp_path / "runs" / "base")
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == base
    assert yaml.safe_load((run / "adapter" / "rocktune_config.yaml").read_text())["model"]["name_or_path"] == base
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["name_or_path"] == "runs/base"  # resume's
    card = (run / "adapter" / "README.md").read_text()
    assert "Model Card for Model ID" not in card and f"# LoRA adapter for {base}" in card
    assert "| eval loss before → after | 3.0000 → 0.5000 |" in card and "r=8, alpha=16" in card
    assert f"PeftModel.from_pretrained(base, '{run / 'adapter'}')" in card


def test_the_tiny_wan_builder_has_help_instead_of_a_directory_named_help(tmp_path, monkeypatch, capsys):
    from rocktune.tasks.wan.diffusion import tiny

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        tiny.main(["--help"])
    assert exc.value.code == 0 and "output directory" in capsys.readouterr().out
    assert not (tmp_path / "--help").exists()


def test_plan_fits_an_80_column_terminal(capsys, monkeypatch):
    from rocktune.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", "Qwen2.5-3B", "--vram", "32GiB"]) == 0
    out = capsys.readouterr().out.splitlines()
    table = [line for line in out if line[:1] in "┏┃┡│├└"]
    assert table and all(len(line) <= 80 for line in table)
    assert any(line.startswith("│ base_weights") and line.count("5.75 GiB") == 2 for line in table)  # one line a row
    assert "  base_weights: 3,085,938,688 params x 2 B (bf16)" in out  # the inputs, below the table


def test_malformed_lines_are_refused_before_a_child_starts(tmp_path, capsys, monkeypatch):
    from rocktune import cli
    from rocktune.process import supervisor

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{oops\nnope\n')
    cfg = tiny_run_config(tmp_path, bad, None, tmp_path / "run")  # the model is never looked at
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr(supervisor, "supervise", lambda *a: pytest.fail("a child was started"))
    assert cli.main(["train", "-c", str(tmp_path / "c.yaml")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{bad}:2: malformed JSON" in err and f"{bad}:3: malformed JSON" in err
    assert not (tmp_path / "run").exists()
