"""rocktune data preview and the data checks that stop a run: each broken case on tiny tokenizers."""

from __future__ import annotations

import json
import shutil

import pytest

from rocktune.cli import main
from rocktune.config import DataConfig, config_from_dict
from rocktune.data.checks import check_training_data, enforce
from rocktune.data.dataset import Examples
from rocktune.data.encode import IGNORE
from rocktune.errors import UserError
from rocktune.data.preview import build_preview
from tests.conftest import tiny_run_config, write_jsonl

EOS = 256  # the tiny tokenizer's <|endoftext|>
CHAT = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 4
# A chat template that ends assistant turns with a plain newline: nothing teaches the model to stop.
NO_END_OF_TURN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def codes(problems, level="error"):
    return {p.code for p in problems if p.level == level}


@pytest.fixture
def no_eot_model(tiny_model_dir, tmp_path):
    """The tiny model with a chat template that never writes an end-of-turn token."""
    from transformers import AutoTokenizer

    out = tmp_path / "no_eot"
    shutil.copytree(tiny_model_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = NO_END_OF_TURN
    tok.save_pretrained(out)
    return out


def test_preview_counts_lengths_and_trained_tokens(tmp_path, tokenizer):
    rows = [{"prompt": "add 1 2 =", "completion": " 03"}, {"prompt": "upper abcd =", "completion": " ABCD"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    pv = build_preview(str(data), "auto", tokenizer, 64, False, n_show=2)
    assert (pv.shape, pv.n_records, pv.n_kept, pv.n_truncated, pv.n_dropped) == ("prompt_completion", 2, 2, 0, 0)
    # one token per byte: prompt + completion + EOS; loss on the completion and the EOS
    assert pv.lengths == [9 + 3 + 1, 12 + 5 + 1]
    assert pv.loss_tokens == (3 + 1) + (5 + 1) and pv.total_tokens == 13 + 18
    runs = pv.examples[1]["runs"]
    assert "".join(t for t, trained, _ in runs if trained) == " ABCD<|endoftext|>"
    assert "".join(t for t, trained, _ in runs if not trained) == "upper abcd ="
    assert runs[-1] == ["<|endoftext|>", True, True]
    assert pv.problems == [] and pv.stop_tokens == ["<|endoftext|>"]


def test_preview_counts_truncated_and_dropped(tmp_path, tokenizer):
    rows = [{"prompt": "p" * 30, "completion": " c"}, {"prompt": "short", "completion": " answer that runs long"}]
    data = str(write_jsonl(tmp_path / "d.jsonl", rows))
    pv = build_preview(data, "auto", tokenizer, 16, False, truncation="end")
    assert (pv.n_truncated, pv.n_dropped, pv.n_kept) == (2, 1, 1)  # the first lost its whole completion
    assert "1 examples were dropped" in " ".join(pv.truncation_notes)
    pv = build_preview(data, "auto", tokenizer, 16, False, truncation="prompt")
    assert (pv.n_truncated, pv.n_dropped, pv.n_kept) == (2, 0, 2)
    assert "lost the start of their prompt" in pv.truncation_notes[0]


def test_no_loss_bearing_token_is_an_error(tokenizer):
    ex = Examples([[1, 2, 3]], [[IGNORE] * 3])
    assert codes(check_training_data(ex, tokenizer, "prompt_completion", False)) == {"no-loss-tokens"}


def test_everything_trained_although_completion_only(tmp_path, tokenizer):
    rows = [{"prompt": "", "completion": "whole text"}] * 3  # empty prompts: nothing is masked
    pv = build_preview(str(write_jsonl(tmp_path / "d.jsonl", rows)), "auto", tokenizer, 64, False)
    assert {p["code"] for p in pv.problems if p["level"] == "error"} == {"all-trained"}
    ex = Examples([[1, 2, EOS]], [[1, 2, EOS]])
    assert "all-trained" not in codes(check_training_data(ex, tokenizer, "prompt_completion", True))
    assert "all-trained" not in codes(check_training_data(ex, tokenizer, "text", False))


def test_eos_masked_like_padding_is_an_error(tokenizer):
    # pad == EOS and a collator that masks padding: the EOS label is gone in every example (trl#1623)
    ex = Examples([[1, 2, 3, EOS]] * 3, [[IGNORE, IGNORE, 3, IGNORE]] * 3)
    problems = check_training_data(ex, tokenizer, "prompt_completion", False)
    assert codes(problems) == {"stop-never-trained"}
    with pytest.raises(UserError, match="never carries loss"):
        enforce(problems, "data.jsonl")


def test_chat_template_without_end_of_turn_is_flagged(tmp_path, no_eot_model, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    code = main(["data", "preview", "--data", str(data), "--model", str(no_eot_model)])
    out = capsys.readouterr().out
    assert code == 1 and "never carries loss" in out and "rocktune train would stop" in out
    assert main(["data", "preview", "--data", str(data), "--model", str(no_eot_model.parent / "nowhere")]) == 2


def test_good_chat_data_passes_and_trains_the_end_of_turn(tmp_path, tiny_model_dir, tokenizer):
    pv = build_preview(str(write_jsonl(tmp_path / "chat.jsonl", CHAT)), "auto", tokenizer, 64, False, n_show=1)
    assert pv.problems == [] and pv.stop_tokens == ["<|im_end|>"]
    trained = "".join(t for t, on, _ in pv.examples[0]["runs"] if on)
    assert trained == "yo<|im_end|>\n"


class _OwnRenderDiffers:
    """A tokenizer whose own chat rendering adds a token rocktune's per-turn rendering does not have."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *a, **k):
        return self._tok(*a, **k)

    def apply_chat_template(self, messages, tokenize=False, **kw):
        out = self._tok.apply_chat_template(messages, tokenize=tokenize, **kw)
        if not tokenize:
            return out
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        return [EOS] + ids


def test_template_rendering_differently_from_the_tokenizers_own(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    pv = build_preview(str(data), "auto", _OwnRenderDiffers(tokenizer), 64, False)
    assert {p["code"] for p in pv.problems} == {"template-differs"}


def test_train_stops_before_touching_the_run_dir(tmp_path, no_eot_model):
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT * 4)
    cfg = config_from_dict(tiny_run_config(no_eot_model, data, None, tmp_path / "out"))
    from rocktune.tasks import train

    with pytest.raises(UserError, match="<|endoftext|> never carries loss"):
        train(cfg, quiet=True)
    assert not (tmp_path / "out").exists()


def test_cli_json_and_html(tmp_path, tiny_model_dir, capsys):
    rows = [{"prompt": "upper ab =", "completion": " AB"}] * 5
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(tiny_run_config(tiny_model_dir, data, None, tmp_path / "out")))
    html = tmp_path / "preview.html"
    assert main(["data", "preview", "-c", str(cfg), "data.max_length=32", "--json", "--html", str(html)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["n_records"], got["max_length"], got["problems"]) == (5, 32, [])
    assert got["loss_share"] == pytest.approx(4 / 14)
    page = html.read_text()
    assert '<span class="trained"> AB</span><span class="trained special">&lt;|endoftext|&gt;</span>' in page
    assert main(["data", "preview"]) == 2


def _conversations(n: int, seed: int = 0) -> list[dict]:
    """Synthetic 1-4-turn conversations, long enough that a small data.max_length truncates most of them."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "You answer questions about numbers. " * rng.randint(1, 3)}]
        for turn in range(rng.randint(1, 4)):
            msgs += [{"role": "user", "content": f"Question {i}.{turn}: what is {rng.randint(0, 999)} squared? " * 3},
                     {"role": "assistant", "content": f"It is {rng.randint(0, 10**6)}, as computed. " * 2}]
        out.append({"messages": msgs})
    return out


def test_truncated_multi_turn_chat_is_not_a_template_difference(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "chat.jsonl", _conversations(24))
    keep = DataConfig(lossy_truncation="keep")  # the cut loses system prompts: a warning here, not the subject
    pv = build_preview(str(data), "auto", tokenizer, 128, False, data=keep)
    assert pv.n_truncated >= 16  # the comparison really sees truncated examples
    assert [(p["level"], p["code"]) for p in pv.problems] == [("warning", "truncation-loses")]
    # The check itself still fires on a real difference, truncated or not.
    pv = build_preview(str(data), "auto", _OwnRenderDiffers(tokenizer), 128, False, data=keep)
    assert {p["code"] for p in pv.problems if p["level"] == "error"} == {"template-differs"}


def test_preview_shows_source_mapping_rate_and_cache_size(tmp_path, tiny_model_dir, capsys):
    import datasets

    rows = [{"q": f"add {i} {i} =", "a": f" {2 * i:02d}"} for i in range(6)]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "d.parquet")
    cfg = tiny_run_config(tiny_model_dir, tmp_path / "d.parquet", None, tmp_path / "out")
    cfg["data"]["columns"] = {"prompt": "q", "completion": "a"}
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    assert main(["data", "preview", "-c", str(tmp_path / "c.yaml"), "--json"]) == 0
    pv = json.loads(capsys.readouterr().out)
    assert pv["source"].startswith(f"{tmp_path / 'd.parquet'} (parquet, 6 rows; columns prompt<-q, completion<-a)")
    assert pv["records_per_s"] > 0 and pv["cache_bytes"] > 6 * 4 * 2 and pv["n_kept"] == 6
    assert main(["data", "preview", "-c", str(tmp_path / "c.yaml")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "records/s" in out and "token cache" in out and "prompt<-q" in out
    assert not (tmp_path / "out").exists()  # a preview leaves nothing behind
