"""One training forward/backward of rocktune's LM path under torch.profiler: which attention ran, the ops, the time.

    python benchmarks/profile_step.py --device cuda --model qwen2.5-0.5b-shape --out /tmp/prof     # on a GPU
    python benchmarks/profile_step.py --device cpu --model tiny --out /tmp/prof                    # CPU / dry run

Packed rows of random documents (50 to ``--max-length`` tokens) as the collate builds them, the attention that
``attn_implementation: auto`` picks for this device (its self-test included; the note says why), LoRA r 16 on all
linear layers, rocktune's chunked loss, under the precision policy's autocast. One warm-up forward/backward (three
with ``--compile``), three timed, then one profiled. On a GPU the device speaks for itself (``bench/device_time.py``):
CUDA events give each step's device span, the profiled step's kernels their count, summed time, busy share (kernel
time / device span) and time per kernel class. The host's time to enqueue a step is reported beside it, but is not
a starvation signal: with the launch queue full the host blocks inside launches. Writes ``profile.json`` (the
choice, op counts, times, peak memory, what the compiler did, the device's account) and ``profile.txt`` (the top
ops) under ``--out``, and prints the JSON. ``--lora peft`` runs PEFT's own LoRA forward
and ``--lora lean`` rocktune's lean one instead of the fused one (rocktune's default, docs/speed.md section 6),
and ``--precision bf16`` a bf16 base under bf16 autocast on a CPU too: the op counts of docs/speed.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path


def packed_batch(rows: int, max_length: int, vocab: int, segments: bool, seed: int = 0) -> dict:
    from rocktune.data.batching import with_loss_index
    from rocktune.data.packing import collate_packed, pack_rows

    rng = random.Random(seed)
    docs = []
    while sum(len(d) for d in docs) < rows * max_length * 0.9:
        n = rng.randint(50, max_length)
        ids = [rng.randrange(vocab) for _ in range(n)]
        docs.append((ids, ids))
    packed = pack_rows([len(x) for x, _ in docs], max_length, list(range(len(docs))))[:rows]
    return with_loss_index(collate_packed([[docs[i] for i in row] for row in packed], 0, max_length, segments))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen2.5-0.5b-shape")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--out", default="/tmp/rt-profile")
    ap.add_argument("--precision", default="auto", help="auto (the platform policy) | fp32 | bf16 | fp16")
    ap.add_argument("--lora", default="fused", choices=("fused", "lean", "peft"),
                    help="rocktune's fused LoRA path (default, as training runs), its lean forward or PEFT's own")
    ap.add_argument("--compile", action="store_true",
                    help="the decoder and the loss compiled, as a GPU run compiles them; warmed up first, and what "
                         "Dynamo did (graph breaks, recompiles) is reported")
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from rocktune.kernels.attention import VARLEN, choose, repeats_kv
    from rocktune.bench import workload
    from rocktune.bench.compiler import CompilerRecord
    from rocktune.bench.device_time import kernels_of, summary
    from rocktune.lora.lean import lean_lora
    from rocktune.models.load import DTYPES, apply_lora, load_model
    from rocktune.platform.advise import device_precision
    from rocktune.tasks.causal.build import compile_decoder
    from rocktune.tasks.causal.loss import LossModule
    from rocktune.train.build import autocast

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    precision = device_precision(args.device) if args.precision == "auto" else args.precision
    attn, note = choose("auto", "sdpa", args.device, (True, False), DTYPES[precision])
    model_dir = workload.model_dir(args.model, Path("/tmp/rt-suite") / args.model / "cache")
    model = apply_lora(load_model(model_dir, precision, attn, False, args.device), 16, 32, 0.0, "all-linear", False)
    lora_note = (lean_lora(model, fused=args.lora == "fused") if args.lora != "peft"
                 else "LoRA side path: PEFT's own forward")
    vocab = model.get_base_model().config.vocab_size
    batch = packed_batch(args.rows, args.max_length, vocab, attn == VARLEN)
    batch = {k: v.to(args.device) for k, v in batch.items()}
    record = CompilerRecord().start()
    if args.compile:
        compile_decoder(model)
    loss_module = LossModule(model, 2048 if args.device == "cuda" else 256, True, compiled=args.compile)
    cast = autocast(args.device, precision)

    def step():
        with cast():
            loss = loss_module(batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(3 if args.compile else 1):  # warm-up: compiled, kernels chosen, the allocator filled
        step()
        sync()
    enqueue_s, step_s = host_and_step_seconds(step, sync)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        span = device_span(step, torch.cuda) if cuda else None
        sync()
    seconds = time.perf_counter() - t0
    device = summary(kernels_of(prof.events()), span) if cuda else None
    events = prof.key_averages()
    aten = [e for e in events if e.key.startswith("aten::")]
    sort = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    (out / "profile.txt").write_text(events.table(sort_by=sort, row_limit=30))
    result = {"device": args.device, "model": args.model, "precision": precision, "attention": attn,
              "attention_note": note, "lora": lora_note, "rows": args.rows, "max_length": args.max_length,
              "tokens": int(batch["input_ids"].numel()), "compiled": args.compile,
              "step_s": round(step_s, 4), "host_enqueue_s": round(enqueue_s, 4), "device_time": device,
              "torch": torch.__version__, "varlen_kv_copies": attn == VARLEN and repeats_kv(),
              "compiler": record.report(),
              "profiled_step_s": round(seconds, 4),
              "aten_op_calls": sum(e.count for e in aten),
              "top_ops": {e.key: e.count for e in sorted(aten, key=lambda e: -e.count)[:15]},
              "peak_allocated_bytes": torch.cuda.max_memory_allocated() if args.device == "cuda" else None,
              "measured_on": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    (out / "profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


def device_span(step, cuda) -> float:
    """Seconds between CUDA events recorded before and after ``step`` on the device: its span there, gaps
    included (``cuda``: torch.cuda, or a test's fake)."""
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    cuda.synchronize()
    start.record()
    step()
    end.record()
    cuda.synchronize()
    return start.elapsed_time(end) / 1000


def host_and_step_seconds(step, sync, repeats: int = 3) -> tuple[float, float]:
    """Medians of (the time until ``step`` returns, the time until the device has finished it). On a GPU the host
    enqueues work; when the launch queue is full it blocks inside launch calls, so the first figure says how long
    the host was busy, not whether the device waited (the device's busy share does: ``device_span``)."""
    import statistics

    enqueue, total = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        sync()
        enqueue.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    return statistics.median(enqueue), statistics.median(total)


if __name__ == "__main__":
    sys.exit(main())
