"""The same numbers as TRL: on the tiny model with a non-zero LoRA adapter, the same pairs (the same token ids) and
the same settings, rocktune's DPO and ORPO loss, rewards, margins, accuracy and log-probs equal TRL's
DPOTrainer / ORPOTrainer within 1e-5. TRL is a test-only dependency (the test extra)."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from rocktune.tasks.preference.pairs import PairText, encode_pair, pair_set  # noqa: E402 -- after the importorskip
from rocktune.tasks.preference.feed import collate_pairs  # noqa: E402
from rocktune.tasks.preference.loss import Objective, PreferenceLoss  # noqa: E402

PAIRS = [("upper abcd =", " ABCD", " abcd"), ("reverse hgfe =", " efgh", " hgfe hgfe"),
         ("add 3 4 =", " 07", " 7 is the answer"), ("upper jihg =", " JIHG", " JIHG!")]
TOL = 1e-5


LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0}


def _base(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")


def _randomise_adapter(model) -> None:
    """LoRA B matrices start at zero (policy = reference): random ones make the comparison say something."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)


@pytest.fixture(scope="module")
def encoded(tokenizer):
    return pair_set([encode_pair(PairText(p, c, r, False), tokenizer, 64, "prompt", f"pair {i}")
                     for i, (p, c, r) in enumerate(PAIRS)])


def _ours(policy, encoded, tokenizer, objective: Objective) -> dict[str, float]:
    chosen_tokens = sum(len(p.chosen[0]) - 1 for p in encoded.pairs)
    batch = collate_pairs(encoded, list(range(len(encoded))), tokenizer.pad_token_id,
                          len(encoded) / chosen_tokens, False)
    module = PreferenceLoss(policy, objective)
    with torch.no_grad():
        loss = module(batch) / len(encoded)  # the engine's normalisation: the step's pairs
    return {"loss": float(loss), **module.take_stats()}


def _padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


def _trl_dpo(tiny_model_dir, encoded, tokenizer, tmp_path, loss_type: str, beta: float):
    """TRL's DPOTrainer on the base with a new adapter (its reference: the adapter disabled, as ours), and the
    policy it trains; the adapter randomised after TRL built it."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path), beta=beta, loss_type=[loss_type], report_to=[], use_cpu=True,
                     per_device_train_batch_size=len(PAIRS), max_length=None)
    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    trainer = DPOTrainer(model=_base(tiny_model_dir), args=args, train_dataset=data, processing_class=tokenizer,
                         peft_config=LoraConfig(**LORA))
    _randomise_adapter(trainer.model)
    # The same token ids as ours: rows [chosen..., rejected...], the completion marked where our labels are.
    seqs = [p.chosen for p in encoded.pairs] + [p.rejected for p in encoded.pairs]
    ids, mask = _padded([s[0] for s in seqs], tokenizer.pad_token_id)
    completion = torch.zeros_like(ids)
    for i, (_, labels) in enumerate(seqs):
        completion[i, : len(labels)] = torch.tensor([int(x != -100) for x in labels])
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, {"input_ids": ids, "attention_mask": mask,
                                                     "completion_mask": completion}, False)
    got = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    return {"loss": float(loss), **got}, trainer.model


def _trl_orpo(tiny_model_dir, encoded, tokenizer, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    args = ORPOConfig(output_dir=str(tmp_path), beta=0.1, report_to=[], use_cpu=True,
                      per_device_train_batch_size=len(PAIRS))
    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    trainer = ORPOTrainer(model=_base(tiny_model_dir), args=args, train_dataset=data, processing_class=tokenizer,
                          peft_config=LoraConfig(**LORA))
    _randomise_adapter(trainer.model)
    batch = {}
    for side in ("chosen", "rejected"):
        seqs = [getattr(p, side) for p in encoded.pairs]
        ids, mask = _padded([s[0] for s in seqs], tokenizer.pad_token_id)
        labels, _ = _padded([s[1] for s in seqs], -100)
        batch |= {f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels}
    trainer.model.eval()
    with torch.no_grad():
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch, train_eval="eval")
    return {"loss": float(loss), **{k.removeprefix("eval_"): float(v) for k, v in metrics.items()}}, trainer.model


KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
        "logps/rejected")


# IPO at beta 0.5: its loss is (margin - 1/(2 beta))^2, about 1 here; at beta 0.1 it is about 26, where fp32's
# last digit alone is 2e-6 and the two summation orders differ by 1.1e-5 (4e-7 relative).
@pytest.mark.parametrize(("loss_type", "beta"), [("sigmoid", 0.1), ("ipo", 0.5)])
def test_dpo_equals_trl(tiny_model_dir, encoded, tokenizer, tmp_path, loss_type, beta):
    theirs, policy = _trl_dpo(tiny_model_dir, encoded, tokenizer, tmp_path, loss_type, beta)
    ours = _ours(policy, encoded, tokenizer, Objective("dpo", beta, loss_type))
    assert abs(ours["rewards/margins"]) > 1e-3  # the adapter moved the policy away from the reference
    for key in ("loss", *KEYS):
        assert ours[key] == pytest.approx(theirs[key], abs=TOL), key


def test_orpo_equals_trl(tiny_model_dir, encoded, tokenizer, tmp_path):
    theirs, policy = _trl_orpo(tiny_model_dir, encoded, tokenizer, tmp_path)
    ours = _ours(policy, encoded, tokenizer, Objective("orpo", 0.1))
    for key in ("loss", *KEYS, "nll_loss", "log_odds_ratio"):
        assert ours[key] == pytest.approx(theirs[key], abs=TOL), key
    # ORPO's logps are per-token means (TRL's average_log_prob): rewards are beta times them
    assert ours["rewards/chosen"] == pytest.approx(0.1 * theirs["logps/chosen"], abs=TOL)
