"""The recurrent layers' fast kernels on the device, as training would run them (rocktune.kernels.recurrent): each
against transformers' torch reference on the layer's own call, forward and backward. Pass: training uses them.
Otherwise the reason training runs transformers' torch reference instead: not installed, no GPU, or the self-test
failed (with the error measured)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

from rocktune.doctor.checks import DTYPES, CheckResult

# check -> (a transformers modeling module whose layers call the kernels, transformers' names of the kernels)
FAMILIES = {
    "gated_deltanet": ("transformers.models.qwen3_5.modeling_qwen3_5",
                       ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")),
    "causal_conv1d": ("transformers.models.qwen3_5.modeling_qwen3_5", ("causal_conv1d_fn", "causal_conv1d_update")),
    "mamba2": ("transformers.models.granitemoehybrid.modeling_granitemoehybrid",
               ("mamba_chunk_scan_combined", "selective_state_update")),
}


def family_kernels(family: str) -> list:
    """The family's kernels as the installed transformers resolved them (``recurrent.Kernel``); empty where this
    transformers has no such module or picks its kernels another way."""
    from rocktune.kernels import recurrent

    module_name, names = FAMILIES[family]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return []
    found = [k for k in (recurrent.resolve(module, a) for a in list(vars(module))) if k is not None]
    return sorted((k for k in found if k.name in names), key=lambda k: names.index(k.name))


def check_recurrent(device: str, family: str, dtype: str, stand_ins: Mapping[str, Callable] | None = None,
                    dims=None) -> CheckResult:
    """``stand_ins``: transformers' kernel name -> a kernel tried in place of the package's, on the CPU too (the
    tests feed correct and wrong ones); ``dims``: the inputs' sizes (``recurrent_cases.Dims``; its small default
    heads unless given: the CPU tests give smaller ones)."""
    import transformers

    from rocktune.kernels import recurrent
    from rocktune.kernels.recurrent_selftest import TOLERANCE, self_test

    fallback = "training runs transformers' torch reference path"
    if not device.startswith("cuda") and stand_ins is None:
        return CheckResult("", "skip", f"no GPU: {fallback} on the CPU (the packages' kernels are GPU code)")
    kernels = family_kernels(family)
    if not kernels:
        return CheckResult("", "skip", f"transformers {transformers.__version__} has no {FAMILIES[family][0]} whose "
                                       "kernels rocktune chooses")
    fast = {k.name: (stand_ins or {}).get(k.name) or k.fast for k in kernels}
    if not any(fast.values()):
        dist = recurrent.DISTRIBUTION.get(kernels[0].package, kernels[0].package)
        return CheckResult("", "skip", f"{dist} is not installed: {fallback} (pip install {dist} for the fast one)")
    tol = TOLERANCE[DTYPES[dtype]]
    verdicts = {k.name: self_test(k.name, fast[k.name], recurrent.reference_call(k), device, DTYPES[dtype], dims)
                for k in kernels if fast[k.name]}
    failed = {n: v for n, v in verdicts.items() if not v.ok}
    worst = max((v.error if v.error is not None else float("inf") for v in verdicts.values()), default=0.0)
    if failed:
        return CheckResult("", "fail", f"{fallback} for " + "; ".join(f"{n} (self-test failed: {v.detail})"
                                                                      for n, v in failed.items()), worst, tol)
    return CheckResult("", "pass", f"training uses {', '.join(verdicts)}: worst relative error {worst:.1e} against "
                                   f"transformers' torch reference, tolerance {tol:.0e}", worst, tol)
