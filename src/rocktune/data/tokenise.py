"""Validate and tokenise every row of a source into an Arrow file of token lists, over several processes.

Batches of ``BATCH`` rows are spread over ``num_proc`` forked worker processes, one batch per task, the results
taken in order: a worker reads its rows from the memory-mapped ``datasets.Dataset`` it inherited (only row numbers
travel), or, for a streamed source (``data.streaming``: an ``IterableDataset``, no Arrow copy of the source is made),
gets the batch read here. The results go into one Arrow file in a scratch folder (``out.scratch``) that ``dataset``
turns into the token cache and then removes. (``datasets.map`` did this before, over contiguous shards: a worker the
shared machine slowed down held the other up, and its progress went through a manager process.)
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rocktune.data import checks, fastencode, meaning, records, sources, textstream, truncate

ROWS_PER_PROC = 4000  # below this a worker process costs more to start than it saves
BATCH = 1000  # rows per tokenizer call
PROGRESS_FROM = 20_000  # rows from which the progress bar is shown (on a terminal)


def row(values: dict) -> dict:
    """A record as the JSON reader gives it: a key Arrow filled with null (absent in that row) is absent, at every
    depth (Arrow gives every message, tool call and tool schema of a column the union of all their keys)."""
    return {k: _strip(v) for k, v in values.items() if v is not None}


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def prepare_rows(pairs: list[tuple[object, dict]], settings: fastencode.EncodeSettings) -> list[dict]:
    """The records of ``pairs`` (location, row) checked and in the encoder's form (``records.prepare``)."""
    return records.prepare(pairs, settings.source_shape, dict(settings.roles), settings.templated,
                           settings.tools == "drop")


class _Encode:
    """What a worker runs on a batch: validate each row, drop empty targets, tokenise the rest."""

    def __init__(self, tokenizer, settings: fastencode.EncodeSettings, src: sources.Source):
        self.tokenizer, self.settings = tokenizer, settings
        self.name, self.kind = src.name, src.kind
        self.layout = fastencode.chat_layout(tokenizer) if settings.shape == "messages" else None
        self.used = meaning.used_keys(settings.source_shape, settings.templated)

    def __call__(self, batch: dict, idx: list[int]) -> dict:
        shape = self.settings.shape
        names = list(batch)
        raw = [row({k: batch[k][j] for k in names}) for j in range(len(idx))]
        locs = [sources.RowLoc(self.name, self.kind, i) for i in idx]
        rows = prepare_rows(list(zip(locs, raw)), self.settings)
        empty = [records.targets_empty(rec, shape) for rec in rows]
        todo = [j for j, e in enumerate(empty) if not e]
        per_record = [[] for _ in idx]  # a text document gives several windows, any other record one example
        for j, encoded in zip(todo, self._encode([rows[j] for j in todo], [locs[j] for j in todo])):
            per_record[j] = encoded
        out = {name: [] for name in COLUMNS}
        s = self.settings
        for j, encoded in enumerate(per_record):
            unused = meaning.unused(raw[j], self.used)
            head = shape != "text" and truncate.has_head(rows[j], shape)
            for k, enc in enumerate(encoded or [None]):
                lost = truncate.lost(head, enc.prompt_cut, enc.completion_cut, s.truncation) \
                    if enc is not None and shape != "text" else 0
                _append(out, enc, empty=empty[j] and k == 0, first=k == 0, unused=unused if k == 0 else [],
                        lost=lost, drop=bool(lost) and s.lossy == "drop")
        return _table(out)

    def _encode(self, recs: list[dict], locs: list) -> list[list]:
        if self.settings.shape == "text":
            return textstream.encode_documents([r["text"] for r in recs], self.tokenizer, self.settings.max_length,
                                               self.settings.stride, locs)
        return [[e] for e in fastencode.encode_many(recs, self.tokenizer, self.settings, locs, self.layout)]


COLUMNS = ("input_ids", "labels", "truncated", "prompt_cut", "completion_cut", "empty", "kept", "max_id", "unused",
           "first", "lost", "length")


def _append(out: dict, enc, empty: bool, first: bool, unused: list, lost: int = 0, drop: bool = False) -> None:
    """One output row: an example (``enc``), or a record without one (empty targets). ``lost``: what its cut removed
    (``truncate.lost``); ``drop``: left out for it (data.lossy_truncation=drop). ``length``: its tokens before any
    cut (every token a cut removed is counted on one side or the other)."""
    kept = enc is not None and not drop and checks.loss_positions(enc.labels) > 0  # list.count: no Python loop
    out["input_ids"].append(enc.input_ids if kept else [])  # a dropped example (nothing left to learn from after
    out["labels"].append(enc.labels if kept else [])  # truncation) stores no tokens
    out["truncated"].append(enc is not None and enc.truncated)
    out["prompt_cut"].append(enc.prompt_cut if enc is not None else 0)
    out["completion_cut"].append(enc.completion_cut if enc is not None else 0)
    out["max_id"].append(max(enc.input_ids, default=-1) if enc is not None else -1)
    out["empty"].append(empty)
    out["kept"].append(kept)
    out["unused"].append(unused)
    out["first"].append(first)
    out["lost"].append(lost)
    out["length"].append(len(enc.input_ids) + enc.prompt_cut + enc.completion_cut if enc is not None else 0)


