"""Prepare the train and eval examples: open the source, validate and tokenise (through the cache), split.

The rows come from a memory-mapped ``datasets.Dataset`` (``data/sources.py``); validation and tokenisation run in
batches over ``data.num_proc`` forked processes (``data/tokenise.py``, ``data/fastencode.py``, tokens equal to
``data/encode.py``'s record by record), and the tokens land in the cache as flat memory-mapped arrays
(``data/cache.py``) that ``Examples`` reads row by row.

Check, then write: every file is read, validated and tokenised, and the split and the caller's checks done, before
any cache entry is committed; on any rejection the temporary entries (and a cache folder this call created) go.
"""

from __future__ import annotations

import collections
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rocktune.data import (cache, checks, fastencode, instruct, meaning, records, sources, textstream, tokenise,
                           truncate)
from rocktune.data.tokens import TokenRows
from rocktune.errors import UserError

@dataclass
class Examples:
    """Token ids and labels per example: lists (small sets, tests) or ``TokenRows`` over the mapped cache."""

    input_ids: Any  # Sequence[list[int]]: lists or TokenRows
    labels: Any

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> list[int]:
        if isinstance(self.input_ids, TokenRows):
            return self.input_ids.lengths().tolist()
        return [len(x) for x in self.input_ids]

    def subset(self, idx: list[int]) -> Examples:
        if isinstance(self.input_ids, TokenRows):
            return Examples(self.input_ids.take(idx), self.labels.take(idx))
        return Examples([self.input_ids[i] for i in idx], [self.labels[i] for i in idx])


@dataclass
class DataStats:
    shape: str
    n_records: int
    n_truncated: int
    n_dropped: int  # no loss-bearing token left after truncation
    cache_hit: bool
    fingerprint: str
    notes: list[str] = field(default_factory=list)
    n_prompt_cut: int = 0  # truncated examples that lost prompt-side tokens
    n_completion_cut: int = 0  # truncated examples that lost completion-side tokens
    source: str = ""  # what was read: path or hub id, kind, rows, column mapping
    records_per_s: float = 0.0  # tokenisation rate (0 on a cache hit)
    cache_bytes: int = 0
    probes: list = field(default_factory=list)  # chat data: the first records, for the template comparison
    n_empty: int = 0  # records without any target, dropped before tokenising (not in n_records)
    n_windows: int = 0  # text: the examples its documents were cut into (textstream); 0 for other shapes
    stride: int = 0  # text: tokens between window starts
    cuts: truncate.Judged = field(default_factory=truncate.Judged)  # examples whose cut removed what they teach


@dataclass
class Pending:
    """Cache entries written under temporary names, committed once every check passed."""

    entries: list = field(default_factory=list)  # (cache.Entry, meta)
    created: Path | None = None  # the cache folder, when this preparation created it
    sources: Path | None = None  # datasets' Arrow copies of the sources (``sources.SourceSettings.cache_dir``)
    sources_before: frozenset = frozenset()  # what was in ``sources`` before this preparation

    @classmethod
    def start(cls, cache_dir: Path) -> Pending:
        held = cache_dir / "sources"
        return cls(created=None if cache_dir.exists() else cache_dir, sources=held, sources_before=_tree(held))

    def commit(self) -> None:
        for entry, meta in self.entries:
            entry.commit(meta)

    def discard(self) -> None:
        for entry, _ in self.entries:
            entry.discard()
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
        elif self.sources is not None:  # a rejected file's Arrow copy would otherwise outlive its rejection
            for path in sorted(_tree(self.sources) - self.sources_before, key=lambda p: len(p.parts), reverse=True):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)


def _tree(root: Path) -> frozenset:
    """Every file and folder under ``root`` (a few per source: datasets keeps one folder of Arrow shards each)."""
    return frozenset(root.rglob("*")) if root.is_dir() else frozenset()


def source_settings(d, cache_dir: Path, eval_side: bool = False) -> sources.SourceSettings:
    return sources.SourceSettings(dict(d.columns), d.eval_split if eval_side else d.split, d.subset, d.revision,
                                  cache_dir, d.streaming, d.text_split)


def tokenize_file(spec: str, d, tokenizer, cache_dir: Path, vocab_size: int | None = None,
                  pending: Pending | None = None, eval_side: bool = False) -> tuple[Examples, DataStats]:
    """Examples of one source, per the ``data:`` config section ``d``. ``vocab_size``: the model's, when known; a
    token id beyond it is an error naming the record. ``pending``: the cache entry is left for the caller to commit
    (``prepare_data``) instead of committed here."""
    own = pending is None
    pending = Pending.start(cache_dir) if own else pending
    try:
        out = _tokenize_source(spec, d, tokenizer, cache_dir, vocab_size, pending, eval_side)
    except BaseException:
        if own:
            pending.discard()
        raise
    if own:
        pending.commit()
    return out


