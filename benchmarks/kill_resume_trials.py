"""Kill -9 a training run at random moments, resume it each time, and compare with a run never interrupted.

    python benchmarks/kill_resume_trials.py --trials 100 --steps 20 [--seed 0] [--supervised-every 8]

The run is the demo's tiny model on a small demo task, a checkpoint after every step (``save_every: 1``), a
metrics line every step, LoRA dropout on (resume must restore the RNG) and one sample prompt. Each trial kills its
run one to three times, each kill aimed at one of: soon after the n-th new checkpoint appears, soon after the final
eval's line appears (the final phase: samples, adapter), or a random moment; then resumes it until it finishes.
Every few trials the run is a real supervised ``rocktune train`` whose *supervisor* is killed and the resume started
at once, while the orphaned worker still trains (it checkpoints and stops within seconds): the case two processes
shared a run directory in (issue 47). The other attempts are forked from this process after the imports, so a trial
costs the training, not the start-up of Python, torch and transformers.

Prints one JSON object: per trial the kills (aim, seconds, last logged step, the write a kill cut short as the run
directory shows it, whether it landed in the final phase) and whether the adapter bytes, the whole metrics log
(line by line, every field but the wall-clock and memory ones in ``VOLATILE``) and the samples equal the
reference's; then the counts. Kills aimed at each write phase are tests/test_kill_phases.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

# Fields of a metrics line that differ between two runs of the same steps: time and memory measured as it ran, and
# "compiling" (the first step of every attempt compiles, when compiling).
VOLATILE = {"step_s", "useful_tokens_per_s", "device_wait_s", "rss_bytes", "peak_rss_bytes", "peak_mem_bytes",
            "mem_allocated_bytes", "mem_reserved_bytes", "compiling", "compile_fallback"}
AIMS = ("checkpoint", "final", "random")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-kills", type=int, default=3, help="kills per trial before letting it finish")
    ap.add_argument("--supervised-every", type=int, default=8, help="every N-th trial kills a real supervisor")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="rocktune-kill-"))
    bench = Bench(root, args.steps)
    t0 = time.perf_counter()
    bench.finish(bench.config("reference"), resume=False)
    ref_seconds = time.perf_counter() - t0
    reference = outcome(root / "reference")
    rng = random.Random(args.seed)
    trials = []
    for i in range(args.trials):
        supervised = args.supervised_every > 0 and i % args.supervised_every == args.supervised_every - 1
        kills = bench.trial(f"trial{i}", rng, args.max_kills, ref_seconds, supervised)
        got = outcome(root / f"trial{i}")
        trials.append({"trial": i, "supervised": supervised, "kills": kills,
                       "adapter_bytes_equal": got["adapter"] == reference["adapter"],
                       "log_equal": got["log"] == reference["log"], "samples_equal": got["samples"] == reference[
                           "samples"], "log_lines": len(got["log"])})
        print(json.dumps(trials[-1]), file=sys.stderr, flush=True)
    print(json.dumps(summarise(args, trials, ref_seconds, len(reference["log"]), time.perf_counter() - t0), indent=1))
    return 0 if all(t["adapter_bytes_equal"] and t["log_equal"] and t["samples_equal"] for t in trials) else 1


def summarise(args, trials: list[dict], ref_seconds: float, ref_lines: int, wall: float) -> dict:
    kills = [k for t in trials for k in t["kills"]]
    return {"command": "python benchmarks/kill_resume_trials.py " + " ".join(sys.argv[1:]), "steps": args.steps,
            "reference_seconds": round(ref_seconds, 1), "reference_log_lines": ref_lines,
            "wall_seconds": round(wall, 1), "trials": trials, "trial_count": len(trials),
            "supervised_trials": sum(t["supervised"] for t in trials), "kills": len(kills),
            "kills_by_aim": dict(Counter(k["aim"] for k in kills)),
            "kills_in_final_phase": sum(k["final_phase"] for k in kills),
            "kills_inside_a_write": sum(k["inside_write"] is not None for k in kills),
            "inside_write_by_phase": dict(Counter(k["inside_write"] for k in kills if k["inside_write"])),
            "adapter_bytes_equal": sum(t["adapter_bytes_equal"] for t in trials),
            "log_equal": sum(t["log_equal"] for t in trials), "samples_equal": sum(t["samples_equal"] for t in trials),
            "all_identical": all(t["adapter_bytes_equal"] and t["log_equal"] and t["samples_equal"] for t in trials)}


class Bench:
    def __init__(self, root: Path, steps: int):
        self.root, self.steps = root, steps
        self.base = root / "base_model"
        # Built in a child: a torch operation here would start OpenMP's threads, which a forked child cannot use.
        in_child(lambda: _write_inputs(root))
        # What a forked attempt imports is imported here, once: the model's code, peft (and the bitsandbytes and
        # compiler modules it pulls in) are most of an attempt's CPU time otherwise. Importing starts no thread.
        import importlib

        for name in ("rocktune.process.worker", "rocktune.tasks.lm.task", "rocktune.train.loop", "peft",
                     "transformers.models.qwen2.modeling_qwen2", "torch._inductor.compile_fx"):
            importlib.import_module(name)

    def config(self, name: str) -> dict:
        from rocktune.demo.run import demo_config

        cfg = demo_config(self.base, self.root / "data", self.root / name, self.steps)
        cfg["lora"]["dropout"] = 0.05
        cfg["training"].update(micro_batch_size=8, log_every=1, sample_count=1, sample_max_new_tokens=4)
        cfg["data"]["cache_dir"] = str(self.root / "cache")
        cfg["reliability"] = {"save_every": 1, "keep_checkpoints": 2, "min_free_disk_mb": 0}
        return cfg

    def trial(self, name: str, rng: random.Random, max_kills: int, ref_seconds: float, supervised: bool) -> list:
        cfg, run, kills, resume = self.config(name), self.root / name, [], False
        for n in range(rng.randint(1, max_kills)):
            aim = rng.choice(AIMS)
            proc = self.start_supervised(cfg, resume) if supervised and n == 0 else Forked(cfg, resume, run)
            kill = self.aim_and_kill(proc, run, aim, rng, ref_seconds)
            if kill is None:
                break  # it finished first
            kills.append(kill)
            resume = True
        self.finish(cfg, resume)
        return kills

    def aim_and_kill(self, proc, run: Path, aim: str, rng: random.Random, ref_seconds: float) -> dict | None:
        t0 = time.perf_counter()
        trigger = _trigger(run, aim, rng, ref_seconds, self.steps)
        while not proc.done():
            if trigger():
                time.sleep(rng.uniform(0.0, 0.05))  # soon after: inside the next write, or between two
                if proc.done():
                    return None
                proc.kill()
                return {"aim": aim, "supervisor_killed": isinstance(proc, Supervised),
                        "after_s": round(time.perf_counter() - t0, 2), "last_logged_step": last_step(run),
                        "inside_write": write_in_progress(run), "final_phase": in_final_phase(run, self.steps)}
            time.sleep(0.002)
        return None

    def start_supervised(self, cfg: dict, resume: bool) -> Supervised:
        path = self.root / f"{Path(cfg['output']['dir']).name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        cmd = [sys.executable, "-m", "rocktune", "train", "-c", str(path)] + (["--resume"] if resume else [])
        return Supervised(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def finish(self, cfg: dict, resume: bool) -> None:
        proc = Forked(cfg, resume, Path(cfg["output"]["dir"]))
        if proc.wait() != 0:
            raise SystemExit(f"{cfg['output']['dir']}: the final attempt failed (exit {proc.code}); see its "
                             f"attempts.log")


def _write_inputs(root: Path) -> None:
    from rocktune.demo.run import MODEL_SHAPE
    from rocktune.demo.task import make_task, write_jsonl
    from rocktune.demo.tiny import build_tiny_model

    build_tiny_model(root / "base_model", seed=0, **MODEL_SHAPE)
    tr, ev = make_task(n_train=400, n_eval=8, seed=0)
    write_jsonl(root / "data" / "train.jsonl", tr)
    write_jsonl(root / "data" / "eval.jsonl", ev)


def in_child(fn) -> None:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        raise SystemExit("setting up the model and data failed")


class Forked:
    """One attempt of the run in a child forked from this process (its output goes to RUN/../NAME.attempts.log)."""

    def __init__(self, cfg: dict, resume: bool, run: Path):
        from rocktune.train.request import RunOptions, RunRequest

        request = RunRequest(cfg, RunOptions(resume=resume, overwrite=not resume))
        log = run.parent / f"{run.name}.attempts.log"
        self.code = None
        self.pid = os.fork()
        if self.pid == 0:  # the child: run the attempt, then leave without running the parent's cleanup
            code = 98
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                from rocktune.process.worker import run_in_process

                code = run_in_process(request)
            finally:
                os._exit(code)

    def done(self) -> bool:
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code is not None

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.wait()

    def wait(self) -> int:
        if self.code is None:
            self.code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.code


class Supervised:
    """A real ``rocktune train``: ``kill`` kills the supervisor only; its worker, orphaned, goes on for a moment."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def done(self) -> bool:
        return self.proc.poll() is not None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _trigger(run: Path, aim: str, rng: random.Random, ref_seconds: float, steps: int):
    """A test that turns true at the aimed moment."""
    ckpts = run / "checkpoints"
    if aim == "checkpoint":
        old = {p.name for p in ckpts.glob("step-*")}
        seen, wanted = set(), rng.randint(1, steps)

        def new_checkpoints() -> bool:
            seen.update(p.name for p in ckpts.glob("step-*") if p.name not in old)
            return len(seen) >= wanted
        return new_checkpoints
    if aim == "final":
        return lambda: in_final_phase(run, steps)
    deadline = time.perf_counter() + rng.uniform(0.5, ref_seconds)
    return lambda: time.perf_counter() >= deadline


