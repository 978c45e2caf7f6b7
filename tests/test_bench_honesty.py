"""The bench's honesty (issue 24): MFU charges the head where the loss needs it (the all-token convention beside it,
labelled), ratios against the best Hugging Face row that ran, the attention and compile fallbacks recorded, and
hf-best as an expert sets it up without extra packages. GPU results are fed in: no GPU here."""

from __future__ import annotations

import json

import pytest

from rocktune.bench import runner, stats

SHAPE = {"matmul_params": 494_000_000, "layers": 24, "attn_dim": 896, "head_params": 136_000_000,
         "dtype": "bfloat16"}
H200_BF16 = 989.4e12


def _result(name, useful, real, resolved=None, status="ok"):
    steps = [{"step": i, "loss": 2.0 - i / 10, "tokens": useful, "step_s": 1.0, "real_tokens": real,
              "batch_tokens": real, "device_wait_s": 0.9} for i in range(1, 4)]
    return {"name": name, "kind": "rocktune" if name.startswith(("rocktune", "rt-")) else "hf", "status": status,
            "steps": steps, "memory": {"device_peak_allocated_bytes": 1e9, "rss_growth_bytes": 1}, "shape": SHAPE,
            "environment": {"gpu": "NVIDIA H200", "device": "cuda"}, "resolved": resolved or {},
            "reason": None if status == "ok" else "timed out after 85 s"}


def test_mfu_charges_the_head_at_loss_positions_and_reports_the_all_token_convention_beside_it():
    lengths = [500, 1500]
    rep = runner.summarise([_result("rocktune", 40_000, 80_000)], 0, lengths, "cuda")
    row = rep["configs"][0]
    per_token = stats.flops_per_token(SHAPE["matmul_params"], 24, 896, lengths)
    body = per_token - 4 * SHAPE["head_params"]
    assert row["mfu"] == pytest.approx((80_000 * body + 40_000 * 4 * SHAPE["head_params"]) / H200_BF16)
    assert row["mfu_all_token_head"] == pytest.approx(80_000 * per_token / H200_BF16)
    assert row["mfu"] < row["mfu_all_token_head"]  # half the tokens carry loss: the head counts half as often
    assert "loss-bearing tokens/s x 4 x head" in rep["mfu_convention"] and "every token" in rep["mfu_convention"]
    assert stats.mfu(80_000, per_token, H200_BF16, (SHAPE["head_params"], None)) is None  # no loss count, no MFU


def test_ratios_are_against_the_fastest_hf_row_that_ran():
    rows = [_result("hf-seed", 1_000, 2_000), _result("hf-best", 0, 0, status="error"),
            _result("hf-tuned", 3_000, 6_000), _result("rocktune", 9_000, 18_000)]
    rep = runner.summarise(rows, 0, [500], "cuda")
    rt = next(r for r in rep["configs"] if r["name"] == "rocktune")
    assert rep["best_hf"] == "hf-tuned"  # hf-best failed: it is no yardstick
    assert rt["ratios"]["best-hf"]["against"] == "hf-tuned"
    assert rt["ratios"]["best-hf"]["tokens_per_s"] == pytest.approx(3.0)
    t = runner.targets(rep["configs"], None, "cuda", "qwen2.5-0.5b-shape")
    assert t["tokens_per_s_vs_best-hf"] == {"value": pytest.approx(3.0), "target": 1.5, "met": True}
    json.dumps(rep)


