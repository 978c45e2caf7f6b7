"""What the template check (``data/fidelity.py``: every part of a record must be in its rendering) costs per record,
beside the rendering and locating of the turns it checks. Prints one JSON object.

    PYTHONPATH=src python benchmarks/template_check_cost.py [--records 3000] [--repeats 3]

Synthetic conversations (``data/synthetic.py``: 1-4 turns, a system prompt in 70%), the BPE tokenizer of
``data_speed.py`` carrying the demo's ChatML template; the one-rendering layout (``fastencode.chat_segments``), which
is what plain chats take. Times are per record, the best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from rocktune.data import fastencode, fidelity, records, synthetic
    from rocktune.demo.tiny import build_bpe_tokenizer

    tok = build_bpe_tokenizer(vocab_size=2000, per_set=300, seed=9)
    rows = records.prepare([(f"r{i}", r) for i, r in enumerate(synthetic.chats(args.records, seed=1))], "messages")
    layout = fastencode.chat_layout(tok)

    def render():
        return [fastencode.chat_segments(r["messages"], tok, layout) for r in rows]

    def check(segs):
        for rec, seg in zip(rows, segs):
            fidelity.check(rec, seg, "x", located=True)

    segs = render()
    render_s = min(_timed(render) for _ in range(args.repeats))
    check_s = min(_timed(lambda: check(segs)) for _ in range(args.repeats))
    print(json.dumps({"records": len(rows), "render_and_locate_us_per_record": round(render_s / len(rows) * 1e6, 1),
                      "check_us_per_record": round(check_s / len(rows) * 1e6, 1),
                      "check_share_of_rendering": round(check_s / render_s, 3)}))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
