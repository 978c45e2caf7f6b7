"""Apply Advice's environment before torch initialises a device, and print it as shell lines.

The HIP/CUDA runtime reads most of these variables once, when the device is first initialised; the allocator
reads its config at the first allocation. So ``apply_environment`` must run before anything touches the GPU.
A variable the user already set is never overwritten: their value wins and we say so.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

from rocktune.platform.advise import Advice, EnvAdvice, advise
from rocktune.platform.detect import Platform, detect


def apply_environment(environ: MutableMapping[str, str] | None = None, platform: Platform | None = None,
                      ) -> list[str]:
    """Set the ``documented`` env advice for ``platform`` (default: this machine); return one message per decision."""
    if platform is None:
        return prepare_environment(environ)[1]
    return apply_advice(advise(platform), os.environ if environ is None else environ)


def resolve_device(requested: str) -> str:
    """``auto`` -> the GPU when torch sees one, else the CPU; the runtime variables set first either way, since
    ROCm/CUDA read them when the device initialises. The one resolver for generate, export and the bench (training
    resolves through train/context.py, which also proves the precision on the device)."""
    from rocktune.errors import UserError

    if requested != "auto" and requested != "cpu" and not re.fullmatch(r"cuda(:\d+)?", requested):
        raise UserError(f"--device must be auto, cpu or cuda (ROCm builds of torch call the GPU cuda too), not "
                        f"{requested!r}")
    if requested == "cpu":
        return requested
    apply_environment()
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def prepare_environment(environ: MutableMapping[str, str] | None = None) -> tuple[Platform, list[str]]:
    """This machine's snapshot and the advice for it applied: what a run resolves its choices from (train/context.py
    keeps the snapshot, so nothing is detected twice). The device list comes from a child process
    (``probe="child"``) so this process stays uninitialised."""
    import torch

    messages = []
    if torch.cuda.is_initialized():
        messages.append("the GPU was initialised before the environment advice: some variables may not apply")
    platform = detect("child" if (torch.version.hip or torch.version.cuda) else "passive")
    return platform, messages + apply_advice(advise(platform), os.environ if environ is None else environ)


def apply_advice(advice: Advice, environ: MutableMapping[str, str]) -> list[str]:
    """Set documented advice in ``environ`` unless the user set the variable; messages say what happened."""
    messages, done = [], set()
    for e in advice.env:
        if e.confidence != "documented":
            messages.append(f"not applied (reported, unverified): {e.name}={e.value} ({e.reason}; {e.source})")
        elif e.name in environ and e.name not in done:
            if environ[e.name] != e.value:
                messages.append(f"kept your {e.name}={environ[e.name]} (advice: {e.value}, {e.reason})")
        elif e.name not in done:
            environ[e.name] = e.value
            done.add(e.name)
            messages.append(f"set {e.name}={e.value} ({e.reason})")
    return messages


def env_lines(advice: Advice, shell: str = "bash", current: dict[str, str] | None = None) -> list[str]:
    """``export`` lines (PowerShell ``$env:`` lines) for documented advice; reported advice as comments."""
    current = current or {}
    lines = [f"# rocktune env for {advice.arch}: documented advice is exported, reported advice is commented out"]
    seen: set[str] = set()
    for e in advice.env:
        line = _assign(e, shell)
        if e.confidence == "reported":
            lines.append(f"# reported, unverified ({e.source}): {e.reason}")
            lines.append(f"# {line}")
        elif e.name not in seen:
            seen.add(e.name)
            if e.name in current and current[e.name] != e.value:
                lines.append(f"# you have {e.name}={current[e.name]}; rocktune advises:")
            lines.append(f"# {e.reason} ({e.source})")
            lines.append(line)
    if len(lines) == 1:
        lines.append("# nothing to set on this platform")
    return lines


def _assign(e: EnvAdvice, shell: str) -> str:
    if shell == "powershell":
        return f'$env:{e.name} = "{e.value}"'
    return f"export {e.name}='{e.value}'"


def print_env(shell: str | None = None, simulate: str | None = None, arch: str | None = None) -> int:
    """``rocktune env``: print the lines for this machine (or a snapshot); never initialises a GPU."""
    import sys

    from rocktune.platform.detect import Device, load_platform

    plat = load_platform(simulate) if simulate else detect("passive")
    if arch:  # advice for a named arch, e.g. on Windows where nothing passive reveals it
        plat.devices = [Device(0, arch, arch, None, False, "simulated")] if arch != "cpu" else []
        if plat.backend == "cpu" and arch != "cpu":
            plat.backend = "rocm" if arch.startswith("gfx") else "cuda"
    shell = shell or ("powershell" if plat.os == "windows" else "bash")
    for line in env_lines(advise(plat), shell, plat.env):
        sys.stdout.write(line + "\n")
    return 0
