"""task: dpo / orpo — preference data as users have it, the pair layout the engine never cuts, the losses'
formulas, the refusals from the config's field tags, and real training on the tiny model (tests/test_task_contract.py
runs the engine's reliability contract against both tasks; tests/test_preference_trl.py compares with TRL)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from rocktune.config import config_from_dict
from rocktune.data.encode import IGNORE
from rocktune.tasks.preference.pairs import PairText, encode_pair, pair_set, read_pair
from rocktune.errors import UserError
from rocktune.tasks.preference.feed import PairFeed, collate_pairs, split_pairs
from rocktune.tasks.preference.loss import Objective, SequenceLogps, pair_losses
from tests.conftest import tiny_run_config, write_jsonl

CHAT_PROMPT = [{"role": "user", "content": "upper abcd"}]


def test_every_format_gives_the_same_pair(tokenizer):
    """TRL's plain, conversational and implicit-prompt records and LLaMA-Factory's ranking records are read into
    the same prompt and answers; the prompt is masked and shared, each answer ends with its end marker."""
    plain = read_pair({"prompt": "upper abcd =", "chosen": " ABCD", "rejected": " abcd"}, "r0")
    implicit = read_pair({"chosen": "upper abcd = ABCD", "rejected": "upper abcd = abcd"}, "r1")
    assert (implicit.prompt, implicit.chosen, implicit.rejected) == ("upper abcd =", " ABCD", " abcd")
    assert plain == implicit
    conv = read_pair({"prompt": CHAT_PROMPT, "chosen": [{"role": "assistant", "content": "ABCD"}],
                      "rejected": [{"role": "assistant", "content": "abcd"}]}, "r2")
    implicit_conv = read_pair({"chosen": CHAT_PROMPT + [{"role": "assistant", "content": "ABCD"}],
                               "rejected": CHAT_PROMPT + [{"role": "assistant", "content": "abcd"}]}, "r3")
    sharegpt = read_pair({"conversations": [{"from": "human", "value": "upper abcd"}],
                          "chosen": {"from": "gpt", "value": "ABCD"}, "rejected": {"from": "gpt", "value": "abcd"}},
                         "r4")
    assert conv == implicit_conv == sharegpt and conv.chat
    alpaca = read_pair({"instruction": "Upper-case it.", "input": "abcd", "chosen": "ABCD", "rejected": "abcd"}, "r5")
    assert "### Instruction:\nUpper-case it." in alpaca.prompt and alpaca.prompt.endswith("### Response:\n")

    pair = encode_pair(plain, tokenizer, 64, "prompt", "r0")
    (c_ids, c_labels), (r_ids, _) = pair.chosen, pair.rejected
    n_prompt = len(tokenizer("upper abcd =")["input_ids"])
    assert c_ids[:n_prompt] == r_ids[:n_prompt] and c_labels[:n_prompt] == [IGNORE] * n_prompt
    assert c_labels[n_prompt:] == c_ids[n_prompt:] and c_ids[-1] == tokenizer.eos_token_id
    chat = encode_pair(conv, tokenizer, 64, "prompt", "r2")
    rendered = tokenizer.apply_chat_template(CHAT_PROMPT, tokenize=False, add_generation_prompt=True)
    n_chat = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert chat.chosen[1][:n_chat] == [IGNORE] * n_chat and IGNORE not in chat.chosen[1][n_chat:]
    assert tokenizer.decode(chat.chosen[0][n_chat:]).startswith("ABCD")


def test_data_columns_map_other_names(tmp_path, tokenizer):
    from rocktune.config import DataConfig
    from rocktune.data.rows import read_rows
    from rocktune.tasks.preference.pairs import encode_rows

    f = write_jsonl(tmp_path / "p.jsonl", [{"question": "add 1 2 =", "good": " 03", "bad": " 04"}])
    d = DataConfig(train_file=str(f), columns={"prompt": "question", "chosen": "good", "rejected": "bad"})
    pairs, cut = encode_rows(read_rows(str(f), d, tmp_path / "cache", "data.train_file"), tokenizer, 64, "prompt")
    assert len(pairs) == 1 and cut == 0
    assert tokenizer.decode([t for t in pairs[0].chosen[1] if t != IGNORE]).startswith(" 03")


@pytest.mark.parametrize(("row", "words"), [
    ({"prompt": "p", "chosen": "a"}, "needs 'chosen' and 'rejected'"),
    ({"prompt": "p", "chosen": "a", "rejected": 3}, "'rejected' must be a string"),
    ({"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}, "both be text or both"),
    ({"conversations": [{"from": "robot", "value": "x"}], "chosen": {"from": "gpt", "value": "a"},
      "rejected": {"from": "gpt", "value": "b"}}, r"conversations\[0\] must be a \{'from', 'value'\} turn"),
])
def test_a_bad_row_is_named(tmp_path, tokenizer, row, words):
    from rocktune.config import DataConfig
    from rocktune.data.rows import read_rows
    from rocktune.tasks.preference.pairs import encode_rows

    good = {"prompt": "p", "chosen": " a", "rejected": " b"}
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n")  # the blank line: the row is on line 3
    d = DataConfig(train_file=str(f))
    with pytest.raises(UserError, match=f"p.jsonl:3: .*{words}"):
        encode_rows(read_rows(str(f), d, tmp_path / "cache", "data.train_file"), tokenizer, 64, "prompt")


def test_an_empty_answer_is_named(tokenizer):
    with pytest.raises(UserError, match="row 7: the 'rejected' answer is empty"):
        encode_pair(PairText("p", " a", "", False), tokenizer, 64, "prompt", "row 7")


def test_truncation_cuts_the_prompt_first_and_both_answers_alike(tokenizer):
    long_prompt = " ".join(["word"] * 40)
    pair = encode_pair(PairText(long_prompt, " yes", " no no", False), tokenizer, 16, "prompt", "r")
    assert pair.truncated
    (c_ids, c_labels), (r_ids, r_labels) = pair.chosen, pair.rejected
    n_prompt = c_labels.index(next(t for t in c_labels if t != IGNORE))
    assert c_ids[:n_prompt] == r_ids[:n_prompt]  # the same prompt tokens: the answers are compared on one context
    assert len(r_ids) == 16 and r_labels[n_prompt:] == r_ids[n_prompt:]  # the longer answer whole, the prompt's end
    assert tokenizer.decode(r_ids[n_prompt:-1]) == " no no" and r_ids[-1] == tokenizer.eos_token_id
    end = encode_pair(PairText(long_prompt, " yes", " no", False), tokenizer, 16, "end", "r")
    assert len(end.chosen[0]) == len(end.rejected[0]) == 16 and end.chosen[1][-1] != IGNORE


def _pairs(tokenizer, n=5):
    texts = [("add 1 2 =", " 03", " 04 04"), ("upper ab =", " AB", " ab"), ("x", " y", " z z z"),
             ("reverse abc =", " cba", " abc"), ("add 2 2 =", " 04", " 05")][:n]
    return pair_set([encode_pair(PairText(*t, False), tokenizer, 32, "prompt", f"r{i}") for i, t in enumerate(texts)])


def test_a_row_is_one_pair_and_no_split_separates_it(tokenizer):
    """chosen and rejected share a row (each its own positions), and the OOM split cuts between rows only."""
    pairs = _pairs(tokenizer)
    batch = collate_pairs(pairs, [0, 1, 2], tokenizer.pad_token_id, 0.5, segments=True)
    assert batch["input_ids"].shape[0] == 3 and all(v.shape[0] == 3 for k, v in batch.items() if k != "cu_seq_lens")
    c, r = len(pairs.pairs[0].chosen[0]), len(pairs.pairs[0].rejected[0])
    assert batch["side"][0, :c].eq(1).all() and batch["side"][0, c:c + r].eq(2).all()
    assert batch["position_ids"][0, c] == 0  # the rejected sequence restarts: it never attends to the chosen
    pieces = split_pairs(batch, 8)
    assert len(pieces) == 3
    width = batch["input_ids"].shape[1]
    for i, piece in enumerate(pieces):
        assert piece["input_ids"].equal(batch["input_ids"][i : i + 1])
        ci, ri = len(pairs.pairs[i].chosen[0]), len(pairs.pairs[i].rejected[0])
        assert piece["cu_seq_lens"].tolist() == [0, ci, ci + ri] + ([width] if ci + ri < width else [])
    feed = PairFeed(pairs, 2, 2, 0, lambda idx, scale: collate_pairs(pairs, idx, 0, scale, False), (1, 2, None))
    step = feed.next()
    from rocktune.data.batching import epoch_batches

    first_two = epoch_batches(pairs.lengths(), 2, 0, 0)[:2]  # the step's two micro-batches (every rank's pairs)
    assert step.loss_tokens == sum(map(len, first_two)) and len(step.forwards) == 1  # rank 1 takes one of them
    assert step.picked == first_two[1:]


def test_sequence_logps_score_each_answer_on_its_own_tokens(tokenizer, tiny_model_dir):
    """The packed row's log-probabilities equal those of each sequence run alone."""
    from transformers import AutoModelForCausalLM

    from rocktune.tasks.preference.loss import sequence_logps

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    pairs = _pairs(tokenizer, 2)
    got = sequence_logps(model, collate_pairs(pairs, [0, 1], tokenizer.pad_token_id, 1.0, False))
    for row, pair in enumerate(pairs.pairs):
        for col, (ids, labels) in enumerate((pair.chosen, pair.rejected)):
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
            logps = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
            keep = torch.tensor(labels[1:]) != IGNORE
            assert float(got.sums[row, col]) == pytest.approx(float(logps[keep].sum()), abs=1e-4)
            assert int(got.counts[row, col]) == int(keep.sum())


