"""task: grpo — data shapes, rewards, advantages, the sampler and a tiny run through the one loop, on the CPU."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from rocktune.config import config_from_dict
from rocktune.tasks.grpo.prompts import encode_prompt, gsm8k_answer, read_prompt
from rocktune.errors import UserError
from rocktune.tasks.grpo import rewards as R
from rocktune.tasks.grpo import scoring as S
from rocktune.tasks.grpo.feed import advantages, row_weights
from rocktune.tasks.grpo.rollout import Sampling, new_generator, row_draws, sample
from tests.conftest import write_jsonl


def test_rows_of_every_shape():
    text = read_prompt({"prompt": "add 1 2 =", "answer": " 03", "level": 2}, "f:1")
    assert (text.prompt, text.answer, text.chat, text.fields) == ("add 1 2 =", " 03", False,
                                                                   {"answer": " 03", "level": 2})
    chat = read_prompt({"prompt": [{"role": "user", "content": "hi"}], "solution": "x"}, "f:2")
    assert chat.chat and chat.answer == "x" and chat.fields == {"solution": "x", "answer": "x"}
    gsm = read_prompt({"question": "How many?", "answer": "3 + 4 = 7 apples\n#### 1,007"}, "f:3")
    assert (gsm.prompt, gsm.answer) == ("How many?", "1007")
    assert read_prompt({"prompt": "only a prompt"}, "f:4").answer is None
    assert gsm8k_answer("no marker 12") == "no marker 12"


@pytest.mark.parametrize("row, words", [({"text": "x"}, "needs 'prompt'"), ({"prompt": ""}, "non-empty"),
                                        ({"prompt": [{"role": "bot", "content": "x"}]}, r"prompt\[0\]"),
                                        ({"prompt": "p", "answer": [1]}, "text or a number")])
def test_bad_rows_name_the_row(row, words):
    with pytest.raises(UserError, match=words) as exc:
        read_prompt(row, "train.jsonl:7")
    assert "train.jsonl:7" in str(exc.value)


def test_a_long_prompt_keeps_its_end(tokenizer):
    p = encode_prompt(read_prompt({"prompt": "upper abcdefghij " * 20 + "= end"}, "r"), tokenizer, 8, "r")
    assert p.truncated and len(p.ids) == 8 and tokenizer.decode(p.ids).endswith("= end")


def test_built_in_rewards():
    comps = [" ABCD", "the answer is #### 42", "so \\boxed{41.9}", "nothing"]
    refs = [" ABCD", "42", "42", "7"]
    where = ["r0", "r1", "r2", "r3"]
    assert R.exact(comps, where, answer=refs) == [1.0, 1.0, 0.0, 0.0]
    assert R.numeric(0.2)(comps, where, answer=["1"] + refs[1:]) == [0.0, 1.0, 1.0, 0.0]  # ' ABCD': no number
    assert R.regex(r"####\s*\d+$")(comps) == [0.0, 1.0, 0.0, 0.0]
    assert R.length(10, 4)([[1] * 5, [1] * 6, [1] * 8, [1] * 12]) == [0.0, 0.0, -0.5, -1.0]
    with pytest.raises(UserError, match="r1: the 'numeric' reward needs a number"):
        R.numeric(0.1)(["1", "2"], ["r0", "r1"], answer=["1", "two"])
    with pytest.raises(UserError, match="r0: the 'exact' reward compares with a reference answer"):
        R.exact(["1"], ["r0"], answer=[None])


def _batch(n=2):
    return S.Batch(["p"] * n, ["a"] * n, [[1]] * n, [{"answer": "a"}] * n, [f"train.jsonl:{i + 1}" for i in range(n)])


def test_user_rewards_checked_and_named(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def good(completions, **kw):\n    return [len(c) for c in completions]\n"
        "def nan(completions, **kw):\n    return [1.0, float('nan')]\n"
        "def boom(completions, **kw):\n    raise KeyError('solution')\n"
        "def short(completions, **kw):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config_from_dict({"task": "grpo", "data": {"train_file": "x"}, "grpo": {"rewards": [
        {"function": "my_rewards:good", "weight": 0.5}, {"function": "exact", "weight": 2.0}]}})
    built = R.build(cfg.grpo.rewards, 16)
    table = S.score(built, _batch())
    assert [r.name for r in built] == ["good", "exact"] and table == [[1.0, 1.0], [1.0, 1.0]]
    assert S.weighted(built, table) == [2.5, 2.5]
    for fn, words in (("nan", "train.jsonl:2: the reward 'nan' returned nan"), ("boom", "raised KeyError"),
                      ("short", r"one number \(or None\) per completion")):
        with pytest.raises(UserError, match=words):
            S.score([R.Reward(fn, 1.0, getattr(sys.modules["my_rewards"], fn))], _batch())
    with pytest.raises(UserError, match="no_such_module:f: no module 'no_such_module'"):
        R.build(config_from_dict({"task": "grpo", "data": {"train_file": "x"}, "grpo": {"rewards": [
            {"function": "no_such_module:f"}]}}).grpo.rewards, 16)


def test_reward_config_is_checked():
    from rocktune.errors import UserError as E

    for spec, words in (({"function": "regex"}, "needs pattern"), ({"function": "regex", "pattern": "("}, "not a "
                        "regular expression"), ({"function": "bleu"}, "module:function")):
        with pytest.raises(E, match=words):
            config_from_dict({"task": "grpo", "data": {"train_file": "x"}, "grpo": {"rewards": [spec]}})
    with pytest.raises(E, match="only for task=grpo"):
        from rocktune.config import refuse_inapplicable
        refuse_inapplicable(config_from_dict({"data": {"train_file": "x"}, "grpo": {"beta": 0.1}}))


def test_advantages_and_weights():
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    group = advantages(r, 3, "group")
    assert torch.allclose(group[:3], (r[:3] - 1 / 3) / (r[:3].std() + 1e-4))
    assert torch.equal(group[3:], torch.zeros(3))  # equal rewards: no signal
    assert torch.allclose(advantages(r, 3, "none"), torch.tensor([2 / 3, -1 / 3, -1 / 3, 0, 0, 0]))
    assert torch.allclose(advantages(r, 3, "batch"), advantages(r, 3, "none") / (r.std() + 1e-4))
    assert row_weights([2, 4], "grpo", 8) == ([0.5, 0.25], 2)
    assert row_weights([2, 4], "dapo", 8) == ([1.0, 1.0], 6)
    assert row_weights([2, 4], "dr_grpo", 8) == ([0.125, 0.125], 2)


def test_the_zero_guard_judges_what_a_step_can_show():
    """GRPO's on-policy loss value is zero whenever the advantages cancel, and its gradient too when every reward of
    every group is equal: neither is the device's silent zero; a zero gradient on a step with signal still is."""
    from rocktune.train.guards import FatalNumerics, NumericGuard

    guard = NumericGuard(nan_patience=3, zero_patience=3)
    for step in range(1, 10):  # the loss value alone, or everything on a step without signal
        guard.check(step, 0.0, 0.5, ("loss",))
        guard.check(step, 0.0, 0.0, ("loss", "grad"))
    assert guard.zero_in_row == 0
    guard.check(10, 0.0, 0.0, ("loss",))
    guard.check(11, 0.0, 0.0, ("loss", "grad"))  # neither counts nor clears
    guard.check(12, 0.0, 0.0, ("loss",))
    with pytest.raises(FatalNumerics, match="exactly zero for 3 steps"):
        guard.check(13, 0.0, 0.0, ("loss",))


