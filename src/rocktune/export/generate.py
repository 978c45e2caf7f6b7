"""``rocktune generate``: see what the training did, in one command.

Base + adapter (kept unmerged, so ``--compare`` can switch the adapter off for the same prompt) or a merged /
plain model directory; prompts are formatted the way the run trained (``style``), decoding is greedy unless a
temperature is given, on the GPU when there is one.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from rocktune.errors import UserError, first_line
from rocktune.export import prompts_file
from rocktune.export import style as styles
from rocktune.export.source import Origin, Source, load_tokenizer, resolve
from rocktune.models.load import stop_ids
from rocktune.platform.environment import resolve_device
from rocktune.tasks.vlm.vision.families import text_task_refusal, vision_checkpoint


def load(src: Source, device: str):
    """(model, tokenizer) ready for generation; the adapter stays a PeftModel."""
    from transformers import AutoModelForCausalLM

    from rocktune.models.load import quiet_transformers

    quiet_transformers()
    from rocktune.models.load import DTYPES
    from rocktune.platform.advise import device_precision

    dtype = DTYPES[device_precision(device)]  # the platform's policy: fp32 on gfx906, where bf16 is emulated
    tok = load_tokenizer(src)
    try:
        model = AutoModelForCausalLM.from_pretrained(src.base, dtype=dtype, trust_remote_code=src.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(f"could not load {src.base}: {first_line(exc)} (offline? pass a local "
                        "model directory with --base)") from None
    if src.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(src.adapter))
    return model.to(device).eval(), tok


@dataclass(frozen=True)
class Budget:
    """How many tokens a reply may have: ``--max-new-tokens``, and what the model's context leaves after the prompt
    (None: the config does not say). Past its context a model's positions are untrained and the work grows with
    every token, so a reply never runs beyond it."""
    max_new_tokens: int
    context: int | None = None

    def for_prompt(self, prompt_tokens: int) -> int:
        if self.context is None:
            return self.max_new_tokens
        return max(1, min(self.max_new_tokens, self.context - prompt_tokens))


def context_length(src: Source) -> int | None:
    """The model's context in tokens from its config (no weights loaded), or None when it does not say."""
    from rocktune.export.source import load_config

    cfg = load_config(src.base, src.trust_remote_code)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    value = getattr(cfg, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def complete(model, tokenizer, text: str, style: str, budget: Budget | int, temperature: float) -> str:
    """One reply to the already formatted ``text``; special tokens as in training (chat templates render theirs)."""
    import torch

    enc = tokenizer(text, add_special_tokens=style != "chat", return_tensors="pt")
    ids = enc["input_ids"].to(model.device)
    budget = budget if isinstance(budget, Budget) else Budget(budget)
    max_new_tokens = budget.for_prompt(ids.shape[1])
    stops = stop_ids(tokenizer, model)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops or [0])[0]
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             eos_token_id=stops or None, pad_token_id=pad, **sampling)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def run_generate(origin: Origin, prompt: str | None, chat: bool, file: str | None, max_new_tokens: int,
                 template: str, temperature: float, device: str, compare: bool) -> int:
    if sum(x is not None for x in (prompt, chat or None, file)) > 1:
        raise UserError("give one of --prompt TEXT, --chat or --file PROMPTS.jsonl (none: --chat).")
    if compare and prompt is None and file is None:
        raise UserError("--compare answers each prompt twice, with the adapter off and on: give it --prompt TEXT or "
                        "--file PROMPTS.jsonl (the chat keeps one conversation, with the adapter on).")
    if file is not None:
        prompts_file.check_shape(Path(file))  # before minutes of model loading
    src = resolve(origin.path, origin.base, origin.trust_remote_code)
    found = vision_checkpoint(src.base)
    if found is not None:  # a text run's adapter with a vision-language --base: as train refuses it
        raise text_task_refusal(src.run_config.get("task", "lm"), f"what {origin.path} trained",
                                f"its base {src.base}", found[0])
    if compare and src.adapter is None:
        raise UserError("--compare switches the adapter off for a second answer; this is a model directory "
                        "without an adapter.")
    context = context_length(src)
    if context is not None and max_new_tokens > context:
        sys.stderr.write(f"note: --max-new-tokens {max_new_tokens} is more than the model's context holds "
                         f"({context} tokens, prompt included); each reply stops where the context is full.\n")
    tok = load_tokenizer(src)
    style = styles.resolve_style(template, src.run_config, tok)
    rows = prompts_file.read_prompts(Path(file), style, tok) if file is not None else None  # rendered and checked
    model, tok = load(src, resolve_device(device))

    def reply(formatted: str) -> str:
        return complete(model, tok, formatted, style, Budget(max_new_tokens, context), temperature)

    def answer(text=None, messages=None) -> str:
        return reply(styles.render(style, tok, prompt=text, messages=messages))

    if prompt is not None:
        if compare:
            with model.disable_adapter():
                sys.stdout.write(f"base:  {answer(prompt)}\n")
            sys.stdout.write(f"tuned: {answer(prompt)}\n")
        else:
            sys.stdout.write(answer(prompt) + "\n")
    elif rows is not None:
        for row in rows:
            base = {}
            if compare:  # side by side on one line: the base's answer, then the adapter's
                with model.disable_adapter():
                    base = {"base_output": reply(row.text)}
            sys.stdout.write(json.dumps({**row.row, **base, "output": reply(row.text)}) + "\n")
            sys.stdout.flush()
    else:
        _chat_loop(answer, style)
    return 0


def _chat_loop(answer, style: str) -> None:
    """A short interactive loop; chat-style runs keep the conversation, raw ones answer each line alone."""
    history: list[dict] = []
    sys.stderr.write("type a message; an empty line or Ctrl-D ends\n")
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if style == "chat":
            history.append({"role": "user", "content": line})
            reply = answer(messages=history)
            history.append({"role": "assistant", "content": reply})
        else:
            reply = answer(line)
        sys.stdout.write(reply + "\n")
        sys.stdout.flush()
