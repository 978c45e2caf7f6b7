"""``rocktune plan``: the breakdown with and without checkpointing, the fit for the budget, as a table or JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

from rocktune.errors import UserError
from rocktune.planner.budget import detect_budget, parse_budget
from rocktune.planner.estimate import ATTN, DTYPE_BYTES, GIB, QUANT, Estimate, RunSpec, estimate
from rocktune.planner.fit import MARGIN, fit
from rocktune.planner.shapes import load_shape
from rocktune.tasks.vlm.planner.vlm import is_qwen, is_vlm_config

WIDE_COLUMNS = 120  # a terminal this wide shows each term's inputs in the table; a narrower one, below it


def run_plan(model: str, vram: str | None, spec: RunSpec, global_batch: int, as_json: bool,
             device: str | None = None) -> int:
    """``spec``: the run as given on the command line; ``device``: what the budget is (default: detected)."""
    shape = load_shape(model)
    if is_qwen(shape.model_type) or is_vlm_config(model):
        raise UserError(f"{model} is a vision-language model ({shape.model_type}); plan it with --task vlm, which "
                        "counts its images and its vision tower too.")
    if spec.precision not in DTYPE_BYTES or spec.attn not in ATTN or spec.quant not in ("none", *QUANT):
        raise UserError(f"precision must be one of {', '.join(DTYPE_BYTES)}, attn one of {', '.join(ATTN)}, "
                        f"quant one of none, {', '.join(QUANT)}.")
    if min(spec.seq_len, spec.micro_batch, global_batch, spec.lora_r, spec.loss_chunk) < 1 or spec.seq_len < 2:
        raise UserError("max-length (>= 2), batch, global-batch, lora-r and loss-chunk must be positive integers.")
    if vram is not None:
        budget, kind, source = parse_budget(vram), "gpu", "given"
    else:
        budget, kind, source = detect_budget()
    spec = replace(spec, device=device or kind)
    est = estimate(shape, spec)
    other = estimate(shape, replace(spec, checkpointing=not spec.checkpointing))
    try:
        suggestion = asdict(fit(shape, spec, budget, spec.precision, global_batch, source))
    except UserError as exc:
        suggestion = {"error": str(exc)}
    usable = int(budget * (1 - MARGIN))
    doc = {"model": shape.name, "shape": asdict(shape), "n_params": shape.n_params,
           "active_params": shape.active_params,
           "settings": est.settings(), "terms": est.by_name(), "total_bytes": est.total_bytes,
           "peak_allocated_bytes": est.peak_allocated, "saved_activation_bytes": est.saved_bytes,
           "budget_bytes": budget, "budget_source": source, "fits": est.total_bytes <= usable,
           "terms_detail": [asdict(t) for t in est.terms],
           "other_checkpointing": {"checkpointing": other.spec.checkpointing, "terms": other.by_name(),
                                   "total_bytes": other.total_bytes, "fits": other.total_bytes <= usable},
           "fit": suggestion}
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        _render(est, other, doc)
    return 0


def param_count(n: int) -> str:
    """A parameter count people read: 7.62B, 494.0M, 1.2M, 65.5K, 812 (a tiny model's is not 0.00B)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}" if unit == "B" else f"{n / scale:.1f}{unit}"
    return str(n)


def _render(est: Estimate, other: Estimate, doc: dict) -> None:
    s = est.spec
    active = f" ({param_count(doc['active_params'])} active)" if doc["active_params"] != doc["n_params"] else ""
    title = (f"{doc['model']}: {param_count(doc['n_params'])} params{active}, LoRA r={s.lora_r}, {s.precision}"
             f"{'' if s.quant == 'none' else ' ' + s.quant}, micro-batch {s.micro_batch} x {s.seq_len} tokens, "
             f"{s.attn}, loss {s.loss_mode}")
    console = render_table(est, other, doc, title)
    fit = doc["fit"]
    if "error" in fit:
        console.print(f"[bold red]no fit:[/] {fit['error']}")
        return
    changed = ("model.quantization=nf4 " if fit["quant"] != s.quant else "") + \
        (f"lora.r={fit['lora_r']} " if fit["lora_r"] and fit["lora_r"] != s.lora_r else "")  # MoE: see the reasons
    console.print(f"[bold]suggested[/] for global batch {fit['micro_batch_size'] * fit['grad_accum']}: {changed}"
                  f"micro_batch_size={fit['micro_batch_size']} grad_accum={fit['grad_accum']} "
                  f"gradient_checkpointing={fit['gradient_checkpointing']} precision={fit['precision']} "
                  f"{_length(fit['max_length'], s.rollout_new if s.rollout_rows else 0)}")
    for reason in fit["reasons"]:
        console.print(f"  - {reason}", highlight=False)


def render_table(est: Estimate, other: Estimate, doc: dict, title: str):
    """The breakdown with and without checkpointing (``doc``: budget_bytes, budget_source); returns the console."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    on, off = (est, other) if est.spec.checkpointing else (other, est)
    console = Console()
    # The inputs column needs room: on a narrow terminal each term's inputs follow the table, one line each,
    # instead of folding every row into a column a few words wide.
    wide = console.width >= WIDE_COLUMNS
    table = Table(title=title, title_justify="left")
    table.add_column("term")
    table.add_column("no checkpointing", justify="right")
    table.add_column("checkpointing", justify="right")
    if wide:
        table.add_column("inputs", overflow="fold")
    names = list(dict.fromkeys([t.name for t in off.terms] + [t.name for t in on.terms]))
    a, b = off.by_name(), on.by_name()
    details = {t.name: t.inputs for t in off.terms} | {t.name: t.inputs for t in on.terms if t.name not in a}
    budget = doc["budget_bytes"]
    usable = budget * (1 - MARGIN)
    notes = {"peak allocated": "static + saved + largest transient, or static + the rollout's terms (grpo) or the "
             "vision forward (vlm) when larger (compare with torch.cuda.max_memory_allocated)",
             "total": "peak + allocator overhead + device context",
             "fits?": f"budget {fmt_bytes(budget)} ({doc['budget_source']}), {MARGIN:.0%} kept free"}
    for name in names:
        table.add_row(name, fmt_bytes(a.get(name)), fmt_bytes(b.get(name)), *([details[name]] if wide else []))
    table.add_section()
    table.add_row("peak allocated", fmt_bytes(off.peak_allocated), fmt_bytes(on.peak_allocated),
                  *([notes["peak allocated"]] if wide else []))
    table.add_row("[bold]total[/]", f"[bold]{fmt_bytes(off.total_bytes)}[/]", f"[bold]{fmt_bytes(on.total_bytes)}[/]",
                  *([notes["total"]] if wide else []))
    table.add_row("fits?", yes_no(off.total_bytes <= usable), yes_no(on.total_bytes <= usable),
                  *([notes["fits?"]] if wide else []))
    console.print(table)
    if not wide:
        for name, inputs in [*details.items(), *notes.items()]:
            console.print(f"  [bold]{name}[/]: {escape(inputs)}", highlight=False)
    return console


def _length(row_tokens: int, completion: int) -> str:
    """The length setting a user copies: for GRPO the update's row is the prompt (data.max_length) plus the
    completion (grpo.max_new_tokens), and each is its own key."""
    if not completion:
        return f"max_length={row_tokens}"
    return f"max_length={row_tokens - completion} grpo.max_completion_length={completion}"


def fmt_bytes(n) -> str:
    return "—" if n is None else f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def yes_no(ok: bool) -> str:
    return "[green]yes[/]" if ok else "[red]no[/]"