def _tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_sampler_matches_a_full_forward_and_its_rng_resumes(tiny_model_dir, tokenizer):
    """Greedy completions from the KV cache equal argmax over full forwards of the growing text; a generator state
    saved and restored samples the same completions again; a row's keyed draws sample the same completion whatever
    rows share its batch."""
    model = _tiny(tiny_model_dir)
    prompts = [tuple(tokenizer("upper abcd =")["input_ids"]), tuple(tokenizer("add 3 4 =")["input_ids"])]
    greedy = sample(model, prompts, Sampling(6, 0.0), tokenizer.pad_token_id, None)
    for p, got in zip(prompts, greedy):
        ids = list(p)
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert got == ids[len(p):]
    gen = new_generator("cpu", 3)
    state = gen.get_state()
    s = Sampling(8, 1.0, top_k=20, top_p=0.9, stop_ids=(tokenizer.eos_token_id,))
    first = sample(model, prompts * 2, s, tokenizer.pad_token_id, gen)
    gen.set_state(state)
    assert sample(model, prompts * 2, s, tokenizer.pad_token_id, gen) == first
    draws = row_draws([11, 12, 13, 14], 8)
    whole = sample(model, prompts * 2, s, tokenizer.pad_token_id, draws)
    assert len(set(map(tuple, whole))) > 2  # sampled, not one greedy answer per prompt
    alone = [sample(model, [p], s, tokenizer.pad_token_id, draws[i : i + 1])[0] for i, p in enumerate(prompts * 2)]
    assert alone == whole
    stopped = sample(model, prompts, Sampling(8, 0.0, stop_strings=(greedy[0] and tokenizer.decode(greedy[0][:2]),)),
                     tokenizer.pad_token_id, None, lambda ids: tokenizer.decode(ids))
    assert stopped[0] == greedy[0][:2]


