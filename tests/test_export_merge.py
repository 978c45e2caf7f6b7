"""--to merged: the merged model, reloaded by transformers, computes what the PeftModel computed."""

from __future__ import annotations

import pytest
import torch

from rocktune.cli import main
from tests.export_fixtures import build_model, make_run

IDS = torch.arange(5, 60).reshape(1, -1)
# (target_modules, modules_to_save): attention only; LoRA on the head; on the embedding; a full head copy; all
CASES = [(["q_proj", "v_proj"], None), (["q_proj", "lm_head"], None), (["q_proj", "embed_tokens"], None),
         (["q_proj"], ["lm_head"]), ("all-linear", ["lm_head", "embed_tokens"])]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    return {tied: build_model(root / f"tied-{tied}", "qwen2", tied=tied) for tied in (True, False)}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("targets,to_save", CASES, ids=["attn", "lora-head", "lora-embed", "head-copy", "all"])
def test_merged_logits_equal_peft(bases, tmp_path, tied, targets, to_save):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    peft_model = make_run(run, bases[tied], targets, to_save)
    with torch.no_grad():
        want = peft_model(IDS).logits
    dtype = "float32" if tied else "fp32"  # torch's spelling is accepted as well as rocktune's (issue 35)
    assert main(["export", str(run), "--to", "merged", "--dtype", dtype]) == 0
    merged = AutoModelForCausalLM.from_pretrained(run / "export" / "merged", dtype=torch.float32)
    with torch.no_grad():
        got = merged(IDS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not [k for k in merged.state_dict() if "lora_" in k]
    touched = "lm_head" in str(targets) + str(to_save) or "embed_tokens" in str(targets) + str(to_save)
    assert merged.config.tie_word_embeddings == (tied and not touched)
    assert (run / "export" / "merged" / "tokenizer.json").is_file()
    assert not list((run / "export").glob(".*"))  # no staging leftovers


def test_merged_bf16_default_dtype_and_tolerance(bases, tmp_path, capsys):
    """--dtype bf16 casts once after the fp32 merge: within bf16 rounding of the fp32 logits (stated: 0.05)."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    peft_model = make_run(run, bases[True], "all-linear")
    with torch.no_grad():
        want = peft_model(IDS).logits
    assert main(["export", str(run), "--to", "merged", "--dtype", "bf16"]) == 0
    assert "rounded a second time" in capsys.readouterr().out  # the way to a GGUF with one rounding is named
    merged = AutoModelForCausalLM.from_pretrained(run / "export" / "merged")
    assert merged.dtype == torch.bfloat16
    with torch.no_grad():
        got = merged.float()(IDS).logits
    assert (got - want).abs().max().item() < 0.05
    # the default dtype is the base checkpoint's (fp32 here)
    assert main(["export", str(run), "--to", "merged", "--overwrite"]) == 0
    assert "rounded a second time" not in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(run / "export" / "merged").dtype == torch.float32