def test_loss_formulas():
    """The formulas written out independently: DPO sigmoid with conservative label smoothing (TRL's own sigmoid
    has none since 1.0; this is the DPO paper's cDPO, as TRL < 1.0 computed it), IPO, ORPO."""
    pol = SequenceLogps(torch.tensor([[-4.0, -6.0], [-3.0, -2.5]]), torch.tensor([[2.0, 3.0], [1.0, 2.0]]),
                        torch.tensor([5.0, 4.0]))
    ref = SequenceLogps(torch.tensor([[-5.0, -5.0], [-3.0, -3.0]]), pol.counts)
    beta, eps = 0.2, 0.1
    losses, stats = pair_losses(Objective("dpo", beta, "sigmoid", eps), pol, ref)
    m = [beta * ((-4 + 5) - (-6 + 5)), beta * ((-3 + 3) - (-2.5 + 3))]
    want = [-(1 - eps) * math.log(1 / (1 + math.exp(-x))) - eps * math.log(1 / (1 + math.exp(x))) for x in m]
    assert losses.tolist() == pytest.approx(want, abs=1e-6)
    assert stats["rewards/chosen"].tolist() == pytest.approx([0.2, 0.0])
    assert stats["rewards/accuracies"].tolist() == [1, 0]
    losses, _ = pair_losses(Objective("dpo", beta, "ipo"), pol, ref)
    assert losses.tolist() == pytest.approx([((1 / 2 - -1 / 3) - 2.5) ** 2, ((0 / 1 - 0.5 / 2) - 2.5) ** 2], abs=1e-6)
    losses, stats = pair_losses(Objective("orpo", beta), pol, None, torch.tensor([0.5, 0.5]))
    ac, ar = torch.tensor([-2.0, -3.0]), torch.tensor([-2.0, -1.25])
    odds = (ac - ar) - (torch.log1p(-ac.exp()) - torch.log1p(-ar.exp()))
    assert losses.tolist() == pytest.approx((torch.tensor([2.5, 2.0]) - beta * F.logsigmoid(odds)).tolist(), abs=1e-6)


