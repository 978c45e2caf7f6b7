"""How a run ends: the figures that say whether it worked, where the result is, and what to run next.

Every figure comes from ``metrics.jsonl`` (so a resumed run reports the whole run, not its last leg) or is measured
here (peak memory); nothing is estimated. ``already_complete`` is the same summary for a finished run given
``--resume``: it says so instead of loading everything to save the same adapter again.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from rocktune.readers import metrics_log
from rocktune.readers.json_file import JsonProblem, parse_json

# The commands that use a run directory, each shown only once its module is installed.
NEXT_COMMANDS = (
    (("rocktune.generate", "rocktune.export.generate"), "{rocktune} generate {run} {ask}", "chat with the result"),
    (("rocktune.export",), "{rocktune} export {run} --to gguf", "a GGUF for llama.cpp / Ollama"),
    (("rocktune.report",), "{rocktune} report {run}", "plots and an HTML page of the run"),
)


@dataclass
class RunFigures:
    steps: int = 0
    eval_before: float | None = None
    eval_after: float | None = None
    tokens: int = 0  # loss-bearing tokens over the logged steps (every training.log_every-th) but compiling ones
    step_seconds: float = 0.0  # their time
    logged: int = 0
    compiling: int = 0  # logged steps that compiled the decoder: left out of tokens/s (48 of 56 s on an H200 run)
    device_peak: int = 0  # the largest logged step's device peak
    peak_rss: int = 0  # a CPU run's process RSS at its end (the final metrics line)


def read_figures(metrics_file: Path) -> RunFigures:
    fig = RunFigures()
    if not metrics_file.is_file():
        return fig
    recs = []
    for line in metrics_file.read_text(encoding="utf-8").splitlines():
        try:
            recs.append(parse_json(line))
        except JsonProblem:
            continue  # a line torn by a crash; the checkpoint's count already excludes it
    again = metrics_log.repeats(recs)  # a log of an older version may hold steps twice: counted once
    for rec in (r for i, r in enumerate(recs) if i not in again and isinstance(r, dict)):
        fig.device_peak = max(fig.device_peak, rec.get("peak_mem_bytes") or 0)
        fig.peak_rss = rec.get("peak_rss_bytes") or fig.peak_rss
        if "eval_loss" in rec:
            fig.eval_before = rec["eval_loss"] if fig.eval_before is None else fig.eval_before
            fig.eval_after = rec["eval_loss"] if rec.get("step") else fig.eval_after
        if "loss" in rec:
            fig.steps = max(fig.steps, rec.get("step", 0))
            fig.logged += 1
            if rec.get("compiling"):
                fig.compiling += 1
                continue
            fig.tokens += rec.get("tokens") or 0
            fig.step_seconds += rec.get("step_s") or 0.0
    return fig


def log_summary(run_dir: Path, log, wall_s: float | None, device_peak: int = 0,
                predicted_peak: int | None = None, outputs: list[str] | None = None,
                prompt: str | None = None) -> RunFigures:
    """Write the end-of-run block through ``log`` (the progress bar's, so it lands below the bar). ``outputs``:
    the lines naming what was written and what to run next, for a task other than LM LoRA; ``prompt``: see
    ``next_commands``."""
    fig = read_figures(run_dir / "metrics.jsonl")
    wall = f" in {wall_s:.1f} s wall (eval, steps and save; loading not counted)" if wall_s is not None else ""
    log(f"[bold]run complete[/]: {fig.steps} steps{wall}")
    if fig.eval_before is not None and fig.eval_after is not None:
        log(f"  eval loss       {fig.eval_before:.4f} -> {fig.eval_after:.4f}")
    if fig.step_seconds > 0:
        basis = (f"{fig.tokens:,} loss-bearing tokens in {fig.step_seconds:.1f} s of steps" if fig.logged == fig.steps
                 else f"over the {fig.logged} of {fig.steps} steps logged in metrics.jsonl")
        if fig.compiling:
            basis += f"; {fig.compiling} compiling step{'s' if fig.compiling > 1 else ''} left out"
        log(f"  useful tokens/s {fig.tokens / fig.step_seconds:,.0f} ({basis})")
    # A live run (wall_s given) may measure itself; a finished one shown again by --resume has only its records.
    rss = fig.peak_rss or (peak_rss() if wall_s is not None else 0)
    log(f"  peak memory     {_memory(device_peak or fig.device_peak, predicted_peak, rss)}")
    for line in outputs if outputs is not None else [f"  adapter         {run_dir / 'adapter'}",
                                                       *next_commands(run_dir, prompt)]:
        log(line)
    return fig


def next_commands(run_dir: Path, prompt: str | None = None) -> list[str]:
    """``prompt``: generate answers it beside the base model's answer instead of opening a chat."""
    run = _quote(str(run_dir))
    ask = f"--prompt {_quote(prompt)} --compare" if prompt else "--chat"
    found = [(cmd.format(rocktune=rocktune_command(), run=run, ask=ask), why) for modules, cmd, why in NEXT_COMMANDS
             if any(_installed(m) for m in modules)]
    if not found:
        return []
    width = max(len(c) for c, _ in found)
    return ["next:"] + [f"  {c:<{width}}  # {why}" for c, why in found]


def rocktune_command() -> str:
    """``rocktune`` as the user can type it here: the bare name when the one on PATH is this interpreter's, else the
    script beside this interpreter (``.venv/bin/rocktune`` when the venv is not activated), else ``python -m``."""
    import os
    import shutil

    script = Path(sys.executable).parent / ("rocktune.exe" if sys.platform == "win32" else "rocktune")
    if not script.is_file():  # run from a source tree, not installed: the module always works
        return f"{_quote(sys.executable)} -m rocktune"
    on_path = shutil.which("rocktune")
    try:
        if on_path and os.path.samefile(on_path, script):
            return "rocktune"
    except OSError:
        pass
    try:  # relative under the working directory (the README's .venv/bin/rocktune): short, and it has a slash
        rel = os.path.relpath(script)
    except ValueError:  # another drive on Windows
        rel = ".."
    return _quote(str(script) if rel.startswith("..") else rel)


def already_complete(run_dir: Path, force: bool) -> bool:
    """A run given ``--resume`` whose adapter exists has nothing left to do (its config was checked unchanged).

    With ``--resume-force`` the config may have changed (e.g. a longer ``max_steps``), so the run goes on.
    """
    return not force and (run_dir / "adapter" / "adapter_config.json").is_file()


def report_complete(run_dir: Path, outputs: list[str] | None = None) -> RunFigures:
    from rich.console import Console

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    console.print(f"{run_dir} is already complete: nothing to resume. Pass --overwrite to train it again from "
                  "scratch, or raise training.max_steps and pass --resume-force to train it further.")
    return log_summary(run_dir, console.print, None, outputs=outputs)


def _memory(device_peak: int, predicted_peak: int | None, rss: int) -> str:
    """The run's own figures from metrics.jsonl: a finished run given --resume must not show this process's RSS."""
    if device_peak:  # the measured figure beside the planner's, so a wrong prediction shows itself
        planned = f" (planner predicted {predicted_peak / 2**30:.2f} GiB)" if predicted_peak else ""
        return f"{device_peak / 2**30:.2f} GiB device memory allocated in a step{planned}"
    return f"{rss / 2**30:.2f} GiB process RSS (CPU run)" if rss else "not recorded for this run"


def peak_rss() -> int:
    """This process's peak resident memory in bytes (0 where it cannot be measured)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def _quote(path: str) -> str:
    import shlex

    return shlex.quote(path) if sys.platform != "win32" else (f'"{path}"' if " " in path else path)
