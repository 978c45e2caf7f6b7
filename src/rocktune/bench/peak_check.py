"""The memory planner against every measured GPU peak under ``docs/gpu-runs``: each measured run, sized again.

A rocktune row of a bench suite file records the device's peak allocated bytes and what the planner needs to size
that run again: the model (the bench's random-init shapes), the workload, precision, attention, compile, the loss
chunk and, from issue 36 on, the tokens each step processed and in how many forwards (the largest forward sets the
peak). Rows that predate those fields (the first H200 run) are rebuilt from their workload: the bench data are
deterministic (``workload.make_records``), the steps are the token feed's (``epoch_steps``, ``step_rows``) and the
rows per forward are what that run's planner chose (it sized every packed forward as SDPA with a mask). The rebuilt
steps must give the recorded mean length and padding fraction, or the case fails: they are then not that run's.
The training loop resets the device's peak counters as each step starts, so a row without the steps' own peaks
(``device_step_peak_allocated_bytes``, recorded from issue 36 on) measured its last step only: its case is that
step's largest forward.
A profile (``profile.json``) records its rows, width, precision, attention and peak; its labels are its inputs.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from rocktune.bench import workload
from rocktune.data.packing import cut_forwards, epoch_steps, step_rows
from rocktune.planner.estimate import RunSpec, estimate
from rocktune.planner.fit import fit_token_rows
from rocktune.planner.shapes import ModelShape, shape_from_config

GPU_LOSS_CHUNK = 2048  # training.loss_chunk_size auto on ROCm/CUDA (tasks/causal/autofit.LOSS_CHUNK), profile_step's
PRECISIONS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


@dataclass(frozen=True)
class MeasuredPeak:
    name: str  # run folder / file / configuration
    measured: int  # the device's max allocated bytes
    shape: ModelShape
    spec: RunSpec  # the largest forward of that run, as the planner describes it
    source: str  # how the largest forward was found

    @property
    def predicted(self) -> int:
        return estimate(self.shape, self.spec).peak_allocated

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def cases(root: Path) -> list[MeasuredPeak]:
    """Every measured peak under ``root`` (docs/gpu-runs): rocktune rows of bench suite files, and profiles."""
    out = []
    for path in sorted(root.rglob("*.json")):
        doc = json.loads(path.read_text())
        name = str(path.relative_to(root))
        if isinstance(doc, dict) and doc.get("schema") == "rocktune-bench-suite/1":
            for report in doc["reports"].values():
                out += [bench_case(f"{name}#{row['name']}", report, row) for row in report["configs"]
                        if row.get("kind") == "rocktune" and row.get("status") == "ok"
                        and (row.get("memory") or {}).get("device_peak_allocated_bytes")]
        elif isinstance(doc, dict) and doc.get("peak_allocated_bytes") and "rows" in doc:
            out.append(profile_case(name, doc, _sibling_torch(path)))
    return out


def model_shape(name: str) -> ModelShape:
    """One of the bench's random-init shapes, as ``demo.tiny.tiny_config`` writes its config.json."""
    s = workload.SHAPES[name]
    return shape_from_config({"model_type": "qwen2", "hidden_size": s["hidden"], "intermediate_size": s["intermediate"],
                              "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
                              "num_key_value_heads": s["kv_heads"], "vocab_size": s["vocab_size"],
                              "tie_word_embeddings": True}, name)


def bench_case(name: str, report: dict, row: dict) -> MeasuredPeak:
    w, env, resolved = report["workload"], report.get("environment", {}), row.get("resolved") or {}
    shape = model_shape(w["model"])
    spec = RunSpec(seq_len=w["max_length"], lora_r=w["lora_r"], precision=precision(row), device="gpu",
                   attn=attention(row.get("attention") or ""), compiled=bool(resolved.get("compiled")),
                   loss_chunk=resolved.get("loss_chunk") or GPU_LOSS_CHUNK,
                   kv_copies=resolved.get("varlen_kv_copies", _torch_before(env.get("torch", ""), (2, 13))))
    last_only = "device_step_peak_allocated_bytes" not in row["memory"]
    if row.get("tokens_per_step") and all(row.get("forwards_per_step") or [None]):
        rows, real, source = _recorded_forward(row, w["max_length"], last_only)
    else:
        rows, real, source = _rebuilt_forward(report, row, shape, spec, env["gpu_memory_bytes"])
    n_loss = real * w["loss_token_share"]
    return MeasuredPeak(name, row["memory"]["device_peak_allocated_bytes"], shape,
                        replace(spec, micro_batch=rows, loss_fraction=n_loss / (rows * (w["max_length"] - 1))), source)


