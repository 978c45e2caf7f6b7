"""The run's context: the resolved platform and the choices made for it, the process group, and one list of notes.

Built once, at the start of ``train``, and handed to the task and the loop explicitly: nothing about the machine
travels through module globals, and every note (environment advice, auto choices, quantisation, --auto, the data,
the process group) lands both on the console and in ``run_info.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rocktune.config import RunConfig
from rocktune.platform.detect import Platform
from rocktune.train import distributed
from rocktune.train.autoconf import AutoChoices, resolve_auto
from rocktune.train.faults import Faults
from rocktune.train.request import RunOptions

if TYPE_CHECKING:
    from rocktune.train.runlock import RunLock


@dataclass
class RunContext:
    cfg: RunConfig  # the task may replace it once, before anything is written (--auto fits it to the device)
    options: RunOptions
    platform: Platform  # this machine's snapshot, taken once
    choices: AutoChoices  # device, precision, attention and the platform's defaults for them
    dist: distributed.Dist
    faults: Faults = field(default_factory=Faults)
    quiet: bool = False
    notes: list[str] = field(default_factory=list)  # in the order decided: the console and run_info.json
    on_step_done: Callable[[int], None] | None = None  # the supervised worker: start-up is over after step 1
    run_lock: RunLock | None = None  # held by rank 0 while it trains the run directory

    @property
    def device(self) -> str:
        return self.choices.device

    @property
    def precision(self) -> str:
        return self.choices.precision

    @property
    def attn(self) -> str:
        return self.choices.attn_implementation

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.output.dir)

    @property
    def cache_root(self) -> Path:
        """Token and latent caches: ``data.cache_dir``, else beside the run so that runs on the same data share it."""
        d = self.cfg.data
        return Path(d.cache_dir) if d.cache_dir else self.run_dir.resolve().parent / ".rocktune_cache"

    def vram_bytes(self) -> int | None:
        """The device's memory (None on a CPU), for planner warnings."""
        if self.device != "cuda":
            return None
        import torch

        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def resolve(cfg: RunConfig, options: RunOptions, attn_setting: str, faults: Faults | None = None,
            quiet: bool = False) -> RunContext:
    """Environment advice applied (before anything touches the device), each rank on its own GPU, then the auto
    choices resolved and proven on it. ``attn_setting``: the task's attention setting (Wan always uses SDPA)."""
    from rocktune.platform.environment import prepare_environment
    from rocktune.platform.threads import apply_threads, choose_threads

    platform, notes = prepare_environment()
    # the cores this process may use, not the machine's; on a CPU run, the count that measures fastest under the load
    # the machine carries now (platform/threads.py, thread_probe.py)
    on_cpu = cfg.training.device == "cpu" or not platform.devices
    threads = choose_threads(probe=on_cpu)
    apply_threads(threads)
    dist = distributed.from_env()  # one process unless torchrun started several
    distributed.device_for(dist)  # each rank's own GPU, before any self-test touches one
    choices = resolve_auto(cfg.training.device, cfg.training.precision, attn_setting, platform=platform)
    return RunContext(cfg, options, platform, choices, dist, faults or Faults(), quiet,
                      notes=notes + [threads.note] + choices.messages)
