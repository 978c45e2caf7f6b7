"""Choose micro-batch, accumulation, checkpointing, precision and length that fit a budget, fastest first.

Throughput is a relative model, not a measurement: training FLOPs per useful token (forward + input gradients,
plus one more forward of every layer under checkpointing), divided by a utilisation that grows with the tokens per
micro-batch (small batches leave the GPU idle), times 2 for half precision where the caller allows it. It only
ranks candidates; ``rocktune bench`` measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rocktune.errors import UserError
from rocktune.planner.budget import detect_budget
from rocktune.planner.estimate import GIB, Estimate, RunSpec, estimate, lora_param_count
from rocktune.planner.shapes import ModelShape, load_shape

MARGIN = 0.05  # of the budget, kept free
SATURATION_TOKENS = 2048  # tokens per micro-batch at which a GPU is about half busy
MIN_LENGTH = 128
MIN_RANK = 4  # the lowest LoRA rank the planner proposes (MoE models, whose expert adapters dominate)
RANK_REASON = "the adapters of r="


@dataclass
class Suggestion:
    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool
    precision: str
    max_length: int
    predicted_peak_bytes: int  # allocated peak, comparable to torch.cuda.max_memory_allocated
    reasons: list[str] = field(default_factory=list)
    total_bytes: int = 0  # with allocator overhead and device context: what must fit the budget
    budget_bytes: int = 0
    quant: str = "none"  # "nf4" when the planner proposes a quantised base because nothing else fits
    lora_r: int = 0  # the LoRA rank: lower than asked only for an MoE model whose expert adapters do not fit


def suggest_settings(model: str, vram_bytes: int | None, base: RunSpec, global_batch: int,
                     device: str | None = None) -> Suggestion:
    """Micro batch, checkpointing and length for ``base`` (its seq_len is the wanted max_length) that fit the budget.
    ``base.precision="auto"`` lets the planner pick between bf16 and fp32 (pass the platform's choice if known).
    ``device`` ("gpu" | "cpu"), when the caller knows it, keeps a given ``vram_bytes`` on the same device's overheads
    as the detected budget would be (``train --auto`` with and without ``--vram`` then agree)."""
    shape = load_shape(model)
    budget, device, source = (vram_bytes, device or "gpu", "given") if vram_bytes else detect_budget()
    return fit(shape, replace(base, device=device), budget, base.precision, max(1, global_batch), source)


def fit(shape: ModelShape, base: RunSpec, budget: int, precision: str, global_batch: int,
        source: str = "given") -> Suggestion:
    usable = int(budget * (1 - MARGIN))
    precisions = ["bf16", "fp32"] if precision == "auto" else [precision]
    micro = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    length = base.seq_len
    while True:
        cands = [estimate(shape, replace(base, precision=p, checkpointing=c, micro_batch=m, seq_len=length))
                 for p in precisions for c in (False, True) for m in micro]
        fitting = [e for e in cands if e.total_bytes <= usable]
        if fitting or length // 2 < MIN_LENGTH:
            break
        length //= 2
    if base.quant == "none" and (not fitting or length < base.seq_len):
        proposal = _propose_nf4(shape, base, budget, precision, global_batch, source, cands)
        if proposal is not None:
            return proposal
    if shape.experts and (not fitting or length < base.seq_len):
        proposal = _propose_rank(shape, base, budget, precision, global_batch, source, bool(fitting))
        if proposal is not None:
            return proposal
    if not fitting:
        smallest = min(cands, key=lambda e: e.total_bytes)
        raise UserError(f"{shape.name} does not fit in {_gib(budget)} ({source}) with any micro-batch, "
                        f"checkpointing or precision, even at max_length {length}: the smallest configuration "
                        f"({_describe(smallest.spec)}) needs {_gib(smallest.total_bytes)}, so a budget of at least "
                        f"{_gib(smallest.total_bytes / (1 - MARGIN))} would work. Use a smaller model, QLoRA, or "
                        f"a shorter max_length.{_moe_note(shape)}")
    best = max(fitting, key=throughput)
    s = best.spec
    reasons = [f"chosen: {_describe(s)}, accumulation {global_batch // s.micro_batch} -> global batch "
               f"{global_batch}; needs {_gib(best.total_bytes)} of {_gib(budget)} ({source}, {MARGIN:.0%} kept free)"]
    if length < base.seq_len:
        reasons.append(f"max_length {base.seq_len} did not fit with any setting: shortened to {length} "
                       "(longer examples are truncated)")
    reasons += _losers(best, cands, usable)
    return Suggestion(micro_batch_size=s.micro_batch, grad_accum=global_batch // s.micro_batch,
                      gradient_checkpointing=s.checkpointing, precision=s.precision, max_length=s.seq_len,
                      predicted_peak_bytes=best.peak_allocated, reasons=reasons, total_bytes=best.total_bytes,
                      budget_bytes=budget, quant=s.quant, lora_r=s.lora_r)


def _propose_nf4(shape: ModelShape, base: RunSpec, budget: int, precision: str, global_batch: int, source: str,
                 unquantised: list[Estimate]) -> Suggestion | None:
    """When nothing fits at the asked length without quantisation, an nf4 base that does (QLoRA), saying so."""
    try:
        sug = fit(shape, replace(base, quant="nf4"), budget, precision, global_batch, source)
    except UserError:
        return None
    usable = int(budget * (1 - MARGIN))
    if sug.max_length < base.seq_len and any(e.total_bytes <= usable for e in unquantised):
        return None  # shortening anyway: keep the unquantised weights (unless they fit at no length)
    smallest = min(unquantised, key=lambda e: e.total_bytes)
    sug.reasons.insert(0, f"nothing fits {_gib(budget)} at max_length {base.seq_len} without quantisation (the "
                       f"smallest, {_describe(smallest.spec)}, needs {_gib(smallest.total_bytes)}): proposing an "
                       "nf4 base (QLoRA, model.quantization=nf4, needs bitsandbytes >= 0.50 and a supported GPU)")
    return sug


def _moe_note(shape: ModelShape) -> str:
    """Why QLoRA does not rescue an MoE model yet (planner/moe.py's EXPERTS_4BIT)."""
    from rocktune.planner import moe

    if shape.mxfp4_experts:
        return " " + moe.mxfp4_fit_note(shape)
    if not shape.experts or moe.stacks_4bit(shape, "nf4", True):
        return ""
    stacks = shape.moe_layers * moe.stack_values(shape)
    return (f" This mixture-of-experts model's expert stacks ({stacks:,} values, {_gib(stacks * 2)} in bf16) stay "
            "unquantised under model.quantization (bitsandbytes quantises linear layers only, and k-bit preparation "
            "holds the stacks in fp32): rocktune cannot store them in 4 bit for this family.")


def _propose_rank(shape: ModelShape, base: RunSpec, budget: int, precision: str, global_batch: int,
                  source: str, fits_shorter: bool) -> Suggestion | None:
    """An MoE model's expert adapters hold a rank-r pair per expert (PEFT's target_parameters): when nothing fits at
    the asked length, the highest lower rank (halved, down to MIN_RANK) that does, with an nf4 base if need be; at a
    shorter length too when the asked rank fits at none (``fits_shorter`` False)."""
    r = base.lora_r // 2
    if r < MIN_RANK:
        return None
    try:  # (which halves again, down to MIN_RANK, when r does not fit either)
        sug = fit(shape, replace(base, lora_r=r), budget, precision, global_batch, source)
    except UserError:
        return None
    if sug.max_length < base.seq_len and fits_shorter:
        return None  # shortening anyway: keep the rank
    n_asked = lora_param_count(shape, base)
    sug.reasons = [x for x in sug.reasons if not x.startswith(RANK_REASON)]  # a lower rank's: said once, here
    sug.reasons.insert(0, f"{RANK_REASON}{base.lora_r} ({n_asked:,} params with every expert's, "
                       f"{_gib(16 * n_asked)} with gradients and AdamW states) leave no room at max_length "
                       f"{sug.max_length}: proposing lora.r={sug.lora_r} (lora.alpha scaled with it, so the update's "
                       "scale alpha/r stays)")
    return sug


def describe_fit(model: str, vram_bytes: int | None, base: RunSpec, global_batch: int) -> str:
    """One paragraph for the OOM handler: what would fit instead, or the smallest budget that would."""
    try:
        sug = suggest_settings(model, vram_bytes, base, global_batch)
    except UserError as exc:
        return str(exc)
    return (f"rocktune plan suggests: micro_batch_size={sug.micro_batch_size} grad_accum={sug.grad_accum} "
            f"gradient_checkpointing={sug.gradient_checkpointing} precision={sug.precision} "
            f"max_length={sug.max_length} (predicted peak {_gib(sug.predicted_peak_bytes)}). "
            + " ".join(sug.reasons[1:3]))


def throughput(est: Estimate) -> float:
    """Relative useful tokens per second of a candidate (see the module docstring)."""
    sh, s = est.shape, est.spec
    linear = sum(n * n_in * n_out for n, lin in sh.layer_linears() for _, n_in, n_out, _ in lin)
    linear += sh.moe_layers * sh.experts_per_token * 3 * sh.hidden * sh.expert_intermediate  # the routed experts
    layer_fwd = 2 * linear + 2 * s.seq_len * sh.q_dim * sh.layers  # matmuls + causal attention
    head = 2 * sh.hidden * sh.vocab * s.loss_fraction
    work = 2 * layer_fwd + 2 * head + (layer_fwd if s.checkpointing else 0)
    tokens = s.micro_batch * s.seq_len
    utilisation = tokens / (tokens + SATURATION_TOKENS)
    speed = 2.0 if s.precision in ("bf16", "fp16") else 1.0
    return utilisation * speed / work


def _losers(best: Estimate, cands: list[Estimate], usable: int) -> list[str]:
    out, top = [], throughput(best)
    for e in cands:
        s = e.spec
        if e is best or (s.precision, s.checkpointing) == (best.spec.precision, best.spec.checkpointing) and \
                s.micro_batch < best.spec.micro_batch:
            continue
        if e.total_bytes > usable:
            if s.micro_batch == min(c.spec.micro_batch for c in cands if c.spec.precision == s.precision and
                                    c.spec.checkpointing == s.checkpointing and c.total_bytes > usable):
                out.append(f"{_describe(s)}: needs {_gib(e.total_bytes)} > {_gib(usable)} usable")
        elif s.micro_batch == max(c.spec.micro_batch for c in cands if c.spec.precision == s.precision and
                                  c.spec.checkpointing == s.checkpointing and c.total_bytes <= usable):
            out.append(f"{_describe(s)}: fits ({_gib(e.total_bytes)}) but ~{throughput(e) / top:.2f}x the "
                       "estimated throughput" + (" (recomputes every layer)" if s.checkpointing else ""))
    return out


def _describe(s: RunSpec) -> str:
    return (f"micro-batch {s.micro_batch}, checkpointing {'on' if s.checkpointing else 'off'}, {s.precision}"
            f"{'' if s.quant == 'none' else ' on an ' + s.quant + ' base'}, max_length {s.seq_len}")


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass
class TokenBudget:
    rows: int  # rows of max_length per forward
    max_length: int
    predicted_peak_bytes: int
    total_bytes: int
    budget_bytes: int
    reason: str

    @property
    def tokens(self) -> int:
        return self.rows * self.max_length


def fit_token_rows(shape: ModelShape, base: RunSpec, budget: int, max_rows: int,
                   source: str = "given") -> TokenBudget:
    """The most rows of ``base.seq_len`` packed tokens per forward that fit ``budget`` (``MARGIN`` kept free), up to
    ``max_rows`` (what a step holds). Memory grows with rows, so a bisection finds the largest. Packed rows carry a
    block-diagonal mask except under flash-attention and varlen (document bounds)."""
    usable = int(budget * (1 - MARGIN))
    def spec(rows):
        return replace(base, micro_batch=rows, padded=base.attn not in ("flash_attention_2", "varlen"))
    if estimate(shape, spec(1)).total_bytes > usable:
        one = estimate(shape, spec(1))
        raise UserError(f"{shape.name}: one packed row of {base.seq_len} tokens needs {_gib(one.total_bytes)}, more "
                        f"than the {_gib(usable)} usable of {_gib(budget)} ({source}); lower data.max_length, turn "
                        "on model.gradient_checkpointing, or see `rocktune plan` for settings that fit.")
    lo, hi = 1, max(1, max_rows)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if estimate(shape, spec(mid)).total_bytes <= usable else (lo, mid - 1)
    est = estimate(shape, spec(lo))
    capped = " (all a step holds)" if lo == max_rows else ""
    reason = (f"{lo} rows x {base.seq_len} = {lo * base.seq_len:,} tokens per forward{capped}: predicted peak "
              f"{_gib(est.peak_allocated)}, {_gib(est.total_bytes)} with allocator and context, of {_gib(budget)} "
              f"({source}, {MARGIN:.0%} kept free)")
    return TokenBudget(rows=lo, max_length=base.seq_len, predicted_peak_bytes=est.peak_allocated,
                       total_bytes=est.total_bytes, budget_bytes=budget, reason=reason)


def suggest_token_budget(model: str, vram_bytes: int | None, base: RunSpec, max_rows: int) -> TokenBudget:
    """The token budget per forward for ``base`` (its seq_len is the row length); with ``base.ranks`` > 1 per rank,
    for DDP or FSDP (``base.parallel``)."""
    shape = load_shape(model)
    budget, device, source = (vram_bytes, "gpu", "given") if vram_bytes else detect_budget()
    return fit_token_rows(shape, replace(base, device=device), budget, max_rows, source)