def grpo_config(model_dir, train, out, **training) -> dict:
    t = {"max_steps": 4, "micro_batch_size": 4, "grad_accum": 2, "lr": 5e-3, "warmup_steps": 0, "eval_every": 2,
         "precision": "fp32", "device": "cpu", "seed": 0, **training}
    return {"task": "grpo", "model": {"name_or_path": str(model_dir)}, "lora": {"r": 8, "alpha": 16},
            "data": {"train_file": str(train), "max_length": 32, "eval_fraction": 0.2},
            "grpo": {"num_generations": 4, "max_completion_length": 6, "beta": 0.05, "top_k": 30,
                     "rewards": [{"function": "exact"}, {"function": "regex", "pattern": "[A-Z]", "weight": 0.5}]},
            "training": t, "output": {"dir": str(out)}}


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    from rocktune.demo.task import make_task

    rows, _ = make_task(n_train=40, n_eval=0, seed=1)
    return write_jsonl(tmp_path_factory.mktemp("grpo") / "prompts.jsonl",
                       [{"prompt": r["prompt"], "answer": r["completion"]} for r in rows])


def test_a_tiny_run_logs_trl_metrics(tiny_model_dir, prompt_file, tmp_path):
    from rocktune.tasks import train

    result = train(config_from_dict(grpo_config(tiny_model_dir, prompt_file, tmp_path / "run")), quiet=True)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 4 and all(r["completions"] == 8 for r in steps)
    for key in ("reward", "reward_std", "kl", "rewards/exact/mean", "rewards/regex/mean", "completions/mean_length",
                "clip_ratio/region_mean", "frac_reward_zero_std", "rollout_tokens_per_s"):
        assert all(key in r for r in steps), key
    assert all(0 < r["completions/mean_length"] <= 6 for r in steps)
    assert all(r["clip_ratio/region_mean"] == 0.0 for r in steps)  # one update per rollout: the ratio is 1
    assert steps[0]["kl"] == 0.0 and steps[-1]["kl"] > 0  # the adapter starts as the reference, then moves
    assert [r["step"] for r in rows if "eval_reward" in r] == [0, 2, 4]  # every eval_every, not only the ends
    assert (result.run_dir / "adapter" / "adapter_model.safetensors").is_file()
    pytest.importorskip("matplotlib")
    from rocktune.report.plots import all_plots
    from rocktune.report.rundata import load_run
    from rocktune.report.run_report import summary_row

    plots = all_plots([load_run(result.run_dir)])
    assert {"loss", "reward", "kl", "completion_length", "clip_ratio"} <= set(plots)
    assert "held-out reward, greedy (first → last)" in summary_row(load_run(result.run_dir))


def test_plan_counts_the_rollout_kv_cache():
    """K and V of every layer for every completion of a step, prompt + completion tokens long; the rollout's peak
    replaces the update's when larger (the cache is freed before the update's forward)."""
    from dataclasses import replace

    from rocktune.planner.estimate import RunSpec, estimate
    from rocktune.planner.shapes import load_shape

    shape = load_shape("Qwen2.5-0.5B")
    spec = RunSpec(micro_batch=4, seq_len=768, precision="bf16", rollout_rows=64, rollout_prompt=256,
                   rollout_new=512)
    est = estimate(shape, spec)
    assert est.by_name()["rollout_kv_cache"] == 2 * shape.layers * shape.kv_dim * 2 * 64 * 768
    update = estimate(shape, replace(spec, rollout_rows=0))
    assert "rollout_kv_cache" not in update.by_name()
    rollout = sum(t.bytes for t in est.terms if t.phase == "rollout")
    assert est.peak_allocated == max(update.peak_allocated, update.phase("static") + rollout)
    huge = estimate(shape, replace(spec, rollout_rows=4096))
    assert huge.peak_allocated == huge.phase("static") + sum(t.bytes for t in huge.terms if t.phase == "rollout")