def test_keys_of_other_tasks_are_refused_from_the_field_tags(tiny_model_dir, pair_files, tmp_path):
    from rocktune.tasks import train

    cfg = tiny_run_config(tiny_model_dir, *pair_files, tmp_path / "run")
    cfg["task"] = "orpo"
    cfg["training"]["sample_count"], cfg["preference"] = 2, {"loss_type": "ipo"}
    with pytest.raises(UserError, match=r"training.sample_count=2: only for task=lm, vlm; preference.loss_type=ipo: "
                                        r"only for task=dpo\. Not supported for task=orpo"):
        train(config_from_dict(cfg), quiet=True)
    lm = tiny_run_config(tiny_model_dir, *pair_files, tmp_path / "run")
    lm["preference"] = {"beta": 0.5}
    with pytest.raises(UserError, match=r"preference.beta=0.5: only for task=dpo, orpo"):
        train(config_from_dict(lm), quiet=True)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("task", ["dpo", "orpo"])
def test_training_prefers_the_chosen_answers(task, tiny_model_dir, pair_files, tmp_path):
    """A real run: the metrics users read are logged every step, the reward margin and accuracy on the held-out
    pairs rise, and only the adapter changed."""
    from rocktune.tasks import train

    cfg = tiny_run_config(tiny_model_dir, *pair_files, tmp_path / "run", max_steps=12, micro_batch_size=8,
                          grad_accum=1, lr=1e-2, eval_every=0)
    cfg["task"] = task
    result = train(config_from_dict(cfg), quiet=True)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 12 and all(r["pairs"] == 8 for r in steps)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected"):
        assert all(math.isfinite(r[key]) for r in steps), key
    evals = [r for r in rows if "eval_rewards/margins" in r]
    assert [r["step"] for r in evals] == [0, 12]
    # measured (2 CPU cores, fp32): DPO 0.0 -> 1.045, accuracy 0 -> 1; ORPO -0.011 -> 0.035, accuracy 0.5 -> 1
    rise = 0.5 if task == "dpo" else 0.02
    assert evals[1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"] + rise
    assert evals[1]["eval_rewards/accuracies"] >= 0.75
    assert result.eval_loss_after < result.eval_loss_before
    if task == "dpo":
        assert evals[0]["eval_rewards/margins"] == 0.0 and result.eval_loss_before == pytest.approx(math.log(2))
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    from rocktune.report.rundata import load_run
    from rocktune.report.run_report import summary_row, write_report

    page = write_report([load_run(tmp_path / "run")]).read_text()
    assert "Preference rewards" in page and "Reward accuracy" in page and "loss per preference pair" not in page
    assert {p.name for p in (tmp_path / "run" / "report_plots").iterdir()} >= {"rewards.png", "accuracy.png"}
    row = summary_row(load_run(tmp_path / "run"))["eval reward accuracy / margin (first → last)"]
    assert row.endswith(f"{evals[1]['eval_rewards/accuracies']:.3f} / {evals[1]['eval_rewards/margins']:.4f}")


def test_data_preview_shows_a_pair_side_by_side_with_its_trained_tokens(tiny_model_dir, pair_files, tmp_path):
    import subprocess
    import sys

    import yaml

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"task": "dpo", "model": {"name_or_path": str(tiny_model_dir)},
                                   "data": {"train_file": str(pair_files[0]), "max_length": 32}}))
    out = subprocess.run([sys.executable, "-m", "rocktune", "data", "preview", "-c", str(cfg), "-n", "1", "--json"],
                         capture_output=True, text=True, check=True).stdout
    pv = json.loads(out)
    first = json.loads(pair_files[0].read_text().splitlines()[0])
    assert pv["n_pairs"] == 64 and pv["n_truncated"] == 0 and pv["pairs"][0]["loc"].endswith("train.jsonl:1")
    chosen, rejected = pv["pairs"][0]["chosen"], pv["pairs"][0]["rejected"]
    assert chosen[0] == [first["prompt"], False, False] and rejected[0] == chosen[0]  # the prompt: shared, untrained
    assert "".join(t for t, trained, _ in chosen if trained).startswith(first["chosen"])
    assert "".join(t for t, trained, _ in rejected if trained).startswith(first["rejected"])
    text = subprocess.run([sys.executable, "-m", "rocktune", "data", "preview", "-c", str(cfg), "-n", "1"],
                          capture_output=True, text=True, check=True).stdout
    assert f"[{first['chosen']}]" in text and f"[{first['rejected']}]" in text


