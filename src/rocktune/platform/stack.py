"""The libraries around torch: which releases work with the torch that is installed, and refusing those that do not.

Users bring their own torch (a ROCm or CUDA build, installed first), and pip then picks transformers, peft and
friends by their newest releases, not by that torch: transformers 5 treats a torch below 2.6 as absent, so an MI50's
2.4.1 ended in "PyTorch was not found" three packages deep. The knowledge of which releases fit which torch is data
(``stacks`` in knowledge.yaml); this module reads it three ways: as pip constraints for the installer
(``python -m rocktune.platform.stack --constraints``, run by ``make install`` before rocktune is installed, so it
reads versions from package metadata and never imports torch), as findings for ``doctor``, and as a refusal that
``doctor`` and ``train`` raise before anything imports transformers.
"""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import dataclass

from rocktune.platform import knowledge


@dataclass(frozen=True)
class StackProblem:
    id: str
    message: str  # what is wrong and why
    fix: str  # the versions that work, and the command that installs them
    source: str
    confidence: str


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed(names) -> dict[str, str]:
    return {name: v for name in names if (v := installed_version(name)) is not None}


def stack_for(torch_version: str) -> dict | None:
    """The first ``stacks`` entry whose torch range holds ``torch_version``; None when none does."""
    return next((s for s in knowledge.load()["stacks"] if knowledge.version_matches(torch_version, s["torch"])), None)


def compile_refusal(torch_version: str) -> str | None:
    """Why torch.compile cannot run beside ``torch_version``'s stack; None where it can."""
    return (stack_for(torch_version) or {}).get("compile")


def task_refusal(torch_version: str | None, task: str) -> str | None:
    """Why ``task`` cannot run beside ``torch_version``'s stack; None where it can."""
    return ((stack_for(torch_version or "") or {}).get("tasks") or {}).get(task)


def refuse_task(task: str) -> None:
    """Raise UserError when the installed torch's stack cannot run ``task``, before anything is loaded."""
    torch_version = installed_version("torch") or _imported_torch_version()
    why = task_refusal(torch_version, task)
    if why:
        from rocktune.errors import UserError

        raise UserError(f"rocktune train: task {task} with torch {torch_version}: {why}")


def pinned_names() -> list[str]:
    return sorted({name for s in knowledge.load()["stacks"] for name in s.get("pins", {})})


def constraints(torch_version: str) -> list[str]:
    """pip constraint lines (``transformers>=4.56,<5``) for ``torch_version``; none where no pin is needed."""
    stack = stack_for(torch_version) or {}
    return [f"{name}{spec}" for name, spec in sorted(stack.get("pins", {}).items())]


def problems(torch_version: str | None, libraries: dict[str, str]) -> list[StackProblem]:
    """What makes this torch, or a library installed beside it, unable to train: refusals, with their fixes."""
    if torch_version is None:
        return [StackProblem("torch-missing", "torch is not installed", _install_hint(None), "rocktune pyproject",
                             "documented")]
    stack = stack_for(torch_version)
    if stack is None or stack.get("refuse"):
        why = (stack or {}).get("refuse", f"no entry of rocktune's knowledge covers torch {torch_version}")
        return [StackProblem("torch-unsupported", f"torch {torch_version} is not supported: {why}",
                             _supported_hint(), (stack or {}).get("source", "rocktune knowledge.yaml stacks"),
                             (stack or {}).get("confidence", "documented"))]
    pins = stack.get("pins", {})
    wrong = {n: v for n, v in libraries.items() if n in pins and not knowledge.version_matches(v, pins[n])}
    if not wrong:
        return []
    have = ", ".join(f"{n} {v}" for n, v in sorted(wrong.items()))
    return [StackProblem("stack-mismatch", f"torch {torch_version} with {have}: {stack['why']}",
                         _install_hint(torch_version), stack["source"], stack["confidence"])]


def check_installed() -> list[StackProblem]:
    """``problems`` for this interpreter's packages, read from their metadata (nothing is imported)."""
    return problems(installed_version("torch") or _imported_torch_version(), installed(pinned_names()))


def _imported_torch_version() -> str | None:
    """A torch without package metadata (a source build on sys.path) still counts: ask torch itself."""
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def refuse_unsupported(command: str) -> None:
    """Raise UserError naming the reason and the versions that work, before ``command`` imports transformers."""
    found = [p for p in check_installed() if p.confidence == "documented"]
    if found:
        from rocktune.errors import UserError

        raise UserError(f"rocktune {command}: " + " ".join(f"{p.message}. {p.fix}" for p in found))


def _install_hint(torch_version: str | None) -> str:
    pins = constraints(torch_version) if torch_version else []
    if not pins:
        return ("Install your torch build first (README: Installing on a GPU machine), then rocktune: "
                "`make install`, or `pip install -e .`")
    # Reinstalling rocktune under the constraints, not the pins alone: pip then also moves datasets and diffusers
    # back to releases that accept the older huggingface-hub the older transformers needs.
    return (f"Versions that work with torch {torch_version}: {', '.join(pins)}. `make install` applies them as pip "
            "constraints; by hand: python -m rocktune.platform.stack --constraints > constraints.txt && "
            "pip install -c constraints.txt -e .")


def _supported_hint() -> str:
    ranges = [f"torch {s['torch']}" + (f" (tested: {s['tested']})" if s.get("tested") else "")
              for s in knowledge.load()["stacks"] if not s.get("refuse")]
    return "Supported: " + "; ".join(ranges) + ". Install one of these first, then rocktune (README)"


def main(argv: list[str]) -> int:
    """``--constraints``: print the pip constraints for the torch installed here (nothing when none is needed)."""
    if argv != ["--constraints"]:
        print("usage: python -m rocktune.platform.stack --constraints", file=sys.stderr)
        return 2
    torch_version = installed_version("torch")
    if torch_version is None:
        return 0  # the installer puts its pinned CPU build in first; nothing to constrain yet
    refused = [p for p in problems(torch_version, {}) if p.id == "torch-unsupported"]
    for p in refused:
        print(f"error: {p.message}. {p.fix}", file=sys.stderr)
    for line in constraints(torch_version):
        print(line)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