def test_data_preview_shows_prompt_answer_and_generation_prompt(tiny_model_dir, tmp_path):
    import subprocess

    import yaml

    rows = [{"question": "How many apples?", "answer": "3 + 4 = 7\n#### 7", "level": 1}, {"prompt": "upper ab ="}]
    cfg = {"task": "grpo", "model": {"name_or_path": str(tiny_model_dir)},
           "data": {"train_file": str(write_jsonl(tmp_path / "p.jsonl", rows)), "max_length": 32}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-m", "rocktune", "data", "preview", "-c", str(tmp_path / "c.yaml"),
                          "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    pv = json.loads(out.stdout)
    assert (pv["n_prompts"], pv["n_with_answer"]) == (2, 1)
    first, second = pv["prompts"]
    assert (first["prompt"], first["answer"], first["fields"]) == ("How many apples?", "7", ["level"])
    assert first["rendered"].endswith("How many apples?") and second["answer"] is None
    ref = pv["reference_tokens"]  # the worked solution as written, not only the final '7'
    assert ref["min"] == ref["max"] > 3 and pv["max_completion_length"] == 512 and pv["completion_note"] is None


@pytest.mark.parametrize("change, options, words", [
    ({"training": {"micro_batch_size": 5}}, {}, "multiple of grpo.num_generations=4"),
    ({"training": {"parallel": "fsdp"}}, {"processes": 2}, "training.parallel=ddp"),
    ({}, {"auto_fit": True}, "--auto fits supervised"),
])
def test_refused_before_launch(tiny_model_dir, prompt_file, tmp_path, change, options, words):
    from rocktune.tasks import refuse_before_launch
    from rocktune.train.request import RunOptions

    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path / "run")
    for section, values in change.items():
        cfg[section].update(values)
    with pytest.raises(UserError, match=words):
        refuse_before_launch(config_from_dict(cfg), RunOptions(**options))


def test_generate_prompts_a_grpo_run_as_it_was_trained(tmp_path):
    """Text prompts were tokenised raw (even where the tokenizer has a chat template); messages through it."""
    from rocktune.export.style import training_style

    text = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "upper ab =", "answer": " AB"}])
    chat = write_jsonl(tmp_path / "c.jsonl", [{"q": [{"role": "user", "content": "hi"}]}])
    assert training_style({"task": "grpo", "data": {"train_file": str(text)}}) == "raw"
    assert training_style({"task": "grpo", "data": {"train_file": str(chat), "columns": {"prompt": "q"}}}) == "chat"
    talk = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    assert training_style({"task": "grpo", "data": {"train_file": str(talk)}}) == "chat"  # a conversation's turns


