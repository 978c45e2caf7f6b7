"""rocktune bench: harness numerics, the configuration table, input errors, skips, and one real end-to-end run."""

from __future__ import annotations

import json

import pytest

from rocktune.bench import configs, runner, stats
from rocktune.cli import main
from rocktune.errors import UserError


def test_median_ratio_padding():
    assert stats.median([3.0, 1.0, 2.0, None]) == 2.0
    assert stats.median([]) is None
    assert stats.ratio(6.0, 2.0) == 3.0
    assert stats.ratio(1.0, None) is None and stats.ratio(None, 1.0) is None
    assert stats.padding_fraction(750, 1000) == pytest.approx(0.25)
    assert stats.padding_fraction(None, 1000) is None


def test_flops_per_token_and_mfu():
    # 4N + 6 * layers * d * (sum S^2 / sum S): two sequences of 100 and 300 tokens -> s_eff = 250.
    fpt = stats.flops_per_token(matmul_params=1000, layers=2, attn_dim=8, lengths=[100, 300])
    assert fpt == pytest.approx(4 * 1000 + 6 * 2 * 8 * 250)
    assert stats.mfu(100.0, fpt, 100.0 * fpt * 4) == pytest.approx(0.25)
    assert stats.mfu(100.0, fpt, None) is None


def test_summarise_excludes_warmup_and_takes_medians():
    steps = [{"step": 1, "loss": 3.0, "tokens": 100, "step_s": 10.0, "real_tokens": 150, "batch_tokens": 200},
             {"step": 2, "loss": 2.0, "tokens": 100, "step_s": 1.0, "real_tokens": 150, "batch_tokens": 200},
             {"step": 3, "loss": 1.5, "tokens": 300, "step_s": 1.0, "real_tokens": 350, "batch_tokens": 400},
             {"step": 4, "loss": 1.0, "tokens": 200, "step_s": 1.0, "real_tokens": 150, "batch_tokens": 200}]
    s = stats.summarise_steps(steps, warmup=1)
    assert s["measured_steps"] == 3
    assert s["useful_tokens_per_s"] == 200.0  # median of 100, 300, 200 — the slow warm-up step is not in it
    assert s["step_s"] == 1.0
    assert s["padding_fraction"] == pytest.approx(1 - 650 / 800)
    assert s["final_loss"] == 1.0 and len(s["losses"]) == 4


def test_loss_parity():
    ok = stats.loss_parity([2.0, 1.5], [2.0, 1.5000001], rel_tol=1e-4)
    assert ok["match"] and ok["max_abs_diff"] == pytest.approx(1e-7)
    assert not stats.loss_parity([2.0, 1.4], [2.0, 1.5], rel_tol=1e-4)["match"]
    assert not stats.loss_parity([2.0], [2.0, 1.5], rel_tol=1e-4)["match"]  # a missing step is no match


def test_config_table():
    cpu = configs.default_names("cpu")
    assert {"hf-seed", "hf-tuned", "rocktune"} <= set(cpu) and "rt-compile" not in cpu
    assert "rt-compile" not in configs.default_names("cuda")  # compile is the GPU default where sound
    assert {"hf-best", "rt-examples", "rt-no-compile"} <= set(configs.default_names("cuda"))
    assert "hf-best" not in cpu and "rt-no-compile" not in cpu
    assert configs.BASELINES == ["hf-seed", "hf-tuned", "hf-best"]
    assert configs.PARITY["parity-rocktune"].settings["training.batching"] == "examples"  # HF is fed that order
    assert configs.CONFIGS["hf-seed"].settings["padding"] == "max_length"
    assert configs.CONFIGS["hf-seed"].settings["gradient_checkpointing"] is True
    assert [c.name for c in configs.select("rocktune, hf-seed", "cpu")] == ["rocktune", "hf-seed"]
    assert len(configs.select("all", "cpu")) == len(configs.CONFIGS)
    with pytest.raises(UserError, match="unknown bench configuration nope"):
        configs.select("rocktune,nope", "cpu")


