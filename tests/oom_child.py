"""A supervised worker (``python tests/oom_child.py REQUEST_JSON ROOM_MB``) that meets a real address-space limit at
step 2: the limit (RLIMIT_AS) is set to what the process maps then, and what is already mapped but free is filled
with ballast, leaving ROOM_MB. torch's CPU allocator is then refused for real, as under ``prlimit --as`` or a
container's limit, whatever the machine's free heap happened to be."""

from __future__ import annotations

import resource
import sys

from rocktune.process import worker
from rocktune.train import faults
from rocktune.train.request import RunRequest


def mapped() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmSize:"))


class LimitAtStep2(faults.Faults):
    room_mb = 0

    def before_forward(self, step: int) -> None:
        if step == 2 and not hasattr(self, "ballast"):
            resource.setrlimit(resource.RLIMIT_AS, (mapped(), resource.getrlimit(resource.RLIMIT_AS)[1]))
            self.ballast = []
            for size in (1 << 20, 1 << 16, 1 << 12):  # large blocks first, then the gaps between them
                try:
                    while True:
                        self.ballast.append(bytearray(size))
                except MemoryError:
                    pass
            del self.ballast[:self.room_mb]  # the first blocks are 1 MiB each
        super().before_forward(step)


if __name__ == "__main__":
    LimitAtStep2.room_mb = int(sys.argv[2])
    faults.Faults = LimitAtStep2  # the worker builds its Faults by this name
    raise SystemExit(worker.run_in_process(RunRequest.from_json(sys.argv[1])))
