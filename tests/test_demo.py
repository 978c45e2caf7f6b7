"""The embedded default: `rocktune demo` must show real learning, offline, on CPU."""

import json

import pytest

from rocktune.cli import main


@pytest.mark.slow
def test_demo_learns_and_prints_json(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo"), "--json"]) == 0
    fig = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(fig) >= {"eval_loss_before", "eval_loss_after", "exact_match", "run_dir"}
    # The README's figures (eval loss 6.04 -> 0.31, 75% exact match), with a margin for BLAS thread-count noise:
    # a change that makes the demo learn less fails here before the README's claim goes stale.
    assert fig["eval_loss_before"] == pytest.approx(6.04, abs=0.05)
    assert fig["eval_loss_after"] <= 0.31 + 0.05
    assert fig["exact_match"] >= 0.70
    assert (tmp_path / "demo" / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_demo_tokenizer_roundtrips_through_autotokenizer(tiny_model_dir, tokenizer):
    from rocktune.demo.tiny import build_tokenizer

    text = "reverse abc = cba<|im_end|>\nupper é"
    assert tokenizer(text)["input_ids"] == build_tokenizer()(text)["input_ids"]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