def profile_case(name: str, doc: dict, torch_version: str) -> MeasuredPeak:
    shape, note = model_shape(doc["model"]), doc.get("attention_note") or doc["attention"]
    spec = RunSpec(micro_batch=doc["rows"], seq_len=doc["max_length"], lora_r=16,
                   precision=PRECISIONS[doc["precision"]], attn=attention(note),
                   compiled=bool(doc.get("compiled")), loss_chunk=GPU_LOSS_CHUNK, device="gpu",
                   kv_copies=doc.get("varlen_kv_copies", _torch_before(doc.get("torch", torch_version), (2, 13))))
    return MeasuredPeak(name, doc["peak_allocated_bytes"], shape, spec, "profile: its rows x max_length")


def attention(note: str) -> str:
    """The planner's name for what a run's attention note (or setting) says ran."""
    note = note.removeprefix("attention: ")
    if note.startswith(("varlen_attn", "rocktune_varlen")):
        return "varlen"
    for name in ("flash_attention_2", "eager"):
        if name in note:
            return name
    return "sdpa"  # sdpa, and flex attention (no dense mask, sized as sdpa: errs large)


def precision(row: dict) -> str:
    """Recorded since issue 36; earlier rows name it only in the varlen self-test's note ("varlen_attn bfloat16")."""
    given = (row.get("resolved") or {}).get("precision")
    if given:
        return PRECISIONS[given]
    m = re.search(r"varlen_attn (bfloat16|float16|float32)", row.get("attention") or "")
    if not m:
        raise ValueError(f"{row.get('name')}: the row records no precision")
    return PRECISIONS[m.group(1)]


def _torch_before(version: str, than: tuple[int, int]) -> bool:
    """torch 2.11's varlen_attn takes no ``enable_gqa`` (read from its wheel), 2.13's does: before 2.13 the glue
    repeats K/V."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return bool(m) and (int(m.group(1)), int(m.group(2))) < than


def _sibling_torch(path: Path) -> str:
    """A profile records no torch version: a bench file of the same run folder does."""
    for other in sorted(path.parent.glob("*.json")) + sorted(path.parent.parent.glob("*.json")):
        doc = json.loads(other.read_text())
        for report in (doc.get("reports") or {}).values() if isinstance(doc, dict) else ():
            if report.get("environment", {}).get("torch"):
                return report["environment"]["torch"]
    return ""


def _recorded_forward(row: dict, width: int, last_only: bool) -> tuple[int, int, str]:
    """Rows and non-pad tokens of the largest forward from the per-step record (rows are padded to ``width`` when
    the run compiles; otherwise a row of ``width`` errs large)."""
    per = [(math.ceil(t / f / width), t / f) for t, f in zip(row["tokens_per_step"], row["forwards_per_step"])]
    rows, tokens = max(per[-1:] if last_only else per)
    which = " (the last step: its peak is the one measured)" if last_only else ""
    real = round(tokens * (1 - (row.get("padding_fraction") or 0)))
    return rows, real, f"recorded: tokens and forwards per step{which}"


def _rebuilt_forward(report: dict, row: dict, shape: ModelShape, spec: RunSpec, budget: int) -> tuple[int, int, str]:
    w = report["workload"]
    lo, hi = w.get("token_range") or map(int, re.search(r"_(\d+)-(\d+)\.jsonl$", w["data_file"]).groups())
    records = workload.make_records(w["examples"], w["seed"], (lo, hi))
    lengths = [len(r["prompt"]) + len(r["completion"]) + 1 for r in records]  # a token per byte, and EOS
    if not math.isclose(sum(lengths) / len(lengths), w["mean_tokens"], rel_tol=1e-12):
        raise ValueError(f"rebuilt lengths' mean {sum(lengths) / len(lengths)} is not the recorded {w['mean_tokens']}")
    width, warm = w["max_length"], w["warmup_steps_excluded"]
    steps = [step_rows(s, lengths, width) for s in
             epoch_steps(lengths, w["samples_per_step"], w["seed"], 0)[: warm + w["measured_steps"]]]
    real = [sum(lengths[i] for r in rows for i in r) for rows in steps]
    padding = 1 - sum(real[warm:]) / sum(len(rows) * width for rows in steps[warm:])
    if not math.isclose(padding, row["padding_fraction"], rel_tol=1e-9):
        raise ValueError(f"rebuilt steps' padding {padding} is not the recorded {row['padding_fraction']}")
    cap = -(-int(w["samples_per_step"] * w["mean_tokens"]) // width) + 1  # tasks/causal/feed.rows_per_step
    sized = replace(spec, attn="sdpa", compiled=False, loss_chunk=spec.loss_chunk)  # that run's planner: SDPA
    per_forward = fit_token_rows(shape, sized, budget, cap).rows
    last = cut_forwards(steps[-1], per_forward)  # the peak counters were reset as the last step started
    biggest = max(last, key=len)
    return len(biggest), sum(lengths[i] for r in biggest for i in r), (
        f"rebuilt from the workload: {len(steps)} steps of {[len(s) for s in steps]} rows, {per_forward} rows per "
        f"forward (that run's SDPA-sized budget); the last step's forwards, {[len(f) for f in last]} rows, carry "
        "the measured peak")
