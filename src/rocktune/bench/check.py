"""The GPU check's stage lines and its one report (``benchmarks/gpu_check.sh``).

The check runs each bench configuration as its own time-boxed stage, so each stage's bench report holds one row and
no ratio. Here the rows of one command's stages are put back into one report per model shape, and the ratios, the
best Hugging Face row and the targets are computed over all of them (``runner.compare``). A stage cut by its own
timeout left no report: its row comes from what its ``metrics.jsonl`` held (``runner.partial_result``).

Each stage prints one line: status, loss first -> last, MFU, tokens/s, peak, attention, fusion, recompiles for a bench
stage; the pytest verdict for a test stage; the grouped-query finding for the varlen stage; which kernel packages
import and each self-test's verdict for the doctor's recurrent stage; each row and rocktune's ratio for a bench stage
that ran its configurations in one report (the recurrent part's).

    python -m rocktune.bench.check bench  --stage S --rc RC --secs N --file S.json --shape SHAPE --config C \
        --run-dir DIR --device cuda [--out report.json EARLIER.json... S.json]
    python -m rocktune.bench.check tests  --stage S --rc RC --secs N --file S.txt
    python -m rocktune.bench.check varlen --stage S --rc RC --secs N --file S.json
    python -m rocktune.bench.check doctor --stage S --rc RC --secs N --file S.txt
    python -m rocktune.bench.check pair   --stage S --rc RC --secs N --file S.json
    python -m rocktune.bench.check merge  --out report.json --device cuda STAGE.json...
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

TIMED_OUT = (124, 137)  # timeout's own exit status, and SIGKILL's after its grace period


@dataclass(frozen=True)
class Stage:
    """One stage as the shell ran it: its name, exit status, seconds and the file its output went to."""

    name: str
    rc: int
    secs: int
    file: Path

    def status(self, ok: bool) -> str:
        return "TIMEOUT" if self.rc in TIMED_OUT else "ok" if ok and self.rc == 0 else "FAIL"


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---- bench stages -------------------------------------------------------------------------------------------------

def bench_row(stage: Stage, shape: str, config: str, run_dir: Path, device: str) -> dict:
    """The configuration's row from the stage's report; where the stage was killed before writing one, a report of
    what the run's ``metrics.jsonl`` held is written in its place (so that the merge finds every stage)."""
    report = _load(stage.file)
    if report is not None:
        rows = next(iter(report["reports"].values()))["configs"]
        return next(r for r in rows if r["name"] == config)
    from rocktune.bench import runner

    kind = runner._config(config).kind
    cut_off = ", timed out" if stage.rc in TIMED_OUT else ""
    why = f"the bench wrote no report (exit status {stage.rc} after {stage.secs} s{cut_off})"
    cut = runner.partial_result(config, kind, run_dir, {"warmup": _suite(shape).warmup, "device": device}, why)
    common = {**runner.COMMON, **_suite(shape).common}
    rep = runner.summarise([cut], 0, [], device, common)
    rep["workload"] = {"model": shape, "partial": True, **common}
    stage.file.write_text(json.dumps({"schema": "rocktune-bench-suite/1", "suite": "gpu", "reports": {shape: rep}}))
    return rep["configs"][0]


def _suite(shape: str):
    from rocktune.bench.suites import SUITES

    gpu = SUITES["gpu"]
    return gpu if shape in gpu.models else gpu.dry()


