"""Self-tests of the pieces training uses: SDPA backends, a LoRA step, the caching allocator."""

from __future__ import annotations

import copy as _copy
import math

import torch
import torch.nn.functional as F

from rocktune.doctor.checks import DTYPES, CheckResult, sync
from rocktune.errors import first_line

SDPA_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def default_attention(q, k, v, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def check_sdpa(device: str, backend: str, dtype: str, attention=default_attention) -> CheckResult:
    """One SDPA backend (MATH, FLASH_ATTENTION, ...) on the device against a causal fp64 reference on the CPU."""
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 96, 32, generator=gen).to(dt) for _ in range(3))
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(96, 96, dtype=torch.bool).tril()
    ref = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.double()
    try:
        got = attention(q.to(device), k.to(device), v.to(device), backend).to("cpu").double()
        sync(device)
    except RuntimeError as exc:
        text = first_line(exc, 160)
        if "No available kernel" in str(exc) or "not supported" in str(exc).lower():
            return CheckResult("", "skip", f"backend not available here: {text}")
        return CheckResult("", "fail", f"{type(exc).__name__}: {text}")
    tol = SDPA_TOL[dt]
    if not torch.isfinite(got).all():
        return CheckResult("", "fail", f"{int((~torch.isfinite(got)).sum())} non-finite outputs", float("inf"), tol)
    err = float((got - ref).abs().max() / ref.abs().max())
    return CheckResult("", "pass" if err <= tol else "fail", f"max error {err:.2e} vs fp64 math (tol {tol:.0e})",
                       err, tol)


def _tiny_lora_model():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(4)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["0", "2"])
    return get_peft_model(base, cfg)


def _lora_steps(model, device: str, dtype: torch.dtype, steps: int = 3) -> tuple[list[float], list[str]]:
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 32, generator=gen).to(device), torch.randn(8, 16, generator=gen).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, problems = [], []
    amp = dtype != torch.float32
    for _ in range(steps):
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=amp):
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        if not all(p.grad is not None and torch.isfinite(p.grad).all() for p in params):
            problems.append("non-finite or missing adapter gradients")
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, problems


def check_lora(device: str, dtype: str = "float32") -> CheckResult:
    """Forward, backward, AdamW step of a PEFT LoRA layer: adapters change, base stays, losses match the CPU."""
    dt = DTYPES[dtype]
    if dt != torch.float32 and not device.startswith("cuda"):
        return CheckResult("", "skip", "mixed precision LoRA is checked on GPUs only")
    ref_model = _tiny_lora_model()
    model = _copy.deepcopy(ref_model).to(device)
    before = {n: p.detach().to("cpu").clone() for n, p in model.named_parameters()}
    ref_losses, _ = _lora_steps(ref_model, "cpu", torch.float32)
    losses, problems = _lora_steps(model, device, dt)
    after = {n: p.detach().to("cpu") for n, p in model.named_parameters()}
    unchanged = [n for n in before if "lora_" in n and torch.equal(before[n], after[n])]
    base_moved = [n for n in before if "lora_" not in n and not torch.equal(before[n], after[n])]
    if unchanged:
        problems.append(f"adapter weights did not change: {unchanged[:2]}")
    if base_moved:
        problems.append(f"frozen base weights changed: {base_moved[:2]}")
    if not losses[-1] < losses[0]:
        problems.append(f"loss did not decrease: {losses}")
    err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    tol = 1e-4 if dt == torch.float32 else 5e-2
    if err > tol:
        problems.append(f"losses differ from the CPU reference by {err:.2e} (tol {tol:.0e})")
    detail = "; ".join(problems) or f"losses {', '.join(f'{v:.4f}' for v in losses)} match the CPU"
    return CheckResult("", "fail" if problems else "pass", detail, err, tol)


def check_allocator(device: str, budget_mb: int = 256) -> CheckResult:
    """Allocate mixed sizes, free every other block, allocate again: report reserved vs allocated."""
    if not device.startswith("cuda"):
        return CheckResult("", "skip", "the CPU has no caching allocator to fragment")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    gen = torch.Generator().manual_seed(6)
    blocks, used = [], 0
    while used < budget_mb * 2**20 // 2:
        size = int(torch.randint(1, 9, (1,), generator=gen)) * 2**20
        blocks.append(torch.empty(size, dtype=torch.uint8, device=device))
        used += size
    del blocks[::2]
    blocks += [torch.empty(12 * 2**20, dtype=torch.uint8, device=device) for _ in range(budget_mb // 24)]
    sync(device)
    alloc, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    frag = 1 - alloc / reserved if reserved else 0.0
    metrics = {"allocated_mb": round(alloc / 2**20, 1), "reserved_mb": round(reserved / 2**20, 1),
               "fragmentation": round(frag, 3)}
    del blocks
    torch.cuda.empty_cache()
    return CheckResult("", "pass", f"allocated {metrics['allocated_mb']} MB, reserved {metrics['reserved_mb']} MB "
                       f"({frag:.0%} reserved but unused)", frag, None, metrics)


def check_varlen(device: str, dtype: str, kernel=None) -> CheckResult:
    """Variable-length attention over packed rows (what ``attn_implementation: auto`` picks on a GPU when this
    passes): forward and backward through rocktune's glue against fp32 math attention with the dense mask.
    ``kernel`` replaces torch's (CUDA-only) kernel: the CPU tests pass the per-segment reference."""
    from rocktune.kernels.attention import SELF_TEST_TOL, self_test, varlen_kernel

    if kernel is None and not device.startswith("cuda"):
        return CheckResult("", "skip", "torch's varlen_attn runs on ROCm/CUDA only")
    if kernel is None and varlen_kernel() is None:
        return CheckResult("", "skip", f"torch {torch.__version__} has no torch.nn.attention.varlen (>= 2.10)")
    result = self_test(device, DTYPES[dtype], kernel)
    return CheckResult("", "pass" if result.ok else "fail", result.detail, result.error, SELF_TEST_TOL[DTYPES[dtype]])