def test_a_rollout_out_of_memory_samples_in_smaller_batches(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """More than 4 rows in one sampling batch "run out of memory": the step's 8 rows are sampled in 2 batches from
    then on (logged, and kept by checkpoints), and the run trains on, sampling the completions a run without the
    split samples (each row's draws are its own)."""
    from rocktune.tasks import train
    from rocktune.tasks.grpo import task as grpo_task

    real = grpo_task.sample

    def small_only(model, prompts, *args, **kwargs):
        if len(prompts) > 4:
            raise MemoryError()
        return real(model, prompts, *args, **kwargs)

    train(config_from_dict(grpo_config(tiny_model_dir, prompt_file, tmp_path / "whole", max_steps=2, eval_every=0)),
          quiet=True)
    monkeypatch.setattr(grpo_task, "sample", small_only)
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path / "run", max_steps=2, eval_every=0)
    train(config_from_dict(cfg), quiet=True)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_pieces"] for r in rows if "loss" in r] == [2, 2]
    whole = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in rows if "loss" in r] == [r["samples"] for r in whole if "loss" in r]
    assert all(r["completions"] == 8 for r in rows if "loss" in r)
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step-0000002" / "meta.json").read_text())
    assert meta["extra"]["rollout_pieces"] == 2

    def never(model, prompts, *args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(grpo_task, "sample", never)
    from rocktune.train.step import OutOfMemoryAtMinimum

    with pytest.raises(OutOfMemoryAtMinimum, match="one completion at a time"):
        train(config_from_dict(grpo_config(tiny_model_dir, prompt_file, tmp_path / "b", max_steps=1)), quiet=True)


def _adapted(tiny_model_dir):
    """The tiny model with a LoRA adapter whose B is not zero (so the side path shows), rocktune's side paths on."""
    from rocktune.lora.lean import lean_lora
    from rocktune.models.load import apply_lora

    model = apply_lora(_tiny(tiny_model_dir), 8, 16, 0.0, "all-linear", False)
    lean_lora(model)
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model.eval()


def _rollout_prompts(tokenizer):
    return [tuple(tokenizer(t)["input_ids"]) for t in ("upper abcd =", "add 3 4 =", "rev xyz =", "upper q =")] * 2


def test_the_rollout_on_rocktunes_side_path_equals_pefts(tiny_model_dir, tokenizer):
    """The rollout decodes through rocktune's LoRA side path (lean_lora: what training patches in); its greedy
    completions, and those it samples from the same generator state, are PEFT's own forward's, token for token."""
    from rocktune.lora.lean import peft_forward

    model = _adapted(tiny_model_dir)
    prompts, pad = _rollout_prompts(tokenizer), tokenizer.pad_token_id
    assert any("_peft_forward" in vars(m) for m in model.modules())  # the side path is on
    for s, seed in ((Sampling(12, 0.0), None), (Sampling(12, 1.0, top_k=40), 5)):
        fast = sample(model, prompts, s, pad, seed and new_generator("cpu", seed))
        with peft_forward(model):
            ref = sample(model, prompts, s, pad, seed and new_generator("cpu", seed))
        assert fast == ref


@pytest.mark.long
def test_the_compiled_static_rollout_equals_pefts_and_follows_the_adapter(tiny_model_dir, tokenizer):
    """grpo.compile_rollout: the compiled decode step over a static cache gives PEFT's eager greedy completions
    and log-probabilities (within lora/check.py's fp32 tolerance), for prompts of another width on a later call too,
    and after the adapter's values change in place (an optimizer step): nothing stale is compiled in."""
    from rocktune.lora.lean import peft_forward
    from rocktune.tasks.grpo.rollout import StaticDecode

    _skip_under_a_chosen_kernel_set()
    model = _adapted(tiny_model_dir)
    prompts, pad = _rollout_prompts(tokenizer), tokenizer.pad_token_id
    static = StaticDecode(model, 32 + 10)
    for round_ in range(3):
        batch = prompts if round_ != 1 else [p + p[-2:] for p in prompts]  # another width: the same graph
        with peft_forward(model):
            ref = sample(model, batch, Sampling(10, 0.0), pad, None)
        got = sample(model, batch, Sampling(10, 0.0), pad, None, static=static)
        assert got == ref
        rows = [list(p) + c for p, c in zip(batch, got)]
        _assert_logps_equal(model, static, batch, rows, pad)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.5)
    _compiled_or_skip(static.fallback)


def _compiled_or_skip(fallback: str | None) -> None:
    """The values above held; if they came from the eager fallback, the compiled step itself was not checked: say
    so."""
    if fallback:
        pytest.skip(f"Inductor could not compile here ({fallback}); only the eager fallback was checked")


def _skip_under_a_chosen_kernel_set() -> None:
    """torch 2.13's Inductor built a decode step that returned wrong tokens under ATEN_CPU_CAPABILITY=avx2 on an
    AVX-512 CPU, and none under default: a run turns grpo.compile_rollout off there (GRPOTask.prepare)."""
    import os

    if os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip("grpo.compile_rollout is off under ATEN_CPU_CAPABILITY (Inductor's CPU code is not built for it)")


def _assert_logps_equal(model, static, prompts, rows, pad):
    """The static path's decode-step log-probabilities against PEFT's full forward over each whole row, relative to
    max(|log p|, 1) as lora/check.py compares losses."""
    from rocktune.lora.lean import peft_forward
    from rocktune.lora.check import TOLERANCE

    logged = []
    run = static.run

    def keep(*args):
        out = run(*args)
        logged.append(torch.log_softmax(out.float(), -1))
        return out
    static.run = keep
    try:
        sample(model, prompts, Sampling(10, 0.0), pad, None, static=static)
    finally:
        static.run = run
    with peft_forward(model), torch.no_grad():
        for i, (p, row) in enumerate(zip(prompts, rows)):
            full = torch.log_softmax(model(torch.tensor([row])).logits[0].float(), -1)
            for t, step in enumerate(logged):  # step t predicts the token after prompt + t + 1 tokens
                want = full[len(p) + t]
                worst = float(((step[i] - want).abs() / want.abs().clamp(min=1.0)).max())
                assert worst <= TOLERANCE["fp32"]["loss"], (i, t, worst)


