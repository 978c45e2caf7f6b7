"""Exit statuses: one table for the CLI, the supervisor, its child (worker or torchrun launcher) and every rank.

docs/reliability.md lists them for users; tests/test_exits.py checks that the docs and this table agree.
"""

from __future__ import annotations

OK = 0
CRASH = 1  # an unexpected error after start-up, or the supervisor giving up: the run can go on with --resume
USER_ERROR = 2  # a problem with the input: one paragraph says what and how to fix it; never retried
ROLLBACK = 3  # child -> supervisor: non-finite steps in a row, continue from the last checkpoint in fp32
FATAL = 4  # child -> supervisor: a diagnosis a restart cannot fix (silent zeros); out of memory has its own (7)
DISK_FULL = 5  # a write failed for lack of disk space; never retried
STARTUP = 6  # child -> supervisor: an unexpected error before the first step (deterministic); never retried
OUT_OF_MEMORY = 7  # memory ran out (any device) even at the smallest split, or the OOM killer struck twice; final
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as a shell reports it

MEANING = {
    OK: "the run finished",
    CRASH: "crashed after start-up, or the supervisor used up its restarts: continue with --resume",
    USER_ERROR: "bad input (config, data, model, paths): the message says what to fix",
    ROLLBACK: "(between rocktune's own processes) non-finite steps: continue in fp32 from the last checkpoint",
    FATAL: "(between rocktune's own processes) a diagnosis a restart cannot fix",
    DISK_FULL: "the disk is full: free space, then --resume",
    STARTUP: "(between rocktune's own processes) an unexpected error before the first step",
    OUT_OF_MEMORY: "out of memory even with the step split to one example per forward: the message says what was "
                   "asked and what the planner suggests",
    INTERRUPTED: "interrupted (Ctrl-C): a checkpoint was written, continue with --resume",
}

# What the supervisor passes through as the run's own result, never restarting: the run ended, or input is wrong.
FINAL = (OK, USER_ERROR, FATAL, OUT_OF_MEMORY, INTERRUPTED)
