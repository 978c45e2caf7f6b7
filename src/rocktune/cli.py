"""Command-line interface: argument parsing only.

Each subcommand is two small functions: ``_add_<name>`` declares its arguments and ``_run_<name>`` imports the
layer below lazily (so ``rocktune plan`` never imports torch's device code) and calls one function with flat
arguments. ``UserError`` becomes one clear paragraph and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from rocktune import __version__
from rocktune.errors import UserError


def main(argv: list[str] | None = None) -> int:
    # PEFT still calls transformers' deprecated is_gradient_checkpointing; the warning is not the user's to fix.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        if args.debug:
            raise
        print_error(str(exc))
        return 2
    except KeyboardInterrupt:
        print_error("interrupted")
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rocktune", description="Rock-solid, fast LoRA fine-tuning.")
    parser.add_argument("--version", action="version", version=f"rocktune {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_demo(sub)
    _add_doctor(sub)
    _add_env(sub)
    return parser


def print_error(message: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {message}", markup=True)


# --- train -----------------------------------------------------------------------------------------------------


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="LoRA fine-tune a causal LM on your data")
    p.add_argument("-c", "--config", help="YAML config file (fields not given keep their defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.lr=2e-4 lora.r=16")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--overwrite", action="store_true", help="replace an existing, different run in output.dir")
    p.add_argument("--resume", action="store_true", help="continue the run in output.dir from its last checkpoint")
    p.add_argument("--resume-force", action="store_true",
                   help="resume even though the config or data changed (the result is no longer one exact run)")
    p.add_argument("--no-supervise", action="store_true",
                   help="train in this process instead of a supervised child that is restarted after a crash")
    p.set_defaults(func=_run_train)


def _run_train(args) -> int:
    from rocktune.config import dump_config, load_config

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        sys.stdout.write(dump_config(cfg))
        return 0
    resume = args.resume or args.resume_force
    if args.no_supervise:
        from rocktune.train.guards import FatalNumerics, RollbackRequired
        from rocktune.train.loop import train
        from rocktune.train.step import OutOfMemoryAtMinimum

        try:
            result = train(cfg, overwrite=args.overwrite, resume_run=resume, resume_force=args.resume_force)
        except (FatalNumerics, OutOfMemoryAtMinimum, RollbackRequired) as exc:
            print_error(f"{exc}. The last good checkpoint is in {cfg.output.dir}/checkpoints; continue with --resume.")
            return 1
        return 130 if result.interrupted else 0
    from rocktune.train.supervisor import supervise

    return supervise(cfg.model_dump(mode="json"), args.overwrite, resume, args.resume_force,
                     cfg.reliability.max_restarts)


# --- demo ------------------------------------------------------------------------------------------------------


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="train the built-in tiny model on a synthetic task (offline, ~1 minute on CPU)")
    p.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the demo's own)")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from rocktune.demo.run import run_demo

    return run_demo(out_dir=args.out, as_json=args.json, steps=args.steps)


# --- doctor ----------------------------------------------------------------------------------------------------


def _add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine: platform, known-bad combinations, advice, self-tests")
    p.add_argument("--json", action="store_true", help="print one JSON object with keys platform, advice, checks")
    p.add_argument("--no-device", action="store_true",
                   help="do not touch the GPU: snapshot from the kernel's view, self-tests on the CPU")
    p.add_argument("--simulate", metavar="PLATFORM.json",
                   help="advice for a saved snapshot (the 'platform' of --json, or a whole report); runs nothing")
    p.add_argument("--no-checks", action="store_true", help="snapshot and advice only")
    p.add_argument("--no-perf", action="store_true", help="skip the TFLOP/s and GB/s measurements")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a hung check is killed (default 300)")
    p.set_defaults(func=_run_doctor)


def _run_doctor(args) -> int:
    from pathlib import Path

    if args.simulate and not Path(args.simulate).is_file():
        raise UserError(f"--simulate: no such file {args.simulate}")
    if args.timeout <= 0:
        raise UserError("--timeout must be positive")
    from rocktune.doctor.main import run_doctor

    return run_doctor(as_json=args.json, no_device=args.no_device, simulate=args.simulate,
                      run_checks=not args.no_checks, perf=not args.no_perf, timeout=args.timeout)


# --- env -------------------------------------------------------------------------------------------------------


def _add_env(sub) -> None:
    p = sub.add_parser("env", help="print the environment variables rocktune advises for this machine (export lines)")
    p.add_argument("--shell", choices=["bash", "powershell"], help="line format (default: powershell on Windows)")
    p.add_argument("--simulate", metavar="PLATFORM.json", help="advise for a saved snapshot instead of this machine")
    p.add_argument("--arch", help="advise for this arch (e.g. gfx1151, sm_89, cpu) instead of the detected one")
    p.set_defaults(func=_run_env)


def _run_env(args) -> int:
    from pathlib import Path

    if args.simulate and not Path(args.simulate).is_file():
        raise UserError(f"--simulate: no such file {args.simulate}")
    if args.arch and not (args.arch == "cpu" or args.arch.startswith(("gfx", "sm_"))):
        raise UserError(f"--arch must look like gfx1100, sm_89 or cpu, not {args.arch!r}")
    from rocktune.platform.environment import print_env

    return print_env(shell=args.shell, simulate=args.simulate, arch=args.arch)