def test_targets_from_ratios():
    rows = [{"name": "rocktune", "status": "ok", "ratios": {
        "hf-seed": {"tokens_per_s": 3.5, "memory": 0.4}, "hf-tuned": {"tokens_per_s": 1.4, "memory": 0.5}}}]
    t = runner.targets(rows, {"match": True, "max_rel_diff": 1e-6})
    assert t["tokens_per_s_vs_hf-seed"]["met"] is True
    assert t["tokens_per_s_vs_hf-tuned"]["met"] is False
    assert t["memory_vs_hf-tuned"]["met"] is True and t["loss_parity"]["met"] is True
    assert runner.targets([], None)["tokens_per_s_vs_hf-seed"]["met"] is None


@pytest.mark.parametrize("argv, message", [
    (["bench", "--steps", "0"], "--steps must be at least 1"),
    (["bench", "--configs", "nope", "--parity-steps", "0"], "unknown bench configuration"),
    (["bench", "--model", "/no/such/model", "--parity-steps", "0"], "does not exist"),
])
def test_bench_input_errors_exit_2(argv, message, tmp_path, capsys):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_model_that_cannot_load_is_a_user_error(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert main(["bench", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "o")]) == 2
    assert "could not load model" in capsys.readouterr().err


def test_baseline_that_cannot_run_is_skipped_with_reason(tmp_path, monkeypatch):
    from rocktune.bench import child, hf_baseline

    gpu_only = configs.CONFIGS["rt-no-liger"]
    r = runner.run_one(gpu_only, {"device": "cpu"}, tmp_path, timeout=10)
    assert r["status"] == "skipped" and "ROCm/CUDA" in r["reason"]

    monkeypatch.setattr(hf_baseline.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(hf_baseline.SkipBaseline, match="accelerate"):
        hf_baseline.run_hf("unused", None, configs.HF_SEED, 1, runner.COMMON, "cpu", None)

    spec = {"name": "hf-seed", "kind": "hf", "device": "cuda", "threads": 1}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    if not __import__("torch").cuda.is_available():
        child.main(str(tmp_path / "spec.json"), str(tmp_path / "result.json"))
        result = json.loads((tmp_path / "result.json").read_text())
        assert result["status"] == "skipped" and "device" in result["reason"]
        assert "useful_tokens_per_s" not in result


@pytest.mark.slow
def test_bench_end_to_end_losses_match_hf(tiny_model_dir, tmp_path):
    """Two configurations x 8 steps: rocktune's loop and the HF Trainer on the same micro-batches. Eight, since a
    speed counts only where the loss fell (its later half below its earlier half): each step is other examples, and
    in the mixed batch order the first two steps' losses rise (6.41 -> 6.57) before they fall (6.33 at step 8)."""
    report = runner.run_bench(runner.BenchRequest(model=str(tiny_model_dir), configs="parity-rocktune,parity-hf",
                                                  steps=8, warmup=0, threads=1, device="cpu", out=str(tmp_path),
                                                  n_samples=32, parity_steps=0), log=lambda msg: None)
    json.dumps(report)  # the whole report is JSON
    assert {"schema", "environment", "workload", "configs", "parity", "targets"} <= set(report)
    assert report["environment"]["torch_threads"] == 1
    rt, hf = report["configs"]
    for row in (rt, hf):
        assert row["status"] == "ok", row.get("reason")
        assert {"useful_tokens_per_s", "step_s", "peak_memory_bytes", "padding_fraction", "mfu", "final_loss",
                "losses", "ratios", "memory"} <= set(row)
        assert row["useful_tokens_per_s"] > 0 and len(row["losses"]) == 8
        assert 0 <= row["padding_fraction"] < 1
    parity = stats.loss_parity(rt["losses"], hf["losses"], rel_tol=1e-4)
    assert parity["match"], parity


def test_peaks_table_loads_as_numbers_and_matches_gpu_names():
    """The H200 bench crash: PyYAML read 989.4e12 as a string and the MFU division raised after the run."""
    from rocktune.bench.peaks import load_peaks, peak_flops

    rows = load_peaks()
    assert rows and all(isinstance(r[k], float) for r in rows for k in ("bf16", "fp16", "fp32") if k in r)
    assert peak_flops("NVIDIA H200", "bfloat16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756.5e12  # the PCIe row comes before the SXM one
    assert peak_flops("AMD Instinct MI300X", "float32") == 163.4e12
    assert peak_flops("Radeon RX 7900 XT", "bfloat16") is None and peak_flops(None, "bf16") is None


def test_peaks_loader_converts_unsigned_exponents_and_rejects_junk(tmp_path):
    from rocktune.bench.peaks import load_peaks

    ok = tmp_path / "ok.yaml"
    ok.write_text("- match: X\n  bf16: 989.4e12\n")  # a string to PyYAML: converted, not crashed on later
    assert load_peaks(str(ok))[0]["bf16"] == 989.4e12
    bad = tmp_path / "bad.yaml"
    bad.write_text("- match: X\n  bf16: fast\n")
    with pytest.raises(ValueError):
        load_peaks(str(bad))


def test_summarise_computes_mfu_for_a_gpu_result():
    """The whole GPU report path on the CPU: a fake H200 result through summarise, ratios and targets."""
    def result(name, tok_s, peak):
        steps = [{"step": i, "loss": 2.0 - i / 10, "tokens": tok_s, "step_s": 1.0, "real_tokens": 2 * tok_s,
                  "batch_tokens": 2 * tok_s + 10, "device_wait_s": 0.9} for i in range(1, 4)]
        return {"name": name, "kind": "rocktune" if name == "rocktune" else "hf", "status": "ok", "steps": steps,
                "first_round_losses": [s["loss"] for s in steps],
                "memory": {"device_peak_allocated_bytes": peak, "rss_growth_bytes": 1},
                "shape": {"matmul_params": 494_000_000, "layers": 24, "attn_dim": 896, "dtype": "bfloat16"},
                "environment": {"gpu": "NVIDIA H200", "device": "cuda"},
                "first_round_steps": [{**s, "forwards": 1} for s in steps],
                "resolved": {"device_time": {"busy_share": 0.97, "kernels": 4200}} if name == "rocktune" else {}}

    rep = runner.summarise([result("hf-seed", 1000, 4e9), result("hf-tuned", 1200, 3e9),
                            result("rocktune", 50000, 2e9)],
                           0, [500, 1500], "cuda")
    rt = next(r for r in rep["configs"] if r["name"] == "rocktune")
    fpt = stats.flops_per_token(494_000_000, 24, 896, [500, 1500])
    assert rt["mfu"] == pytest.approx(100000 * fpt / 989.4e12)
    assert rt["ratios"]["hf-seed"]["tokens_per_s"] == pytest.approx(50.0)
    assert rt["device_busy_share"] == 0.97 and rt["device_time"]["kernels"] == 4200  # the device's own account
    assert rt["forwards_per_step"] == [1, 1, 1] and rt["tokens_per_step"] == [100010] * 3
    assert "device_wait_fraction" not in rt  # the host's wait at the sync is not a starvation signal
    assert runner.targets(rep["configs"], None)["tokens_per_s_vs_hf-seed"]["met"] is True
    json.dumps(rep)  # the report must serialise


def test_gpu_targets_include_mfu_per_shape_and_the_best_hf_row():
    rows = [{"name": "rocktune", "status": "ok", "mfu": 0.33, "ratios": {
        "hf-seed": {"tokens_per_s": 5.0, "memory": 0.5}, "best-hf": {"tokens_per_s": 1.4, "memory": 0.9}}}]
    t = runner.targets(rows, None, "cuda", "qwen2.5-0.5b-shape")
    assert t["mfu"] == {"value": 0.33, "target": 0.30, "met": True}
    assert t["tokens_per_s_vs_hf-seed"]["target"] == 4.0 and t["tokens_per_s_vs_hf-seed"]["met"] is True
    assert t["tokens_per_s_vs_best-hf"]["met"] is False and t["memory_vs_best-hf"]["met"] is True
    assert runner.targets(rows, None, "cuda", "qwen2.5-1.5b-shape")["mfu"]["met"] is False  # 0.40 there
    assert "mfu" not in runner.targets(rows, None, "cpu", "tiny")


def test_hf_best_runs_at_a_fixed_micro_batch_that_keeps_the_global_batch():
    """No probing OOM by OOM (over 100 s of the H200's time-boxed run): 8 examples per device batch, the global batch
    kept; a micro-batch that does not divide it falls back to the common one."""
    from rocktune.bench.hf_baseline import fixed_micro_batch

    assert configs.CONFIGS["hf-best"].settings["micro_batch"] == 8
    assert fixed_micro_batch(8, {"micro_batch_size": 8, "grad_accum": 8}) == (8, 8)  # the GPU suite
    assert fixed_micro_batch(8, {"micro_batch_size": 2, "grad_accum": 8}) == (8, 2)
    assert fixed_micro_batch(8, {"micro_batch_size": 2, "grad_accum": 3}) == (2, 3)  # 6 examples: not divisible
    assert fixed_micro_batch(None, {"micro_batch_size": 2, "grad_accum": 4}) == (2, 4)


def test_flattened_batches_count_every_token_as_real():
    import torch

    from rocktune.bench.hf_baseline import real_token_count

    assert real_token_count({"input_ids": torch.ones(1, 30)}) == 30
    batch = {"input_ids": torch.ones(2, 5), "attention_mask": torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])}
    assert real_token_count(batch) == 7


