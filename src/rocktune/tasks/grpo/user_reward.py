"""A user's own reward function (``grpo.rewards[i].function: module:function``): found, checked and imported, every
failure a UserError (exit 2) naming ``module:function`` and, where there is one, the file and line.

Standard library only: the launching process runs ``precheck`` before any worker starts, so a missing module or a
syntax error is refused there without executing the user's code (the source is compiled, not run). The training
process alone imports the module (``load``); ``user_frame`` names the line of the user's code a reward raised in.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import traceback
from pathlib import Path
from types import TracebackType
from typing import Callable

from rocktune.errors import UserError, first_line

_HINT = ("the module must be importable from where rocktune runs (a .py file in the working directory, or an "
         "installed package)")


def _origin(module: str) -> str | None:
    """The source file of ``module`` (dotted names walk their packages' folders), found as the worker's
    ``python -m`` finds it (the working directory first), without importing or running anything."""
    search: list[str] | None = [os.getcwd(), *sys.path]
    spec = None
    for part in module.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    return None if spec is None else spec.origin or ""  # "": found, with no source file (a namespace package)


def precheck(target: str, key: str) -> None:
    """Refuse a ``module:function`` whose module cannot be found or does not compile (its file:line), in the
    launching process; a module already imported (an installed package) is left to ``load``."""
    module = target.partition(":")[0]
    if module in sys.modules:
        return
    origin = _origin(module)
    if origin is None:
        raise UserError(f"{key}.function={target}: no module '{module}' ({module.replace('.', '/')}.py) was found; "
                        f"{_HINT}. The working directory is {os.getcwd()}.")
    if not origin.endswith(".py"):
        return  # an extension module or a namespace package: only importing it can tell
    path = Path(origin)
    try:
        compile(path.read_bytes(), str(path), "exec")
    except SyntaxError as exc:
        raise UserError(f"{key}.function={target}: {exc.filename or path}:{exc.lineno}: {type(exc).__name__}: "
                        f"{exc.msg}; fix the module (nothing was started).") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{key}.function={target}: cannot read {path} ({first_line(exc)}).") from None


def load(target: str, key: str) -> Callable:
    """The function ``module:function`` names, imported now (the training process only)."""
    module, _, name = target.partition(":")
    try:
        loaded = importlib.import_module(module)
    except SyntaxError as exc:
        raise UserError(f"{key}.function={target}: {exc.filename}:{exc.lineno}: {type(exc).__name__}: {exc.msg}; "
                        "fix the module.") from None
    except ModuleNotFoundError as exc:
        if exc.name and exc.name != module and not module.startswith(exc.name + "."):
            raise UserError(f"{key}.function={target}: importing it failed at {user_frame(exc.__traceback__)}: "
                            f"{first_line(exc)} (a module your reward imports is not installed).") from None
        raise UserError(f"{key}.function={target}: no module '{module}' was found; {_HINT}.") from None
    except Exception as exc:  # noqa: BLE001 -- the user's module ran and failed: any error is theirs to fix
        raise UserError(f"{key}.function={target}: importing it raised {type(exc).__name__} at "
                        f"{user_frame(exc.__traceback__)}: {first_line(exc)}; fix the module.") from None
    if not hasattr(loaded, name):
        found = sorted(n for n, v in vars(loaded).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == loaded.__name__)
        raise UserError(f"{key}.function={target}: {_file(loaded)} has no '{name}'"
                        f"{'; its functions: ' + ', '.join(found) if found else ''}.")
    fn = getattr(loaded, name)
    if not callable(fn):
        raise UserError(f"{key}.function={target}: '{name}' in {_file(loaded)} is a {type(fn).__name__}, not a "
                        "function.")
    return fn


def _file(module) -> str:
    return getattr(module, "__file__", None) or module.__name__


# rocktune's package and the standard library: frames there are not the user's
_OURS = (str(Path(__file__).resolve().parents[2]), str(Path(os.__file__).resolve().parent))


def user_frame(tb: TracebackType | None) -> str:
    """``file:line`` of the last frame of ``tb`` in the user's code (not rocktune's, the standard library's or an
    installed package's), else of the last frame at all."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return "(no traceback)"

    def theirs(f: traceback.FrameSummary) -> bool:
        path = str(Path(f.filename).resolve()) if not f.filename.startswith("<") else f.filename
        return not (path.startswith(_OURS) or "site-packages" in path or f.filename.startswith("<frozen"))
    mine = [f for f in frames if theirs(f)] or frames
    return f"{mine[-1].filename}:{mine[-1].lineno}"
