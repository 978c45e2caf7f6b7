"""How often llama.cpp's answer equals transformers' on held-out images, for a tiny Qwen2.5-VL that learned which
shape is drawn or its colour (rocktune.tasks.vlm.demo.vision_task, 56 x 56 images: 4 image tokens to its processor): the
exported f32 files run in llama.cpp's mtmd (llama-cpp-python, `make llama-cpp`) as `export --to gguf` prints
them (with the run's image-token limits) and with mtmd's own limits (8 to 4096 tokens: 9 tokens an image), greedy,
against `rocktune generate`'s answer from the run.

    .venv/bin/python benchmarks/vlm_llama_cpp_agreement.py [--task shape|colour] [--eval N] [--steps N]

Prints one line per setting: the image tokens mtmd made of the first image, and the share of answers equal to
transformers'. Minutes on 2 CPU cores (training first)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import re
import shlex
import tempfile
from pathlib import Path

F32 = 0  # ggml's type id: an f32 KV cache, so that the f32 export is computed in f32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval", type=int, default=200, help="held-out images (default 200)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--task", choices=("colour", "shape"), default="shape",
                        help="what the model learns to name: the shape's colour or the shape (default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run, flags, data = _trained_and_exported(Path(tmp), args.steps, (args.task, args.eval))
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        want = _transformers_answers(run, data.parent, rows)
        for name, limits in (("as printed " + " ".join(flags), _limits(flags)), ("mtmd's own limits", (-1, -1))):
            got, tokens = _llama_cpp_answers(run / "export", data.parent, rows, limits)
            same = sum(a == b for a, b in zip(got, want))
            print(f"{name}: {tokens} image tokens an image; llama.cpp = transformers on {same}/{len(rows)} "
                  f"({same / len(rows):.1%})")


def _trained_and_exported(tmp: Path, steps: int, task: tuple[str, int]) -> tuple[Path, list[str], Path]:
    from rocktune.cli import main as cli
    from rocktune.config import config_from_dict
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task, write_shape_task
    from rocktune.tasks import train

    base = build_tiny_vlm(tmp / "base")
    write = write_colour_task if task[0] == "colour" else write_shape_task
    train_file, eval_file = write(tmp / "data", n_train=256, n_eval=task[1], seed=0)
    training = {"max_steps": steps, "micro_batch_size": 8, "grad_accum": 1, "lr": 5e-3, "warmup_steps": 5,
                "eval_every": 0, "precision": "fp32", "device": "cpu", "seed": 0}
    cfg = {"task": "vlm", "model": {"name_or_path": str(base)}, "lora": {"r": 16, "alpha": 32},
           "data": {"train_file": str(train_file), "eval_file": str(eval_file), "max_length": 64},
           "training": training, "reliability": {"save_every": 0, "min_free_disk_mb": 0},
           "output": {"dir": str(tmp / "run")}}
    train(config_from_dict(cfg), quiet=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli(["export", str(tmp / "run"), "--to", "gguf", "--quant", "f32"]) == 0
    then = next(line for line in printed.getvalue().splitlines() if line.startswith("note: then: "))
    argv = shlex.split(then.removeprefix("note: then: ").split(" (or llama-server")[0])
    flags = [f"{a} {b}" for a, b in zip(argv, argv[1:]) if a.startswith("--image-")]
    return tmp / "run", flags, eval_file


def _limits(flags: list[str]) -> tuple[int, int]:
    values = dict(f.split() for f in flags)
    return int(values.get("--image-min-tokens", -1)), int(values.get("--image-max-tokens", -1))


def _transformers_answers(run: Path, folder: Path, rows: list[dict]) -> list[str]:
    from rocktune.export.source import resolve
    from rocktune.tasks.vlm.export.vision_generate import load, reply

    model, tok, vision = load(resolve(str(run)), "cpu")
    return [reply(model, tok, vision, _question(r), [str(folder / _image(r))], (8, 0.0)).strip() for r in rows]


def _llama_cpp_answers(export: Path, folder: Path, rows: list[dict], limits: tuple[int, int]):
    """Greedy answers of the exported files in mtmd with these image-token limits (-1: mtmd's), and the image tokens
    it made of the first image."""
    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd

    llm = llama_cpp.Llama(model_path=str(export / "model-f32.gguf"), n_ctx=512, n_batch=512, verbose=False,
                          flash_attn=False, type_k=F32, type_v=F32)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings = False, 2, False
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.image_min_tokens, params.image_max_tokens = limits
    ctx = mtmd.mtmd_init_from_file(str(export / "mmproj-f32.gguf").encode(), llm.model, params)
    answers, first = [], None
    try:
        for r in rows:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
            answer, made = _one(llm, ctx, _prompt(llm, r), folder / _image(r))
            answers.append(answer)
            first = made if first is None else first
    finally:
        mtmd.mtmd_free(ctx)
    return answers, first


def _one(llm, ctx, prompt: str, image: Path) -> tuple[str, int]:
    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd
    import numpy as np

    bitmap = mtmd.mtmd_helper_bitmap_init_from_file(ctx, str(image).encode(), False)
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        raw = prompt.encode()
        text = mtmd.mtmd_input_text()
        text.text, text.text_len, text.add_special, text.parse_special = raw, len(raw), False, True
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
        made = sum(mtmd.mtmd_input_chunk_get_n_tokens(mtmd.mtmd_input_chunks_get(chunks, i))
                   for i in range(mtmd.mtmd_input_chunks_size(chunks))
                   if mtmd.mtmd_input_chunk_get_type(mtmd.mtmd_input_chunks_get(chunks, i))
                   == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE)
        pos = llama_cpp.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(ctx, llm._ctx.ctx, chunks, 0, 0, 512, True, ctypes.byref(pos)) == 0
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
    out, at = [], pos.value
    for _ in range(8):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
        token = int(logits.argmax())
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
            break
        out.append(token)
        batch = llama_cpp.llama_batch_init(1, 0, 1)
        batch.n_tokens, batch.token[0], batch.pos[0], batch.n_seq_id[0] = 1, token, at, 1
        batch.seq_id[0][0], batch.logits[0] = 0, True
        try:
            assert llama_cpp.llama_decode(llm._ctx.ctx, batch) == 0
        finally:
            llama_cpp.llama_batch_free(batch)
        at += 1  # after an image, Qwen's positions (mtmd's n_past) are not the count of tokens
    return llm.detokenize(out).decode(errors="replace").strip(), made


def _prompt(llm, row: dict) -> str:
    """The chat turn as the GGUF's template renders it (the processor's), mtmd's marker where the image goes."""
    import llama_cpp.mtmd_cpp as mtmd
    from jinja2 import Template

    template = llm.metadata["tokenizer.chat_template"]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _question(row)}]}]
    text = Template(template).render(messages=messages, add_generation_prompt=True)
    return re.sub(r"<\|vision_start\|>(<\|image_pad\|>)*<\|vision_end\|>", mtmd.mtmd_default_marker().decode(), text)


def _question(row: dict) -> str:
    return next(p["text"] for p in row["messages"][0]["content"] if p["type"] == "text")


def _image(row: dict) -> str:
    return next(p["image_url"]["url"] for p in row["messages"][0]["content"] if p["type"] == "image_url")


if __name__ == "__main__":
    main()
