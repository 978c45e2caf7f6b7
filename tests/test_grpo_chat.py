"""GRPO from conversations (issue 55 point 4): ``messages`` rows (OpenAI's chat format; GSM8K as chat rows) read as
prompt + reference, the reward and its spread on the progress line, a warning when the completions are cut at
``grpo.max_completion_length`` or no group has any reward spread, and rollouts with their rewards kept in
samples.jsonl and shown by ``rocktune report``."""

from __future__ import annotations

import json

import pytest

from rocktune.config import config_from_dict
from rocktune.errors import UserError
from rocktune.tasks.grpo import watch
from rocktune.tasks.grpo.prompts import encode_prompt, read_prompt
from tests.conftest import write_jsonl


def _gsm8k_chat(a: int, b: int) -> dict:
    return {"messages": [{"role": "system", "content": "Answer after ####."},
                         {"role": "user", "content": [{"type": "text", "text": f"What is {a} + {b}?"}]},
                         {"role": "assistant", "content": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b:,}"}]}


def test_a_conversation_is_its_turns_before_the_last_answer_and_that_answer(tokenizer):
    row = read_prompt(_gsm8k_chat(1200, 34), "chat.jsonl:1")
    assert row.chat and row.answer == "1234"  # after '####', thousands separator dropped, as GSM8K's shape
    assert row.prompt == [{"role": "system", "content": "Answer after ####."},
                          {"role": "user", "content": "What is 1200 + 34?"}]  # OpenAI's content parts joined
    assert "messages" not in row.fields and row.fields["answer"] == "1234"
    text = encode_prompt(row, tokenizer, 128, "chat.jsonl:1").text
    assert text.endswith("What is 1200 + 34?<|im_end|>\n<|im_start|>assistant\n") and "1234" not in text
    plain = read_prompt({"messages": [{"role": "developer", "content": "be brief"},
                                      {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                         "solution": "HELLO"}, "f:2")
    assert plain.prompt[0]["role"] == "system" and plain.answer == "HELLO"  # the row's own answer column wins
    open_ended = read_prompt({"messages": [{"role": "user", "content": "tell a story"}]}, "f:3")
    assert open_ended.answer is None and len(open_ended.prompt) == 1  # no final answer: prompt-only
    share = read_prompt({"conversations": [{"from": "human", "value": "2+2?"}, {"from": "bot", "value": "#### 4"}],
                         "system": "Be brief.", "tools": [{"name": "calc", "parameters": {"type": "object"}}]},
                        "f:6", {"bot": "assistant"})  # ShareGPT, a system column, data.roles, bare tool schemas
    assert share.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert share.answer == "4" and share.tools[0]["function"]["name"] == "calc"  # tools in the templates' layout
    assert set(share.fields) == {"answer", "tools"}  # the conversation and system became the prompt
    with pytest.raises(UserError, match="f:4: 'messages' holds only an assistant turn"):
        read_prompt({"messages": [{"role": "assistant", "content": "x"}]}, "f:4")
    with pytest.raises(UserError, match="f:5: a GRPO row needs 'prompt', 'messages'.*data.columns"):
        read_prompt({"dialog": []}, "f:5")
    with pytest.raises(UserError, match="f:7: 'conversations' must be a non-empty list"):
        read_prompt({"conversations": []}, "f:7")


def test_the_watch_says_each_failure_once_after_a_few_steps():
    w = watch.Watch(max_completion_length=6, temperature=0.9)
    cut = {"completions/clipped_ratio": 0.75, "frac_reward_zero_std": 0.5}
    assert w.check(1, cut) == [] and w.check(2, cut) == []
    said = w.check(3, cut)
    assert len(said) == 1 and "75% of the completions hit grpo.max_completion_length=6" in said[0]
    assert "grpo.temperature (now 0.9)" in said[0]
    assert w.check(4, cut) == []  # once
    flat = {"completions/clipped_ratio": 0.0, "frac_reward_zero_std": 1.0}
    assert w.check(5, flat) == [] and w.check(6, {"frac_reward_zero_std": 0.9}) == []  # the streak restarts
    assert w.check(7, flat) == [] and w.check(8, flat) == []
    assert "frac_reward_zero_std 1.0" in w.check(9, flat)[0]
    solved = watch.Watch(6, 1.0)
    said = [solved.check(s, {"frac_reward_zero_std": 1.0, "reward": 1.0}) for s in (1, 2, 3)][-1][0]
    assert "mean reward is 1.000: if that is the best score, the prompts are solved" in said
    assert watch.progress({"reward": 0.25, "reward_std": 0.5}) == "reward 0.250±0.500"
    assert watch.progress({"loss": 0.0}) == ""
    note = watch.length_note([2] + [10] * 19, 5)
    assert "grpo.max_completion_length=5: 19 of the 20 reference answers" in note and "median 10 tokens" in note
    assert "grpo.max_completion_length: 10 keeps 95%" in note
    assert watch.length_note([2] * 19 + [10], 5) is None  # few are longer: nothing to say


def test_a_run_from_gsm8k_chat_rows_warns_keeps_rollouts_and_reports_them(tiny_model_dir, tmp_path, capsys,
                                                                          monkeypatch):
    from rocktune.tasks import train

    (tmp_path / "logging_rw.py").write_text(  # TRL's log_extra / log_metric hooks, used as TRL documents them
        "def logs(completions, log_extra, log_metric, **kw):\n"
        "    log_extra('chars', [len(c[0]['content']) for c in completions])\n"
        "    log_metric('seen', float(len(completions)))\n"
        "    return [0.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    data = write_jsonl(tmp_path / "chat.jsonl", [_gsm8k_chat(i + 2, 3 * i + 1) for i in range(24)])
    cfg = {"task": "grpo", "model": {"name_or_path": str(tiny_model_dir)}, "lora": {"r": 8, "alpha": 16},
           "data": {"train_file": str(data), "max_length": 64, "eval_fraction": 0.2},
           "grpo": {"num_generations": 4, "max_completion_length": 3, "rewards": [{"function": "exact"},
                                                                                {"function": "logging_rw:logs"}]},
           "training": {"max_steps": 4, "micro_batch_size": 4, "grad_accum": 2, "eval_every": 2, "device": "cpu",
                        "precision": "fp32", "seed": 0}, "output": {"dir": str(tmp_path / "run")}}
    result = train(config_from_dict(cfg), quiet=False)
    err = capsys.readouterr().err
    assert "step 1/4 loss" in err and " reward 0.000±0.000 " in err  # a log file's first progress line
    assert "reference answers in the data are longer" in err  # said before the first step, from the data alone
    info = json.loads((result.run_dir / "run_info.json").read_text())
    assert any("grpo.max_completion_length=3" in n for n in info["notes"])
    assert err.count("hit grpo.max_completion_length=3") == 1 and err.count("frac_reward_zero_std 1.0") == 1
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    warned = [r for r in lines if "warnings" in r]
    assert [r["step"] for r in warned] == [3] and len(warned[0]["warnings"]) == 2
    samples = [json.loads(x) for x in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    rollouts = [s for s in samples if s["kind"] == "rollout"]
    assert sorted({s["step"] for s in rollouts}) == [2, 4] and len(rollouts) == 2 * 4  # one group per eval point
    held = [s for s in samples if s["kind"] == "eval"]
    assert sorted({s["step"] for s in held}) == [0, 2, 4]
    assert all(s["reward"] == 0.0 and s["rewards"] == {"exact": 0.0, "logs": 0.0} for s in samples)
    assert all(s["extra"]["chars"] == len(s["output"]) for s in samples)  # log_extra's column, per completion
    assert all(r["seen"] == 8.0 for r in lines if "loss" in r)  # log_metric: the step's 8 completions
    assert all(s["expected"].isdigit() and s["prompt"].startswith("What is") for s in samples)
    pytest.importorskip("matplotlib")
    from rocktune.report.rundata import load_run
    from rocktune.report.run_report import write_report

    page = write_report([load_run(result.run_dir)]).read_text()
    assert "Rollouts of step 4" in page and "No samples" not in page and held[-1]["prompt"] in page
    assert "hit grpo.max_completion_length=3" in page  # the warnings among the run's incidents
