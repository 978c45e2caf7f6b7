"""Sample generations at each eval pass: the same few prompts, completed greedily, so a person sees the model
change (or not) while the run goes, and the report shows them before and after.

Prompts are fixed for the run: the first ``count`` eval examples (each example's tokens before its first
loss-bearing token, the expected completion beside it) and the user's ``sample_prompts``. Greedy decoding draws no
random numbers and dropout is off in eval mode, so sampling leaves an exact resume exact.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rocktune.data import checks
from rocktune.data.encode import ALPACA_NO_INPUT, IGNORE
from rocktune.readers.json_file import parse_json
from rocktune.readers.template import render_chat_template

SHOWN_CHARS = 80


def prompts_from_examples(input_ids: list[list[int]], labels: list[list[int]], count: int
                          ) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, expected ids)``: the tokens before the first loss-bearing one, and the trained tokens."""
    out = []
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
    autocast: object = contextlib.nullcontext


class Sampler:
    def __init__(self, path: Path, tokenizer, prompts: list[tuple[list[int], list[int] | None]], stop_ids: list[int],
                 settings: SampleSettings, start_step: int = 0, write: bool = True, synced: bool = False):
        """``prompts``: (token ids, expected completion or None); ``settings``: length, device and autocast."""
        self.path, self.tokenizer, self.prompts, self.stop_ids = path, tokenizer, prompts, stop_ids
        self.max_new_tokens, self.device, self.autocast = settings.max_new_tokens, settings.device, settings.autocast
        # write=False: a rank other than 0 of a sharded (FSDP) run generates in step with rank 0 (every forward
        # gathers weights from all ranks) but keeps quiet
        self.write = write
        self.synced = synced  # FSDP: every rank keeps decoding until all are done (transformers' synced_gpus)
        if prompts and write:  # only the process that samples touches the file
            _keep_until(path, start_step)

    @classmethod
    def build(cls, run_dir: Path, tokenizer, shape: str, eval_set, settings: SampleSettings, start_step: int,
              write: bool = True, synced: bool = False) -> Sampler:
        prompts = prompts_from_examples(eval_set.input_ids, eval_set.labels, settings.count) if settings.count else []
        prompts += [(render_prompt(p, tokenizer, shape), None) for p in settings.prompts]
        stops = sorted({*checks.stop_token_ids(tokenizer, shape), tokenizer.eos_token_id} - {None})
        return cls(run_dir / "samples.jsonl", tokenizer, prompts, stops, settings, start_step, write, synced)

    @torch.no_grad()
    def at(self, step: int, model, log, say) -> None:
        """Complete every prompt; append to samples.jsonl, show each in ``say``, log the set as text to ``log``."""
        if not self.prompts:
            return
        was_training = model.training
        model.eval()
        rows = []
        for ids, expected in self.prompts:
            rows.append({"step": step, "prompt": self.tokenizer.decode(ids), "output": self._complete(model, ids),
                         "expected": None if expected is None else self._text(expected)})
        model.train(was_training)
        if not self.write:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        for r in rows:
            say(f"[dim]sample @ step {step}:[/] {_short(r['prompt'])} [cyan]→ {_short(r['output'])}[/]")
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


def _keep_until(path: Path, step: int) -> None:
    """A resumed run drops the samples logged after its checkpoint (they are generated again); a new run, all."""
    from rocktune.atomic import write_atomic

    kept = []
    if step and path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                if parse_json(line)["step"] <= step:
                    kept.append(line + "\n")
    write_atomic(path, "".join(kept))


def _short(text: str) -> str:
    from rich.markup import escape

    text = repr(text)[1:-1]
    return escape(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + "…")


def _markdown(rows: list[dict]) -> str:
    def cell(s):
        return "" if s is None else s.replace("|", "\\|").replace("\n", "⏎")

    return "| prompt | output | expected |\n|---|---|---|\n" + "".join(
        f"| {cell(r['prompt'])} | {cell(r['output'])} | {cell(r['expected'])} |\n" for r in rows)