def _tokenize_source(spec, d, tokenizer, cache_dir, vocab_size, pending: Pending, eval_side: bool):
    key_name = "data.eval_file" if eval_side else "data.train_file"
    src = sources.open_source(spec, source_settings(d, cache_dir, eval_side), key_name)
    head = [tokenise.row(r) for r in src.head(checks.TEMPLATE_PROBES)]
    if not head:
        raise tokenise.records_empty(src)
    shape = records.detect_shape([(src.where(0), head[0])], d.format)
    settings = encode_settings(d, shape, tokenizer)
    key = cache.fingerprint(spec if Path(spec).is_file() else src.fingerprint, cache.tokenizer_fingerprint(tokenizer),
                            shape=shape, max_length=d.max_length, train_on_prompt=d.train_on_prompt,
                            **({"train_reasoning": True} if d.train_reasoning else {}),  # old caches stay valid
                            truncation=d.truncation, empty_targets="dropped", columns=src.columns,
                            split=d.eval_split if eval_side else d.split, subset=d.subset, revision=d.revision,
                            roles=settings.roles, templated=settings.templated, text_split=d.text_split,
                            tools=d.tools, records="chat-v5", text_stride=settings.stride,
                            lossy=d.lossy_truncation)
    probes = []
    if settings.shape == "messages":
        pairs = [(src.where(i), rec) for i, rec in enumerate(head)]
        probes = list(zip([loc for loc, _ in pairs], tokenise.prepare_rows(pairs, settings)))
    hit = cache.load(cache_dir, key)
    if hit is not None:
        arrays, meta = hit
        if vocab_size is not None and meta["max_id"] >= vocab_size:
            raise UserError(_beyond_vocab(spec, meta["max_id"], vocab_size))
        stats = _stats(meta, True, key, src.describe(), 0.0, cache.size_bytes(cache_dir, key))
        stats.probes = probes
        return _examples(arrays), stats
    started = time.perf_counter()
    out = tokenise.run(src, tokenizer, settings, d.num_proc, cache_dir)
    rate = len(out) / max(time.perf_counter() - started, 1e-9)
    try:
        meta = _summarise(out, src, settings, vocab_size, d)
        entry = cache.Entry(cache_dir, key)
        pending.entries.append((entry, meta))
        _write(out, entry, meta)
    finally:
        shutil.rmtree(out.scratch, ignore_errors=True)
    stats = _stats(meta, False, key, src.describe(), rate, sum(f.stat().st_size for f in entry.tmp.iterdir()))
    stats.probes = probes
    return _examples(entry.mapped()), stats


def _column(out, name: str) -> np.ndarray:
    return out.data.column(name).to_numpy()


def encode_settings(d, shape: str, tokenizer) -> fastencode.EncodeSettings:
    """How records of ``shape`` are encoded per the ``data:`` config section ``d``."""
    templated = instruct.uses_template(d.chat_template, shape, tokenizer)
    stride = textstream.stride_for(d.max_length, d.text_stride) if shape == "text" else 0
    return fastencode.EncodeSettings("messages" if templated else shape, d.max_length, d.train_on_prompt,
                                     d.truncation, shape, tuple(sorted(d.roles.items())), d.tools, stride,
                                     d.lossy_truncation, d.train_reasoning)


def describe_shape(settings: fastencode.EncodeSettings, chat_template: str) -> str:
    """The shape as the preview and the log name it: an instruction set rendered through the chat template says so,
    and which setting decided it."""
    if settings.templated:
        plain = "the Alpaca prompt" if settings.source_shape == "alpaca" else "the plain prompt"
        return (f"{settings.source_shape}, rendered through the model's chat template (data.chat_template="
                f"{chat_template}; data.chat_template=never keeps {plain})")
    return settings.shape


