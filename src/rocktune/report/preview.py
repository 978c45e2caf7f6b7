"""``rocktune data preview``: what training will see, before it starts.

The records go through the same reading, shape detection, validation and encoding as ``train``
(``data.records`` / ``data.encode``), then through the same checks (``data.checks``); nothing here re-implements
masking, so what the preview shows is what gets trained.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from rocktune.data import checks, encode, records, truncate
from rocktune.data.dataset import Examples


@dataclass
class Preview:
    data_file: str
    shape: str
    max_length: int
    train_on_prompt: bool
    n_records: int
    n_kept: int
    n_truncated: int
    n_dropped: int  # no loss-bearing token left after truncation, as in prepare_data
    truncation_notes: list[str]  # how many were cut where, and why some were dropped (the words train logs)
    lengths: list[int]
    loss_tokens: int
    total_tokens: int
    stop_tokens: list[str]
    examples: list[dict] = field(default_factory=list)  # {"loc", "truncated", "runs": [[text, trained, special]]}
    problems: list[dict] = field(default_factory=list)

    @property
    def loss_share(self) -> float:
        return self.loss_tokens / max(self.total_tokens, 1)

    def length_stats(self) -> dict:
        xs = sorted(self.lengths) or [0]
        return {"min": xs[0], "median": statistics.median(xs), "p95": xs[min(len(xs) - 1, int(0.95 * len(xs)))],
                "max": xs[-1], "mean": statistics.fmean(xs)}

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("lengths")
        out.update(loss_share=self.loss_share, lengths=self.length_stats(), histogram=histogram(self.lengths))
        return out


def build_preview(data_file: str, shape: str, tokenizer, max_length: int, train_on_prompt: bool,
                  n_show: int = 3, truncation: str = "prompt") -> Preview:
    recs = records.read_records(data_file)
    shape = records.detect_shape(recs, shape)
    records.validate(recs, shape)
    encoded = [(loc, encode.encode(rec, shape, tokenizer, max_length, train_on_prompt, loc, truncation))
               for loc, rec in recs]
    kept = [(loc, e) for loc, e in encoded if checks.loss_positions(e.labels)]
    # The checks see what training would: the kept examples (all of them when none is kept, to say so).
    seen = Examples([e.input_ids for _, e in kept or encoded], [e.labels for _, e in kept or encoded])
    problems = checks.check_training_data(seen, tokenizer, shape, train_on_prompt, data_file, max_length)
    special = set(tokenizer.all_special_ids)
    n_truncated = sum(e.truncated for _, e in encoded)
    notes = truncate.describe(len(recs), n_truncated, sum(e.prompt_cut > 0 for _, e in encoded),
                              sum(e.completion_cut > 0 for _, e in encoded), len(encoded) - len(kept), max_length,
                              truncation)
    return Preview(
        data_file=str(data_file), shape=shape, max_length=max_length, train_on_prompt=train_on_prompt,
        n_records=len(recs), n_kept=len(kept), n_truncated=n_truncated, n_dropped=len(encoded) - len(kept),
        truncation_notes=notes, lengths=seen.lengths(),
        loss_tokens=sum(checks.loss_positions(lab) for lab in seen.labels), total_tokens=sum(seen.lengths()),
        stop_tokens=list(checks.stop_token_ids(tokenizer, shape).values()),
        examples=[{"loc": loc, "truncated": e.truncated, "runs": runs(e.input_ids, e.labels, tokenizer, special)}
                  for loc, e in encoded[:n_show]],
        problems=[asdict(p) for p in problems])


def runs(input_ids: list[int], labels: list[int], tokenizer, special: set[int]) -> list[list]:
    """The example as ``[text, trained, is_special]`` runs: neighbouring tokens of one kind decode together (one
    token alone can be half a UTF-8 character); each special token is its own run so it can be shown as such."""
    out: list[list] = []
    group: list[int] = []
    kind = None
    for i, tok in enumerate(input_ids):
        this = (i > 0 and labels[i] != encode.IGNORE, tok in special)
        if group and (this != kind or this[1]):
            out.append([tokenizer.decode(group), *kind])
            group = []
        group.append(tok)
        kind = this
    if group:
        out.append([tokenizer.decode(group), *kind])
    return out


def histogram(lengths: list[int], bins: int = 10) -> list[dict]:
    if not lengths:
        return []
    lo, hi = min(lengths), max(lengths)
    width = max(1, -(-(hi - lo + 1) // bins))
    counts = [0] * bins
    for n in lengths:
        counts[min((n - lo) // width, bins - 1)] += 1
    return [{"from": lo + i * width, "to": lo + (i + 1) * width - 1, "count": c} for i, c in enumerate(counts)
            if lo + i * width <= hi]