def _short_run(tiny_model_dir, pair_files, out, task="dpo", **model):
    from rocktune.tasks import train

    cfg = tiny_run_config(tiny_model_dir, *pair_files, out, max_steps=4, micro_batch_size=8, grad_accum=1, lr=1e-2,
                          eval_every=0)
    cfg["task"] = task
    cfg["model"].update(model)
    return train(config_from_dict(cfg), quiet=True)


def test_qlora_dpo_trains_on_a_4bit_base(tiny_model_dir, pair_files, tmp_path):
    """The reference pass (adapter off) runs through the same quantised base: no second copy of it."""
    pytest.importorskip("bitsandbytes")
    result = _short_run(tiny_model_dir, pair_files, tmp_path / "run", quantization="nf4")
    assert result.eval_loss_before == pytest.approx(math.log(2))
    assert result.eval_loss_after < result.eval_loss_before - 0.05  # measured 0.693 -> 0.519


@pytest.mark.long
def test_a_preference_run_exports_and_generates_like_any_lm_run(tiny_model_dir, pair_files, tmp_path):
    import subprocess
    import sys

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _short_run(tiny_model_dir, pair_files, tmp_path / "run")

    def rocktune(*args):
        res = subprocess.run([sys.executable, "-m", "rocktune", *map(str, args)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-2000:]
        return res.stdout

    rocktune("export", tmp_path / "run", "--to", "merged", "--out", tmp_path / "merged")
    ids = torch.tensor([[5, 9, 17, 3, 22, 8]])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "run" / "adapter")).eval()
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, adapted(ids).logits, atol=1e-4)
    for to, out in (("gguf", tmp_path / "m.gguf"), ("gguf-lora", tmp_path / "a.gguf"),
                    ("ollama", tmp_path / "ollama")):
        rocktune("export", tmp_path / "run", "--to", to, "--out", out)
        assert out.exists()
    gguf = pytest.importorskip("gguf")
    assert len(gguf.GGUFReader(tmp_path / "m.gguf").tensors) > 0
    assert len(gguf.GGUFReader(tmp_path / "a.gguf").tensors) > 0
    assert (tmp_path / "ollama" / "Modelfile").is_file()
    out = rocktune("generate", tmp_path / "run", "--prompt", "add 1 2 =", "--max-new-tokens", "4")
    assert out.strip()


def test_the_planner_counts_a_pair_as_two_sequences(capsys):
    """--task dpo --batch 2: two pairs, i.e. four sequences in the forward (the reference pass keeps no
    activations: it runs without gradients)."""
    from rocktune.cli import main

    def plan(*args):
        assert main(["plan", "Qwen2.5-0.5B", "--vram", "8GiB", "--json", *args]) == 0
        return json.loads(capsys.readouterr().out)

    pairs, sequences, one = plan("--task", "dpo", "--batch", "2"), plan("--batch", "4"), plan("--batch", "2")
    assert pairs["peak_allocated_bytes"] == sequences["peak_allocated_bytes"] > one["peak_allocated_bytes"]
    assert pairs["saved_activation_bytes"] == sequences["saved_activation_bytes"]
