"""``rocktune data preview``: what training will see, before it starts.

The records go through the same source, validation and tokenisation as ``train`` (``data.dataset.tokenize_file``,
into a temporary cache), then through the same checks (``data.checks``); the shown examples are encoded by the
per-record reference (``data.encode``), which gives the same tokens. Nothing here re-implements masking, so what the
preview shows is what gets trained.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rocktune.data import checks, dataset, encode, records, sources, textstream, tokenise, truncate


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
    source: str = ""  # path or hub id, its kind, rows and column mapping
    records_per_s: float = 0.0  # tokenisation rate, imports done
    cache_bytes: int = 0  # what the token cache of this data takes
    n_windows: int = 0  # text: the windows its documents were cut into (the examples trained); 0 otherwise
    uncut: dict | None = None  # tokens per example before any cut (truncate.Judged.lengths); None for text
    needed: int = 0  # the max_length that keeps whole every example whose cut removes what it teaches (0: none)

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
                  n_show: int = 3, truncation: str = "prompt", data=None) -> Preview:
    """``data``: the ``data:`` config section (columns, split, num_proc ...); the arguments override its fields.
    The data is tokenised as ``train`` does it, into a temporary cache (a preview leaves nothing behind)."""
    from rocktune.config import DataConfig

    d = (data or DataConfig()).model_copy(update={"train_file": data_file, "format": shape, "max_length": max_length,
                                                   "train_on_prompt": train_on_prompt, "truncation": truncation})
    with tempfile.TemporaryDirectory(prefix="rocktune-preview-") as tmp:
        seen, stats = dataset.tokenize_file(data_file, d, tokenizer, Path(tmp) / "cache")
        src = sources.open_source(data_file, dataset.source_settings(d, Path(tmp) / "cache"))
        pairs = [(src.where(i), tokenise.row(r)) for i, r in enumerate(src.head(max(n_show, 1)))]
        settings = dataset.encode_settings(d, records.detect_shape(pairs[:1], d.format), tokenizer)
        pairs = pairs[:n_show]  # -n 0: the figures alone (the first record still names the shape)
        shown = list(zip([loc for loc, _ in pairs], tokenise.prepare_rows(pairs, settings)))
        problems = checks.check_training_data(seen, tokenizer, stats.shape, train_on_prompt, stats.probes)
        judged = truncate.judge(stats.cuts, max_length, d.lossy_truncation)
        if judged is not None and judged[0] != "note":  # a note (drop) goes with the truncation notes
            problems.insert(0, checks.Problem(judged[0], "truncation-loses", judged[1] + "."))
        lengths = seen.lengths()
        loss = seen.labels.loss_counts().sum() if hasattr(seen.labels, "loss_counts") else \
            sum(checks.loss_positions(lab) for lab in seen.labels)
        special = set(tokenizer.all_special_ids)
        encoded = _shown(shown, stats, tokenizer, d, n_show)
        n_rows = stats.n_records + stats.n_empty
        n_kept = len(seen) if stats.shape != "text" else n_rows - stats.n_dropped
    notes = stats.notes + truncate.describe(stats.n_records, stats.n_truncated, stats.n_prompt_cut,
                                            stats.n_completion_cut, stats.n_dropped, max_length, truncation)
    notes += [judged[1]] if judged is not None and judged[0] == "note" else []
    return Preview(
        data_file=str(data_file), shape=dataset.describe_shape(settings, d.chat_template), max_length=max_length,
        train_on_prompt=train_on_prompt,
        n_records=n_rows, n_kept=n_kept, n_truncated=stats.n_truncated, n_dropped=n_rows - n_kept,
        truncation_notes=notes, lengths=lengths, loss_tokens=int(loss), total_tokens=int(sum(lengths)),
        stop_tokens=list(checks.stop_token_ids(tokenizer, stats.shape).values()),
        examples=[{"loc": loc, "truncated": e.truncated, "runs": runs(e.input_ids, e.labels, tokenizer, special)}
                  for loc, e in encoded],
        problems=[asdict(p) for p in problems], source=stats.source, records_per_s=stats.records_per_s,
        cache_bytes=stats.cache_bytes, n_windows=stats.n_windows,
        uncut=stats.cuts.lengths if stats.shape != "text" else None, needed=stats.cuts.needed)


def _shown(shown: list[tuple[str, dict]], stats, tokenizer, d, n_show: int) -> list[tuple[str, encode.Encoded]]:
    """The examples to show, encoded by the per-record reference; a text set's first windows, named by document
    and window."""
    if stats.shape != "text":
        return [(loc, encode.encode(rec, stats.shape, tokenizer, d.max_length, d.train_on_prompt, loc, d.truncation,
                                      d.train_reasoning))
                for loc, rec in shown]
    docs = textstream.encode_documents([rec["text"] for _, rec in shown], tokenizer, d.max_length, stats.stride,
                                       [loc for loc, _ in shown])
    named = [(f"{loc} window {k + 1} of {len(wins)}", w) for (loc, _), wins in zip(shown, docs)
             for k, w in enumerate(wins)]
    return named[:n_show]


def runs(input_ids: list[int], labels: list[int], tokenizer, special: set[int], start: int = 0) -> list[list]:
    """The example as ``[text, trained, is_special]`` runs: neighbouring tokens of one kind decode together (one
    token alone can be half a UTF-8 character); each special token is its own run so it can be shown as such.
    ``start``: where the tokens begin in their sequence (its first token is never trained: nothing predicts it)."""
    out: list[list] = []
    group: list[int] = []
    kind = None
    for i, tok in enumerate(input_ids):
        this = (start + i > 0 and labels[i] != encode.IGNORE, tok in special)
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
