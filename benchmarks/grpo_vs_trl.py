"""Rollout and update tokens/s of rocktune's GRPO beside TRL's GRPOTrainer without vLLM (its default), on the same
tiny model, prompts and settings, in one run (each side's training in a process of its own). Prints one JSON
object.

    PYTHONPATH=src python benchmarks/grpo_vs_trl.py [--steps 6] [--warmup 1] [--rounds 3] [--threads 1]
        [--device cpu] [--eager-rollout] [--generators N]

Both sides: the demo's tiny Qwen2 (random weights: most completions run to max_completion_length; both stop at
``<|endoftext|>`` and ``<|im_end|>``, ``_stop_at_end_of_turn``), LoRA r=16 on all linear layers, 4 prompts x 8
completions per optimizer step,
one micro-batch, temperature 1, beta 0, loss dapo, fp32, AdamW. rocktune's rollout runs with
``grpo.compile_rollout`` (its decode step compiled over a static KV cache; the compile happens in the first, warmup
step, whose rollout seconds are printed as ``first_rollout_s``) unless ``--eager-rollout``; TRL's runs as it comes.
Measured per optimizer step after ``--warmup`` steps:

- rollout: the completions' generation alone (rocktune: tasks/grpo/rollout.sample, its ``rollout_s``; TRL: its
  ``_generate``, transformers' ``generate``), tokens/s = completion tokens / seconds;
- update: the rest of the optimizer step (rewards, advantages, forward, backward, optimizer step), tokens/s =
  completion tokens / seconds (rocktune: ``step_s - rollout_s``; TRL: the callback-timed step minus ``_generate``).

The ratio is rocktune's over TRL's, from the tokens and seconds of every round together. Each round trains both
afresh, one after the other (rocktune first in even rounds, TRL first in odd ones), each in a new process
(``in_child``: rocktune as its CLI worker runs, TRL as a script would), so that a machine shared with other jobs
slows both alike; the per-round ratios show how much the load moved the figures. Beside the wall-clock
figures, ``cpu_*`` ones count the main thread's CPU seconds (``time.thread_time``) of the same spans (the update's:
from one rollout's start to the next, less the rollout): with one torch thread, time that other jobs take from the
process is not in them, so they move much less with the machine's load. Each side runs one step more than it
measures, left out: the last step's span would hold the run's end (rocktune's final checkpoint, TRL's teardown).
``--generators N`` adds the generators alone, interleaved call by call N times over one step's 32 prompt rows on
one model: rocktune's ``rollout.sample`` eager and compiled (``StaticDecode``) beside transformers' ``generate`` on
the PEFT model with TRL's sampling settings (do_sample, temperature 1, top_p 1, top_k 0: what TRL's ``_generate``
calls without vLLM), completion tokens per CPU second of each.

TRL is the test extra's; nothing of it is imported by rocktune.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2}
PROMPTS, G, NEW, LR, R = 4, 8, 32, 1e-3, 16


def _reward(completions, **kwargs):
    return [float("A" in c) for c in completions]


def _setup(work: Path) -> tuple[Path, Path]:
    from rocktune.demo.task import make_task, write_jsonl
    from rocktune.demo.tiny import build_tiny_model

    model = build_tiny_model(work / "model", seed=0, **SHAPE)
    _stop_at_end_of_turn(model)
    rows, _ = make_task(n_train=256, n_eval=0, seed=0, skills=("upper",))
    data = write_jsonl(work / "prompts.jsonl", [{"prompt": r["prompt"], "answer": r["completion"]} for r in rows])
    return model, data


def _stop_at_end_of_turn(model: Path) -> None:
    """The model's generation config lists ``<|im_end|>`` beside ``<|endoftext|>``, as a real ChatML model's does
    (Qwen2.5-Instruct's: both): TRL's GRPOTrainer stops at what the generation config lists, rocktune at that and
    the template's end of turn. The tiny model's config lists ``<|endoftext|>`` alone, which made TRL's completions
    of random tokens about 6% longer than rocktune's in the same padded width."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model)
    config = GenerationConfig.from_pretrained(model)
    config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    config.save_pretrained(model)


def run_rocktune(model: Path, data: Path, out: Path, steps: int, device: str, compile_rollout: bool = True
                 ) -> list[dict]:
    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from rocktune.tasks.grpo.task import GRPOTask
    from rocktune.train.request import RunOptions

    cfg = {"task": "grpo", "model": {"name_or_path": str(model)}, "lora": {"r": R, "alpha": 2 * R},
           "data": {"train_file": str(data), "eval_fraction": 0.0, "max_length": 32},
           "grpo": {"num_generations": G, "max_completion_length": NEW, "beta": 0.0, "loss_type": "dapo",
                    "rewards": [{"function": "regex", "pattern": "A"}], "compile_rollout": compile_rollout},
           "training": {"max_steps": steps, "micro_batch_size": PROMPTS * G, "grad_accum": 1, "lr": LR,
                        "warmup_steps": 0, "eval_every": 0, "log_every": 1, "precision": "fp32", "device": device,
                        "seed": 0},
           "reliability": {"save_every": 0}, "output": {"dir": str(out)}}
    cpu = CpuClock()
    generate = GRPOTask._generate
    GRPOTask._generate = lambda self, *a, **k: cpu.around(lambda: generate(self, *a, **k))
    try:
        train(config_from_dict(cfg), RunOptions(overwrite=True), quiet=True)
    finally:
        GRPOTask._generate = generate
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{"rollout_s": r["rollout_s"], "update_s": r["step_s"] - r["rollout_s"], "tokens": r["tokens"], **c}
            for r, c in zip([r for r in rows if "loss" in r], cpu.steps())]


