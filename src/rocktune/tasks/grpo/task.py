"""The GRPO task (task: grpo): a causal LM's LoRA trained by reinforcement learning with verifiable rewards.

It reuses the LM task's model building (tokenizer, kernels, QLoRA, LoRA, attention) and the engine's everything
else (steps, OOM split of the update, guards, checkpoints, resume); what is its own is the data (prompts with their
reference answers, prompts.py), the rollouts (rollout.py: sampled on rocktune's own generation path, inside
the feed, so the engine sees an ordinary step), the rewards (rewards.py) and the loss (loss.py). The reference the
KL is taken to is the same model with the adapter switched off. Each completion samples from uniforms keyed by the
seed, the step, its prompt and its number (feed.row_keys), so a resumed run, the rollout's OOM split and a run over
several ranks (``--nproc``: each rank samples a share of the prompts, feed.py gathers the scores) sample the very
completions one uninterrupted process does.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch

from rocktune.config import RunConfig, refuse_inapplicable
from rocktune.tasks.grpo import prompts as promptdata
from rocktune.data.truncate import cut_note
from rocktune.errors import UserError
from rocktune.models.load import stop_ids
from rocktune.tasks.grpo import rewards as rewardfns
from rocktune.tasks.grpo import scoring, watch
from rocktune.tasks.grpo.launch import refuse_grpo
from rocktune.tasks.grpo.feed import Rollout, RolloutFeed, Share, StepShape
from rocktune.tasks.grpo.loss import GRPOLoss, Objective
from rocktune.tasks.grpo.rollout import Sampling, StaticDecode, row_draws, sample
from rocktune.tasks.causal import build, preflight
from rocktune.tasks.causal.quant_gate import check_quantization
from rocktune.tasks.base import TaskBase
from rocktune.train import build as engine_build
from rocktune.train import distributed, resume
from rocktune.train.context import RunContext
from rocktune.train.oom import describe, is_out_of_memory
from rocktune.train.request import RunOptions
from rocktune.train.step import OutOfMemoryAtMinimum
from rocktune.train.task import Prepared

EVAL_ROWS = 64  # held-out prompts generated per forward (greedy, no gradients)
SAMPLER = "row-keyed"  # how rollouts draw (checkpoints say it: an older run's stream cannot be continued exactly)


@dataclass(frozen=True)
class GRPORun:
    """What ``prepare`` built and the later hooks use: set once, never changed."""

    ctx: RunContext
    tokenizer: Any  # a transformers tokenizer
    model: Any  # the PEFT model
    train: promptdata.PromptSet
    held: promptdata.PromptSet
    rewards: list
    loss: GRPOLoss
    sampling: Sampling
    autocast: Callable[[], Any]
    static: StaticDecode | None  # grpo.compile_rollout: the sampled rollouts' compiled decode step


class GRPOTask(TaskBase):
    kind = "grpo"
    samples_what = " and the rollout samples"

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        # prepare's result for the later hooks: the engine calls prepare before any of them (train/task.py)
        self.run: GRPORun = cast(GRPORun, None)
        self.eval_stats: dict[str, float] = {}
        self.rollout_pieces = 1  # the rollout's OOM split: batches it samples in (kept by checkpoints)
        self.fallback_told = False
        self.log = print
        self.metrics = None  # the run's metrics log (start): the warnings go there too
        self.done = 0  # optimizer steps done: TRL's trainer_state.global_step for the rewards
        self.watch = watch.Watch(cfg.grpo.max_completion_length, cfg.grpo.temperature)
        self.reward_log = scoring.RewardLog()  # what the rewards logged through log_extra / log_metric
        self.samples: dict[str, list[dict]] = {"rollout": [], "eval": []}  # samples.jsonl's next lines

    def refuse(self, options: RunOptions) -> None:
        refuse_inapplicable(self.cfg)
        refuse_grpo(self.cfg, options)  # the launching process said the same (tasks/grpo/launch.py)

    def check(self, ctx: RunContext) -> None:
        cfg = ctx.cfg
        preflight.check_run(cfg.model.name_or_path, cast(str, cfg.data.train_file), cfg.data.eval_file, ctx.device,
                            cfg.model.liger, ctx.attn)
        m = cfg.model
        ctx.notes += check_quantization(m.quantization, m.name_or_path, ctx.precision, ctx.device,
                                        cfg.data.max_length + cfg.grpo.max_completion_length, cfg.lora.r, ctx.platform)

    def prepare(self, ctx: RunContext) -> Prepared:
        cfg, device, g = ctx.cfg, ctx.device, ctx.cfg.grpo
        m = cfg.model
        tokenizer = preflight.load_tokenizer(m.name_or_path, m.trust_remote_code)
        rel, dist = cfg.reliability, ctx.dist
        distributed.init(dist, device, rel.collective_timeout_s, rel.preflight_timeout_s)
        ctx.notes += distributed.preflight(dist, device, rel.preflight_timeout_s)
        train, held = promptdata.read_sets(cfg, tokenizer, ctx.cache_root)
        distributed.same_run(dist, train.fingerprint)
        strategy = distributed.strategy(dist, "ddp", m.quantization)  # fsdp is refused (launch.refuse_grpo)
        # Rollouts decode from a KV cache over padded rows: attention that needs packed rows does not apply.
        attn = "sdpa" if m.attn_implementation in ("auto", "varlen", "flash_attention_2", "flex_attention") \
            else m.attn_implementation
        model, model_notes = build.model_with_adapter(m, cfg.lora, ctx.precision, attn, device, False)
        reward_list = rewardfns.build(g.rewards, g.max_completion_length)  # user code imported here, and only here
        prompts = [*train.prompts, *held.prompts]
        ctx.notes += model_notes + cut_note(sum(p.truncated for p in prompts), len(prompts), "prompts",
                                            cfg.data.max_length, "each loses its start (its end, the question next "
                                            "to the completion, is kept)")
        note = watch.length_note(promptdata.reference_lengths(train.prompts, tokenizer), g.max_completion_length)
        ctx.notes += [note] if note else []
        loss = GRPOLoss(model, Objective(g.beta, g.epsilon, g.epsilon_high, g.loss_type, g.max_completion_length,
                                         g.temperature, g.use_bias_correction_kl), g.share_prompt)
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
                           engine_build.autocast(device, ctx.precision), static)
        info = {"task": "grpo", "shape": "prompts", "n_train": len(train), "n_eval": len(held),
                "train_tokens": sum(train.lengths()), "max_example_tokens": max(train.lengths(), default=0),
                "n_truncated": sum(p.truncated for p in train.prompts), "fingerprint": train.fingerprint,
                "rewards": [r.name for r in reward_list]}
        return Prepared(model, distributed.wrap(loss, dist, device, strategy, ctx.notes), train.fingerprint,
                        f"{len(train)} train / {len(held)} eval prompts (grpo, {g.num_generations} completions each, "
                        f"rewards {', '.join(r.name for r in reward_list)})", info, tokenizer=tokenizer)

    def new_feed(self, **position) -> RolloutFeed:
        t, g, dist = self.cfg.training, self.cfg.grpo, self.run.ctx.dist
        shape = StepShape(t.micro_batch_size * t.grad_accum // g.num_generations, g.num_generations,
                          t.micro_batch_size, g.loss_type, g.max_completion_length, g.scale_rewards,
                          self.run.tokenizer.pad_token_id, t.seed, g.beta == 0.0)
        share = Share(dist.rank, dist.world, lambda mine: distributed.gather_objects(dist, mine))
        return RolloutFeed(len(self.run.train), shape, self._rollout, share, **position)

    def _rollout(self, idx: list[int], keys: list[int]) -> Rollout:
        r, G = self.run, self.cfg.grpo.num_generations
        rows = [r.train.prompts[i] for i in idx for _ in range(G)]
        if not rows:  # this rank's share of an epoch's short last step
            return Rollout([], [], [], {rw.name: [] for rw in r.rewards}, [])
        t0 = time.perf_counter()
        completions = self._generate(rows, r.sampling, row_draws(keys, r.sampling.max_new_tokens), r.static)
        seconds = time.perf_counter() - t0
        log = scoring.RewardLog()
        total, table, texts = self._score(rows, completions, log)
        for name, values in log.metrics.items():  # log_metric: in this step's line
            self.reward_log.metrics[name] += values
        self.samples["rollout"] = watch.sample_rows(self.done + 1, "rollout", rows[:G], texts[:G], total[:G],
                                                    {rw.name: col[:G] for rw, col in zip(r.rewards, table)},
                                                    log.extra)
        ended = [bool(c) and c[-1] in r.sampling.stop_ids for c in completions]
        return Rollout([p.ids for p in rows], completions, total, {rw.name: col for rw, col in zip(r.rewards, table)},
                       ended, seconds)

    def _generate(self, rows: list, sampling: Sampling, draws: torch.Tensor | None,
                  static: StaticDecode | None = None) -> list[list[int]]:
        """Completions of ``rows`` (``draws``: their uniforms, None for greedy), sampled in ``rollout_pieces``
        batches. Out of memory, the rows are cut in twice as many batches (kept for the rest of the run and by
        checkpoints); each row's draws are its own, so the cut changes no completion. With one row per batch there
        is nothing left to cut."""
        while True:
            try:
                return self._sample_in(rows, sampling, draws, self.rollout_pieces, static)
            except Exception as exc:  # noqa: BLE001 -- only out-of-memory is handled; the rest re-raised
                if not is_out_of_memory(exc):
                    raise
                message = describe(exc)
            # outside the except block: the failed batch's tensors are no longer pinned by the traceback
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if self.rollout_pieces >= len(rows):
                raise OutOfMemoryAtMinimum(f"{message} while sampling one completion at a time; lower "
                                           "grpo.max_completion_length or data.max_length")
            self.rollout_pieces *= 2
            self.log(f"[yellow]out of memory in the rollout: sampling in {self.rollout_pieces} batches[/]")

    def _sample_in(self, rows: list, sampling: Sampling, draws, pieces: int, static) -> list[list[int]]:
        r = self.run
        model, size = r.model, -(-len(rows) // pieces)
        was_training = model.training
        model.eval()  # no dropout while sampling: the completions are the policy's own
        try:
            out = []
            for i in range(0, len(rows), size):
                mine = None if draws is None else draws[i : i + size]
                with r.autocast():
                    out += sample(model, [p.ids for p in rows[i : i + size]], sampling, r.tokenizer.pad_token_id,
                                  mine, lambda ids: r.tokenizer.decode(ids, skip_special_tokens=True), static)
            if static is not None and static.fallback and not self.fallback_told:
                self.fallback_told = True
                self.log(f"[yellow]grpo.compile_rollout: the compile failed ({static.fallback}); decoding eagerly[/]")
            return out
        finally:
            model.train(was_training)

    def _score(self, rows: list, completions: list[list[int]],
               log: scoring.RewardLog) -> tuple[list[float], list[list[float]], list[str]]:
        """(each completion's weighted reward, each reward function's column, the completions' text), the rewards
        called as TRL calls them (scoring.py)."""
        from transformers import TrainerState

        r, t = self.run, self.cfg.training
        texts = r.tokenizer.batch_decode(completions, skip_special_tokens=True)
        prompts = [p.row.prompt for p in rows]
        steps = t.max_steps or 0
        batch = scoring.Batch(prompts, scoring.completions_for(prompts, texts), completions,
                              [p.row.fields for p in rows], [p.where for p in rows],
                              TrainerState(global_step=self.done, max_steps=steps))
        table = scoring.score(r.rewards, batch, log)
        return [float(x) for x in scoring.weighted(r.rewards, table)], table, texts

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Greedy completions of the held-out prompts (each rank a share), scored: the mean reward (and each
        reward's) is kept for ``after_eval``; there is no eval loss (None)."""
        r, dist = self.run, self.run.ctx.dist
        if not len(r.held):
            return None
        greedy = Sampling(r.sampling.max_new_tokens, 0.0, stop_ids=r.sampling.stop_ids,
                          stop_strings=r.sampling.stop_strings)
        rows = Share(dist.rank, dist.world).mine(list(r.held.prompts))
        completions = []
        for i in range(0, len(rows), EVAL_ROWS):
            completions += self._generate(rows[i : i + EVAL_ROWS], greedy, None)  # greedy: the split changes nothing
        log = scoring.RewardLog()  # log_extra's columns go with the samples; log_metric is the rollouts' only
        total, table, texts = self._score(rows, completions, log) if rows else ([], [[] for _ in r.rewards], [])
        k = watch.EVAL_SAMPLES  # rank 0's share starts with the first held-out prompts
        self.samples["eval"] = watch.sample_rows(self.done, "eval", rows[:k], texts[:k], total[:k],
                                                 {rw.name: col[:k] for rw, col in zip(r.rewards, table)}, log.extra)
        shares = distributed.gather_objects(dist, (total, table)) if dist.enabled else [(total, table)]
        every = [x for t, _ in shares for x in t]
        self.eval_stats = {"eval_reward": scoring.nan_mean(every)}  # None values (NaN) left out, as TRL's nanmean
        for j, rw in enumerate(r.rewards):
            col = [x for _, tab in shares for x in tab[j]]
            self.eval_stats[f"eval_rewards/{rw.name}/mean"] = scoring.nan_mean(col)
        self.eval_stats = {k: v for k, v in self.eval_stats.items() if v == v}  # a figure no reward applied to
        return None

    def check_resume(self, restored, force: bool) -> None:
        dist = self.run.ctx.dist
        resume.check_world(restored, dist.world, force)
        if restored.extra.get("sampler") != SAMPLER and not force:
            raise UserError("--resume: the checkpoint was written by a rocktune whose rollouts drew from another "
                            "random stream, so the run could not continue as one exact run; pass --resume-force to "
                            "continue with this version's samples.")
        note = distributed.check_rng(dist, restored.extra.get("rank_rng"), force)
        if note:
            self.run.ctx.notes.append(note)

    def resumed(self, restored) -> None:
        self.rollout_pieces = max(self.rollout_pieces, restored.extra.get("rollout_pieces", 1))
        self.watch.restore(restored.extra.get("watch"))  # a resumed run warns where the uninterrupted one does
        distributed.restore_rng(self.run.ctx.dist, restored.extra.get("rank_rng"))

    def checkpoint_extra(self) -> dict:
        dist = self.run.ctx.dist
        return {"world_size": dist.world, "sampler": SAMPLER, "rank_rng": distributed.gather_rng(dist),
                "rollout_pieces": self.rollout_pieces, "watch": self.watch.state()}

    def start(self, redo_from: int, metrics, log) -> None:
        """The run's log for the rollout's OOM split and the warnings; samples.jsonl keeps only what was logged
        before ``redo_from`` (a resume logs the rest again)."""
        from rocktune.tasks.causal.samples import _keep_before

        self.log, self.metrics, self.done = log, metrics, max(redo_from - 1, 0)
        path = self.run.ctx.run_dir / "samples.jsonl"
        if self.run.ctx.dist.main and path.is_file():  # none yet: the first eval point writes it
            _keep_before(path, redo_from)

    def record(self, fed) -> dict:
        """The step's rollout statistics and the update's (TRL's names), the whole step's over every rank; tokens:
        the completion tokens scored. A rollout that cannot teach is said (watch.py)."""
        dist = self.run.ctx.dist
        self.done += 1
        padded = float(sum(b["input_ids"].numel() for b in fed.forwards))
        said = self.watch.check(self.done, fed.stats)
        for line in said:
            self.log(f"[yellow]warning: {line}[/]")
        if said and self.metrics is not None:
            self.metrics.write({"step": self.done, "warnings": said})  # one line per step (the log's key)
        logged, self.reward_log = self.reward_log.means(), scoring.RewardLog()
        return {"tokens": fed.completion_tokens, "real_tokens": fed.real_tokens, "completions": fed.completions,
                "rollout_pieces": self.rollout_pieces, "samples": fed.samples, **fed.stats, **logged,
                **self.run.loss.take_stats(lambda v: distributed.sum_over_ranks(dist, v), fed.completion_tokens),
                "batch_tokens": int(distributed.sum_over_ranks(dist, torch.tensor([padded]))[0])}

    def progress(self, record: dict) -> str:
        return watch.progress(record)

    def after_eval(self, step: int, metrics, log) -> None:
        if self.eval_stats:
            metrics.write({"step": step, **self.eval_stats})
            log(f"step {step}: held-out reward {self.eval_stats.get('eval_reward', float('nan')):.3f} (greedy)")
            self.eval_stats = {}
        rows = [*self.samples["eval"], *(x for x in self.samples["rollout"] if x["step"] == step)]
        self.samples = {"rollout": [], "eval": []}
        if rows and self.run.ctx.dist.main:
            watch.append(self.run.ctx.run_dir / "samples.jsonl", [{**x, "step": step} for x in rows])

    def oom_message(self, step: int, exc: BaseException) -> str:
        return (f"out of memory at step {step} even with one completion per forward ({exc}); lower "
                "grpo.max_completion_length or data.max_length, turn on model.gradient_checkpointing, or use "
                "model.quantization=nf4.")