def in_final_phase(run: Path, steps: int) -> bool:
    """The final eval's line is in the log and the adapter not yet in place."""
    if (run / "adapter").is_dir():
        return False
    for rec in _rows(run / "metrics.jsonl"):
        if rec.get("step") == steps and "eval_loss" in rec:
            return True
    return False


def write_in_progress(run: Path) -> str | None:
    """Which write a kill cut short, read off what it left (None: the kill landed between writes). The names are
    those of rocktune.atomic.PHASES, the phase that had last completed."""
    from rocktune.atomic import leftovers
    from rocktune.train import checkpoint

    ckpts = run / "checkpoints"
    for tmp in sorted(ckpts.glob(".tmp-step-*")):
        names = {p.name for p in tmp.iterdir()}
        for name, phase in ((checkpoint.MANIFEST, "checkpoint.before_fsync"),
                            ("meta.json", "checkpoint.before_manifest"), (checkpoint.STATE, "checkpoint.state_written"),
                            ("adapter_model.safetensors", "checkpoint.adapter_written")):
            if name in names:
                return phase
        return "checkpoint.adapter_being_written"  # inside save_pretrained: not one of the kill points
    steps = sorted(p for p in ckpts.glob("step-*") if p.is_dir())
    if any(not (p / checkpoint.MANIFEST).exists() for p in steps):
        return "checkpoint.pruning"
    latest = ckpts / checkpoint.LATEST
    if steps and latest.is_file() and latest.read_text().strip() != steps[-1].name:
        return "checkpoint.renamed"
    for target in (latest, run / "config.yaml", run / "run_info.json", run / "metrics.jsonl", run / "samples.jsonl"):
        if leftovers(target):
            return f"atomic.written ({target.name})"
    if (run / "adapter.tmp").exists():  # its README.md is the last file written into it
        return "adapter.staged" if (run / "adapter.tmp" / "README.md").exists() else "adapter.weights_written"
    if (run / "adapter.old").exists():
        return "adapter.swapped"
    return None


def outcome(run: Path) -> dict:
    # every line's fields, and the values of all but the volatile ones
    log = [{k: v for k, v in r.items() if k not in VOLATILE} | {"_fields": sorted(r)}
           for r in _rows(run / "metrics.jsonl")]
    return {"adapter": (run / "adapter" / "adapter_model.safetensors").read_bytes(), "log": log,
            "samples": _rows(run / "samples.jsonl")}


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append({"unreadable": line})
    return out


def last_step(run: Path) -> int:
    return max((r.get("step", 0) for r in _rows(run / "metrics.jsonl") if isinstance(r.get("step"), int)),
               default=0)


if __name__ == "__main__":
    raise SystemExit(main())
