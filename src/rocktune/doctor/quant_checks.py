"""bitsandbytes 4-bit self-tests: quantise/dequantise a known matrix, the 4-bit linear, one LoRA step through it.

Each compares the device with a reference that does not trust bitsandbytes: blockwise absmax scaling and the
nearest code of the 4-bit table, computed with plain torch on the CPU. A build that loads but computes garbage
(bitsandbytes#2087: Linear4bit wrong on gfx1100 while dequantisation was right) fails here, not in training.
``dequant`` is a parameter so a test can inject a wrong dequantisation and watch the check fail.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from rocktune.doctor.checks import CheckResult, sync

BLOCK = 64  # bitsandbytes' default 4-bit block (what transformers' BitsAndBytesConfig uses)
QUANT_TOL = 1e-3  # mean |bnb - reference| / mean |W|: codes may differ only at rounding ties
# max error of the 4-bit linear vs x @ reference(W)^T, relative to max |ref|: bitsandbytes' CPU kernels measured
# 3.5e-3 (half-precision rounding inside); the wrong gfx1100 kernel of bitsandbytes#2087 was off by ~1
MATMUL_TOL = 1e-2
# LLM.int8 also rounds the inputs to int8 per row (and fp16): measured 2.7e-3 on this CPU
INT8_TOL = 2e-2


def default_dequant(packed, state):
    import bitsandbytes.functional as bf

    return bf.dequantize_4bit(packed, state)


def reference_4bit(w: torch.Tensor, quant_type: str) -> torch.Tensor:
    """What 4-bit blockwise quantisation must give: per block of 64 values, absmax x the nearest code."""
    import bitsandbytes.functional as bf

    code = bf.get_4bit_type(quant_type, device="cpu").float()
    blocks = w.double().reshape(-1, BLOCK)
    absmax = blocks.abs().amax(1, keepdim=True)
    nearest = ((blocks / absmax).unsqueeze(-1) - code.double()).abs().argmin(-1)
    return (code.double()[nearest] * absmax).reshape(w.shape)


def _missing() -> CheckResult | None:
    if importlib.util.find_spec("bitsandbytes") is None:
        return CheckResult("", "skip", "bitsandbytes not installed (pip install 'rocktune[qlora]')")
    return None


def check_quant4(device: str, quant_type: str = "nf4", shape: tuple[int, int] = (256, 512),
                 dequant=default_dequant) -> CheckResult:
    """Quantise a known matrix on the device and dequantise it; compare with the CPU reference."""
    if (skip := _missing()) is not None:
        return skip
    import bitsandbytes.functional as bf

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    packed, state = bf.quantize_4bit(w.to(device), quant_type=quant_type, blocksize=BLOCK)
    got = dequant(packed, state).to("cpu").double()
    sync(device)
    ref = reference_4bit(w, quant_type)
    if not torch.isfinite(got).all():
        return CheckResult("", "fail", f"{int((~torch.isfinite(got)).sum())} non-finite values", float("inf"),
                           QUANT_TOL)
    err = float((got - ref).abs().mean() / w.abs().mean())
    own = float((ref - w.double()).abs().mean() / w.abs().mean())
    detail = (f"dequantised {quant_type} differs from the reference by {err:.2e} of mean |W| (tol {QUANT_TOL:.0e});"
              f" the quantisation error itself is {own:.3f}")
    return CheckResult("", "pass" if err <= QUANT_TOL else "fail", detail, err, QUANT_TOL)


def _linear4bit(w: torch.Tensor, quant_type: str, device: str):
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(w.shape[1], w.shape[0], bias=False, quant_type=quant_type,
                              compute_dtype=torch.float32, device="meta")
    layer.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type=quant_type, blocksize=BLOCK)
    return layer.to(device)  # bitsandbytes quantises on the move


def check_linear4bit(device: str, quant_type: str = "nf4") -> CheckResult:
    """The 4-bit linear (its fused GEMM/GEMV kernels) for 1, 8 and 64 rows against x @ reference(W)^T."""
    if (skip := _missing()) is not None:
        return skip
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(256, 512, generator=gen)
    layer, ref_w = _linear4bit(w, quant_type, device), reference_4bit(w, quant_type)
    return _against_reference(layer, ref_w, gen, device, MATMUL_TOL, f"{quant_type} linear")


def check_linear8bit(device: str) -> CheckResult:
    """LLM.int8's linear (int8 rows of W, int8 rows of x, outliers kept in fp16) vs x @ row-quantised(W)^T."""
    if (skip := _missing()) is not None:
        return skip
    import bitsandbytes as bnb

    gen = torch.Generator().manual_seed(11)
    w = torch.randn(256, 512, generator=gen)
    layer = bnb.nn.Linear8bitLt(512, 256, bias=False, has_fp16_weights=False, threshold=6.0, device="meta")
    layer.weight = bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
    layer = layer.to(device)
    scale = w.double().abs().amax(1, keepdim=True) / 127
    ref_w = (w.double() / scale).round().clamp(-127, 127) * scale
    return _against_reference(layer, ref_w, gen, device, INT8_TOL, "int8 linear")


def _against_reference(layer, ref_w: torch.Tensor, gen: torch.Generator, device: str, tol: float,
                       what: str) -> CheckResult:
    """The quantised layer on 1, 8 and 64 input rows against x @ ref_w^T in float64: worst relative error."""
    worst = 0.0
    for rows in (1, 8, 64):
        x = torch.randn(rows, ref_w.shape[1], generator=gen)
        with torch.no_grad():
            got = layer(x.to(device)).to("cpu").double()
        sync(device)
        ref = x.double() @ ref_w.t()
        if not torch.isfinite(got).all():
            return CheckResult("", "fail", f"{rows} rows: non-finite outputs", float("inf"), tol)
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    return CheckResult("", "pass" if worst <= tol else "fail",
                       f"{what}, 1/8/64 rows: max error {worst:.2e} vs the reference (tol {tol:.0e})", worst, tol)


def _qlora_losses(device: str, quant_type: str, steps: int = 3) -> tuple[list[float], object]:
    from peft import LoraConfig, get_peft_model

    gen = torch.Generator().manual_seed(9)
    w1, w2 = torch.randn(128, 64, generator=gen) * 0.2, torch.randn(64, 128, generator=gen) * 0.2
    base = torch.nn.Sequential(_linear4bit(w1, quant_type, device), torch.nn.Tanh(),
                               _linear4bit(w2, quant_type, device))
    torch.manual_seed(10)  # the adapters' initialisation: the same on the device and on the CPU
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"]))
    x, y = torch.randn(16, 64, generator=gen).to(device), torch.randn(16, 64, generator=gen).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


def check_qlora_step(device: str, quant_type: str = "nf4") -> CheckResult:
    """Three LoRA steps through a 4-bit base: the loss falls, the packed base is untouched, the CPU agrees."""
    if (skip := _missing()) is not None:
        return skip
    losses, model = _qlora_losses(device, quant_type)
    ref, _ = _qlora_losses("cpu", quant_type)
    problems = [] if losses[-1] < losses[0] else [f"loss did not decrease: {losses}"]
    if any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n):
        problems.append("base weights are trainable")
    err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))
    if err > 1e-3:
        problems.append(f"losses differ from the CPU by {err:.2e} (tol 1e-03)")
    detail = "; ".join(problems) or f"losses {', '.join(f'{v:.4f}' for v in losses)} match the CPU"
    return CheckResult("", "fail" if problems else "pass", detail, err, 1e-3)
