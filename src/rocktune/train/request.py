"""What one process asks of the next: the CLI of the supervisor, the supervisor of its child (a worker, or the
torchrun launcher), the launcher of its ranks. One typed object with one JSON form, so every process reads the same
fields by name and a field added here reaches all of them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class RunOptions:
    """How to treat the run directory and the start of this attempt; ``train(cfg, options)`` takes these."""

    overwrite: bool = False  # wipe an existing run directory of another run
    resume: bool = False  # continue from the newest checkpoint that verifies
    resume_force: bool = False  # resume although the config changed (the changed keys are named)
    pieces: int = 1  # each micro-batch split in this many forwards (the supervisor doubles it after a repeated fault)
    auto_fit: bool = False  # --auto: fit micro batch, checkpointing and loss chunks to the device
    vram_bytes: int | None = None  # --vram: the memory budget --auto fits to (default: the device's own)
    processes: int = 1  # --nproc x --nnodes: refusals that depend on it are decided before any worker starts
    next_prompt: str | None = None  # the summary's `generate` line asks this beside the base model (demo --real)


@dataclass
class Launch:
    """``--nproc``/``--nnodes``: several worker processes through torchrun (process/launch.py)."""

    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29500
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rendezvous_timeout_s: float = 300.0  # reliability.rendezvous_timeout_s or --rendezvous-timeout

    @property
    def multi(self) -> bool:
        return self.nproc > 1 or self.nnodes > 1


@dataclass
class RunRequest:
    config: dict  # the resolved config (RunConfig.model_dump(mode="json")); each process validates it again
    options: RunOptions = field(default_factory=RunOptions)
    launch: Launch | None = None  # None: one process
    status_file: str | None = None  # the supervisor's: where its child reports (process/outcome.py)

    @property
    def multi(self) -> bool:
        return self.launch is not None and self.launch.multi

    @property
    def run_dir(self) -> str:
        return self.config["output"]["dir"]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunRequest:
        data = json.loads(text)
        launch = data.get("launch")
        return cls(config=data["config"], options=RunOptions(**data.get("options", {})),
                   launch=Launch(**launch) if launch else None, status_file=data.get("status_file"))
