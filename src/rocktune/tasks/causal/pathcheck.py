"""``rocktune doctor --model PATH``: that model's training path, for a few steps on the device, against the reference.

The model is built the way ``train`` builds it (tasks/causal/build.model_with_adapter: its kernels, the fused LoRA side
path, the compiled decoder where the run would compile) and trained three steps on one batch with the optimizer the
run would take; the same model, adapter and batch are then trained from the same start by the reference (PEFT's own
eager forward, torch's single-tensor AdamW). rocktune.lora.check judges the two traces, so a torch or ROCm build
that computes wrong gradients, or a path that stops learning, is caught before a long run and named by its cause.

It runs in a child process (``python -m rocktune.tasks.causal.pathcheck``) under the doctor's timeout and protocol: a
GPU fault or a hang is a failed check, not a dead doctor.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import torch

from rocktune.lora import check as lora_check
from rocktune.doctor.checks import CheckResult, timed
from rocktune.train import build

STEPS, LR = 3, 5e-3
INJECT_ENV = "ROCKTUNE_DOCTOR_INJECT"  # tests: "train-path=stale" or "train-path=nograd" puts a known bug back


def names(device: str, precision: str) -> list[str]:
    """The cases the doctor runs: eager everywhere, compiled too where ``train`` compiles by default (a GPU)."""
    return [f"train-path[{precision},{mode}]" for mode in (("eager", "compiled") if device != "cpu" else ("eager",))]


def _loss_fn(vocab: int, device: str):
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(3)).to(device)

    def loss(model):
        return model(input_ids=ids, labels=ids).loss
    return loss


def check(model_path: str, device: str, precision: str, compiled: bool) -> CheckResult:
    from rocktune.config import LoraConfig, ModelConfig
    from rocktune.tasks.causal.build import compile_decoder, model_with_adapter

    model, notes = model_with_adapter(ModelConfig(name_or_path=model_path), LoraConfig(), precision, "sdpa", device,
                                      False)
    params = lora_check.adapter_params(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B non-zero, so that every adapter tensor has a gradient at the first step
        for n, p in params.items():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    start = {n: p.detach().clone() for n, p in params.items()}
    loss_fn, autocast = _loss_fn(model.config.vocab_size, device), build.autocast(device.split(":")[0], precision)
    model.train()
    with lora_check.reference_mode(model):
        ref = lora_check.train_trace(model, loss_fn, lora_check.reference_optimizer(list(params.values()), LR),
                                     STEPS, autocast)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(start[n])
    if compiled:
        compile_decoder(model)
    optimizer = build.optimizer(list(params.values()), "auto", LR, 0.0, device.split(":")[0])
    got = lora_check.train_trace(model, loss_fn, optimizer, STEPS, autocast)
    problems = lora_check.compare(got, ref, precision)
    kind = "fused" if optimizer.defaults.get("fused") else "foreach"
    path = next((n for n in notes if n.startswith("LoRA side path")), "PEFT's own LoRA forward")
    detail = (f"{STEPS} steps of AdamW ({kind}) on {path.split(':', 1)[-1].strip()}; loss "
              f"{got.losses[0]:.4f} -> {got.losses[-1]:.4f} (reference {ref.losses[0]:.4f} -> {ref.losses[-1]:.4f})")
    if problems:
        return CheckResult("", "fail", "; ".join(map(str, problems)) + f" [{detail}]")
    return CheckResult("", "pass", detail, metrics={"losses": got.losses, "reference_losses": ref.losses})


def _inject(kind: str) -> None:
    """Test hook: put back one of the bugs the check exists for (a stale cast, gradients a compiler dropped)."""
    from rocktune.lora import fused as lora_fused

    if kind == "stale":
        frozen: dict = {}
        real = lora_fused._adapter_casts

        def stale(plan, a_params, b_params, dtype):
            key = id(a_params[0])
            if key not in frozen:
                a, bs = real(plan, a_params, b_params, dtype)
                frozen[key] = (a.detach().clone(), [b.detach().clone() for b in bs])
            return frozen[key]
        lora_fused._adapter_casts = stale
    elif kind == "nograd":
        real_bwd = lora_fused.FusedLoRA.backward

        def dropped(ctx, *dys):
            grads = real_bwd(ctx, *dys)
            return (*grads[:2], *[None if i % 4 >= 2 else g for i, g in enumerate(grads[2:])])
        lora_fused.FusedLoRA.backward = staticmethod(dropped)  # type: ignore[method-assign]  # the test fault: patched on purpose


def main(argv: list[str]) -> int:
    """``python -m rocktune.tasks.causal.pathcheck DEVICE MODEL '["train-path[bf16,eager]", ...]'``: the doctor's
    child protocol (``@@start NAME``, then ``@@result {json}``), one line each, flushed."""
    device, model_path, wanted = argv[0], argv[1], json.loads(argv[2])
    spec = dict(item.partition("=")[::2] for item in (os.environ.get(INJECT_ENV) or "").split(";") if item)
    if spec.get("train-path"):
        _inject(spec["train-path"])
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference and the path in true fp32 where asked
    for name in wanted:
        print(f"@@start {name}", flush=True)
        precision, mode = name[len("train-path["):-1].split(",")
        try:
            result = timed(lambda: check(model_path, device, precision, mode == "compiled"))  # noqa: B023
        except Exception as exc:  # noqa: BLE001 -- any failure of the device stack is a finding
            from rocktune.errors import one_line

            result = CheckResult("", "fail", one_line(exc))
        result.name = name
        print("@@result " + json.dumps(asdict(result), default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