def _summarise(out, src: sources.Source, settings: fastencode.EncodeSettings, vocab_size: int | None, d) -> dict:
    """The statistics of the tokenised rows, and every rejection, before anything is written."""
    shape = settings.shape
    empty, kept, first = _column(out, "empty"), _column(out, "kept"), _column(out, "first")
    record = np.cumsum(first) - 1  # the record of each row (a text document gives one row per window)
    n_records, n_empty = int(first.sum()), int(empty.sum())
    if n_empty == n_records:
        raise UserError(records.all_empty([src.where(i) for i in range(min(n_empty, 3))], n_empty, shape, src.name))
    max_id = _column(out, "max_id")
    top = int(max_id.max(initial=-1))
    if vocab_size is not None and top >= vocab_size:
        row = int(np.flatnonzero(max_id >= vocab_size)[0])
        raise UserError(_beyond_vocab(src.where(int(record[row])), int(max_id[row]), vocab_size))
    if not kept.any():
        if settings.lossy == "drop" and (_column(out, "lost") > 0).any():
            need = int(_column(out, "length").max())
            raise UserError(f"{src.name}: data.lossy_truncation=drop left out every example: cut to data.max_length="
                            f"{d.max_length}, each would lose its system prompt, tool list or part of its answer; "
                            f"data.max_length={need} keeps them whole.")
        raise UserError(f"{src.name}: no record has anything to learn from: "
                        + truncate.why_empty(d.max_length, d.truncation))
    tokenised = ~empty
    left_out = (_column(out, "lost") > 0) & (settings.lossy == "drop")  # counted by data.lossy_truncation's note
    docs = first & tokenised  # a record's first row: a text document's first window, any other record's example
    notes = []
    if n_empty:
        where = [src.where(int(record[i])) for i in np.flatnonzero(empty)[:3]]
        note = records.empty_note(where, n_empty, n_records, shape, src.name)
        if settings.tools == "drop" and shape == "messages":
            note += " (data.tools=drop: a conversation whose assistant turns only call tools has none left)"
        notes.append(note)
    counts = collections.Counter(out.data.column("unused").combine_chunks().flatten().to_pylist())
    unused = meaning.unused_note(dict(counts), n_records, settings.source_shape, src.name)
    notes += [unused] if unused else []
    if settings.templated:
        notes.append(f"{src.name}: {describe_shape(settings, d.chat_template)}")
    if shape == "text":
        notes.append(f"{src.name}: " + textstream.describe(int(docs.sum()), int(kept.sum()), d.max_length,
                                                           settings.stride))
    return {"n_records": int(docs.sum()), "n_truncated": int(_column(out, "truncated").sum()),
            "n_dropped": int((tokenised & ~kept & ~left_out).sum()), "shape": shape,
            "n_windows": int(kept.sum()) if shape == "text" else 0, "stride": settings.stride,
            "n_prompt_cut": int((_column(out, "prompt_cut") > 0).sum()),
            "n_completion_cut": int((_column(out, "completion_cut") > 0).sum()), "max_id": top, "n_empty": n_empty,
            "notes": notes, "cuts": _cuts(out, src, record, tokenised, d.max_length)}


def _cuts(out, src: sources.Source, record: np.ndarray, tokenised: np.ndarray, max_length: int) -> dict:
    """``truncate.Judged`` of the tokenised rows, as the cache's meta keeps it: the examples whose cut removed
    their system prompt, tool list or part of their last answer, and the uncut lengths of all of them."""
    lost, length = _column(out, "lost"), _column(out, "length")[tokenised]
    bad = np.flatnonzero(lost > 0)
    xs = np.sort(length) if len(length) else np.zeros(1, dtype=np.int64)
    lengths = {"min": int(xs[0]), "median": float(np.median(xs)), "p95": int(xs[min(len(xs) - 1, int(0.95 * len(xs)))]),
               "max": int(xs[-1]), "over": int((xs > max_length).sum())}
    return {"n_lossy": len(bad), "n_head": int((lost & truncate.HEAD > 0).sum()),
            "n_answer": int((lost & truncate.ANSWER > 0).sum()),
            "needed": int(_column(out, "length")[bad].max()) if len(bad) else 0,
            "first": str(src.where(int(record[bad[0]]))) if len(bad) else "", "lengths": lengths}


def _write(out, entry: cache.Entry, meta: dict) -> None:
    """Arrow lists -> flat arrays, one record batch at a time (never the whole set in memory)."""
    ids_col = out.data.column("input_ids")  # its list offsets only: the lengths
    lengths = np.concatenate([c.value_lengths().fill_null(0).to_numpy() for c in ids_col.chunks]).astype(np.int64)
    kept = _column(out, "kept")
    offsets = np.concatenate([[0], np.cumsum(lengths[kept])]).astype(np.int64)
    entry.write("offsets", len(offsets), np.int64, [offsets])
    for name in ("input_ids", "labels"):
        entry.write(name, int(offsets[-1]), np.int32, _values(out, name))


