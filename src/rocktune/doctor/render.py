"""Print a doctor report (the same dict that ``--json`` writes) as rich tables."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

_STATUS = {"pass": "[green]pass[/]", "fail": "[bold red]FAIL[/]", "skip": "[dim]skip[/]"}
_LEVEL = {"error": "[bold red]error[/]", "warning": "[yellow]warning[/]", "info": "[cyan]info[/]"}


def render(report: dict, console: Console | None = None) -> None:
    console = console or Console(highlight=False)
    plat, advice, checks = report["platform"], report["advice"], report["checks"]
    console.print(_platform_table(plat))
    if report.get("threads"):
        console.print(escape(report["threads"]))
    busy = load_warning(report.get("load"))
    if busy:
        console.print(f"[yellow]warning[/] {escape(busy)}")
    console.print(_defaults_table(advice))
    if advice["env"]:
        console.print(_env_table(advice))
    if advice["findings"]:
        console.print(_findings_table(advice["findings"]))
    if checks:
        console.print(_checks_table(checks, report.get("device", "?")))
        counts = {s: sum(c["status"] == s for c in checks) for s in ("pass", "fail", "skip")}
        verdict = "[bold red]checks failed[/]" if counts["fail"] else "[green]all checks passed[/]"
        busy_note = " [yellow](the machine is oversubscribed: see the warning above)[/]" if busy else ""
        console.print(f"{verdict}: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"
                      + busy_note)
    elif "device" not in report:
        console.print("[dim]no checks run (simulated platform or --no-checks)[/]")


def load_warning(load: dict | None) -> str | None:
    """The oversubscription warning, or None."""
    if not load or not load.get("oversubscribed"):
        return None
    return (f"oversubscribed: other processes keep {load['busy']:.1f} of the {load['cpus']} usable CPUs busy "
            f"({load['source']}). A CPU run measures its torch threads at start and takes the fastest count (often "
            "1 here), and still runs slower than on a quiet machine; stop the other work, or give the run its own "
            "cores (taskset, a container's CPU quota).")


def _platform_table(p: dict) -> Table:
    t = Table(title="platform", show_header=False, title_justify="left")
    build = {"rocm": f"ROCm {p.get('rocm')} (HIP {p.get('hip')})", "cuda": f"CUDA {p.get('cuda')}",
             "cpu": "CPU only"}[p["backend"]]
    t.add_row("system", f"{p['os']} {p.get('os_release', '')} {p.get('machine', '')}, {p.get('cpu_count', '?')} CPUs")
    t.add_row("python / torch", f"{p['python']} / {p.get('torch')} — {build}")
    for d in p["devices"]:
        vram = f"{d['vram_bytes'] / 2**30:.1f} GiB" if d.get("vram_bytes") else "? GiB"
        shared = ", shared memory (APU)" if d.get("shared_memory") else ""
        t.add_row(f"device {d['index']}", f"{d['name']} — {d['arch']}, {vram}{shared} [dim]({d['source']})[/]")
    if not p["devices"]:
        t.add_row("devices", "none (CPU)" if p["backend"] == "cpu" else "no GPU found")
    libs = ", ".join(f"{k} {v}" for k, v in p["libraries"].items()) or "none"
    t.add_row("libraries", libs)
    env = ", ".join(f"{k}={v}" for k, v in p["env"].items())
    t.add_row("environment", escape(env) if env else "no ROCm/CUDA/allocator variables")
    return t


def _defaults_table(a: dict) -> Table:
    t = Table(title=f"training defaults for {a['arch']}", title_justify="left")
    t.add_column("setting")
    t.add_column("value")
    t.add_column("why", overflow="fold")
    for key, value in a["defaults"].items():
        t.add_row(key, str(value), escape(a["reasons"].get(key, "")))
    return t


def _env_table(a: dict) -> Table:
    t = Table(title="environment (documented: set by `rocktune train`; reported: shown only)", title_justify="left")
    for col in ("variable", "value", "confidence", "reason"):
        t.add_column(col, overflow="fold")
    for e in a["env"]:
        conf = e["confidence"] if e["confidence"] == "documented" else "[yellow]reported[/]"
        t.add_row(e["name"], escape(e["value"]), conf, f"{escape(e['reason'])} [dim]({escape(e['source'])})[/]")
    return t


def _findings_table(findings: list[dict]) -> Table:
    t = Table(title="findings", title_justify="left")
    for col in ("level", "finding", "source"):
        t.add_column(col, overflow="fold")
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(findings, key=lambda f: order[f["level"]]):
        text = escape(f["message"]) + (f"\n[bold]fix:[/] {escape(f['fix'])}" if f["fix"] else "")
        src = f["source"] + ("" if f["confidence"] == "documented" else " [yellow](reported)[/]")
        t.add_row(_LEVEL[f["level"]], text, f"[dim]{src}[/]")
    return t


def _checks_table(checks: list[dict], device: str) -> Table:
    t = Table(title=f"self-tests on {device} (each against a CPU reference)", title_justify="left")
    for col in ("check", "status", "error", "detail", "s"):
        t.add_column(col, overflow="fold")
    for c in checks:
        err = c.get("error")
        err_text = "" if err is None else err if isinstance(err, str) else f"{err:.1e}"
        t.add_row(escape(c["name"]), _STATUS.get(c["status"], c["status"]), err_text, escape(c.get("detail", "")),
                  f"{c.get('seconds', 0):.2f}")
    return t