class CpuClock:
    """The main thread's CPU seconds per step: each rollout's own, and from one rollout's start to the next (the
    whole step); the last step ends at the last ``steps`` call."""

    def __init__(self):
        self.starts: list[float] = []
        self.rollouts: list[float] = []

    def around(self, fn):
        t0 = time.thread_time()
        self.starts.append(t0)
        out = fn()
        self.rollouts.append(time.thread_time() - t0)
        return out

    def steps(self) -> list[dict]:
        ends = self.starts[1:] + [time.thread_time()]
        return [{"cpu_rollout_s": r, "cpu_update_s": end - start - r}
                for start, end, r in zip(self.starts, ends, self.rollouts)]


def run_trl(model: Path, data: Path, out: Path, steps: int, device: str) -> list[dict]:
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(out), num_generations=G, max_completion_length=NEW, beta=0.0, loss_type="dapo",
                      per_device_train_batch_size=PROMPTS * G, gradient_accumulation_steps=1, learning_rate=LR,
                      lr_scheduler_type="cosine", warmup_steps=0, max_steps=steps, logging_steps=1, report_to=[],
                      save_strategy="no", bf16=False, use_cpu=device == "cpu", seed=0, gradient_checkpointing=False)
    tokenizer = AutoTokenizer.from_pretrained(model)
    base = AutoModelForCausalLM.from_pretrained(model, dtype="float32")
    trainer = GRPOTrainer(model=base, reward_funcs=_reward, args=args, processing_class=tokenizer,
                          train_dataset=load_dataset("json", data_files=str(data), split="train"),
                          peft_config=LoraConfig(r=R, lora_alpha=2 * R, target_modules="all-linear"))
    steps_out: list[dict] = []
    generate, current, cpu = trainer._generate, {}, CpuClock()

    def timed_generate(prompts):
        t0 = time.perf_counter()
        out = cpu.around(lambda: generate(prompts))
        current["rollout_s"] = current.get("rollout_s", 0.0) + time.perf_counter() - t0
        current["tokens"] = current.get("tokens", 0) + sum(len(c) for c in out[1])
        return out
    trainer._generate = timed_generate

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            current.clear()
            current["t0"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            wall = time.perf_counter() - current["t0"]
            steps_out.append({"rollout_s": current["rollout_s"], "update_s": wall - current["rollout_s"],
                              "tokens": current["tokens"]})
    trainer.add_callback(StepClock())
    trainer.train()
    return [{**s, **c} for s, c in zip(steps_out, cpu.steps())]


def generators(model_dir: Path, data: Path, calls: int) -> dict:
    """Completion tokens per CPU second of each generator, the calls interleaved (see the module's docstring)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from rocktune.lora.lean import lean_lora
    from rocktune.models.load import apply_lora, load_model
    from rocktune.tasks.grpo.rollout import Sampling, StaticDecode, new_generator, sample

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [json.loads(x)["prompt"] for x in data.read_text().splitlines()[:PROMPTS]]
    prompts = [tuple(tok(t)["input_ids"]) for t in texts for _ in range(G)]
    model = apply_lora(load_model(str(model_dir), "fp32", "sdpa", False, "cpu"), R, 2 * R, 0.0, "all-linear", False)
    lean_lora(model)  # what a run does (tasks/causal/build.py)
    model.eval()
    s, pad, eos = Sampling(NEW, 1.0, stop_ids=(tok.eos_token_id,)), tok.pad_token_id, tok.eos_token_id
    static = StaticDecode(model, max(map(len, prompts)) + NEW)
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=NEW, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                              pad_token_id=pad, eos_token_id=eos)

    def hf() -> int:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:].tolist()
        return sum(row.index(eos) + 1 if eos in row else len(row) for row in out)

    sides = {"rocktune_eager": lambda: sum(map(len, sample(model, prompts, s, pad, new_generator("cpu", 0)))),
             "rocktune_compiled": lambda: sum(map(len, sample(model, prompts, s, pad, new_generator("cpu", 0),
                                                              static=static))),
             "transformers_generate": hf}
    from rocktune.lora.lean import peft_forward

    totals = {k: [0, 0.0] for k in sides}
    for i in range(calls + 1):
        for name, fn in sides.items():
            with peft_forward(model) if name == "transformers_generate" else contextlib.nullcontext():
                t0 = time.thread_time()
                n = fn()
                if i:  # the first call of each compiles or warms up
                    totals[name][0] += n
                    totals[name][1] += time.thread_time() - t0
    rates = {k: round(n / sec, 1) for k, (n, sec) in totals.items()}
    return {"calls": calls, "cpu_tokens_per_s": rates,
            "ratios": {k: round(v / rates["transformers_generate"], 2) for k, v in rates.items()}}


def summary(kept: list[dict]) -> dict:
    tokens = sum(s["tokens"] for s in kept)
    out = {"steps_measured": len(kept), "completion_tokens": tokens}
    for clock in ("", "cpu_"):
        for part in ("rollout", "update"):
            out[f"{clock}{part}_tokens_per_s"] = round(tokens / sum(s[f"{clock}{part}_s"] for s in kept), 1)
    out["step_s_median"] = round(statistics.median(s["rollout_s"] + s["update_s"] for s in kept), 4)
    return out


def in_child(side: str, model: Path, data: Path, out: Path, a) -> list[dict]:
    """One side's run in a process of its own, as a user runs either tool: nothing one leaves in its process (torch's
    compile caches, the allocator's state, imported patches) is the other's. The child's console output goes to
    this process's stderr; its measured steps come back as JSON."""
    cmd = [sys.executable, __file__, "--child", side, "--model", str(model), "--data", str(data), "--out", str(out),
           "--steps", str(a.steps + a.warmup + 1), "--device", a.device, "--threads", str(a.threads)]
    subprocess.run(cmd + (["--eager-rollout"] if a.eager_rollout else []), check=True, stdout=sys.stderr)
    return json.loads((out / "bench_steps.json").read_text())


def child(a) -> None:
    import torch

    torch.set_num_threads(a.threads)
    out = Path(a.out)
    steps = run_rocktune(Path(a.model), Path(a.data), out, a.steps, a.device, not a.eager_rollout) \
        if a.child == "rocktune" else run_trl(Path(a.model), Path(a.data), out, a.steps, a.device)
    (out / "bench_steps.json").write_text(json.dumps(steps))


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="fresh runs of each side, alternating (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for both (default 1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--eager-rollout", action="store_true", help="rocktune's rollout without grpo.compile_rollout")
    p.add_argument("--generators", type=int, default=0, help="also the generators alone, N interleaved calls each")
    for name in ("--child", "--model", "--data", "--out"):  # in_child's: one side's run
        p.add_argument(name, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    torch.set_num_threads(a.threads)
    rounds, first_rollout_s = [], []
    with tempfile.TemporaryDirectory(prefix="rocktune-grpo-bench-") as tmp:
        work = Path(tmp)
        model, data = _setup(work)
        for i in range(a.rounds):
            order = ("rocktune", "trl") if i % 2 == 0 else ("trl", "rocktune")
            done = {side: in_child(side, model, data, work / f"{side}{i}", a) for side in order}
            first_rollout_s.append(round(done["rocktune"][0]["rollout_s"], 2))
            rounds.append((done["rocktune"][a.warmup:-1], done["trl"][a.warmup:-1]))
        alone = {"generators": generators(model, data, a.generators)} if a.generators else {}
    ours = summary([s for mine, _ in rounds for s in mine])
    trl = summary([s for _, theirs in rounds for s in theirs])
    keys = ("rollout", "update", "cpu_rollout", "cpu_update")
    per_round = [{k: round(summary(m)[f"{k}_tokens_per_s"] / summary(t)[f"{k}_tokens_per_s"], 2) for k in keys}
                 for m, t in rounds]
    import trl as trl_pkg

    print(json.dumps({"device": a.device, "threads": a.threads, "trl": trl_pkg.__version__, "torch": torch.__version__,
                      "settings": {"prompts_per_step": PROMPTS, "num_generations": G, "max_completion_length": NEW,
                                   "lora_r": R, "model": SHAPE, "compile_rollout": not a.eager_rollout},
                      "rocktune": {**ours, "first_rollout_s": first_rollout_s}, "trl_grpo_trainer": trl,
                      **{f"{k}_ratio": round(ours[f"{k}_tokens_per_s"] / trl[f"{k}_tokens_per_s"], 2) for k in keys},
                      "ratios_per_round": per_round, **alone}))


if __name__ == "__main__":
    main()
