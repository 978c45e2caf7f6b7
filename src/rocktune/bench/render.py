"""The bench report as a table (rich) — the JSON holds everything the table shows, and more."""

from __future__ import annotations

import sys


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}MiB"


def render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    w = report["workload"]
    table = Table(title=f"rocktune bench — {w['model']}, {w['examples']} examples (mean {w['mean_tokens']:.0f} "
                        f"tokens, {w['loss_token_share']:.0%} loss-bearing), {w['samples_per_step']} samples/step, "
                        f"medians of {w['measured_steps']} steps after {w['warmup_steps_excluded']} warm-up; "
                        f"peak mem = {report['peak_memory_kind']}")
    for col in ("config", "useful tok/s", "s/step", "peak mem", "padding", "MFU", "MFU all-token head", "final loss",
                "×seed", "×tuned", "mem×tuned", "×best HF"):
        table.add_column(col, justify="left" if col == "config" else "right", no_wrap=col == "config")
    not_run = []
    for r in report["configs"]:
        if r["status"] != "ok":
            not_run.append(f"{r['name']}: [yellow]{r['status']}[/] — {r.get('reason')}")
            continue
        if r.get("invalid_reason"):
            not_run.append(f"{r['name']}: [red]speed invalid[/] — {r['invalid_reason']}")
        ratios = r.get("ratios", {})
        table.add_row(
            r["name"], _fmt(r["useful_tokens_per_s"], ",.0f"), _fmt(r["step_s"], ".2f"),
            _mib(r["peak_memory_bytes"]), _fmt(r["padding_fraction"], ".0%"), _fmt(r["mfu"], ".1%"),
            _fmt(r.get("mfu_all_token_head"), ".1%"),
            _fmt(r["final_loss"], ".3f"), _fmt(ratios.get("hf-seed", {}).get("tokens_per_s"), ".2f", "×"),
            _fmt(ratios.get("hf-tuned", {}).get("tokens_per_s"), ".2f", "×"),
            _fmt(ratios.get("hf-tuned", {}).get("memory"), ".2f", "×"),
            _fmt(ratios.get("best-hf", {}).get("tokens_per_s"), ".2f", "×"))
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(table)
    if report.get("best_hf"):
        console.print(f"×best HF: against {report['best_hf']}, the fastest Hugging Face row that ran. "
                      f"{report.get('mfu_convention', '')}")
    for r in report["configs"]:
        if r.get("device_time", {}) and r["device_time"].get("kernels") is not None:
            console.print(device_line(r["name"], r["device_time"]), highlight=False)
    for line in not_run:
        console.print(line)
    p = report.get("parity")
    if p:
        verdict = {True: "[green]match[/]", False: "[red]MISMATCH[/]", None: "[yellow]not run[/]"}[p.get("match")]
        detail = p.get("reason") or (f"max |Δloss| {p['max_abs_diff']:.2e} (relative {p['max_rel_diff']:.2e}, "
                                     f"tolerance {p['rel_tol']:.0e}) over {p['steps']} steps")
        console.print(f"loss parity (same samples, same steps, fp32): {verdict} — {detail}")
    for key, t in report.get("targets", {}).items():
        if t["met"] is None:
            continue
        mark = {True: "[green]met[/]", False: "[red]not met[/]", None: "[yellow]n/a[/]"}[t["met"]]
        console.print(f"target {key}: {_fmt(t['value'], '.3g')} (target {t['target']:g}) {mark}")
    if report.get("pick"):
        console.print(f"fastest: [bold]{report['pick']['name']}[/] -> {report['pick']['config_file']}")


def device_line(name: str, d: dict) -> str:
    """One configuration's device account (bench/device_time.py) in a line."""
    classes = ", ".join(f"{c} {v['share']:.0%}" for c, v in d["classes"].items() if v.get("share"))
    return (f"device, {name} (profiled step {d['sampled_step']}): busy {_fmt(d.get('busy_share'), '.0%')} of "
            f"{_fmt(d.get('span_s'), '.3f', ' s')}, {d['kernels']:,} kernels; {classes}")
