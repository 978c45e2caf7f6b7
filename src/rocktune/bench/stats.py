"""The benchmark's numerics, in one tested place: medians over measured steps, ratios, model FLOPs and MFU.

Every figure comes from counted tokens, measured seconds and counted bytes; nothing is assumed.
"""

from __future__ import annotations

import statistics


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def padding_fraction(real_tokens: int | None, batch_tokens: int | None) -> float | None:
    """1 - non-pad tokens / tokens processed (padding included)."""
    if real_tokens is None or not batch_tokens:
        return None
    return 1.0 - real_tokens / batch_tokens


def flops_per_token(matmul_params: int, layers: int, attn_dim: int, lengths: list[int]) -> float:
    """Model FLOPs per non-pad token of a frozen-base LoRA step: 4N + causal attention.

    Forward costs 2N per token for the N weights of the matmuls (head included, input embedding excluded); with
    the base frozen, backward needs only activation gradients, another 2N (LoRA's own FLOPs are negligible).
    Attention (QK^T and AV) over a causal sequence of length S costs 2*S*d per token and layer forward (d: heads x
    head_dim), three times that with backward; the per-token S is length-weighted over the data: sum S^2 / sum S.
    """
    s_eff = sum(s * s for s in lengths) / max(sum(lengths), 1)
    return 4.0 * matmul_params + 6.0 * layers * attn_dim * s_eff


def mfu(real_tokens_per_s: float | None, flops_token: float | None, peak_flops: float | None,
        head: tuple[int, float | None] = (0, None)) -> float | None:
    """Model FLOPs utilisation. ``head`` = (the head's weights H, loss-bearing tokens/s): the head's 4H is then
    charged at loss positions only, the rest of ``flops_token`` at every non-pad token. A causal LM's useful work is
    the next-token prediction at positions that carry loss; rocktune computes the head only there. Without it
    (H = 0) the head is charged at every token: the usual all-token convention, reported beside it."""
    head_params, loss_tokens_per_s = head
    if real_tokens_per_s is None or not flops_token or not peak_flops:
        return None
    if not head_params:
        return real_tokens_per_s * flops_token / peak_flops
    if loss_tokens_per_s is None:
        return None
    body = flops_token - 4.0 * head_params
    return (real_tokens_per_s * body + loss_tokens_per_s * 4.0 * head_params) / peak_flops


def summarise_steps(steps: list[dict], warmup: int) -> dict:
    """Medians over the steps after ``warmup``; each step dict has tokens, step_s, loss and maybe token counts."""
    # compilation is not training speed, nor is a step run under the profiler (bench/device_time.py)
    measured = [s for s in steps[warmup:] if not s.get("compiling") and not s.get("profiled")]
    per_step = [s["tokens"] / s["step_s"] for s in measured if s.get("step_s")]
    real = _sum(measured, "real_tokens")
    batch = _sum(measured, "batch_tokens")
    real_per_s = [s["real_tokens"] / s["step_s"] for s in measured if s.get("real_tokens") and s.get("step_s")]
    return {
        "measured_steps": len(measured),
        "useful_tokens_per_s": median(per_step),
        "step_s": median([s.get("step_s") for s in measured]),
        "real_tokens_per_s": median(real_per_s),
        "useful_tokens_per_step": median([s["tokens"] for s in measured]),
        "padding_fraction": padding_fraction(real, batch),
        # The host's wait at the step's one sync is not reported as a figure: with the launch queue full the host
        # blocks inside launches instead, so a GPU-bound step shows a small wait too (the first H200 run: 7%).
        # Whether the device waits is measured on the device (bench/device_time.py: device_busy_share).
        "forwards_per_step_median": median([s.get("forwards") for s in measured]),
        "losses": [s["loss"] for s in steps],
        "final_loss": steps[-1]["loss"] if steps else None,
    }


def loss_fell(losses: list[float]) -> bool | None:
    """Whether a run's loss fell: its last step below its first, and the later half of its steps below the earlier
    half on average (one lucky last batch is not learning). None with fewer than two steps. A run whose loss did not
    fall trained nothing that can be seen, and its speed is no figure (``runner.summarise``)."""
    if len(losses) < 2:
        return None
    half = len(losses) // 2
    early, late = losses[:half], losses[len(losses) - half:]
    return losses[-1] < losses[0] and sum(late) / half < sum(early) / half


def loss_parity(a: list[float], b: list[float], rel_tol: float) -> dict:
    """Per-step |delta loss| between two runs that saw the same samples in the same optimizer steps."""
    n = min(len(a), len(b))
    diffs = [abs(x - y) for x, y in zip(a[:n], b[:n])]
    rel = [d / max(abs(y), 1e-12) for d, y in zip(diffs, b[:n])]
    return {"steps": n, "abs_diff": diffs, "max_abs_diff": max(diffs) if diffs else None,
            "max_rel_diff": max(rel) if rel else None, "rel_tol": rel_tol,
            "match": bool(n) and len(a) == len(b) and max(rel) <= rel_tol}


def _sum(steps: list[dict], key: str) -> int | None:
    values = [s.get(key) for s in steps]
    return None if not values or any(v is None for v in values) else sum(values)
