"""The same numbers as TRL: on the tiny model with a non-zero LoRA adapter, the same prompts and completions (the
same token ids), the same advantages, "old" log-probabilities and settings, rocktune's GRPO loss, KL and clip ratios
and the adapter's gradient equal TRL 1.16's GRPOTrainer._compute_loss within 1e-5, for each loss aggregation
(grpo, dapo, dr_grpo), with and without the KL term, at a sampling temperature other than 1, with each prompt
computed once for its group (grpo.share_prompt, the default) and over full rows. TRL is a test-only dependency (the
test extra)."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from rocktune.tasks.grpo.feed import advantages, collate, row_weights  # noqa: E402 -- after the importorskip
from rocktune.tasks.grpo.loss import GRPOLoss, Objective, token_logps  # noqa: E402

PROMPTS = ["upper abcd =", "shift hgfe ="]  # the same number of tokens: TRL's left padding is then none
COMPLETIONS = [[" ABCD"], [" AB", " ABCD!!"], [" ihgf"], [" ih", " x"]]
MAX_LEN, TEMPERATURE, TOL = 12, 0.7, 1e-5
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0}


def _trainer(tiny_model_dir, tokenizer, tmp_path, loss_type: str, beta: float):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), beta=beta, loss_type=loss_type, epsilon=0.2, epsilon_high=0.28,
                      num_generations=2, per_device_train_batch_size=4, max_completion_length=MAX_LEN,
                      temperature=TEMPERATURE, report_to=[], use_cpu=True, bf16=False)  # fp32, as ours here
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    trainer = GRPOTrainer(model=base, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                          processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    torch.manual_seed(0)  # LoRA B starts at zero (policy = reference): random ones make the comparison say something
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return trainer


@pytest.fixture(scope="module")
def rollout(tokenizer):
    eos = tokenizer.eos_token_id
    prompts = [tuple(tokenizer(p)["input_ids"]) for p in PROMPTS for _ in range(2)]
    assert len({len(p) for p in prompts}) == 1
    completions = [tokenizer("".join(c))["input_ids"] + [eos] for c in COMPLETIONS]
    completions[3] = completions[3][:-1]  # one completion cut at the length limit: no eos
    rewards = torch.tensor([1.0, 0.5, 0.0, 1.0])
    return prompts, completions, advantages(rewards, 2, "group")


def _old_logps(rows: int, width: int) -> torch.Tensor:
    """The sampling policy's log-probabilities: the current ones shifted so that some ratios clip both ways."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=g) * 0.3


def _theirs(trainer, rollout, tokenizer, old: torch.Tensor) -> dict[str, float]:
    prompts, completions, adv = rollout
    width = max(map(len, completions))
    pad = tokenizer.pad_token_id
    comp = torch.tensor([c + [pad] * (width - len(c)) for c in completions])
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    model = trainer.model
    model.train()  # TRL's metrics go to "train" and its accumulation normaliser is 1 here
    trainer.current_gradient_accumulation_steps = 1
    inputs = {"prompt_ids": torch.tensor(prompts), "prompt_mask": torch.ones(len(prompts), len(prompts[0]),
              dtype=torch.long), "completion_ids": comp, "completion_mask": mask, "advantages": adv,
              "num_items_in_batch": mask.sum()}
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, torch.cat([inputs["prompt_ids"], comp], 1),
                                                                 torch.cat([inputs["prompt_mask"], mask], 1), width)
        inputs["old_per_token_logps"] = logps + old[:, :width]
        if trainer.beta:
            with model.disable_adapter():
                inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                    model, torch.cat([inputs["prompt_ids"], comp], 1), torch.cat([inputs["prompt_mask"], mask], 1),
                    width)
    loss = trainer._compute_loss(model, inputs)
    got = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"loss": float(loss), "grad": _grad(model, loss), **{k: float(v) for k, v in got.items()}}


def _grad(model, loss) -> torch.Tensor:
    """The adapter's gradient of ``loss``, flat; the gradients are cleared again."""
    loss.backward()
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    flat = torch.cat([p.grad.flatten() for p in params])
    for p in params:
        p.grad = None
    return flat


def _ours(model, rollout, tokenizer, old: torch.Tensor, objective: Objective, share: bool) -> dict[str, float]:
    prompts, completions, adv = rollout
    lengths = [len(c) for c in completions]
    weights, normaliser = row_weights(lengths, objective.loss_type, objective.max_completion_length)
    batch = collate(prompts, completions, adv.tolist(), weights, tokenizer.pad_token_id)
    # the same shifts at the same completion tokens: ours are laid out along the whole row
    shifted = torch.zeros(batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1)
    p = len(prompts[0])
    shifted[:, p - 1 : p - 1 + old.shape[1]] = old[:, : shifted.shape[1] - p + 1]
    module = GRPOLoss(model, objective, share_prompt=share)
    with torch.no_grad():
        batch["old_logps"] = token_logps(model, batch, objective.temperature) + shifted
    loss = module(batch) / normaliser
    return {"loss": float(loss), "grad": _grad(model, loss), **module.take_stats()}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("share", [True, False], ids=["shared-prompt", "full-rows"])  # grpo.share_prompt
def test_grpo_loss_equals_trl(tiny_model_dir, tokenizer, rollout, tmp_path, loss_type, beta, share):
    trainer = _trainer(tiny_model_dir, tokenizer, tmp_path, loss_type, beta)
    old = _old_logps(len(rollout[1]), max(map(len, rollout[1])))
    theirs = _theirs(trainer, rollout, tokenizer, old)
    ours = _ours(trainer.model, rollout, tokenizer, old,
                 Objective(beta, 0.2, 0.28, loss_type, MAX_LEN, TEMPERATURE), share)
    keys = ["loss", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"] + (["kl"] if beta else [])
    assert 0 < ours["clip_ratio/region_mean"] < 1  # the shifted old policy clips some tokens, not all
    if beta:
        assert ours["kl"] > 1e-4  # the adapter moved the policy away from the reference
    for key in keys:
        assert ours[key] == pytest.approx(theirs[key], abs=TOL), key
    scale = float(theirs["grad"].abs().max())
    assert scale > 1e-3 and float((ours["grad"] - theirs["grad"]).abs().max()) <= TOL * max(scale, 1.0)