def _table(out: dict):
    """The rows as an Arrow table of ``features()``' schema: built in C by pyarrow from the lists, where datasets'
    writer would infer and convert each column of a returned dict in Python (2 s of 24 in a profile of 20,000
    Alpaca records)."""
    import pyarrow as pa

    return pa.Table.from_pydict(out, schema=schema())


_SCHEMA: list = []


def schema():
    """``features()`` as an Arrow schema, made once per process."""
    if not _SCHEMA:
        _SCHEMA.append(features().arrow_schema)
    return _SCHEMA[0]


def features():
    import datasets

    ints = datasets.List(datasets.Value("int32"))
    return datasets.Features({"input_ids": ints, "labels": ints, "truncated": datasets.Value("bool"),
                              "prompt_cut": datasets.Value("int32"), "completion_cut": datasets.Value("int32"),
                              "empty": datasets.Value("bool"), "kept": datasets.Value("bool"),
                              "max_id": datasets.Value("int64"), "unused": datasets.List(datasets.Value("string")),
                              "first": datasets.Value("bool"), "lost": datasets.Value("int8"),
                              "length": datasets.Value("int64")})


def workers(num_proc: int | None, n_rows: int) -> int:
    """Processes for ``n_rows``: ``data.num_proc`` (default: the cores this process may use), fewer for a small set;
    one where processes cannot fork (the workers inherit the encoder and the mapped rows, never pickled)."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():  # Windows: one process, the tokenizer's own threads
        return 1
    cores = num_proc or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return max(1, min(cores, math.ceil(n_rows / ROWS_PER_PROC)))


def run(src: sources.Source, tokenizer, settings: fastencode.EncodeSettings, num_proc: int | None, where: Path):
    """The tokenised rows (a memory-mapped ``datasets.Dataset`` of ``features()``); ``out.scratch``, a new folder
    under ``where`` (the cache folder: the same disk as the cache, not a possibly small /tmp), holds its file."""
    where.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=where, prefix=".tokens-"))
    encoder = _Encode(tokenizer, settings, src)
    if src.streamed:  # batches read here, as they arrive, and sent to the workers
        work = Work(_numbered(src), _encode_batch, workers(num_proc, 1 << 62), None)
    else:  # a worker reads its rows from the memory-mapped dataset it inherited: only row numbers are sent
        n = len(src.dataset)
        work = Work(((i, min(i + BATCH, n)) for i in range(0, n, BATCH)), _encode_slice, workers(num_proc, n), n)
    try:
        out = _pooled(src, encoder, work, scratch / "tokens.arrow")
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    out.scratch = scratch
    return out


@dataclass
class Work:
    items: Iterator  # what one call of ``task`` encodes: a streamed batch, or a slice of the mapped rows
    task: Callable
    procs: int
    rows: int | None  # for the progress bar: None when streamed (the size is unknown)


def _pooled(src: sources.Source, encoder: _Encode, work: Work, path: Path):
    """Every item encoded, in order, into one Arrow file: by a pool of forked workers (``imap``, one batch per task,
    so a worker the machine slows down takes fewer) or, with one process, here (the tokenizer then uses its own
    threads). The objects alive now are frozen out of the garbage collector first: its full passes would otherwise
    walk every object of torch and transformers, in each worker, a few times per set."""
    import multiprocessing

    import datasets
    import pyarrow as pa
    from tqdm.auto import tqdm

    pool = None
    gc.freeze()
    try:
        _WORKER.update(encode=encoder, source=src)
        if work.procs > 1:  # tokenizers' threads would fight the workers for the cores, and must not cross a fork
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            pool = multiprocessing.get_context("fork").Pool(work.procs)
            results = pool.imap(work.task, work.items, chunksize=1)
        else:
            results = map(work.task, work.items)
        shown = None if work.rows is None or work.rows >= PROGRESS_FROM else True  # None: shown on a terminal
        suffix = "" if work.rows is not None else " (streamed)"
        bar = tqdm(desc=f"tokenising {src.name}{suffix}", unit=" records", total=work.rows, disable=shown)
        with sources.quiet(), pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema()) as writer:
            for out in results:
                writer.write_table(out)
                bar.update(sum(out.column("first").to_pylist()))  # records, not the windows of a text
        bar.close()
    finally:
        if pool is not None:
            pool.terminate()
        _WORKER.clear()
        gc.unfreeze()
    out = datasets.Dataset.from_file(str(path))
    if len(out) == 0:
        raise records_empty(src)
    return out


def records_empty(src: sources.Source):
    from rocktune.errors import UserError

    return UserError(f"data file {src.name} holds no records.")


def _numbered(src: sources.Source):
    """(batch, row numbers) of a streamed source, ``BATCH`` rows at a time; a row the reader cannot parse is the
    user's error, named by the source and the rows read before it."""
    from rocktune.errors import UserError, first_line

    start = 0
    batches = iter(src.dataset.iter(batch_size=BATCH))
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - pyarrow/datasets raise many types for a malformed file
            raise UserError(f"{src.name}: cannot be read past record {start} ({type(exc).__name__}: "
                            f"{first_line(exc)}); fix the file (data.streaming=false names the line of a bad JSON "
                            "record).") from None
        n = len(next(iter(batch.values()), []))
        yield batch, list(range(start, start + n))
        start += n


_WORKER: dict = {}  # the encoder and the source, set before the workers fork (inherited, never pickled)


def _encode_slice(span: tuple[int, int]):
    start, stop = span
    return _WORKER["encode"](_WORKER["source"].dataset[start:stop], list(range(start, stop)))


def _encode_batch(item):
    return _WORKER["encode"](*item)
