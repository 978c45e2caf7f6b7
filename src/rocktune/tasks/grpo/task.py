"""The GRPO task (task: grpo): a causal LM's LoRA trained by reinforcement learning with verifiable rewards.

It reuses the LM task's model building (tokenizer, kernels, QLoRA, LoRA, attention) and the engine's everything
else (steps, OOM split of the update, guards, checkpoints, resume); what is its own is the data (prompts with their
reference answers, data/prompts.py), the rollouts (rollout.py: sampled on rocktune's own generation path, inside
the feed, so the engine sees an ordinary step), the rewards (rewards.py) and the loss (loss.py). The reference the
KL is taken to is the same model with the adapter switched off. The sampler's RNG is part of every checkpoint.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rocktune.config import RunConfig, refuse_inapplicable
from rocktune.data import preference as rows_reader
from rocktune.data import prompts as promptdata
from rocktune.errors import UserError
from rocktune.model import stop_ids
from rocktune.tasks.grpo import rewards as rewardfns
from rocktune.tasks.grpo.launch import refuse_grpo
from rocktune.tasks.grpo.feed import Rollout, RolloutFeed, StepShape, digest
from rocktune.tasks.grpo.loss import GRPOLoss, Objective
from rocktune.tasks.grpo.rollout import (Sampling, StaticDecode, generator_state, new_generator, sample,
                                         set_generator_state)
from rocktune.tasks.lm import build, preflight
from rocktune.tasks.lm.quant_gate import check_quantization
from rocktune.train import build as engine_build
from rocktune.train.context import RunContext
from rocktune.train.oom import describe, is_out_of_memory
from rocktune.train.request import RunOptions
from rocktune.train.step import OutOfMemoryAtMinimum
from rocktune.train.task import Prepared

EVAL_ROWS = 64  # held-out prompts generated per forward (greedy, no gradients)


@dataclass(frozen=True)
class GRPORun:
    """What ``prepare`` built and the later hooks use: set once, never changed (the generator's state advances)."""

    ctx: RunContext
    tokenizer: object
    model: object
    train: promptdata.PromptSet
    held: promptdata.PromptSet
    rewards: list
    loss: GRPOLoss
    sampling: Sampling
    generator: torch.Generator
    autocast: object
    static: StaticDecode | None  # grpo.compile_rollout: the sampled rollouts' compiled decode step


class GRPOTask:
    kind = "grpo"
    samples_what = ""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run: GRPORun | None = None
        self.eval_stats: dict[str, float] = {}
        self.rollout_pieces = 1  # the rollout's OOM split: batches it samples in (kept by checkpoints)
        self.fallback_told = False
        self.log = print

    def attn_setting(self) -> str:
        return self.cfg.model.attn_implementation

    def refuse(self, options: RunOptions) -> None:
        refuse_inapplicable(self.cfg)
        refuse_grpo(self.cfg, options)  # the launching process said the same (tasks/grpo/launch.py)

    def check(self, ctx: RunContext) -> None:
        cfg = ctx.cfg
        preflight.check_run(cfg.model.name_or_path, cfg.data.train_file, cfg.data.eval_file, ctx.device,
                            cfg.model.liger, ctx.attn)
        m = cfg.model
        ctx.notes += check_quantization(m.quantization, m.name_or_path, ctx.precision, ctx.device,
                                        cfg.data.max_length + cfg.grpo.max_completion_length, cfg.lora.r, ctx.platform)

    def prepare(self, ctx: RunContext) -> Prepared:
        cfg, device, g = ctx.cfg, ctx.device, ctx.cfg.grpo
        m = cfg.model
        tokenizer = preflight.load_tokenizer(m.name_or_path, m.trust_remote_code)
        train, held = read_prompts(cfg, tokenizer, ctx.cache_root)
        # Rollouts decode from a KV cache over padded rows: attention that needs packed rows does not apply.
        attn = "sdpa" if m.attn_implementation in ("auto", "varlen", "flash_attention_2", "flex_attention") \
            else m.attn_implementation
        model, model_notes = build.model_with_adapter(m, cfg.lora, ctx.precision, attn, device, False)
        reward_list = rewardfns.build(g.rewards, g.max_completion_length)  # user code imported here, and only here
        ctx.notes += model_notes
        loss = GRPOLoss(model, Objective(g.beta, g.epsilon, g.epsilon_high, g.loss_type, g.max_completion_length,
                                         g.temperature, g.use_bias_correction_kl))
        sampling = Sampling(g.max_completion_length, g.temperature, g.top_p, g.top_k,
                            tuple(stop_ids(tokenizer, model)),
                            tuple(g.stop))
        static = None
        if g.compile_rollout and device == "cpu" and os.environ.get("ATEN_CPU_CAPABILITY"):
            # torch 2.13's Inductor built a decode step that returned wrong tokens under avx2 on an AVX-512 CPU
            # (and failed to build under default): the kernel set chosen by hand is not one it compiles for
            ctx.notes.append(f"grpo.compile_rollout: off under ATEN_CPU_CAPABILITY="
                             f"{os.environ['ATEN_CPU_CAPABILITY']} (Inductor's CPU code is not built for it); eager")
        elif g.compile_rollout:
            static = StaticDecode(model, cfg.data.max_length + g.max_completion_length)
        self.run = GRPORun(ctx, tokenizer, model, train, held, reward_list, loss, sampling,
                           new_generator(device, cfg.training.seed), engine_build.autocast(device, ctx.precision),
                           static)
        info = {"task": "grpo", "shape": "prompts", "n_train": len(train), "n_eval": len(held),
                "train_tokens": sum(train.lengths()), "max_example_tokens": max(train.lengths(), default=0),
                "n_truncated": sum(p.truncated for p in train.prompts), "fingerprint": train.fingerprint,
                "rewards": [r.name for r in reward_list]}
        return Prepared(model, loss, train.fingerprint,
                        f"{len(train)} train / {len(held)} eval prompts (grpo, {g.num_generations} completions each, "
                        f"rewards {', '.join(r.name for r in reward_list)})", info, tokenizer=tokenizer)

    def new_feed(self, **position) -> RolloutFeed:
        t, g = self.cfg.training, self.cfg.grpo
        shape = StepShape(t.micro_batch_size * t.grad_accum // g.num_generations, g.num_generations,
                          t.micro_batch_size, g.loss_type, g.max_completion_length, g.scale_rewards,
                          self.run.tokenizer.pad_token_id, t.seed)
        return RolloutFeed(len(self.run.train), shape, self._rollout, **position)

    def _rollout(self, idx: list[int]) -> Rollout:
        r, G = self.run, self.cfg.grpo.num_generations
        rows = [r.train.prompts[i] for i in idx for _ in range(G)]
        t0 = time.perf_counter()
        completions = self._generate(rows, r.sampling, r.generator, r.static)
        seconds = time.perf_counter() - t0
        total, stats = self._score(rows, completions)
        grouped = total.view(-1, G)
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32)
        eos = torch.tensor([bool(c) and c[-1] in r.sampling.stop_ids for c in completions])
        stats.update({"reward": float(total.mean()), "reward_std": float(total.std()),
                      "frac_reward_zero_std": float((grouped.std(1) < 1e-6).float().mean()),
                      "completions/mean_length": float(lengths.mean()),
                      "completions/min_length": float(lengths.min()),
                      "completions/max_length": float(lengths.max()),
                      "completions/clipped_ratio": float((~eos).float().mean()), "rollout_s": seconds,
                      "rollout_tokens_per_s": float(lengths.sum()) / max(seconds, 1e-9)})
        return Rollout([p.ids for p in rows], completions, total, stats)

    def _generate(self, rows: list, sampling: Sampling, generator, static: StaticDecode | None = None
                  ) -> list[list[int]]:
        """Completions of ``rows``, sampled in ``rollout_pieces`` batches. Out of memory, the sampler's RNG is put
        back and the rows are cut in twice as many batches (kept for the rest of the run and by checkpoints, so a
        resumed run samples the same); with one row per batch there is nothing left to cut."""
        while True:
            state = generator.get_state() if generator is not None else None
            try:
                return self._sample_in(rows, sampling, generator, self.rollout_pieces, static)
            except Exception as exc:  # noqa: BLE001 -- only out-of-memory is handled; the rest re-raised
                if not is_out_of_memory(exc):
                    raise
                message = describe(exc)
            # outside the except block: the failed batch's tensors are no longer pinned by the traceback
            if state is not None:
                generator.set_state(state)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if self.rollout_pieces >= len(rows):
                raise OutOfMemoryAtMinimum(f"{message} while sampling one completion at a time; lower "
                                           "grpo.max_completion_length or data.max_length")
            self.rollout_pieces *= 2
            self.log(f"[yellow]out of memory in the rollout: sampling in {self.rollout_pieces} batches[/]")

    def _sample_in(self, rows: list, sampling: Sampling, generator, pieces: int, static) -> list[list[int]]:
        r = self.run
        model, size = r.model, -(-len(rows) // pieces)
        was_training = model.training
        model.eval()  # no dropout while sampling: the completions are the policy's own
        try:
            out = []
            for i in range(0, len(rows), size):
                with r.autocast():
                    out += sample(model, [p.ids for p in rows[i : i + size]], sampling, r.tokenizer.pad_token_id,
                                  generator, lambda ids: r.tokenizer.decode(ids, skip_special_tokens=True), static)
            if static is not None and static.fallback and not self.fallback_told:
                self.fallback_told = True
                self.log(f"[yellow]grpo.compile_rollout: the compile failed ({static.fallback}); decoding eagerly[/]")
            return out
        finally:
            model.train(was_training)

    def _score(self, rows: list, completions: list[list[int]]) -> tuple[torch.Tensor, dict]:
        r = self.run
        texts = r.tokenizer.batch_decode(completions, skip_special_tokens=True)
        batch = rewardfns.Batch([p.row.prompt for p in rows], texts, completions, [p.row.fields for p in rows],
                                [p.where for p in rows])
        table = rewardfns.score(r.rewards, batch)
        stats = {}
        for reward, col in zip(r.rewards, table):
            values = torch.tensor(col)
            stats[f"rewards/{reward.name}/mean"] = float(values.mean())
            stats[f"rewards/{reward.name}/std"] = float(values.std()) if len(col) > 1 else 0.0
        return torch.tensor(rewardfns.weighted(r.rewards, table), dtype=torch.float32), stats

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Greedy completions of the held-out prompts, scored: the mean reward (and each reward's) is kept for
        ``after_eval``; there is no eval loss (None)."""
        r = self.run
        if not len(r.held):
            return None
        greedy = Sampling(r.sampling.max_new_tokens, 0.0, stop_ids=r.sampling.stop_ids,
                          stop_strings=r.sampling.stop_strings)
        rows = list(r.held.prompts)
        completions = []
        for i in range(0, len(rows), EVAL_ROWS):
            completions += self._generate(rows[i : i + EVAL_ROWS], greedy, None)  # greedy: the split changes nothing
        total, stats = self._score(rows, completions)
        self.eval_stats = {"eval_reward": float(total.mean()),
                           **{f"eval_{k}": v for k, v in stats.items() if k.endswith("/mean")}}
        return None

    def check_resume(self, restored, force: bool) -> None:
        if "sampler_rng" not in restored.extra and not force:
            raise UserError("--resume: the checkpoint holds no sampler state, so the rollouts could not continue "
                            "the same random stream; pass --resume-force to continue with fresh samples.")

    def resumed(self, restored) -> None:
        self.rollout_pieces = max(self.rollout_pieces, restored.extra.get("rollout_pieces", 1))
        state = restored.extra.get("sampler_rng")
        if state is not None:
            set_generator_state(self.run.generator, state)

    def checkpoint_extra(self) -> dict:
        return {"world_size": 1, "sampler_rng": generator_state(self.run.generator),
                "rollout_pieces": self.rollout_pieces}

    def start(self, start_step: int, metrics, log) -> None:
        """Nothing to open (the eval's greedy completions are scored, not written); the rollout's OOM split
        reports through the run's log."""
        self.log = log

    def record(self, fed) -> dict:
        """The step's rollout statistics and the update's (TRL's names); tokens: the completion tokens scored."""
        return {"tokens": fed.completion_tokens, "batch_tokens": sum(b["input_ids"].numel() for b in fed.forwards),
                "real_tokens": fed.real_tokens, "completions": sum(b["input_ids"].shape[0] for b in fed.forwards),
                "rollout_pieces": self.rollout_pieces,
                "samples": digest(fed.forwards), **fed.stats, **self.run.loss.take_stats()}

    def after_eval(self, step: int, metrics, log) -> None:
        if self.eval_stats:
            metrics.write({"step": step, **self.eval_stats})
            log(f"step {step}: held-out reward {self.eval_stats['eval_reward']:.3f} (greedy)")
            self.eval_stats = {}

    def final_files(self, run_dir: Path) -> list:
        return []

    def outputs(self, run_dir: Path) -> list[str] | None:
        return None

    def oom_message(self, step: int, exc: BaseException) -> str:
        return (f"out of memory at step {step} even with one completion per forward ({exc}); lower "
                "grpo.max_completion_length or data.max_length, turn on model.gradient_checkpointing, or use "
                "model.quantization=nf4.")

    def uncompile(self) -> None:
        """Never compiled (training.compile is an SFT setting)."""


def read_prompts(cfg: RunConfig, tokenizer, cache_root: Path):
    """(train prompts, eval prompts): every row read and checked before anything is trained."""
    d = cfg.data
    train = promptdata.encode_rows(rows_reader.read_rows(d.train_file, d, cache_root, "data.train_file"), tokenizer,
                                   d.max_length)
    if not train:
        raise UserError(f"data.train_file={d.train_file} holds no prompts.")
    if d.eval_file:
        held = promptdata.encode_rows(rows_reader.read_rows(d.eval_file, d, cache_root, "data.eval_file", True),
                                      tokenizer, d.max_length)
    else:
        train, held = promptdata.split_prompts(train, d.eval_fraction, cfg.training.seed)
    return promptdata.prompt_set(train), promptdata.prompt_set(held)