def test_the_report_records_which_attention_ran_and_compile_fallbacks(tmp_path):
    from rocktune.bench.child import ran

    (tmp_path / "run_info.json").write_text(json.dumps({"precision": "bf16", "predicted_peak_bytes": 7, "notes": [
        "attn_implementation auto -> sdpa (PyTorch SDPA picks the best sound backend)",
        "torch.compile applied to the decoder (the first steps include compilation)",
        "fusion: inductor (compiled: Liger's kernels would be opaque to Inductor)",
        "attention: varlen_attn over the collate's document bounds (self-test: passed)"]}))
    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9, "compile_fallback": "InductorError: fed in"}]
    resolved = ran(tmp_path, rows)
    assert resolved == {"attention": "varlen_attn over the collate's document bounds (self-test: passed)",
                        "compiled": True, "compile_fallbacks": [{"step": 2, "error": "InductorError: fed in"}],
                        "precision": "bf16", "predicted_peak_bytes": 7, "fusion": "inductor",
                        "fusion_note": "inductor (compiled: Liger's kernels would be opaque to Inductor)"}
    rep = runner.summarise([_result("rocktune", 1, 2, resolved), _result("hf-best", 1, 1, {
        "attn_implementation": "flex_attention"})], 0, [500], "cuda")
    by = {r["name"]: r for r in rep["configs"]}
    assert by["rocktune"]["attention"].startswith("varlen_attn") and by["hf-best"]["attention"] == "flex_attention"
    assert by["rocktune"]["compile_fallbacks"] == [{"step": 2, "error": "InductorError: fed in"}]
    assert by["rocktune"]["fusion"] == "inductor"  # the Liger-vs-Inductor choice travels to the bench row


def test_hf_best_is_an_expert_setup_without_extra_packages(monkeypatch, tokenizer):
    import importlib.util

    from transformers import DataCollatorWithFlattening

    from rocktune.bench import hf_baseline as hf
    from rocktune.bench.configs import HF_BEST

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real_find(n, *a))
    assert hf._attention("best", "cuda") == "flex_attention" and hf._attention("best", "cpu") == "sdpa"
    assert hf.expert_arguments(HF_BEST, "cuda") == {"torch_compile": True, "optim": "adamw_torch_fused"}
    assert hf.expert_arguments(HF_BEST, "cpu") == {}
    collator = hf._collator(HF_BEST, "sdpa", tokenizer, 512)  # flattening whatever the attention
    assert isinstance(collator, DataCollatorWithFlattening)
    batch = collator([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]] and batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]


def test_flattened_rows_under_sdpa_give_the_padded_loss(tiny_model_dir, tokenizer):
    """The premise of hf-best without flash-attn: transformers keeps flattened examples apart under SDPA."""
    import torch
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, DataCollatorWithFlattening

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    model.config.use_cache = False  # as the baseline sets it: a cache hides packed sequences from transformers
    rows = [{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))} for n in (7, 12, 3)]
    flat = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)(rows)
    padded = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)(
        [{**r, "attention_mask": [1] * len(r["input_ids"])} for r in rows])
    with torch.no_grad():
        a = model(**{k: v for k, v in flat.items() if k in ("input_ids", "labels", "position_ids")}).loss
        b = model(**{k: v for k, v in padded.items() if k in ("input_ids", "labels", "attention_mask")}).loss
    assert float(a) == pytest.approx(float(b), rel=1e-5)


def test_the_report_records_graph_breaks_recompiles_and_graphs():
    """What Dynamo did in the configuration's process (bench/compiler.py), counted from its own counters and its
    recompiles log, carried into the report's row. Dynamo's eager backend: the same tracing, no C++ compile."""
    import torch

    from rocktune.bench.compiler import CompilerRecord

    torch._dynamo.reset()
    torch.compile(lambda x: x.sum() + 1, backend="eager")(torch.randn(2))  # before the record: not counted
    record = CompilerRecord().start()

    def step(x):
        y = x * 2
        torch._dynamo.graph_break()  # one break per call: two graphs around it
        return y.sum()

    compiled = torch.compile(step, backend="eager")
    for n in (3, 4, 5):  # 3 -> 4: a recompile with a symbolic size, which 5 reuses
        compiled(torch.randn(n))
    compiled(torch.randn(3, dtype=torch.float64))  # a dtype guard fails: recompiles again
    got = record.report()
    assert got["graph_breaks"] >= 1 and len(got["graph_break_reasons"]) == 1
    assert got["recompiles"] == 4 and got["frames_compiled"] == 6  # 2 frames x (first, size, dtype)
    assert any("size mismatch" in r for r in got["recompile_reasons"])
    assert any("dtype mismatch" in r for r in got["recompile_reasons"])
    rep = runner.summarise([{**_result("rocktune", 1, 2), "compiler": got}], 0, [500], "cuda")
    assert rep["configs"][0]["compiler"] == got
    torch._dynamo.reset()


