"""GRPO rewards are TRL's: the arguments TRL's GRPOTrainer._calculate_rewards passes, in its shapes (a conversational
prompt's completion as [{"role": "assistant", "content": ...}]), TRL's own reward functions run unchanged, None as
"not applicable", and every way a user's reward module can be wrong refused (exit 2) naming module:function and the
file:line."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from rocktune.config import config_from_dict
from rocktune.errors import UserError
from rocktune.tasks.grpo import rewards as R
from rocktune.tasks.grpo import scoring as S
from rocktune.tasks.grpo import user_reward
from rocktune.tasks.grpo.feed import advantages

CHAT = [{"role": "user", "content": "What is 3 + 4?"}]
ROWS = [{"prompt": CHAT, "answer": "7", "level": 1}, {"prompt": CHAT, "answer": "7", "level": 1}]
TEXTS = ["<think>\n3 + 4\n</think>\n#### 7", "7?"]


def _reward(target: str) -> R.Reward:
    return R.Reward(target.rpartition(":")[2], 1.0, user_reward.load(target, "grpo.rewards[0]"), target)


def _batch(rows=ROWS, texts=TEXTS) -> S.Batch:
    prompts = [r["prompt"] for r in rows]
    fields = [{k: v for k, v in r.items() if k != "prompt"} for r in rows]
    return S.Batch(prompts, S.completions_for(prompts, texts), [[1, 2, 3], [4]], fields,
                   [f"train.jsonl:{i + 1}" for i in range(len(rows))])


def _trl_calls(fn, rows, completions, completion_ids) -> dict:
    """The keyword arguments TRL 1.16's own GRPOTrainer._calculate_rewards passes to ``fn`` (run on a stand-in for
    the trainer: the method reads only these attributes)."""
    from types import SimpleNamespace

    from accelerate import PartialState
    from transformers import TrainerState
    from trl import GRPOTrainer

    PartialState()
    seen: dict = {}

    def spy(**kwargs):
        seen.update(kwargs)
        return fn(**kwargs)
    trainer = SimpleNamespace(accelerator=SimpleNamespace(device="cpu", is_main_process=True), reward_funcs=[spy],
                              reward_processing_classes=[None], reward_func_names=["spy"], state=TrainerState(),
                              args=SimpleNamespace(report_to=[]), _log_completion_extra=lambda c, v: None,
                              _log_metric=lambda n, v: None, environments=None)
    GRPOTrainer._calculate_rewards.__wrapped__(trainer, rows, [r["prompt"] for r in rows], completions,
                                               completion_ids)
    return seen


def test_a_user_reward_gets_what_trl_passes():
    pytest.importorskip("trl")
    seen_here: dict = {}

    def spy(**kwargs):
        seen_here.update(kwargs)
        return [1.0] * len(kwargs["completions"])
    batch = _batch()
    S.score([R.Reward("spy", 1.0, spy, "my:spy")], batch)
    theirs = _trl_calls(spy, ROWS, batch.completions, batch.completion_ids)
    assert sorted(seen_here) == sorted(theirs)  # the same names: no 'where', nothing missing
    for key in ("prompts", "completions", "completion_ids", "answer", "level"):
        assert seen_here[key] == theirs[key], key
    assert seen_here["completions"][0] == [{"role": "assistant", "content": TEXTS[0]}]
    text = S.completions_for(["a text prompt"], ["x"])
    assert text == ["x"]  # a text prompt's completion is text, as TRL's


def test_trls_own_reward_functions_run_unchanged(monkeypatch):
    pytest.importorskip("trl")
    think = _reward("trl.rewards:think_format_reward")
    assert S.score([think], _batch()) == [[1.0, 0.0]]
    penalty = R.Reward("rep", 1.0, __import__("trl.rewards", fromlist=["x"]).get_repetition_penalty_reward(2), "x:y")
    assert S.score([penalty], _batch()) == [[0.0, 0.0]]


DOCS_EXAMPLES = '''
import re

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think>.*$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content, re.DOTALL) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]

def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]

def level_reward(completions, level, trainer_state, **kwargs):
    return [float(x) + trainer_state.global_step for x in level]

def only_math(prompts, completions, level, **kwargs):
    return [None if x == 2 else 1.0 for x in level]

async def judged(completions, **kwargs):
    return [0.5 for _ in completions]

def logs(completions, log_extra, log_metric, **kwargs):
    log_extra("note", ["n"] * len(completions))
    log_metric("my_metric", 0.5)
    return [0.0] * len(completions)
'''


@pytest.fixture
def docs_module(tmp_path, monkeypatch):
    (tmp_path / "trl_docs_rewards.py").write_text(DOCS_EXAMPLES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "trl_docs_rewards"


def test_documented_examples_and_none(docs_module):
    from transformers import TrainerState

    batch = _batch()
    batch = S.Batch(batch.prompts, batch.completions, batch.completion_ids, batch.fields, batch.where,
                    TrainerState(global_step=3))
    fmt, length, level = (_reward(f"{docs_module}:{n}") for n in ("format_reward_func", "reward_len", "level_reward"))
    assert S.score([fmt, length, level], batch) == [[1.0, 0.0], [-abs(20 - len(TEXTS[0])), -18], [4.0, 4.0]]
    assert S.score([_reward(f"{docs_module}:judged")], batch) == [[0.5, 0.5]]  # an async reward, awaited
    log = S.RewardLog()
    S.score([_reward(f"{docs_module}:logs")], batch, log)
    assert log.extra == {"note": ["n", "n"]} and log.means() == {"my_metric": 0.5}
    rows = [ROWS[0], {**ROWS[1], "level": 2}]
    none = _reward(f"{docs_module}:only_math")
    table = S.score([none, fmt], _batch(rows))
    assert table[0][0] == 1.0 and math.isnan(table[0][1])
    assert S.weighted([none, fmt], table) == [2.0, 0.0]  # None is left out of the sum, as TRL's nansum
    assert math.isnan(S.weighted([none], [table[0]])[1])  # no function applied: no reward at all


def test_a_completion_no_reward_applies_to_gets_advantage_zero_as_in_trl():
    r = torch.tensor([1.0, 0.0, math.nan, 1.0, 2.0, 2.0, 2.0, math.nan])
    adv = advantages(r, 4, "group")
    assert adv[2] == 0.0 and adv[7] == 0.0
    kept = torch.tensor([1.0, 0.0, 1.0])
    assert torch.allclose(adv[[0, 1, 3]], (kept - kept.mean()) / (kept.std() + 1e-4))
    assert torch.equal(adv[4:7], torch.zeros(3))
    plain = torch.tensor([1.0, 0.0, 0.5, 1.0])
    assert torch.equal(advantages(plain, 2, "batch"), (plain - plain.view(-1, 2).mean(1).repeat_interleave(2))
                       / (plain.std() + 1e-4))


@pytest.mark.parametrize("source, words", [
    ("def f(completions, **kw):\n    raise KeyError('solution')\n",
     r"the reward my_rw:f raised KeyError at .*my_rw.py:2"),
    ("def f(completions, **kw):\n    return [1.0]\n", "my_rw:f must return a list of one number .* got 1 values"),
    ("def f(completions, **kw):\n    return 1.0\n", "my_rw:f must return .* got a float"),
    ("def f(completions, **kw):\n    return [1.0, float('nan')]\n", "train.jsonl:2: the reward my_rw:f returned nan"),
    ("def f(completions, **kw):\n    return [1.0, 'x']\n", "train.jsonl:2: the reward my_rw:f returned 'x'"),
    ("def f(completions, **kw):\n    return [1.0, float('inf')]\n", "returned inf"),
])
def test_a_wrong_reward_is_refused_naming_it(tmp_path, monkeypatch, source, words):
    (tmp_path / "my_rw.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rw", raising=False)
    with pytest.raises(UserError, match=words):
        S.score([_reward("my_rw:f")], _batch())


@pytest.mark.parametrize("source, target, words", [
    (None, "absent_rw:f", "grpo.rewards.0..function=absent_rw:f: no module 'absent_rw'"),
    ("def f(completions, **kw)\n    return []\n", "bad_rw:f", r"bad_rw:f: .*bad_rw.py:1: SyntaxError"),
    ("import not_installed_xyz\n", "bad_rw:f", r"bad_rw:f: importing it failed at .*bad_rw.py:1"),
    ("x = 1 / 0\n", "bad_rw:f", r"bad_rw:f: importing it raised ZeroDivisionError at .*bad_rw.py:1"),
    ("def g(**kw):\n    return []\n", "bad_rw:f", r"bad_rw:f: .*bad_rw.py has no 'f'; its functions: g"),
    ("f = 3\n", "bad_rw:f", "'f' in .*bad_rw.py is a int, not a function"),
])
def test_a_reward_module_that_cannot_load_is_refused(tmp_path, monkeypatch, source, target, words):
    if source is not None:
        (tmp_path / "bad_rw.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bad_rw", raising=False)
    specs = config_from_dict({"task": "grpo", "data": {"train_file": "x"},
                              "grpo": {"rewards": [{"function": target}]}}).grpo.rewards
    with pytest.raises(UserError, match=words):
        R.build(specs, 16)


def test_the_launcher_refuses_a_missing_or_broken_module_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the worker's `python -m` finds modules in the working directory
    (tmp_path / "syn_rw.py").write_text("def f(completions, **kw)\n    return []\n")
    (tmp_path / "runs_rw.py").write_text("open('ran', 'w')\ndef f(**kw):\n    return []\n")
    with pytest.raises(UserError, match=r"grpo.rewards\[1\].function=syn_rw:f: .*syn_rw.py:1: SyntaxError"):
        user_reward.precheck("syn_rw:f", "grpo.rewards[1]")
    with pytest.raises(UserError, match="no module 'nope_rw'"):
        user_reward.precheck("nope_rw:f", "grpo.rewards[0]")
    user_reward.precheck("runs_rw:f", "grpo.rewards[0]")
    assert not (tmp_path / "ran").exists()  # compiled, never run, in the launching process


def test_train_exits_2_on_a_syntax_error_in_the_reward_module(tiny_model_dir, tmp_path):
    """`rocktune train` (the supervised path) refuses it before anything starts: exit 2, the file and line, no
    traceback (it was exit 1, the crash code, with a traceback)."""
    import yaml

    from tests.conftest import write_jsonl

    (tmp_path / "broken_rw.py").write_text("def fmt(completions, **kw)\n    return [1.0] * len(completions)\n")
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "add 1 2 =", "answer": "3"}] * 4)
    cfg = {"task": "grpo", "model": {"name_or_path": str(tiny_model_dir)}, "data": {"train_file": str(data)},
           "grpo": {"num_generations": 2, "rewards": [{"function": "broken_rw:fmt"}]},
           "training": {"max_steps": 1, "micro_batch_size": 2, "device": "cpu"}, "output": {"dir": str(tmp_path / "r")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-m", "rocktune", "train", "-c", "c.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "broken_rw.py:1: SyntaxError" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "r").exists()  # nothing was started


def test_built_ins_read_conversational_completions():
    comps = S.completions_for([CHAT, CHAT], ["so #### 7", "8"])
    assert R.exact(comps, ["a", "b"], answer=["7", "7"]) == [1.0, 0.0]
    assert R.numeric(0.1)(comps, ["a", "b"], answer=["7", "7"]) == [1.0, 0.0]
    assert R.regex("####")(comps) == [1.0, 0.0]


def test_a_users_reward_module_is_documented_as_run():
    """docs/rl.md's reward examples, as printed there, run through the scorer."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "rl.md").read_text()
    block = text.split("### Your own reward function", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(textwrap.dedent(block), namespace)  # noqa: S102 -- our own documentation's example
    fns = [namespace["format_reward"], namespace["brevity"]]
    got = S.score([R.Reward(f.__name__, 1.0, f, f"docs:{f.__name__}") for f in fns], _batch())
    assert got == [[1.0, 0.0], [-3 / 512, -1 / 512]]
