"""What encoding a chat conversation costs per template: one rendering (ChatML) against rendering per prefix (the
released Qwen3.5, GLM-4.6 and gpt-oss templates, whose replies render differently once later turns follow). Prints
one JSON object.

    PYTHONPATH=src python benchmarks/chat_encode_cost.py [--conversations 200] [--repeats 3]

Conversations of 1 and 4 turns, each with a system turn (words repeated so each turn is some 40-80 characters), on the
test fixtures' byte-level tokenizers (``tests/family_fixtures.py``) carrying each template. Two figures per case, in
CPU milliseconds per conversation, the best of ``--repeats``: ``encode`` is ``data/encode.encode`` one conversation at
a time (it always renders per prefix: the reference), ``pipeline`` is what ``rocktune train`` runs
(``fastencode.encode_many`` over the whole batch, with the one-rendering layout where ``chat_layout`` proves it on the
template, ``layout``: ``one rendering`` or ``per prefix``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RELEASED = ROOT / "tests" / "data" / "templates"
# name -> (tests/family_fixtures.py's template key, the released template file or None for the fixture's own)
CASES = {"ChatML (Qwen2.5 shape)": ("chatml", None), "Qwen3.5 released": ("qwen3.5", "Qwen-Qwen3.5-4B.jinja"),
         "GLM-4.6 released": ("glm4.5", "zai-org-GLM-4.6.jinja"),
         "gpt-oss released": ("harmony", "openai-gpt-oss-120b.jinja")}


def conversations(n: int, turns: int) -> list[dict]:
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Be brief."}]
        for t in range(turns):
            msgs += [{"role": "user", "content": f"question {i} {t} " * 5},
                     {"role": "assistant", "content": f"answer {i} {t} " * 8}]
        out.append({"messages": msgs})
    return out


def tokenizer(key: str, file: str | None, folder: Path):
    """The fixture's tokenizer with the template; a model whose stops come from its generation config (GLM's
    <|user|> and <|observation|>) is loaded from a folder holding that file, as a real model is."""
    from transformers import AutoTokenizer

    from tests.family_fixtures import TEMPLATES, build_tokenizer

    t = TEMPLATES[key]
    if file:
        t = replace(t, text=(RELEASED / file).read_text(encoding="utf-8"))
    tok = build_tokenizer(t)
    if not t.stops:
        return tok
    tok.save_pretrained(folder)
    stops = tok.convert_tokens_to_ids([t.eos, *t.stops])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}), encoding="utf-8")
    return AutoTokenizer.from_pretrained(folder)


def cpu_ms(fn, count: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return round(best / count * 1000, 2)


def measure(tok, turns: int, count: int, repeats: int) -> dict:
    from rocktune.data import fastencode
    from rocktune.data.encode import encode

    layout = fastencode.chat_layout(tok)
    settings = fastencode.EncodeSettings("messages", 4096, False)
    rows = conversations(count, turns)
    locs = [f"row {i}" for i in range(len(rows))]
    fastencode.encode_many(rows[:2], tok, settings, locs[:2], layout)  # what is learned once per tokenizer
    return {"layout": "one rendering" if layout else "per prefix",
            "encode_ms": cpu_ms(lambda: [encode(r, "messages", tok, 4096, False, "x") for r in rows], count, repeats),
            "pipeline_ms": cpu_ms(lambda: fastencode.encode_many(rows, tok, settings, locs, layout), count, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # the fixtures' tokenizers live with the tests

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (key, file) in CASES.items():
            tok = tokenizer(key, file, Path(tmp) / key)
            for turns in (1, 4):
                out[f"{name}, {turns} turn{'s' if turns > 1 else ''}"] = measure(tok, turns, args.conversations,
                                                                                 args.repeats)
    print(json.dumps({"conversations": args.conversations, "cpu_ms_per_conversation": out}, indent=1))


if __name__ == "__main__":
    main()