@pytest.mark.long
def test_a_run_with_the_compiled_rollout_samples_what_the_eager_one_does(tiny_model_dir, prompt_file, tmp_path,
                                                                       monkeypatch):
    """grpo.compile_rollout in a whole run: the same completions (the steps' sample digests) and losses as the
    eager rollout, the held-out evaluation included, its rollouts decoded by the compiled step."""
    from rocktune.tasks import train
    from rocktune.tasks.grpo.rollout import StaticDecode

    _skip_under_a_chosen_kernel_set()
    calls = []
    run = StaticDecode.run

    def counted(self, *args):
        out = run(self, *args)
        calls.append(self.fallback)
        return out
    monkeypatch.setattr(StaticDecode, "run", counted)

    runs = []
    for compiled in (False, True):
        cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path / f"run{compiled}", max_steps=3, eval_every=2)
        cfg["grpo"]["compile_rollout"] = compiled
        train(config_from_dict(cfg), quiet=True)
        rows = [json.loads(x) for x in (tmp_path / f"run{compiled}" / "metrics.jsonl").read_text().splitlines()]
        runs.append([r for r in rows if "loss" in r or "eval_reward" in r])
    eager, compiled = runs
    assert [r.get("samples") for r in compiled] == [r.get("samples") for r in eager]
    assert [r.get("eval_reward") for r in compiled] == [r.get("eval_reward") for r in eager]
    for a, b in zip(eager, compiled):
        if "loss" in a:
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"]))
    assert calls  # the rollouts decoded through the static path
    _compiled_or_skip(next((f for f in calls if f), None))


def test_a_checkpoint_of_the_older_sampler_is_refused_unless_forced(tiny_model_dir, prompt_file, tmp_path):
    """A checkpoint written while rollouts drew from one generator (no ``sampler`` key) cannot continue as one exact
    run with keyed draws: refused, and --resume-force goes on; one from another number of processes likewise."""
    from types import SimpleNamespace

    from rocktune.tasks.grpo.task import SAMPLER, GRPOTask
    from rocktune.train.distributed import Dist

    task = GRPOTask(config_from_dict(grpo_config(tiny_model_dir, prompt_file, tmp_path / "run")))
    task.run = SimpleNamespace(ctx=SimpleNamespace(dist=Dist(), notes=[]))

    def restored(**extra):
        return SimpleNamespace(extra={"world_size": 1, **extra}, path=tmp_path / "step-0000002")
    with pytest.raises(UserError, match="another random stream"):
        task.check_resume(restored(sampler_rng="AAAA"), False)
    task.check_resume(restored(sampler_rng="AAAA"), True)
    task.check_resume(restored(sampler=SAMPLER), False)
    with pytest.raises(UserError, match="written by 2 process"):
        task.check_resume(restored(sampler=SAMPLER, world_size=2), False)


def test_token_logps_of_a_padded_batch_are_each_row_alone(tiny_model_dir, tokenizer):
    """The update's forward runs without the padding mask (loss.token_logps: the rows are right-padded, so causal
    attention alone keeps real tokens from the pads): on rows of different prompt and completion lengths, each row's
    log-probabilities and the adapter's gradient equal those of the row alone, unpadded, within fp32 rounding."""
    from rocktune.tasks.grpo.feed import collate
    from rocktune.tasks.grpo.loss import token_logps

    model = _adapted(tiny_model_dir).train()  # with gradients: the fused LoRA node, as in a step
    prompts = _rollout_prompts(tokenizer)[:4]
    completions = [[5, 6, 7], [8] * 9, [9, 10], [11, 12, 13, 14, 15]]
    params = [p for p in model.parameters() if p.requires_grad]

    def logps_and_grad(ps, cs):
        batch = collate(ps, cs, [1.0] * len(ps), [1.0] * len(ps), tokenizer.pad_token_id)
        logps = token_logps(model, batch, 0.7)
        grads = torch.autograd.grad(logps.sum(), params)
        rows = [row[m.bool()] for row, m in zip(logps.detach(), batch["completion_mask"][:, 1:])]
        return rows, torch.cat([g.flatten() for g in grads])

    assert len({len(p) + len(c) for p, c in zip(prompts, completions)}) > 1  # the batch has right padding
    batched, grad = logps_and_grad(prompts, completions)
    alone = [logps_and_grad([p], [c]) for p, c in zip(prompts, completions)]
    for row, (one, _) in zip(batched, alone):
        assert torch.allclose(row, one[0], atol=1e-5)
    assert torch.allclose(grad, sum(g for _, g in alone), atol=1e-5)


