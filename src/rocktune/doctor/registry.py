"""Which checks run on a device, by name, and the test-only fault injection the child honours.

``ROCKTUNE_DOCTOR_INJECT`` (tests only) replaces an operation with a faulty one, e.g.
``transfer=zero;convert=ftz;matmul=off;dequant=swap`` or ``crash=matmul[float32]`` (the child aborts in that
check, as a GPU fault would kill it). It exists so the test suite can show that each check catches the fault it is for.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from rocktune.doctor import checks as c
from rocktune.doctor import model_checks as m
from rocktune.doctor import perf as p
from rocktune.doctor import quant_checks as q
from rocktune.doctor import recurrent_checks as r
from rocktune.errors import one_line

INJECT_ENV = "ROCKTUNE_DOCTOR_INJECT"
CONVERSIONS = [("float32", "bfloat16"), ("bfloat16", "float32"), ("float32", "float16"), ("float16", "float32"),
               ("bfloat16", "float16"), ("float16", "bfloat16")]


def _zero_copy(t, device, non_blocking):
    return c.default_copy(t, device, non_blocking).zero_()


def _perturb_copy(t, device, non_blocking):
    out = c.default_copy(t, device, non_blocking)
    out.view(-1)[out.numel() // 2] += 1
    return out


def _ftz_convert(t, dtype):
    # a conversion that flushes small magnitudes to zero, like the reported "bf16 gives zeros" bug
    return t.masked_fill(t.abs() < 2**-6, 0).to(dtype)


def _off_matmul(a, b):
    return (a @ b) * 1.05


def _off_dequant(packed, state):
    return q.default_dequant(packed, state) * 1.05


def _swapped_dequant(packed, state):
    # nibbles read in the wrong order: a plausible-looking matrix with every pair of values exchanged
    out = q.default_dequant(packed, state)
    return out.reshape(-1, 2).flip(-1).reshape(out.shape)


FAULTS = {
    "transfer": {"zero": _zero_copy, "perturb": _perturb_copy},
    "dequant": {"off": _off_dequant, "swap": _swapped_dequant},
    "convert": {"ftz": _ftz_convert, "zero": lambda t, dtype: t.to(dtype).zero_()},
    "matmul": {"off": _off_matmul, "zero": lambda a, b: (a @ b).zero_()},
}


def parse_faults(spec: str | None) -> dict[str, object]:
    faults: dict[str, object] = {}
    for item in filter(None, (spec or "").split(";")):
        op, _, kind = item.strip().partition("=")
        faults[op] = kind if op == "crash" else FAULTS[op][kind]
    return faults


def faults_from_env() -> dict[str, object]:
    return parse_faults(os.environ.get(INJECT_ENV))


def plan(device: str, faults: dict | None = None, perf: bool = True) -> list[tuple[str, Callable[[], c.CheckResult]]]:
    """(name, zero-argument check) for every check that applies to ``device`` ('cpu' or 'cuda[:N]')."""
    f, gpu, P = faults or {}, device.startswith("cuda"), functools.partial
    copy, convert, mm = (f.get("transfer", c.default_copy), f.get("convert", c.default_convert),
                         f.get("matmul", c.default_matmul))
    out: list[tuple[str, Callable]] = []
    for pinned in (False, True):
        for nb in (False, True):
            name = f"transfer[{'pinned' if pinned else 'pageable'}{'+non_blocking' if nb else ''}]"
            sizes = (1, 4099, 1 << 18, 1 << 24) if gpu else (1, 4099, 1 << 18)
            out.append((name, P(c.check_transfer, device, pinned, nb, sizes, copy=copy)))
    out += [(f"convert[{s}->{d}]", P(c.check_conversion, device, s, d, convert=convert)) for s, d in CONVERSIONS]
    out += [(f"matmul[{dt}]", P(c.check_matmul, device, dt, matmul=mm)) for dt in ("float32", "bfloat16", "float16")]
    sdpa = [("MATH", "float32"), ("FLASH_ATTENTION", "float32")] if not gpu else (
        [("MATH", "float32")] + [(b, dt) for b in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
                                 for dt in ("bfloat16", "float16")])
    out += [(f"sdpa[{b},{dt}]", P(m.check_sdpa, device, b, dt)) for b, dt in sdpa]
    # varlen attention: what attn_implementation auto picks over packed rows on a GPU when this passes
    out += [(f"varlen[{dt}]", P(m.check_varlen, device, dt)) for dt in (("bfloat16", "float16") if gpu else
                                                                         ("float32",))]
    # the recurrent layers' fast kernels (Gated DeltaNet, their short convolution, Mamba2): used where these pass
    out += [(f"recurrent[{fam},{dt}]", P(r.check_recurrent, device, fam, dt)) for fam in r.FAMILIES
            for dt in (("bfloat16", "float16") if gpu else ("float32",))]
    out += [("lora[float32]", P(m.check_lora, device, "float32"))]
    if gpu:
        out += [("lora[bfloat16]", P(m.check_lora, device, "bfloat16"))]
    out += [("allocator", P(m.check_allocator, device))]
    # QLoRA's kernels: skipped with the reason when bitsandbytes is not installed
    out += [(f"quant4[{qt}]", P(q.check_quant4, device, qt, dequant=f.get("dequant", q.default_dequant)))
            for qt in ("nf4", "fp4")]
    out += [("linear4bit[nf4]", P(q.check_linear4bit, device, "nf4")), ("linear8bit", P(q.check_linear8bit, device)),
            ("qlora[nf4]", P(q.check_qlora_step, device))]
    if perf:
        out += [(f"perf.matmul[{dt}]", P(p.perf_matmul, device, dt))
                for dt in (("bfloat16", "float16", "float32") if gpu else ("float32",))]
        copies = [("h2d", False), ("h2d", True), ("d2h", True)] if gpu else [("host", False)]
        out += [(f"perf.copy[{d}{',pinned' if pin else ''}]", P(p.perf_copy, device, d, pin)) for d, pin in copies]
    return out


def run_one(name: str, fn: Callable[[], c.CheckResult]) -> c.CheckResult:
    """Run a check; a Python exception is a failed check with its message, not a crash of the doctor."""
    try:
        result = c.timed(fn)
    except Exception as exc:  # noqa: BLE001 - any error of the device stack is a finding
        result = c.CheckResult("", "fail", one_line(exc))
    result.name = name
    return result
