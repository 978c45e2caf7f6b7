"""Tokenisation speed, peak RSS and cache size of rocktune's data preparation on synthetic sets, beside a plain
``datasets.map`` of the same tokenizer over the same file (the reference). Prints one JSON object.

    PYTHONPATH=src python benchmarks/data_speed.py --records 10000 [--shape alpaca|messages] [--num-proc N]
        [--tokenizer tiny|bpe]
    PYTHONPATH=src python benchmarks/data_speed.py --shape text --megabytes 100 [--tokenizer bpe]

``--shape text`` writes a plain-text corpus of ``--megabytes`` MB (paragraphs of 20-2,000 synthetic words, blank
lines between), prepared as rocktune prepares text (a document per paragraph, cut into 1,024-token windows); the
reference tokenises the same paragraphs through ``datasets``' text builder, whole, without windows.

Tokenizers (offline): ``tiny``, the demo's byte-level one (one token per byte: about 4x the tokens a real tokenizer
gives the same text, the worst case); ``bpe``, a byte-level BPE with 8,000 tokens trained here on the synthetic
words (about as many characters per token as real tokenizers). The reference tokenises the same text (the rendered
Alpaca prompt + output, or the rendered conversation) as one string per record. Each measurement runs in a fresh
process (peak RSS per process); times exclude imports and tokenizer loading, and include reading the JSONL file.
``cpu_seconds``: user + system time of the process and its workers over the same span, which depends far less than
the wall clock on what else the (shared) machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _cpu_seconds() -> float:
    """User + system CPU of this process and its waited-for children (``datasets.map``'s workers): on a shared
    machine the wall-clock rate depends on the neighbours, the CPU seconds much less."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _peak_mib() -> float:
    self_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(self_kib / 1024, 1)


def _child(kind: str, data: str, shape: str, num_proc: int | None, work: str, tok_dir: str) -> dict:
    from transformers import AutoTokenizer

    from rocktune.config import DataConfig
    from rocktune.data.dataset import tokenize_file
    from rocktune.data.encode import ALPACA_NO_INPUT, ALPACA_WITH_INPUT

    tok = AutoTokenizer.from_pretrained(tok_dir)
    import datasets  # noqa: F401 - imported before the clock starts, as in a run

    start, cpu = time.perf_counter(), _cpu_seconds()
    if kind == "rocktune":
        # the Alpaca prompt, as the reference renders it (data.chat_template=auto would use the chat template)
        # lossy_truncation=keep: long synthetic chats are cut as before (a speed figure, not a training set)
        d = DataConfig(max_length=1024, num_proc=num_proc, chat_template="never", lossy_truncation="keep")
        ex, stats = tokenize_file(data, d, tok, Path(work) / "cache")
        out = {"examples": len(ex), "records_read": stats.n_records + stats.n_empty,
               "cache_bytes": stats.cache_bytes, "tokens": int(sum(ex.lengths()))}
    else:
        import datasets as hf

        builder, extra = ("text", {"sample_by": "paragraph"}) if shape == "text" else ("json", {})
        ds = hf.load_dataset(builder, data_files=data, split="train", cache_dir=str(Path(work) / "ref"), **extra)

        def tokenise(batch):
            if shape == "text":
                texts = batch["text"]
            elif shape == "messages":
                texts = [tok.apply_chat_template(m, tokenize=False) for m in batch["messages"]]
            else:
                texts = [(ALPACA_WITH_INPUT if i else ALPACA_NO_INPUT).format(instruction=n, input=i) + o
                         for n, i, o in zip(batch["instruction"], batch["input"], batch["output"])]
            return tok(texts, truncation=True, max_length=1024)

        out_ds = ds.map(tokenise, batched=True, num_proc=num_proc, remove_columns=ds.column_names)
        out = {"examples": len(out_ds), "cache_bytes": sum(Path(f["filename"]).stat().st_size
                                                           for f in out_ds.cache_files)}
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    workers = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)  # datasets.map's processes
    return {**out, "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "peak_rss_mib_main": _peak_mib(),
            "peak_rss_mib_worker": workers}


def _measure(kind: str, data: str, shape: str, num_proc: int | None, tok_dir: str) -> dict:
    with tempfile.TemporaryDirectory() as work:
        code = (f"import json,sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import data_speed; "
                f"print(json.dumps(data_speed._child({kind!r}, {data!r}, {shape!r}, {num_proc!r}, {work!r}, "
                f"{tok_dir!r})))")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _tiny():
    from rocktune.demo.tiny import build_tokenizer

    return build_tokenizer()


def _bpe():
    from rocktune.demo.tiny import build_bpe_tokenizer

    return build_bpe_tokenizer(vocab_size=8000, per_set=2000, seed=7)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=10_000)
    p.add_argument("--shape", choices=("alpaca", "messages", "text"), default="alpaca")
    p.add_argument("--megabytes", type=float, default=100.0, help="--shape text: the corpus size")
    p.add_argument("--num-proc", type=int, default=None)
    p.add_argument("--tokenizer", choices=("tiny", "bpe"), default="tiny")
    p.add_argument("--no-reference", action="store_true", help="measure rocktune only")
    args = p.parse_args()
    from rocktune.data import synthetic

    with tempfile.TemporaryDirectory() as tmp:
        if args.shape == "text":
            data = Path(tmp) / "corpus.txt"
            args.records = _corpus(data, args.megabytes)
        else:
            data = Path(tmp) / f"{args.shape}.jsonl"
            make = synthetic.alpaca if args.shape == "alpaca" else synthetic.chats
            with open(data, "w", encoding="utf-8") as f:
                for start in range(0, args.records, 50_000):  # in chunks: the generator never holds 1M records
                    n = min(50_000, args.records - start)
                    f.writelines(json.dumps(r) + "\n" for r in make(n, seed=start))
        tok_dir = Path(tmp) / "tokenizer"
        (_bpe() if args.tokenizer == "bpe" else _tiny()).save_pretrained(tok_dir)
        result = {"records": args.records, "shape": args.shape, "tokenizer": args.tokenizer,
                  "num_proc": args.num_proc or "all cores", "file_bytes": data.stat().st_size,
                  "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                  "load_average_before": _load()}
        for kind in ("rocktune",) + (() if args.no_reference else ("datasets.map reference",)):
            r = _measure(kind.split()[0], str(data), args.shape, args.num_proc, str(tok_dir))
            r["records_per_s"] = round(args.records / max(r["seconds"], 1e-9))
            r["megabytes_per_s"] = round(result["file_bytes"] / 1e6 / max(r["seconds"], 1e-9), 2)
            result[kind] = r
    result["load_average_after"] = _load()  # the machine is shared: the rates mean little without it
    print(json.dumps(result, indent=1))


def _load() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _corpus(path: Path, megabytes: float) -> int:
    """A plain-text file of about ``megabytes`` MB: paragraphs of 20-2,000 words, blank lines between; returns how
    many paragraphs (rocktune's documents) it holds."""
    import random

    from rocktune.data.synthetic import WORDS

    rng = random.Random(0)
    limit, written, paragraphs = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < limit:
            para = " ".join(rng.choices(WORDS, k=rng.randint(20, 2000))) + "\n\n"
            f.write(para)
            written += len(para)
            paragraphs += 1
    return paragraphs


if __name__ == "__main__":
    main()