def _feed(rewards: list[float], skip: bool, rows_per_forward: int = 4):
    """A RolloutFeed over a fake rollout: 2 prompts x 4 completions with these rewards."""
    from rocktune.tasks.grpo.feed import Rollout, RolloutFeed, StepShape

    prompts = [(5, 6, 7), (8, 9)]

    def rollout(idx, keys):
        rows = [prompts[i % 2] for i in idx for _ in range(4)]
        completions = [[10 + k, 11, 12 + k % 3][: 1 + k % 3] for k in range(len(rows))]
        return Rollout(rows, completions, rewards, {"r": rewards}, [True] * len(rows))

    return RolloutFeed(2, StepShape(2, 4, rows_per_forward, "dapo", 8, "group", 0, 0, skip), rollout)


def test_rows_whose_advantage_is_zero_get_no_forward_and_change_nothing(tiny_model_dir):
    """beta 0: a group of equal rewards has advantage exactly 0, which adds exactly 0 to the loss and its gradient;
    its rows are not computed (each forward keeps one at least), and the step's loss, gradient and statistics are
    those of every row computed."""
    from rocktune.models.load import apply_lora, load_model
    from rocktune.tasks.grpo.loss import GRPOLoss, Objective

    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]  # the second prompt's group: all equal
    skipped, full = _feed(rewards, True).next(), _feed(rewards, False).next()
    assert [b["input_ids"].shape[0] for b in skipped.forwards] == [4, 1]  # the zero group's forward keeps one row
    assert skipped.stats["zero_advantage_skipped"] == 3 and full.stats["zero_advantage_skipped"] == 0
    assert skipped.loss_tokens == full.loss_tokens and skipped.completion_tokens == full.completion_tokens
    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_model_dir), "fp32", "sdpa", False, "cpu"), 8, 16, 0.0, "all-linear", False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    loss = GRPOLoss(model, Objective(epsilon=0.2))
    results = []
    for fed in (skipped, full):
        total = sum(loss({**b, "old_logps": torch.full((b["input_ids"].shape[0], b["input_ids"].shape[1] - 1), -7.0)})
                    for b in fed.forwards) / fed.loss_tokens
        total.backward()
        grad = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if "lora_" in n])
        model.zero_grad()
        results.append((float(total), grad, loss.take_stats(None, fed.completion_tokens)))
    (a, ga, sa), (b, gb, sb) = results
    assert a == pytest.approx(b, rel=1e-6) and float((ga - gb).abs().max()) <= 1e-6 * float(gb.abs().max())
    assert sa == pytest.approx(sb, rel=1e-6) and sa["clip_ratio/high_mean"] > 0  # old logps of -7: ratios clip
    every_zero = _feed([0.5] * 8, True).next()
    assert [b["input_ids"].shape[0] for b in every_zero.forwards] == [1, 1]
    assert every_zero.zero_expected == ("loss", "grad")


def test_the_tripwire_probes_the_shared_prompt_forward(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """GRPO's probe takes two completions of one prompt, so a shared-prompt forward gone wrong (here: positions off
    by one) stops the run at step 1 against the reference over full rows, where a one-row probe shares nothing."""
    from rocktune.tasks import train
    from rocktune.tasks.grpo import prefix
    from rocktune.train import tripwire

    real = prefix._completion_rows

    def shifted(*args):
        tokens, cols, positions, attention = real(*args)
        return tokens, cols, positions + 1, attention

    monkeypatch.setattr(prefix, "_completion_rows", shifted)
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path / "run", max_steps=2, eval_every=0)
    with pytest.raises(tripwire.TrainingPathWrong, match=r"step 1: .*computes other values than PEFT's reference"):
        train(config_from_dict(cfg), quiet=True)
