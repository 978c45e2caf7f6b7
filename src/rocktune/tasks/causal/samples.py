"""Sample generations at each eval pass: the same few prompts, completed greedily, so a person sees the model
change (or not) while the run goes, and the report shows them before and after.

Prompts are fixed for the run: the first ``count`` eval examples (each example's tokens before its first
loss-bearing token, the expected completion beside it) and the user's ``sample_prompts``. Greedy decoding draws no
random numbers and dropout is off in eval mode, so sampling leaves an exact resume exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, cast

import torch

from rocktune.data import checks
from rocktune.data.encode import ALPACA_NO_INPUT, IGNORE
from rocktune.readers.json_file import parse_json
from rocktune.readers.template import render_chat_template

SHOWN_CHARS = 80
_MARK = "ROCKTUNE-USER-TURN-7f3a"  # stands for the user's words when the chat template is rendered once to learn it


class UserTurn:
    """The user's last turn in a chat-template prompt: what a person asked, without the system prompt and the
    special tokens around it (``<|im_start|>system\nYou are a helpful AI assistant…`` hides the question).

    The template is rendered once around a marker: what follows the marker is the end of a user turn and the
    assistant's header; before it, from the last special token on, is the user's header. Prompts not of that form
    (no chat template, a hand-made prompt) are shown as they are."""

    def __init__(self, tokenizer, shape: str):
        self.header = self.footer = None
        if shape != "messages" or not getattr(tokenizer, "chat_template", None):
            return
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                                 add_generation_prompt=True)
        except Exception:  # noqa: BLE001 — a template that cannot render a lone user turn: prompts shown whole
            return
        if not isinstance(text, str) or text.count(_MARK) != 1:
            return
        before, self.footer = text.split(_MARK)
        # Llama 3's header tokens are special added tokens but not among all_special_tokens
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        names = {*getattr(tokenizer, "all_special_tokens", []), *(t.content for t in added if t.special)}
        specials = [t for t in names if t and t in before]
        start = max((before.rfind(t) for t in specials), default=-1)
        self.header = before[start:] if start >= 0 else None

    def __call__(self, prompt: str) -> str | None:
        footer = cast(str, self.footer)  # set whenever header is
        if not self.header or not prompt.endswith(footer):
            return None
        body = prompt[: len(prompt) - len(footer)]
        start = body.rfind(self.header)
        return body[start + len(self.header):] if start >= 0 else None


def prompts_from_examples(input_ids: list[list[int]], labels: list[list[int]], count: int
                          ) -> list[tuple[list[int], list[int] | None]]:
    """``(prompt ids, expected ids)``: the tokens before the first loss-bearing one, and the trained tokens."""
    out: list[tuple[list[int], list[int] | None]] = []
    for ids, lab in zip(input_ids, labels):
        first = next((i for i in range(1, len(lab)) if lab[i] != IGNORE), None)
        if first is not None:
            out.append((ids[:first], [t for t in lab[first:] if t != IGNORE]))
        if len(out) == count:
            break
    return out


def render_prompt(text: str, tokenizer, shape: str) -> list[int]:
    """A user's prompt, dressed the way the data's prompts are (so the model sees the form it is trained on)."""
    if shape == "messages" and getattr(tokenizer, "chat_template", None):
        text = render_chat_template(tokenizer, [{"role": "user", "content": text}], tokenize=False,
                                    add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if shape == "alpaca":
        text = ALPACA_NO_INPUT.format(instruction=text)
    return tokenizer(text)["input_ids"]


@dataclass
class SampleSettings:
    """What to generate: ``count`` eval prompts plus the given ``prompts``, greedy, on ``device``."""

    count: int
    prompts: list[str]
    max_new_tokens: int
    device: str
    autocast: Callable[[], Any] = contextlib.nullcontext
    shape: str = ""  # the data's record shape: "messages" prompts are shown by their user's turn


class Sampler:
    def __init__(self, path: Path, tokenizer, prompts: list[tuple[list[int], list[int] | None]], stop_ids: list[int],
                 settings: SampleSettings, redo_from: int = 0, write: bool = True, synced: bool = False):
        """``prompts``: (token ids, expected completion or None); ``settings``: length, device and autocast."""
        self.path, self.tokenizer, self.prompts, self.stop_ids = path, tokenizer, prompts, stop_ids
        self.user_turn = UserTurn(tokenizer, settings.shape)
        self.max_new_tokens, self.device, self.autocast = settings.max_new_tokens, settings.device, settings.autocast
        # write=False: a rank other than 0 of a sharded (FSDP) run generates in step with rank 0 (every forward
        # gathers weights from all ranks) but keeps quiet
        self.write = write
        self.synced = synced  # FSDP: every rank keeps decoding until all are done (transformers' synced_gpus)
        if prompts and write:  # only the process that samples touches the file
            _keep_before(path, redo_from)

    @classmethod
    def build(cls, run_dir: Path, tokenizer, shape: str, eval_set, settings: SampleSettings, redo_from: int,
              write: bool = True, synced: bool = False) -> Sampler:
        prompts = prompts_from_examples(eval_set.input_ids, eval_set.labels, settings.count) if settings.count else []
        prompts += [(render_prompt(p, tokenizer, shape), None) for p in settings.prompts]
        stops = sorted({*checks.stop_token_ids(tokenizer, shape), tokenizer.eos_token_id} - {None})
        settings = dataclasses.replace(settings, shape=shape)
        return cls(run_dir / "samples.jsonl", tokenizer, prompts, stops, settings, redo_from, write, synced)

    @torch.no_grad()
    def at(self, step: int, model, log, say) -> None:
        """Complete every prompt; append to samples.jsonl, show each in ``say``, log the set as text to ``log``."""
        if not self.prompts:
            return
        was_training = model.training
        model.eval()
        rows = []
        for ids, expected in self.prompts:
            prompt = self.tokenizer.decode(ids)
            row = {"step": step, "prompt": prompt, "output": self._complete(model, ids),
                   "expected": None if expected is None else self._text(expected)}
            question = self.user_turn(prompt)
            rows.append(row if question is None else {**row, "user": question})  # the report shows it too
        model.train(was_training)
        if not self.write:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        for r in rows:
            say(f"[dim]sample @ step {step}:[/] {_short(r.get('user', r['prompt']))} [cyan]→ {_short(r['output'])}[/]")
        log.text("samples", _markdown(rows), step)

    def _complete(self, model, ids: list[int]) -> str:
        x = torch.tensor([ids], device=self.device)
        with self.autocast():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=self.max_new_tokens, eos_token_id=self.stop_ids,
                                 pad_token_id=self.tokenizer.pad_token_id,
                                 **({"synced_gpus": True} if self.synced else {}))
        return self._text(out[0, len(ids):].tolist())

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.stop_ids])


def _keep_before(path: Path, step: int) -> None:
    """An attempt drops the samples logged from ``step`` on, where it logs again: a resume, those after its
    checkpoint (and, when it redoes only the final phase, the final samples at the last step); a new run, all."""
    from rocktune.atomic import write_atomic

    kept = []
    if step and path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                if parse_json(line)["step"] < step:
                    kept.append(line + "\n")
    write_atomic(path, "".join(kept))


def _short(text: str) -> str:
    from rich.markup import escape

    text = visible(text)
    return escape(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + "…")


def visible(text: str) -> str:
    """``text`` on one line with nothing a terminal would act on: a line break as ⏎, a tab as →, another control
    character as its Unicode control picture (0x14 as ␔: an untrained model's byte tokens decode to such bytes,
    which a terminal would otherwise receive raw or as a ``\\x14`` escape that reads like part of the output)."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch == "\n":
            out.append("⏎")
        elif ch == "\t":
            out.append("→")
        elif code < 0x20:
            out.append(chr(0x2400 + code))
        elif code == 0x7F:
            out.append("␡")
        elif not ch.isprintable() and ch != " ":
            out.append("�")
        else:
            out.append(ch)
    return "".join(out)


def _markdown(rows: list[dict]) -> str:
    def cell(s):
        return "" if s is None else visible(s).replace("|", "\\|")

    return "| prompt | output | expected |\n|---|---|---|\n" + "".join(
        f"| {cell(r['prompt'])} | {cell(r['output'])} | {cell(r['expected'])} |\n" for r in rows)
