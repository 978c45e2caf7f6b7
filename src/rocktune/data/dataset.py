"""Prepare the train and eval example lists: read, validate, tokenise (through the cache), split."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from rocktune.data import cache, encode, records, truncate
from rocktune.errors import UserError


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
                  cache_dir: Path, truncation: str = "prompt") -> tuple[Examples, DataStats]:
    recs = records.read_records(path)
    shape = records.detect_shape(recs, shape)
    records.validate(recs, shape)
    key = cache.fingerprint(path, cache.tokenizer_fingerprint(tokenizer), shape=shape, max_length=max_length,
                            train_on_prompt=train_on_prompt, truncation=truncation)
    hit = cache.load(cache_dir, key)
    if hit is not None:
        ids, labels, meta = hit
        return Examples(ids, labels), DataStats(shape, meta["n_records"], meta["n_truncated"], meta["n_dropped"],
                                                True, key, [], meta.get("n_prompt_cut", 0),
                                                meta.get("n_completion_cut", 0))
    ids, labels, truncated, dropped, prompt_cut, completion_cut = [], [], 0, 0, 0, 0
    for loc, rec in recs:
        enc = encode.encode(rec, shape, tokenizer, max_length, train_on_prompt, loc, truncation)
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
            "n_prompt_cut": prompt_cut, "n_completion_cut": completion_cut}
    cache.store(cache_dir, key, ids, labels, meta)
    return Examples(ids, labels), DataStats(shape, len(recs), truncated, dropped, False, key, [], prompt_cut,
                                            completion_cut)


def split(examples: Examples, fraction: float, seed: int) -> tuple[Examples, Examples]:
    """Hold out ``fraction`` of the examples (at least one when fraction > 0), chosen with a seeded shuffle."""
    if fraction <= 0:
        return examples, Examples([], [])
    n_eval = max(1, round(len(examples) * fraction))
    if n_eval >= len(examples):
        raise UserError(f"data.eval_fraction={fraction} leaves no training examples out of {len(examples)}.")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    return examples.subset(sorted(order[n_eval:])), examples.subset(sorted(order[:n_eval]))


def prepare_data(train_file: str, eval_file: str | None, eval_fraction: float, shape: str, max_length: int,
                 train_on_prompt: bool, tokenizer, cache_dir: Path, seed: int, truncation: str = "prompt"
                 ) -> tuple[Examples, Examples, DataStats]:
    """Train and eval examples; eval comes from ``eval_file`` or a seeded ``eval_fraction`` of the train file."""
    train, stats = tokenize_file(train_file, shape, tokenizer, max_length, train_on_prompt, cache_dir, truncation)
    if eval_file:
        evals, _ = tokenize_file(eval_file, shape, tokenizer, max_length, train_on_prompt, cache_dir, truncation)
    else:
        train, evals = split(train, eval_fraction, seed)
    stats.notes += truncate.describe(stats.n_records, stats.n_truncated, stats.n_prompt_cut, stats.n_completion_cut,
                                     stats.n_dropped, max_length, truncation)
    return train, evals, stats
