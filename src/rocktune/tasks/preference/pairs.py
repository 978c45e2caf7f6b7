"""Preference pairs (task: dpo / orpo) as users have them -> a prompt and two answers -> token ids.

Record shapes, detected per row from its keys (``data.columns`` renames source columns to these keys first):

- TRL's preference format: ``prompt``/``chosen``/``rejected``, each a string, or (conversational) each a list of
  ``{role, content}`` messages; with no ``prompt`` (implicit prompt) the prompt is the part ``chosen`` and
  ``rejected`` share: their common leading messages, or for text their common leading characters up to a space.
- LLaMA-Factory's ranking format (``ranking: true``): Alpaca-style ``instruction``/``input``/``chosen``/``rejected``
  strings, or ShareGPT-style ``conversations`` (``from``/``value``) with ``chosen``/``rejected`` turns.

The prompt is rendered as SFT renders it (the chat template's generation prompt for messages, the Alpaca template
for instructions, the text with the tokenizer's specials for plain prompts) and masked; each answer carries loss and
ends with the end-of-sequence token (conversations: the template's end of turn). An error names the row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass

from rocktune.data import fidelity, rows, toolcalls
from rocktune.tasks.preference import signal as pair_signal
from rocktune.data.encode import ALPACA_NO_INPUT, ALPACA_WITH_INPUT, IGNORE
from rocktune.errors import UserError
from rocktune.readers.template import render_chat_template

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "observation": "user", "function_call": "assistant"}
SHAPES = ("prompt/chosen/rejected (TRL, text or messages)", "chosen/rejected (TRL, implicit prompt)",
          "instruction/input/chosen/rejected (LLaMA-Factory ranking, Alpaca)",
          "conversations/chosen/rejected (LLaMA-Factory ranking, ShareGPT)")


@dataclass(frozen=True)
class PairText:
    """One pair, rendered: ``chat`` -> messages (prompt) and assistant messages (answers), else strings."""

    prompt: str | list
    chosen: str | list
    rejected: str | list
    chat: bool
    tools: list | None = None  # function schemas given to the chat template as tools= (conversational pairs)


@dataclass(frozen=True)
class Pair:
    """A tokenised pair: ``(input_ids, labels)`` of prompt + chosen and of prompt + rejected (the prompt masked)."""

    chosen: tuple[list[int], list[int]]
    rejected: tuple[list[int], list[int]]
    truncated: bool = False

    @property
    def length(self) -> int:
        return len(self.chosen[0]) + len(self.rejected[0])


@dataclass(frozen=True)
class PairSet:
    pairs: tuple[Pair, ...]
    fingerprint: str  # of the token ids: a resume refuses other data

    def __len__(self) -> int:
        return len(self.pairs)

    def lengths(self) -> list[int]:
        return [p.length for p in self.pairs]

    def subset(self, idx: list[int]) -> PairSet:
        return PairSet(tuple(self.pairs[i] for i in idx), self.fingerprint)


def read_pair(row: dict, where: str) -> PairText:
    """The pair a source row holds, in whichever shape it comes; a row of no known shape is named. A ``tools``
    list (OpenAI's ``input.tools``, or a column) goes to the chat template with the conversation."""
    # A table (datasets) gives every row every column, None where a record lacks the key.
    row = {k: v for k, v in row.items() if v is not None}
    if "preferred_output" in row or "non_preferred_output" in row:
        row = _openai(row, where)
    pair = _read(row, where)
    tools = toolcalls.schemas(row.get("tools"), where)
    if tools and not pair.chat:
        raise UserError(f"{where}: the pair has a 'tools' list but its prompt and answers are text; tools are "
                        "rendered by a chat template, so give the pair as messages (or drop the tools).")
    return dataclasses.replace(pair, tools=tools) if tools else pair


def _read(row: dict, where: str) -> PairText:
    if "chosen" not in row or "rejected" not in row:
        raise UserError(f"{where}: a preference pair needs 'chosen' and 'rejected' (this row has {sorted(row)}); "
                        f"shapes: {'; '.join(SHAPES)}. Map other column names with data.columns.")
    chosen, rejected = row["chosen"], row["rejected"]
    if row.get("conversations") is not None:
        prompt = [_sharegpt(m, f"{where}: conversations[{i}]") for i, m in enumerate(row["conversations"])]
        return PairText(prompt, [_sharegpt(_one(chosen), f"{where}: chosen")],
                        [_sharegpt(_one(rejected), f"{where}: rejected")], True)
    if row.get("instruction") is not None:
        template = ALPACA_WITH_INPUT if row.get("input") else ALPACA_NO_INPUT
        alpaca = template.format(instruction=_text(row["instruction"], where, "instruction"),
                                 input=row.get("input") or "")
        return PairText(alpaca, _text(chosen, where, "chosen"), _text(rejected, where, "rejected"), False)
    chat = isinstance(chosen, list)
    if isinstance(rejected, list) != chat:
        raise UserError(f"{where}: 'chosen' and 'rejected' must both be text or both be lists of messages.")
    if row.get("prompt") is None:
        return _implicit(chosen, rejected, chat, where)
    prompt = row["prompt"]
    if chat:
        return PairText(_messages(prompt, where, "prompt"), _messages(chosen, where, "chosen"),
                        _messages(rejected, where, "rejected"), True)
    return PairText(_text(prompt, where, "prompt"), _text(chosen, where, "chosen"),
                    _text(rejected, where, "rejected"), False)


def _openai(row: dict, where: str) -> dict:
    """OpenAI's preference format: ``input`` ({messages, tools?, parallel_tool_calls?}), ``preferred_output`` and
    ``non_preferred_output`` (lists of assistant messages), as TRL's conversational prompt/chosen/rejected."""
    missing = [k for k in ("input", "preferred_output", "non_preferred_output") if k not in row]
    inp = row.get("input")
    if missing or not isinstance(inp, dict) or "messages" not in inp:
        raise UserError(f"{where}: OpenAI's preference format needs 'input' ({{'messages': [...]}}), "
                        f"'preferred_output' and 'non_preferred_output'; this row has {sorted(row)}"
                        + (f" (missing {missing})" if missing else f" and its 'input' has "
                           f"{sorted(inp) if isinstance(inp, dict) else type(inp).__name__}") + ".")
    return {"prompt": inp["messages"], "tools": inp.get("tools") or row.get("tools"),
            "chosen": row["preferred_output"], "rejected": row["non_preferred_output"]}


def _implicit(chosen, rejected, chat: bool, where: str) -> PairText:
    """TRL's implicit prompt: what both answers start with."""
    if chat:
        chosen, rejected = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        return PairText(chosen[:n], chosen[n:], rejected[n:], True)
    chosen, rejected = _text(chosen, where, "chosen"), _text(rejected, where, "rejected")
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if 0 < n < len(chosen) and chosen[n - 1] == " ":  # the space starts the answer, as TRL's extract_prompt keeps it
        n -= 1
    return PairText(chosen[:n], chosen[n:], rejected[n:], False)


def _one(turn):
    return turn[-1] if isinstance(turn, list) and turn else turn


def _sharegpt(msg, where: str) -> dict:
    if isinstance(msg, dict) and "role" in msg and "content" in msg:
        return rows.message(msg, where)
    if not (isinstance(msg, dict) and isinstance(msg.get("value"), str) and msg.get("from") in SHAREGPT_ROLES):
        raise UserError(f"{where} must be a {{'from', 'value'}} turn with 'from' one of "
                        f"{', '.join(SHAREGPT_ROLES)}, got {msg!r:.80}.")
    return {"role": SHAREGPT_ROLES[msg["from"]], "content": msg["value"]}


def _messages(value, where: str, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: '{key}' must be a non-empty list of {{'role', 'content'}} messages here (the "
                        "other fields of this pair are messages).")
    return [rows.message(m, f"{where}: {key}[{i}]") for i, m in enumerate(value)]


def _text(value, where: str, key: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{where}: '{key}' must be a string, got {type(value).__name__}.")
    return value


def encode_pair(pair: PairText, tokenizer, max_length: int, truncation: str, where: str) -> Pair:
    """Token ids of both sequences. Both share the prompt's tokens, and are cut the same way: the prompt first
    (keeping its end, ``truncation=prompt``) so that both answers keep as much of themselves as the longer allows,
    then each answer at its end; with ``truncation=end`` every sequence keeps its first ``max_length`` tokens."""
    for key in ("chosen", "rejected"):
        answer = getattr(pair, key)
        if not (answer.strip() if isinstance(answer, str) else any(m["content"].strip() or m.get("tool_calls")
                                                                     for m in answer)):
            raise UserError(f"{where}: the '{key}' answer is empty, so the pair compares nothing; fill it in or "
                            "remove the row.")
    prompt, chosen, rejected = _render(pair, tokenizer, where)
    longest = max(len(chosen), len(rejected))
    truncated = len(prompt) + longest > max_length
    if truncated and truncation == "prompt":
        keep = max(max_length - longest, min(len(prompt), max_length // 4))
        prompt = prompt[len(prompt) - keep:]
    elif truncated:
        prompt = prompt[:max_length - 1]  # at least one answer token each, or the pair would compare nothing
    room = max_length - len(prompt)
    chosen, rejected = chosen[:room], rejected[:room]
    mask = [IGNORE] * len(prompt)
    return Pair((prompt + chosen, mask + chosen), (prompt + rejected, mask + rejected), truncated)


def _render(pair: PairText, tokenizer, where: str) -> tuple[list[int], list[int], list[int]]:
    if not pair.chat:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        prompt = tokenizer(pair.prompt, add_special_tokens=True)["input_ids"] if pair.prompt else []

        def text_answer(text):
            return tokenizer(text, add_special_tokens=not prompt)["input_ids"] + eos
        return prompt, text_answer(pair.chosen), text_answer(pair.rejected)
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{where}: conversational pairs need the tokenizer's chat template, and this tokenizer has "
                        "none; use an instruct model's tokenizer or give the pairs as text.")
    assert isinstance(pair.prompt, list)  # a chat pair's prompt is its messages
    extra = {"tools": pair.tools} if pair.tools else {}
    start = render_chat_template(tokenizer, pair.prompt, tokenize=False, add_generation_prompt=True, **extra) \
        if pair.prompt else ""
    if pair.tools and start == render_chat_template(tokenizer, pair.prompt, tokenize=False,
                                                    add_generation_prompt=True):
        names = ", ".join(t["function"]["name"] for t in pair.tools)
        raise UserError(f"{where}: the model's chat template does not render the pair's tool list ({names}): the "
                        "prompt renders the same with and without it. The one-line fix: data.chat_template: "
                        "builtin-tools (rocktune's own tool-calling template in the model's turn format; it adds no "
                        "system prompt); or data.chat_template naming a .jinja file that renders tools, or a model "
                        "whose own template does; or remove the tools from the pairs if the answers do not depend on "
                        "them.")

    def answer(msgs):
        full = render_chat_template(tokenizer, pair.prompt + msgs, tokenize=False, add_generation_prompt=False,
                                    **extra)
        if not full.startswith(start):
            raise UserError(f"{where}: the chat template does not render the prompt as the start of the whole "
                            "conversation, so the answer cannot be located; use another template or text pairs.")
        fidelity.check_answer(msgs, full[len(start):], where)
        return tokenizer(full[len(start):], add_special_tokens=False)["input_ids"]
    prompt = tokenizer(start, add_special_tokens=False)["input_ids"] if start else []
    return prompt, answer(pair.chosen), answer(pair.rejected)


def encode_rows(rows, tokenizer, max_length: int, truncation: str) -> tuple[list[Pair], int]:
    """``rows``: ``(where, row)``; returns the pairs and how many were truncated."""
    pairs = [pair for pair, _ in encode_kinds(rows, tokenizer, max_length, truncation)]
    return pairs, sum(p.truncated for p in pairs)


def encode_kinds(rows, tokenizer, max_length: int, truncation: str) -> list[tuple[Pair, str | None]]:
    """Each row's pair and why it carries no preference signal (``pair_signal.kind``; None when it does)."""
    out = []
    for where, row in rows:
        text = read_pair(row, where)
        pair = encode_pair(text, tokenizer, max_length, truncation, where)
        out.append((pair, pair_signal.kind(text, pair)))
    return out


def encode_screened(rows, tokenizer, d, policy: str, name: str) -> tuple[list[Pair], int, list[str]]:
    """The pairs of ``rows`` that carry signal (``pair_signal.screen`` per ``policy``: preference.no_signal), how
    many of those were truncated, and the warning naming the others; ``d``: the data section."""
    encoded = encode_kinds(rows, tokenizer, d.max_length, d.truncation)
    keep, notes = pair_signal.screen([(where, k) for (where, _), (_, k) in zip(rows, encoded)], policy, name)
    pairs = [encoded[i][0] for i in keep]
    return pairs, sum(p.truncated for p in pairs), notes


def pair_set(pairs: list[Pair]) -> PairSet:
    h = hashlib.blake2b(digest_size=8)
    for p in pairs:
        for ids, labels in (p.chosen, p.rejected):
            h.update(repr((ids, labels)).encode())
    return PairSet(tuple(pairs), h.hexdigest())


def split_pairs(pairs: list[Pair], fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """Hold out ``fraction`` of the pairs for eval (at least one when asked for and there are two or more)."""
    if fraction <= 0 or len(pairs) < 2:
        return pairs, []
    order = list(range(len(pairs)))
    random.Random(f"eval-pairs:{seed}").shuffle(order)
    n_eval = min(len(pairs) - 1, max(1, round(len(pairs) * fraction)))
    held = set(order[:n_eval])
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]
