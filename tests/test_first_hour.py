"""Issue 13, the first hour: long prompts keep their completion, an offline hub fails in seconds, a run ends with
its figures, a finished run is not redone, a demo run is not silently replaced."""

import json
import time

import pytest
import yaml

from rocktune.cli import main
from rocktune.config import DataConfig
from rocktune.data import truncate
from rocktune.data.dataset import prepare_data, tokenize_file
from rocktune.data.encode import IGNORE, encode
from rocktune.errors import UserError
from tests.conftest import tiny_run_config, write_jsonl


def loss_text(tokenizer, enc) -> str:
    return tokenizer.decode([t for t, lab in zip(enc.input_ids, enc.labels) if lab != IGNORE])


# --- truncation ------------------------------------------------------------------------------------------------


def test_long_prompt_is_cut_at_its_start_and_keeps_the_completion(tokenizer):
    rec = {"prompt": "0123456789" * 10 + " end =", "completion": " ok"}
    enc = encode(rec, "prompt_completion", tokenizer, 20, False, "x")
    assert len(enc.input_ids) == 20 and enc.truncated
    assert tokenizer.decode(enc.input_ids) == "0123456789 end = ok<|endoftext|>"
    assert loss_text(tokenizer, enc) == " ok<|endoftext|>"
    assert (enc.prompt_cut, enc.completion_cut) == (106 + 3 + 1 - 20, 0)


def test_truncation_end_keeps_the_start_as_before(tokenizer):
    rec = {"prompt": "0123456789" * 10, "completion": " ok"}
    enc = encode(rec, "prompt_completion", tokenizer, 20, False, "x", truncation="end")
    assert tokenizer.decode(enc.input_ids) == "01234567890123456789"
    assert all(lab == IGNORE for lab in enc.labels) and enc.prompt_cut == 80 and enc.completion_cut == 4


def test_completion_longer_than_max_length_keeps_the_prompts_last_quarter(tokenizer):
    rec = {"prompt": "abcdefghij" * 3, "completion": "0123456789" * 5}
    enc = encode(rec, "prompt_completion", tokenizer, 40, False, "x")
    assert tokenizer.decode(enc.input_ids) == "abcdefghij" + "0123456789" * 3  # the prompt keeps 40 // 4 tokens
    assert (enc.prompt_cut, enc.completion_cut) == (20, 21)


def test_chat_loses_its_oldest_turns_first(tokenizer):
    msgs = [{"role": "system", "content": "S" * 200}, {"role": "user", "content": "old question"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2"}]
    enc = encode({"messages": msgs}, "messages", tokenizer, 60, False, "x")
    text = tokenizer.decode(enc.input_ids)
    assert len(enc.input_ids) == 60 and text.endswith("<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\nA2"
                                                      "<|im_end|>\n")
    assert loss_text(tokenizer, enc) == "A1<|im_end|>\nA2<|im_end|>\n"
    assert enc.completion_cut == 0 and enc.prompt_cut > 200


def test_fit_keeps_a_leading_bos():
    ids, labels = [1, 10, 11, 12, 13, 20, 2], [IGNORE] * 5 + [20, 2]
    out = truncate.fit(ids, labels, [True] * 5 + [False] * 2, 5, "prompt", keep_first=True)
    assert out.input_ids == [1, 12, 13, 20, 2] and out.labels == [IGNORE, IGNORE, IGNORE, 20, 2]


def test_huge_prompt_is_tokenised_only_as_far_as_max_length_can_use(tokenizer):
    calls = []

    def spy(text, **kw):
        calls.append(len(text))
        return tokenizer(text, **kw)

    spy.bos_token_id, spy.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    prompt = "".join(f"word{i} é, " for i in range(30_000)) + "the question?"  # multi-byte chars: 1 char, 2 tokens
    rec = {"prompt": prompt, "completion": " answer"}
    enc = encode(rec, "prompt_completion", spy, 64, False, "x")
    assert max(calls) <= (64 + truncate.MARGIN) * truncate.CHARS_PER_TOKEN < len(prompt) / 100
    full = tokenizer(prompt)["input_ids"] + tokenizer(" answer")["input_ids"] + [tokenizer.eos_token_id]
    assert enc.input_ids == full[-64:]  # the same tokens as cutting the whole text's tokens


def test_notes_say_how_many_were_cut_on_which_side(tmp_path, tokenizer):
    rows = [{"prompt": "x" * 50, "completion": "y"}, {"prompt": "p", "completion": "long" * 20},
            {"prompt": "p", "completion": "ok"}]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    # keep: the cut answer is trained as cut (data.lossy_truncation's default stops the run: test_truncation_judged)
    d = DataConfig(train_file=str(f), eval_fraction=0.0, max_length=20, lossy_truncation="keep")
    tr, _, stats = prepare_data(d, tokenizer, tmp_path / "c", 0)
    assert (stats.n_truncated, stats.n_prompt_cut, stats.n_completion_cut, stats.n_dropped) == (2, 1, 1, 0)
    assert len(tr) == 3
    note = stats.notes[0]
    assert "2 of 3 examples were longer than data.max_length=20" in note
    assert "1 lost the start of their prompt" in note and "1 had their completion cut at its end" in note
    _, hit = tokenize_file(str(f), DataConfig(max_length=20, lossy_truncation="keep"), tokenizer, tmp_path / "c")
    assert hit.cache_hit and (hit.n_prompt_cut, hit.n_completion_cut) == (1, 1)


def test_nothing_left_to_learn_says_why_without_raising_max_length(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * 5_000, "completion": "y"}])
    with pytest.raises(UserError) as err:
        tokenize_file(str(f), DataConfig(max_length=20, truncation="end"), tokenizer, tmp_path / "c")
    assert "data.truncation=prompt" in str(err.value) and "raise" not in str(err.value)
    ex, stats = tokenize_file(str(f), DataConfig(max_length=20), tokenizer, tmp_path / "c")
    assert len(ex) == 1 and stats.n_prompt_cut == 1