def test_gpu_suite_definition():
    from rocktune.bench.suites import SUITES

    gpu = SUITES["gpu"]
    assert gpu.models == ("qwen2.5-0.5b-shape", "qwen2.5-1.5b-shape") and gpu.token_range == (50, 2000)
    assert gpu.common["micro_batch_size"] * gpu.common["grad_accum"] == 64
    # 8 measured steps (issue 36), and a full step more for the profiled one a GPU run adds
    assert gpu.steps == 8 and gpu.samples() >= 64 * (gpu.steps + gpu.warmup + 1) and gpu.warmup >= 2
    assert set(gpu.configs.split(",")) == {"hf-best", "rocktune", "rt-no-compile", "rt-liger"}


def test_the_qwen35_shape_is_the_hybrid_stack(tmp_path):
    """``--model qwen3.5-tiny-shape``: tiny's size with Qwen3.5's released layer pattern (three Gated DeltaNet layers
    to one full-attention layer) and twice as many linear-attention value heads as key heads."""
    import json

    from rocktune.bench.workload import model_dir

    path = model_dir("qwen3.5-tiny-shape", tmp_path)
    cfg = json.loads((tmp_path / "models" / "qwen3.5-tiny-shape" / "config.json").read_text())
    assert path.endswith("qwen3.5-tiny-shape") and cfg["model_type"] == "qwen3_5_text"
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["linear_num_value_heads"]) == (128, 32768, 4)
    assert cfg["linear_num_value_heads"] == 2 * cfg["linear_num_key_heads"]


def test_lr_reaches_every_configuration_and_a_bad_one_is_refused(monkeypatch, capsys):
    """``--lr`` sets the learning rate every configuration shares (the workload's ``lr``); zero or less is refused
    before anything runs."""
    from rocktune.bench import main as bench_main
    from rocktune.cli import main

    seen = []
    monkeypatch.setattr(bench_main, "run_bench_command", lambda req, **kw: seen.append(req) or 0)
    assert main(["bench", "--lr", "2e-3", "--configs", "rocktune"]) == 0
    assert seen[0].common == {"lr": 2e-3}
    assert main(["bench", "--configs", "rocktune"]) == 0 and seen[1].common is None  # the default, 2e-4
    assert main(["bench", "--lr", "0"]) == 2
    assert "--lr must be a positive learning rate" in capsys.readouterr().err
