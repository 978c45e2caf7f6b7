"""rocktune generate: its greedy output equals a plain argmax loop over the in-memory PeftModel."""

from __future__ import annotations

import json

import pytest
import torch

from rocktune.cli import main
from tests.export_fixtures import build_model, make_run

PROMPTS = ["upper abcd =", "Hello world", "add 3 4 ="]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("gen") / "base", "qwen2")


def argmax_loop(model, ids: list[int], stops: set[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt in stops:
                break
            out.append(nxt)
    return out


def reference(model, tok, text: str, chat: bool, n: int = 16) -> str:
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=not chat)["input_ids"]
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    return tok.decode(argmax_loop(model, ids, stops, n), skip_special_tokens=True)


@pytest.mark.parametrize("fmt", ["prompt_completion", "messages"])
def test_generate_prompt_equals_in_memory_model(base, tmp_path, capsys, fmt):
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    model = make_run(run, base, "all-linear", data_format=fmt)
    tok = AutoTokenizer.from_pretrained(base)
    for prompt in PROMPTS[:2]:
        assert main(["generate", str(run), "--prompt", prompt, "--max-new-tokens", "16", "--device", "cpu"]) == 0
        want = reference(model, tok, prompt, chat=fmt == "messages")
        assert capsys.readouterr().out == want + "\n" and want


@pytest.mark.slow
def test_generate_file_compare_and_merged_dir(base, tmp_path, capsys):
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    model = make_run(run, base, ["q_proj", "v_proj", "down_proj"])
    tok = AutoTokenizer.from_pretrained(base)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert main(["generate", str(run), "--file", str(prompts), "--max-new-tokens", "16", "--device", "cpu"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = [reference(model, tok, p, chat=False) for p in PROMPTS]
    assert [r["output"] for r in rows] == want and [r["prompt"] for r in rows] == PROMPTS
    assert all(want)

    assert main(["generate", str(run), "--prompt", PROMPTS[0], "--compare", "--max-new-tokens", "16",
                 "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    with model.disable_adapter():
        base_answer = reference(model, tok, PROMPTS[0], chat=False)
    assert lines == [f"base:  {base_answer}", f"tuned: {want[0]}"] and base_answer != want[0]

    # the merged directory answers the same (greedy, fp32); no run config there, so the chat template applies
    assert main(["export", str(run), "--to", "merged"]) == 0
    capsys.readouterr()
    assert main(["generate", str(run / "export" / "merged"), "--prompt", PROMPTS[1], "--template", "raw",
                 "--max-new-tokens", "16", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == want[1] + "\n"


def test_generate_chat_loop_keeps_the_conversation(base, tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    model = make_run(run, base, ["q_proj", "v_proj"], data_format="messages")
    tok = AutoTokenizer.from_pretrained(base)
    lines = iter(["Hello world", "add 3 4 =", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["generate", str(run), "--chat", "--max-new-tokens", "8", "--device", "cpu"]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == reference(model, tok, "Hello world", chat=True, n=8)
    history = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "add 3 4 ="}]
    text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    assert second == tok.decode(argmax_loop(model, ids, stops, 8), skip_special_tokens=True)


def test_generate_loads_in_the_platform_policys_precision(tiny_model_dir, monkeypatch):
    """The dtype comes from platform.advise.device_precision (fp32 on gfx906), asked with the device's name."""
    import torch

    from rocktune.export import generate
    from rocktune.export.source import Source
    from rocktune.platform import advise

    asked = []
    monkeypatch.setattr(advise, "device_precision", lambda device: asked.append(device) or "bf16")
    model, _ = generate.load(Source(str(tiny_model_dir), None, {}, False), "cpu")
    assert asked == ["cpu"] and next(model.parameters()).dtype == torch.bfloat16