def _values(out, name: str):
    """The tokens of column ``name``, batch by batch, read from the Arrow files with ordinary reads: read through
    the dataset's memory map, every page of the files would stay in this process's RSS (1.3 GB more at 1M records)."""
    import pyarrow as pa

    for f in out.cache_files:  # the one Arrow file tokenise.run wrote, in the dataset's order
        with pa.OSFile(f["filename"]) as source:
            for batch in pa.ipc.open_stream(source):
                yield batch.column(name).flatten().to_numpy()


def _examples(arrays: dict) -> Examples:
    return Examples(TokenRows(arrays["input_ids"], arrays["offsets"]), TokenRows(arrays["labels"], arrays["offsets"]))


def _stats(meta: dict, hit: bool, key: str, source: str, rate: float, size: int) -> DataStats:
    return DataStats(meta["shape"], meta["n_records"], meta["n_truncated"], meta["n_dropped"], hit, key,
                     list(meta.get("notes", [])), meta.get("n_prompt_cut", 0), meta.get("n_completion_cut", 0),
                     source, rate, size, n_empty=meta.get("n_empty", 0), n_windows=meta.get("n_windows", 0),
                     stride=meta.get("stride", 0), cuts=truncate.Judged(**meta.get("cuts", {})))


def _beyond_vocab(where, token_id: int, vocab_size: int) -> str:
    return (f"{where}: the tokenizer gives token id {token_id}, but the model's vocabulary ends at {vocab_size - 1} "
            f"(vocab_size={vocab_size} in its config.json): the tokenizer and the weights do not belong together. "
            "Point model.name_or_path at a directory whose tokenizer files came with its weights.")


def split(examples: Examples, fraction: float, seed: int, source: str = "") -> tuple[Examples, Examples]:
    """Hold out ``fraction`` of the examples (at least one when fraction > 0), chosen with a seeded shuffle;
    ``source`` says where they came from, for the error."""
    if fraction <= 0:
        return examples, examples.subset([])
    n_eval = max(1, round(len(examples) * fraction))
    if n_eval >= len(examples):
        raise UserError(f"data.eval_fraction={fraction} would hold out {n_eval} of the {len(examples)} examples"
                        f"{source}, leaving none to train on; add records, or set data.eval_fraction=0 (or give "
                        "a separate data.eval_file).")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    return examples.subset(sorted(order[n_eval:])), examples.subset(sorted(order[:n_eval]))


def prepare_data(d, tokenizer, cache_dir: Path, seed: int, vocab_size: int | None = None,
                 check=None) -> tuple[Examples, Examples, DataStats]:
    """Train and eval examples per the ``data:`` config section ``d``; eval comes from ``d.eval_file`` or a seeded
    ``d.eval_fraction`` of the train file. ``check(train, stats)`` (the caller's data checks) returns notes or
    raises; it runs before any cache entry is committed."""
    pending = Pending.start(cache_dir)
    try:
        train, stats = tokenize_file(d.train_file, d, tokenizer, cache_dir, vocab_size, pending)
        if d.eval_file:
            evals, eval_stats = tokenize_file(d.eval_file, d, tokenizer, cache_dir, vocab_size, pending,
                                              eval_side=True)
            stats.notes += eval_stats.notes + _judged(eval_stats, d, d.eval_file)
            stats.cache_bytes += eval_stats.cache_bytes
        else:
            train, evals = split(train, d.eval_fraction, seed, _yield(d.train_file, stats))
        stats.notes += truncate.describe(stats.n_records, stats.n_truncated, stats.n_prompt_cut,
                                         stats.n_completion_cut, stats.n_dropped, d.max_length, d.truncation)
        stats.notes += _judged(stats, d, d.train_file)
        if check is not None:
            stats.notes += check(train, stats)
    except BaseException:
        pending.discard()
        raise
    pending.commit()
    return train, evals, stats


def _judged(stats: DataStats, d, source: str) -> list[str]:
    """data.lossy_truncation on the examples of ``source`` whose cut removed what they teach: an error stops the run
    here, before anything is committed; a warning or a note goes into the run's notes."""
    found = truncate.judge(stats.cuts, d.max_length, d.lossy_truncation)
    if found is None:
        return []
    level, message = found
    if level == "error":
        raise UserError(f"{source}: {message}. (rocktune data preview -c CONFIG shows the lengths.)")
    return [f"warning: {message}." if level == "warning" else f"{message}."]


def _yield(path: str, stats: DataStats) -> str:
    """Where the examples a split works on came from, and what was lost on the way."""
    lost = list(stats.notes)
    if stats.n_dropped:
        lost.append(f"{stats.n_dropped} had nothing to learn from after truncation to data.max_length")
    return f" from {path} ({stats.n_records} records{'; ' + '; '.join(lost) if lost else ''})"