def _status_loss(row: dict) -> tuple[str, str]:
    """A bench row's status (INVALID where its loss did not fall: its speed is no figure) and its loss in words."""
    if row.get("loss_fell") is False:
        status = "INVALID"
    else:
        status = {"ok": "ok", "timeout": "TIMEOUT (partial)"}.get(row["status"], str(row["status"]).upper())
    losses = row.get("losses") or []
    return status, (f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({len(losses)} steps)" if losses else "loss -")


def bench_line(stage: Stage, row: dict) -> str:
    status, loss = _status_loss(row)
    parts = [f"{stage.name}: {status}", loss]
    if row.get("loss_fell") is False:
        parts.append("tokens/s INVALID (loss did not fall)")
    else:
        parts += [f"MFU {_pct(row.get('mfu'))}", f"tokens/s {_num(row.get('useful_tokens_per_s'))}"]
    parts += [f"peak {_gib(row.get('peak_memory_bytes'))}", f"attention {_attention(row.get('attention'))}",
              f"fusion {row.get('fusion') or '-'}", f"recompiles {(row.get('compiler') or {}).get('recompiles', '-')}",
              f"{stage.secs} s"]
    line = ", ".join(parts)
    return line if status == "ok" else f"{line} -- {row.get('invalid_reason') or row.get('reason') or ''}".rstrip()


def _attention(note: str | None) -> str:
    """The attention that ran, short: varlen's note says which grouped-query call its self-test proved."""
    if not note:
        return "-"
    name = note.split(" ", 1)[0].rstrip(",;")
    if "grouped K/V un-repeated" in note:
        return f"{name} (K/V un-repeated)"
    if "K/V repeated" in note:
        return f"{name} (K/V repeated)"
    return name


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


# ---- test stages --------------------------------------------------------------------------------------------------

def tests_line(stage: Stage) -> str:
    """pytest's verdict: its closing summary line (or the reason it never ran)."""
    text = stage.file.read_text(errors="replace") if stage.file.is_file() else ""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    verdict = next((x for x in reversed(lines) if " in " in x and any(w in x for w in (
        "passed", "failed", "error", "skipped", "deselected", "no tests ran", "collected"))), None)
    why = verdict or (lines[-1] if lines else "no output")
    return f"{stage.name}: {stage.status(stage.rc == 0)}, {why}, {stage.secs} s"


# ---- the varlen grouped-query stage -------------------------------------------------------------------------------

def varlen_line(stage: Stage) -> str:
    """benchmarks/varlen_gqa.py's finding per kernel and dtype: whether the glue hands grouped K/V un-repeated."""
    found = _load(stage.file)
    if not found:
        return f"{stage.name}: {stage.status(False)}, no report, {stage.secs} s"
    parts = []
    for kernel, by_dtype in found.get("kernels", {}).items():
        for dtype, r in by_dtype.items():
            glue = r["glue"]
            how = "K/V un-repeated" if glue["grouped_kv_un_repeated"] else "K/V repeated"
            err = r.get("un-repeated", {}).get("error")
            parts.append(f"{kernel} {dtype} {'ok' if glue['ok'] else 'FAIL'} ({how}; un-repeated call "
                         f"{'error ' + format(err, '.1e') if err is not None else 'raised'})")
    heads = "/".join(map(str, found.get("heads", [])))
    what = "; ".join(parts) or found.get("note", "nothing ran")
    return f"{stage.name}: {stage.status(bool(parts))}, torch {found.get('torch')}, heads {heads}: {what}, " \
           f"{stage.secs} s"


# ---- the recurrent part: the doctor's self-tests, and rocktune beside HF in one report ------------------------------

def doctor_line(stage: Stage) -> str:
    """The doctor's recurrent checks as its check process printed them (doctor/child.py: ``@@start NAME``, then
    ``@@result {json}``; the stage adds ``@@package {json}`` first): which kernel packages import, each self-test's
    verdict (pass with its error, fail with what failed, skips grouped by their reason), and any check that began
    without a verdict (its process died, or the stage's timeout hit, inside it). A failed self-test stops nothing:
    training runs transformers' torch reference there."""
    text = stage.file.read_text(errors="replace") if stage.file.is_file() else ""
    packages, started, results = [], [], {}
    for line in text.splitlines():
        tag, _, rest = line.partition(" ")
        if tag in ("@@package", "@@result"):
            try:
                found = json.loads(rest)
            except ValueError:
                continue
            if tag == "@@package":
                packages.append(found)
            else:
                results[found["name"]] = found
        elif tag == "@@start":
            started.append(rest.strip())
    if not packages and not started:
        last = next((x.strip() for x in reversed(text.splitlines()) if x.strip()), "no output")
        return f"{stage.name}: {stage.status(False)}, {last}, {stage.secs} s"
    parts = [", ".join(f"{p['name']} {p['version']}" if "version" in p else f"{p['name']} absent"
                       if p.get("absent") else f"{p['name']}: {p.get('error')}" for p in packages)] if packages else []
    skips: dict[str, list[str]] = {}
    for name in started:
        short = name.removeprefix("recurrent[").removesuffix("]")
        r = results.get(name)
        if r is None:
            parts.append(f"{short} no verdict (its process died or the stage's timeout hit inside it)")
        elif r["status"] == "pass":
            parts.append(f"{short} pass (error {r['error']:.1e}, tolerance {r['tolerance']:.0e})"
                         if r.get("error") is not None and r.get("tolerance") else f"{short} pass")
        elif r["status"] == "skip":
            skips.setdefault(r["detail"].split(":", 1)[0], []).append(short)
        else:
            parts.append(f"{short} FAIL ({r['detail']})")
    parts += [f"skip ({why}): {', '.join(names)}" for why, names in skips.items()]
    ok = bool(started) and all(results.get(n, {}).get("status") in ("pass", "skip") for n in started)
    return f"{stage.name}: {stage.status(ok)}, {'; '.join(parts)}, {stage.secs} s"


def _row_brief(row: dict) -> str:
    """A bench row in a few words: status, loss, tokens/s (INVALID where the loss did not fall), MFU, peak."""
    status, loss = _status_loss(row)
    parts = [f"{row['name']} {status}", loss]
    if row.get("loss_fell") is False:
        parts.append("tokens/s INVALID (loss did not fall)")
    else:
        parts += [f"tokens/s {_num(row.get('useful_tokens_per_s'))}", f"MFU {_pct(row.get('mfu'))}"]
    parts.append(f"peak {_gib(row.get('peak_memory_bytes'))}")
    why = row.get("reason") if status not in ("ok", "INVALID") else None
    return ", ".join(parts) + (f" ({why})" if why else "")


def pair_line(stage: Stage) -> str:
    """A bench stage that ran its configurations in one report (``rocktune bench --json`` without a suite, so the
    ratios are the bench's own): each row, then rocktune's tokens/s and memory against the HF row."""
    report = _load(stage.file)
    rows = (report or {}).get("configs") or []
    if not rows:
        return f"{stage.name}: {stage.status(False)}, no report, {stage.secs} s"
    shape = (report.get("workload") or {}).get("model", "?")
    device = (report.get("environment") or {}).get("device", "?")
    rt = next((r for r in rows if r.get("kind") == "rocktune"), None)
    best = ((rt or {}).get("ratios") or {}).get("best-hf")
    ratio = (f"{rt['name']} / {best['against']}: tokens/s {_x(best.get('tokens_per_s'))}, memory "
             f"{_x(best.get('memory'))}") if rt and best else "no ratio (rocktune and an HF row must both have run)"
    ok = all(r.get("status") == "ok" and r.get("loss_fell") is not False for r in rows)
    return f"{stage.name}: {stage.status(ok)}, {shape} on {device}: " + "; ".join(map(_row_brief, rows)) + \
        f"; {ratio}, {stage.secs} s"


# ---- one report for the command -----------------------------------------------------------------------------------

def merge(paths: list[Path], device: str) -> dict:
    """Every stage's rows in one report per model shape, compared with each other (ratios, best HF row, targets)."""
    from rocktune.bench import runner

    shapes: dict[str, dict] = {}
    for path in paths:
        suite = _load(path)
        for shape, rep in (suite or {}).get("reports", {}).items():
            into = shapes.setdefault(shape, {**rep, "configs": [], "stages": []})
            into["configs"] += [r for r in rep["configs"] if r["name"] not in {x["name"] for x in into["configs"]}]
            into["stages"].append(path.stem)
    for shape, rep in shapes.items():
        common = {**runner.COMMON, **{k: v for k, v in (rep.get("workload") or {}).items() if k in runner.COMMON}}
        rep["best_hf"] = runner.compare(rep["configs"], common)
        rep["targets"] = runner.targets(rep["configs"], rep.get("parity"), device, shape)
    return {"schema": "rocktune-bench-suite/1", "suite": "gpu", "merged": True, "reports": shapes}


def ratio_lines(merged: dict) -> list[str]:
    """The command's answer to the GPU targets: rocktune against the best Hugging Face row, per shape."""
    from rocktune.bench.runner import MFU_TARGETS, TARGETS

    goal = TARGETS["cuda"]
    out = []
    for shape, rep in merged["reports"].items():
        rt = next((r for r in rep["configs"] if r["name"] == "rocktune"), None)
        best = ((rt or {}).get("ratios") or {}).get("best-hf")
        if best is None:
            out.append(f"ratios {shape}: none (rocktune and a Hugging Face row must both have run: "
                       f"{', '.join(r['name'] + ' ' + r['status'] for r in rep['configs'])})")
            continue
        mfu = f", MFU {_pct(rt.get('mfu'))} (target {MFU_TARGETS[shape]:.0%})" if shape in MFU_TARGETS else ""
        out.append(f"ratios {shape}: rocktune / {best['against']}: tokens/s {_x(best['tokens_per_s'])} (target >= "
                   f"{goal['tokens_per_s_vs_best-hf']}x), memory {_x(best['memory'])} (target <= "
                   f"{goal['memory_vs_best-hf']}x){mfu}")
    return out


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rocktune.bench.check", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["bench", "tests", "varlen", "doctor", "pair", "merge"])
    p.add_argument("--stage")
    p.add_argument("--rc", type=int, default=0)
    p.add_argument("--secs", type=int, default=0)
    p.add_argument("--file", type=Path)
    p.add_argument("--shape")
    p.add_argument("--config")
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path)
    p.add_argument("reports", nargs="*", type=Path)
    a = p.parse_intermixed_args(argv)
    if a.what == "merge":
        merged = merge(a.reports, a.device)
        a.out.write_text(json.dumps(merged, indent=1))
        print("\n".join(ratio_lines(merged)))
        return 0
    stage = Stage(a.stage, a.rc, a.secs, a.file)
    if a.what == "bench":
        print(bench_line(stage, bench_row(stage, a.shape, a.config, a.run_dir, a.device)))
        if a.out:  # the command's one report, rebuilt after every bench stage: a later hang loses no row
            a.out.write_text(json.dumps(merge(a.reports, a.device), indent=1))
    else:
        print({"tests": tests_line, "varlen": varlen_line, "doctor": doctor_line, "pair": pair_line}[a.what](stage))
    return 0


if __name__ == "__main__":
    sys.exit(main())
