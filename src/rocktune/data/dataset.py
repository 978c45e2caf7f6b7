"""Prepare the train and eval example lists: read, validate, tokenise (through the cache), split.

Check, then write: every file is read, validated and tokenised, and the split and the caller's checks done, before
any cache entry is written, so a bad eval file (or any later rejection) leaves no half-prepared state behind.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from rocktune.data import cache, encode, records, truncate
from rocktune.errors import UserError, first_line


@dataclass
class Examples:
    input_ids: list[list[int]]
    labels: list[list[int]]

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> list[int]:
        return [len(x) for x in self.input_ids]

    def subset(self, idx: list[int]) -> Examples:
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


def tokenize_file(path: str, shape: str, tokenizer, max_length: int, train_on_prompt: bool,
                  cache_dir: Path, truncation: str = "prompt", vocab_size: int | None = None,
                  pending: list | None = None) -> tuple[Examples, DataStats]:
    """``vocab_size``: the model's, when known; a token id beyond it is an error naming the record. ``pending``: the
    cache write is appended to it instead of done, for the caller to run once everything passed."""
    recs = records.read_records(path)
    shape = records.detect_shape(recs, shape)
    records.validate(recs, shape)
    recs, empty_note = records.drop_empty_targets(recs, shape, path)
    key = cache.fingerprint(path, cache.tokenizer_fingerprint(tokenizer), shape=shape, max_length=max_length,
                            train_on_prompt=train_on_prompt, truncation=truncation, empty_targets="dropped")
    hit = cache.load(cache_dir, key)
    if hit is not None:
        ids, labels, meta = hit
        top = meta.get("max_id")
        top = max((max(x) for x in ids if x), default=-1) if top is None else top  # an entry from before max_id
        if vocab_size is not None and top >= vocab_size:
            raise UserError(_beyond_vocab(str(path), top, vocab_size))
        return Examples(ids, labels), DataStats(shape, meta["n_records"], meta["n_truncated"], meta["n_dropped"],
                                                True, key, [empty_note] if empty_note else [],
                                                meta.get("n_prompt_cut", 0), meta.get("n_completion_cut", 0))
    ids, labels, truncated, dropped, prompt_cut, completion_cut, top = [], [], 0, 0, 0, 0, -1
    for loc, rec in recs:
        enc = _encode(rec, shape, tokenizer, max_length, train_on_prompt, loc, truncation)
        top = max(top, max(enc.input_ids, default=-1))
        if vocab_size is not None and top >= vocab_size:
            raise UserError(_beyond_vocab(loc, top, vocab_size))
        truncated += enc.truncated
        prompt_cut += enc.prompt_cut > 0
        completion_cut += enc.completion_cut > 0
        if all(t == encode.IGNORE for t in enc.labels[1:]):
            dropped += 1  # nothing left to learn from: an empty completion, or cut off entirely
            continue
        ids.append(enc.input_ids)
        labels.append(enc.labels)
    if not ids:
        raise UserError(f"{path}: no record has anything to learn from: " + truncate.why_empty(max_length, truncation))
    meta = {"n_records": len(recs), "n_truncated": truncated, "n_dropped": dropped, "shape": shape,
            "n_prompt_cut": prompt_cut, "n_completion_cut": completion_cut, "max_id": top}
    def store():
        return cache.store(cache_dir, key, ids, labels, meta)
    store() if pending is None else pending.append(store)
    return Examples(ids, labels), DataStats(shape, len(recs), truncated, dropped, False, key,
                                            [empty_note] if empty_note else [], prompt_cut, completion_cut)


def _encode(rec: dict, shape: str, tokenizer, max_length: int, train_on_prompt: bool, loc: str, truncation: str):
    """Any failure to encode one record (a chat template raising on its roles, text the tokenizer refuses) is that
    record's error, named by file:line."""
    try:
        return encode.encode(rec, shape, tokenizer, max_length, train_on_prompt, loc, truncation)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 — templates and tokenizers raise many types; the record is the cause
        text = first_line(exc)
        raise UserError(f"{loc}: this record cannot be tokenised ({type(exc).__name__}: {text}); fix or remove "
                        "it.") from None


def _beyond_vocab(where: str, token_id: int, vocab_size: int) -> str:
    return (f"{where}: the tokenizer gives token id {token_id}, but the model's vocabulary ends at {vocab_size - 1} "
            f"(vocab_size={vocab_size} in its config.json): the tokenizer and the weights do not belong together. "
            "Point model.name_or_path at a directory whose tokenizer files came with its weights.")


def split(examples: Examples, fraction: float, seed: int, source: str = "") -> tuple[Examples, Examples]:
    """Hold out ``fraction`` of the examples (at least one when fraction > 0), chosen with a seeded shuffle;
    ``source`` says where they came from, for the error."""
    if fraction <= 0:
        return examples, Examples([], [])
    n_eval = max(1, round(len(examples) * fraction))
    if n_eval >= len(examples):
        raise UserError(f"data.eval_fraction={fraction} would hold out {n_eval} of the {len(examples)} examples"
                        f"{source}, leaving none to train on; add records, or set data.eval_fraction=0 (or give "
                        "a separate data.eval_file).")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    return examples.subset(sorted(order[n_eval:])), examples.subset(sorted(order[:n_eval]))


def prepare_data(train_file: str, eval_file: str | None, eval_fraction: float, shape: str, max_length: int,
                 train_on_prompt: bool, tokenizer, cache_dir: Path, seed: int, truncation: str = "prompt",
                 vocab_size: int | None = None, check=None) -> tuple[Examples, Examples, DataStats]:
    """Train and eval examples; eval comes from ``eval_file`` or a seeded ``eval_fraction`` of the train file.
    ``check(train, shape)`` (the caller's data checks) returns notes or raises; it runs before any cache write."""
    pending: list = []
    train, stats = tokenize_file(train_file, shape, tokenizer, max_length, train_on_prompt, cache_dir, truncation,
                                 vocab_size, pending)
    if eval_file:
        evals, eval_stats = tokenize_file(eval_file, shape, tokenizer, max_length, train_on_prompt, cache_dir,
                                          truncation, vocab_size, pending)
        stats.notes += eval_stats.notes
    else:
        train, evals = split(train, eval_fraction, seed, _yield(train_file, stats))
    stats.notes += truncate.describe(stats.n_records, stats.n_truncated, stats.n_prompt_cut, stats.n_completion_cut,
                                     stats.n_dropped, max_length, truncation)
    if check is not None:
        stats.notes += check(train, stats.shape)
    for store in pending:
        store()
    return train, evals, stats


def _yield(path: str, stats: DataStats) -> str:
    """Where the examples a split works on came from, and what was lost on the way."""
    lost = list(stats.notes)
    if stats.n_dropped:
        lost.append(f"{stats.n_dropped} had nothing to learn from after truncation to data.max_length")
    return f" from {path} ({stats.n_records} records{'; ' + '; '.join(lost) if lost else ''})"