# --- hub -------------------------------------------------------------------------------------------------------


def _train_args(tmp_path, model: str, *extra: str) -> list[str]:
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "completion": "c"}] * 4)
    return ["train", f"data.train_file={f}", f"model.name_or_path={model}", f"output.dir={tmp_path / 'run'}",
            "--no-supervise", *extra]


def test_offline_hub_id_fails_in_seconds_naming_the_key(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    t0 = time.perf_counter()
    assert main(_train_args(tmp_path, "some-org/some-model")) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - t0 < 10
    assert "model.name_or_path=some-org/some-model" in err and "HF_HUB_OFFLINE" in err
    assert "local model directory" in err and not (tmp_path / "run").exists()


def test_unreachable_hub_fails_in_seconds(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    from rocktune.models import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "probe", lambda endpoint: "ConnectError: Name or service not known")
    assert main(_train_args(tmp_path, "some-org/some-model")) == 2
    err = capsys.readouterr().err
    assert "cannot be reached" in err and "ConnectError" in err and "hf download some-org/some-model" in err


def test_probe_gives_up_on_a_hung_connection(monkeypatch):
    import huggingface_hub.utils

    from rocktune.models import hub

    class Hung:
        def head(self, url, **kw):
            time.sleep(30)

    class Answers:
        def head(self, url, **kw):
            return type("R", (), {"status_code": 200})()

    monkeypatch.setattr(huggingface_hub.utils, "get_session", Hung)
    t0 = time.perf_counter()
    assert "no answer" in hub.probe.__wrapped__("http://hub.invalid", timeout=0.3)
    assert time.perf_counter() - t0 < 2
    monkeypatch.setattr(huggingface_hub.utils, "get_session", Answers)
    assert hub.probe.__wrapped__("http://hub.invalid", timeout=0.3) is None


def test_unreachable_hub_with_a_cached_model_loads_it_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from rocktune.models import hub

    snap = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--name" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--name" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(hub, "probe", lambda endpoint: "ConnectError")
    assert "using the cached copy of org/name offline" in hub.check_hub_model("org/name")
    assert constants.HF_HUB_OFFLINE is True


# --- how a run ends --------------------------------------------------------------------------------------------


def test_summary_figures_come_from_metrics(tmp_path, monkeypatch):
    from rocktune.train import summary

    lines = [{"step": 0, "eval_loss": 6.0}, {"step": 1, "loss": 5.0, "tokens": 300, "step_s": 0.5},
             {"step": 2, "loss": 4.0, "tokens": 100, "step_s": 0.5}, {"step": 2, "eval_loss": 1.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"torn')
    monkeypatch.setattr(summary, "_installed", lambda m: m in ("rocktune.export", "rocktune.report"))
    assert "rocktune generate" not in "\n".join(summary.next_commands(tmp_path))
    out: list[str] = []
    fig = summary.log_summary(tmp_path, out.append, 3.25)
    text = "\n".join(out)
    assert (fig.steps, fig.eval_before, fig.eval_after, fig.tokens, fig.logged) == (2, 6.0, 1.25, 400, 2)
    assert "2 steps in 3.2 s wall" in text and "6.0000 -> 1.2500" in text and "400 loss-bearing tokens" in text
    assert "useful tokens/s 400 " in text and "process RSS" in text and str(tmp_path / "adapter") in text
    assert f"rocktune export {tmp_path} --to gguf" in text and f"rocktune report {tmp_path}" in text
    assert "generate" not in text
    monkeypatch.setattr(summary, "_installed", lambda m: True)
    assert f"rocktune generate {tmp_path} --prompt 'two mugs' --compare" in "\n".join(
        summary.next_commands(tmp_path, prompt="two mugs"))
    assert f"rocktune generate {tmp_path} --chat" in "\n".join(summary.next_commands(tmp_path))


def test_the_summary_leaves_compiling_steps_out_of_tokens_per_second(tmp_path):
    """The H200 run: step 1 compiled for 48 s; counting it gave 12 tokens/s for a loop that ran at about 750."""
    from rocktune.train import summary

    lines = [{"step": 1, "loss": 5.8, "tokens": 86, "step_s": 48.3, "compiling": True},
             *({"step": s, "loss": 5.0, "tokens": 80, "step_s": 0.1, "compiling": False} for s in range(2, 6))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out: list[str] = []
    fig = summary.log_summary(tmp_path, out.append, 50.0)
    assert (fig.steps, fig.logged, fig.compiling, fig.tokens) == (5, 5, 1, 320)
    assert fig.step_seconds == pytest.approx(0.4)
    text = "\n".join(out)
    assert "useful tokens/s 800 (320 loss-bearing tokens in 0.4 s of steps; 1 compiling step left out)" in text


def test_a_run_ends_with_its_figures_and_a_finished_run_is_not_redone(tiny_model_dir, tmp_path, capsys):
    """The 5 MB prompt case, through the CLI: trained with the prompt cut and reported, then --resume is a no-op."""
    rows = [{"prompt": "lorem ipsum dolor sit amet, " * 180_000 + "so the answer is", "completion": " 42"}]
    rows += [{"prompt": f"add {i} {i} =", "completion": f" {2 * i}"} for i in range(15)]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    assert f.stat().st_size > 5_000_000
    cfg = tiny_run_config(tiny_model_dir, f, None, tmp_path / "run", max_steps=2, micro_batch_size=4, grad_accum=1)
    cfg["data"]["eval_fraction"] = 0.25
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    assert main(["train", "-c", str(tmp_path / "c.yaml"), "--no-supervise"]) == 0
    assert time.perf_counter() - t0 < 60
    err = capsys.readouterr().err
    assert "1 of 16 examples were longer than data.max_length=64" in err and "lost the start of their prompt" in err
    assert "run complete" in err and "eval loss" in err and "useful tokens/s" in err and "peak memory" in err
    adapter = tmp_path / "run" / "adapter" / "adapter_model.safetensors"
    before = adapter.stat().st_mtime_ns
    assert main(["train", "-c", str(tmp_path / "c.yaml"), "--no-supervise", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "already complete" in err and "2 steps" in err and "eval loss" in err
    assert adapter.stat().st_mtime_ns == before


def test_demo_refuses_to_replace_a_different_demo_run(tmp_path, capsys):
    from rocktune.demo.run import check_demo_dir, demo_config
    from rocktune.train.rundir import write_config

    out = tmp_path / "demo"
    settings = demo_config(out / "base_model", out / "data", out / "run", 800)
    (out / "run").mkdir(parents=True)
    saved = dict(settings, data=dict(settings["data"], truncation="prompt"))  # a later field: not a difference
    write_config(out / "run", saved)
    check_demo_dir(out, settings, overwrite=False)  # the same demo again: redone
    assert main(["demo", "--out", str(out), "--steps", "5"]) == 2
    assert "holds a different demo run (differs in training.max_steps)" in capsys.readouterr().err
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert main(["demo", "--out", str(other)]) == 2
    assert "does not hold a rocktune demo" in capsys.readouterr().err
    check_demo_dir(other, settings, overwrite=True)


def test_progress_in_a_log_file_is_plain_lines_without_a_bar(capsys):
    from rocktune.train.progress import ProgressBar

    with ProgressBar(50, 0) as bar:
        assert not bar.console.is_terminal  # pytest captures stderr, like nohup or CI
        for step in range(1, 51):
            bar.update(step, 1.0, 1e-3, 100.0, None)
    lines = capsys.readouterr().err.splitlines()
    assert [x.split(" loss")[0] for x in lines] == ["step 1/50", "step 50/50"]  # first step at once, last once
    assert not any("━" in x for x in lines)


# --- config errors and --print-config --------------------------------------------------------------------------


@pytest.fixture
def yaml_config(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  train_file: x.jsonl\ntraining:\n  lr: 1.0e-3\nlora:\n  r: 8\n")
    return f


@pytest.mark.parametrize("override,expect", [("training.lr=abc", "override 'training.lr=abc': training.lr"),
                                             ("lora.r=-1", "override 'lora.r=-1': lora.r")])
def test_override_errors_name_the_override_not_the_yaml_line(yaml_config, capsys, override, expect):
    assert main(["train", "-c", str(yaml_config), override, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert expect in err and f"{yaml_config}:" not in err


def test_comma_list_override_and_yaml_errors_name_the_file(yaml_config, tmp_path, capsys):
    assert main(["train", "-c", str(yaml_config), "lora.target_modules=q_proj, v_proj", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["lora"]["target_modules"] == ["q_proj", "v_proj"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  train_file: x\n training: [\n")
    assert main(["train", "-c", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:3:2: not valid YAML" in err and "unicode string" not in err


def test_print_config_explains_each_field_and_loads_back(yaml_config, tmp_path, capsys):
    from rocktune.config import DataConfig, load_config

    assert main(["train", "-c", str(yaml_config), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "  # " + DataConfig.model_fields["eval_fraction"].description in out
    (tmp_path / "printed.yaml").write_text(out)
    assert load_config(str(tmp_path / "printed.yaml")) == load_config(str(yaml_config))


# --- data messages ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("record,expect", [({"prompt": "p"}, "missing 'completion' (the prompt_completion shape"),
                                           ({"instruction": "i", "input": "x"}, "missing 'output' (the alpaca shape"),
                                           ({"foo": 1}, "unknown record shape")])
def test_incomplete_records_name_the_missing_key(tmp_path, record, expect):
    from rocktune.data import records

    f = write_jsonl(tmp_path / "d.jsonl", [record])
    with pytest.raises(UserError) as err:
        records.detect_shape(records.read_records(f), "auto")
    assert f"{f}:1: " in str(err.value) and expect in str(err.value)


def test_malformed_json_message_reads_right(tmp_path):
    from rocktune.data import records

    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "p", "completion": "unterminated}\n')
    with pytest.raises(UserError) as err:
        records.read_records(f)
    assert "at at" not in str(err.value) and "Unterminated string starting at column" in str(err.value)


def test_relative_path_found_only_beside_the_config_file_is_named(tmp_path, monkeypatch, capsys):
    sub = tmp_path / "project"
    sub.mkdir()
    write_jsonl(sub / "train.jsonl", [{"prompt": "p", "completion": "c"}])
    (sub / "c.yaml").write_text("data:\n  train_file: train.jsonl\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "-c", "project/c.yaml", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "project/c.yaml:2: data.train_file=train.jsonl does not exist relative to the working directory" in err
    assert "project/train.jsonl, which exists" in err
    monkeypatch.chdir(sub)
    assert main(["train", "-c", "c.yaml", "--print-config"]) == 0


def test_auto_states_one_memory_figure_with_or_without_vram(tiny_model_dir, task_files, tmp_path):
    import re

    from rocktune.config import config_from_dict
    from rocktune.planner.budget import detect_budget
    from rocktune.tasks.causal import autofit

    cfg = config_from_dict(tiny_run_config(tiny_model_dir, task_files[0], task_files[1], tmp_path / "run"))
    detected, _, _ = detect_budget()
    runs = [autofit.apply_fit(cfg, "fp32", "sdpa", vram) for vram in (None, detected)]
    assert runs[0][1] == runs[1][1] and runs[0][2] == runs[1][2]
    notes, peak = runs[0][1], runs[0][2]
    assert sum("needs" in n for n in notes) == 1 and not any(n.startswith("chosen:") for n in notes)
    total, _, shown_peak, overhead = map(float, re.findall(r"([\d.]+) GiB", notes[0])[:4])
    assert shown_peak == round(peak / 2**30, 2) and abs(total - shown_peak - overhead) <= 0.011


def test_the_grpo_demo_run_again_is_the_same_demo(tmp_path):
    """Its saved config writes every field of each reward (weights, defaults): the same demo, not a different one
    (a second `rocktune demo --task grpo` was refused as 'differs in grpo.rewards')."""
    from rocktune.config import config_from_dict
    from rocktune.tasks.grpo.demo.run import grpo_config
    from rocktune.demo.run import check_demo_dir
    from rocktune.errors import UserError
    from rocktune.train.rundir import write_config

    out = tmp_path / "demo-grpo"
    settings = grpo_config(out / "sft_merged", out / "data", out / "run", 120)
    (out / "run").mkdir(parents=True)
    write_config(out / "run", config_from_dict(settings).model_dump(mode="json"))
    check_demo_dir(out, settings, overwrite=False)
    changed = dict(settings, grpo=dict(settings["grpo"], rewards=[{"function": "numeric"}]))
    with pytest.raises(UserError, match=r"differs in grpo\.rewards"):
        check_demo_dir(out, changed, overwrite=False)
