"""Apply Advice's environment before torch initialises a device, and print it as shell lines.

The HIP/CUDA runtime reads most of these variables once, when the device is first initialised; the allocator
reads its config at the first allocation. So ``apply_environment`` must run before anything touches the GPU.
A variable the user already set is never overwritten: their value wins and we say so.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from rocktune.platform.advise import Advice, EnvAdvice, advise
from rocktune.platform.detect import Platform, detect

_cache: dict[str, object] = {}


def apply_environment(environ: MutableMapping[str, str] | None = None, platform: Platform | None = None,
                      ) -> list[str]:
    """Set the ``documented`` env advice for this machine; return one message per decision.

    The device list comes from a child process (``probe="child"``) so this process stays uninitialised.
    """
    environ = os.environ if environ is None else environ
    messages = []
    if platform is None:
        import torch

        if torch.cuda.is_initialized():
            messages.append("the GPU was initialised before the environment advice: some variables may not apply")
        platform = detect("child" if (torch.version.hip or torch.version.cuda) else "passive")
        _cache["platform"] = platform  # only this machine's own snapshot is reused by resolve_auto
    advice = advise(platform)
    messages += apply_advice(advice, environ)
    return messages


def cached_platform() -> Platform | None:
    """This machine's snapshot from the last ``apply_environment`` call (train.autoconf reuses it)."""
    return _cache.get("platform")  # type: ignore[return-value]


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