def test_the_speed_of_a_run_whose_loss_did_not_fall_is_no_figure():
    """A run that learns nothing (issue 43: zero LoRA gradients under a compiler) would otherwise report the speed of
    doing nothing: its figures are kept aside as invalid and no ratio or target reads them."""
    assert stats.loss_fell([2.0, 1.9]) and stats.loss_fell([5.0, 5.1, 4.0, 4.1]) and stats.loss_fell([1.0]) is None
    assert not stats.loss_fell([2.0, 2.0, 2.0]) and not stats.loss_fell([2.0, 1.5, 2.5, 1.9])  # late half higher
    flat = _result("rocktune", 9_000, 18_000)
    for s in flat["steps"]:
        s["loss"] = 2.0
    rep = runner.summarise([_result("hf-best", 3_000, 6_000), flat], 0, [500], "cuda")
    rt = next(r for r in rep["configs"] if r["name"] == "rocktune")
    assert rt["loss_fell"] is False and rt["useful_tokens_per_s"] is None and rt["mfu"] is None
    assert rt["invalid_speed"]["useful_tokens_per_s"] == 9_000 and "loss did not fall" in rt["invalid_reason"]
    assert rt["ratios"]["best-hf"]["tokens_per_s"] is None and rt["ratios"]["best-hf"]["memory"] == 1.0
    t = runner.targets(rep["configs"], None, "cuda", "qwen2.5-0.5b-shape")
    assert t["tokens_per_s_vs_best-hf"]["met"] is None and t["mfu"]["value"] is None


def test_a_configuration_cut_by_its_time_limit_reports_what_its_metrics_held(tmp_path):
    """The GPU check's stages are time-boxed: a run killed at its limit keeps the steps it logged (rocktune's loop
    and the HF baseline's timer write metrics.jsonl as they go), warm-up left out of the figures."""
    from rocktune.bench.measure import MemoryProbe

    probe = MemoryProbe("cpu")
    probe.journal = tmp_path / "hf-best" / "metrics.jsonl"
    for i in range(1, 5):  # the HF side's timer, step by step
        probe.log_step({"step": i, "loss": 3.0 - i / 10, "tokens": 100, "real_tokens": 150, "batch_tokens": 160,
                        "step_s": 10.0 if i == 1 else 0.5})
    spec = {"warmup": 1, "device": "cuda"}
    cut = runner.partial_result("hf-best", "hf", tmp_path / "hf-best", spec, "timed out after 90 s")
    assert cut["status"] == "timeout" and cut["reason"] == "timed out after 90 s (4 steps done, 3 measured)"
    assert len(cut["steps"]) == 3 and cut["first_round_losses"] == pytest.approx([2.9, 2.8, 2.7, 2.6])
    row = runner.summarise([cut], 0, [500], "cuda")["configs"][0]
    assert row["status"] == "timeout" and row["useful_tokens_per_s"] == 200.0 and row["loss_fell"] is True
    assert row["peak_memory_bytes"] is None and row["mfu"] is None  # no shape, no peak logged here: not measured
    empty = runner.partial_result("rocktune", "rocktune", tmp_path / "none", spec, "timed out after 9 s")
    assert empty["reason"].endswith("(no step done)") and runner.summarise([empty], 0, [500], "cuda")[
        "configs"][0].get("useful_tokens_per_s") is None
