"""--resume takes the newest checkpoint that verifies, whatever ``checkpoints/latest`` says (issue 31).

A kill between a checkpoint's rename and the update of ``latest`` leaves the pointer on the previous checkpoint
although the newer one is complete. The kill is simulated at exactly that point: the pointer write raises.
"""

from __future__ import annotations

import pytest
import torch

from rocktune.train import checkpoint


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs, and no ``except Exception`` cleans up."""


@pytest.fixture
def trainee(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False)


def _step(model, optimizer) -> None:
    """One real update, so each checkpoint holds different weights and optimizer moments."""
    model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_kill_between_rename_and_latest_resumes_from_the_newer_checkpoint(trainee, tmp_path, monkeypatch):
    model, optimizer, scheduler, scaler = trainee
    state = checkpoint.TrainState(model, optimizer, scheduler, scaler)
    root = tmp_path / "checkpoints"

    def save(step: int):
        return checkpoint.save(root, step, state, {"epoch": 0}, {}, keep=3)

    _step(model, optimizer)
    save(2)
    _step(model, optimizer)
    real_write = checkpoint.write_atomic

    def killed_on_pointer(path, text):
        if path.name == checkpoint.LATEST:
            raise Killed
        real_write(path, text)

    monkeypatch.setattr(checkpoint, "write_atomic", killed_on_pointer)
    with pytest.raises(Killed):
        save(4)
    monkeypatch.setattr(checkpoint, "write_atomic", real_write)
    assert (root / checkpoint.LATEST).read_text().strip() == "step-0000002"  # the pointer never moved
    assert checkpoint.verify(root / "step-0000004") is None  # although step 4 is complete
    want = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}

    _step(model, optimizer)  # move the weights away, so the restore has to bring step 4's back
    restored = checkpoint.restore(root, state)
    assert (restored.step, restored.path.name, restored.skipped) == (4, "step-0000004", [])
    got = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert checkpoint.last_good(root) == 4  # what the supervisor and the messages say resume starts from


def test_newest_is_by_step_number_not_name(tmp_path):
    for step in (9_999_999, 10_000_000):  # past the 7-digit padding a name sort would put 9999999 first
        (tmp_path / f"step-{step:07d}").mkdir()
    (tmp_path / "step-junk").mkdir()  # not a checkpoint name: ignored, never a crash
    assert [p.name for p in checkpoint._candidates(tmp_path)] == ["step-10000000", "step-9999999"]
