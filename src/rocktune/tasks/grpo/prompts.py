"""Prompts for reinforcement learning (task: grpo) as users have them -> a rendered prompt, its reference answer and
the row's other fields -> token ids.

Record shapes, detected per row from its keys (``data.columns`` renames source columns to these keys first):

- TRL's prompt-only format: ``prompt``, a string, or (conversational) a list of ``{role, content}`` messages; every
  other column travels to the reward functions, as TRL passes them (``answer``, ``solution``, ``ground_truth`` ...).
- GSM8K's ``question``/``answer``: the answer's text after the last ``####`` is the reference (``#### 1,234`` ->
  ``1234``); the worked solution before it is never shown to the model.
- A conversation, ``messages`` or ShareGPT's ``conversations``, read as SFT reads one (data/chat.py: OpenAI's
  content parts, the developer role, tool calls and results, a ``system`` column, data.roles; a row's ``tools`` go
  to the chat template): every turn before its final
  assistant turn is the prompt, and that turn is the reference (after its last ``####`` where it has one, as
  GSM8K's), so GSM8K as chat rows just works; a conversation that does not end with an assistant turn is a
  prompt-only row.
- A reference answer under ``answer``, ``solution``, ``ground_truth`` or ``completion`` (the first present, in that
  order) is what the built-in answer rewards compare with; a prompt-only row has none (format rewards still work).

A text prompt is tokenised with the tokenizer's specials, as SFT and DPO render plain prompts; a conversational one
through the chat template with its generation prompt. An error names the row.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

from rocktune.data.chat import ROLE_TAGS, conversation_key, to_chat
from rocktune.data.rows import message as _message
from rocktune.data.rows import read_rows
from rocktune.errors import UserError
from rocktune.readers.template import render_chat_template

ANSWER_KEYS = ("answer", "solution", "ground_truth", "completion")
SHAPES = ("prompt (TRL prompt-only: text or messages), with any answer/solution/ground_truth column",
          "question/answer (GSM8K, the reference after '####')",
          "messages or ShareGPT's conversations (the turns before the final assistant turn are the prompt, that "
          "turn the reference)")


@dataclass(frozen=True)
class PromptRow:
    """One row, read: the prompt (text or messages), its reference answer (None: prompt-only) and every other field
    of the row, which the reward functions receive by name."""

    prompt: str | list
    answer: str | None
    chat: bool
    fields: dict = field(default_factory=dict)
    tools: list | None = None  # the row's tool definitions (OpenAI's format), rendered by the chat template
    written: str | None = None  # the reference as the data wrote it (a worked solution): how long an answer runs


@dataclass(frozen=True)
class Prompt:
    """A tokenised prompt: the ids the rollout continues, the rendered text (data preview) and the row."""

    ids: tuple[int, ...]
    text: str
    row: PromptRow
    where: str  # the file:line or row an error about its rewards names
    truncated: bool = False


@dataclass(frozen=True)
class PromptSet:
    prompts: tuple[Prompt, ...]
    fingerprint: str  # of the token ids and answers: a resume refuses other data

    def __len__(self) -> int:
        return len(self.prompts)

    def lengths(self) -> list[int]:
        return [len(p.ids) for p in self.prompts]


def gsm8k_answer(text: str) -> str:
    """GSM8K's convention: the final answer follows the last ``####`` (thousands separators dropped)."""
    return text.rsplit("####", 1)[1].strip().replace(",", "") if "####" in text else text.strip()


def read_prompt(row: dict, where: str, roles: dict[str, str] | None = None) -> PromptRow:
    """The prompt a source row holds, in whichever shape it comes; a row of no known shape is named. ``roles``:
    data.roles, a conversation's role tags."""
    row = {k: v for k, v in row.items() if v is not None}  # a table gives every row every column
    written, canonical = None, False
    if "prompt" in row:
        prompt = row["prompt"]
    elif "question" in row:
        prompt = row["question"]
        if isinstance(row.get("answer"), str):
            written, row = row["answer"], {**row, "answer": gsm8k_answer(row["answer"])}
    elif "messages" in row or "conversations" in row:
        prompt, row, written = _conversation(row, where, roles or {})
        canonical = True
    else:
        raise UserError(f"{where}: a GRPO row needs 'prompt', 'messages' (or ShareGPT's 'conversations') or GSM8K's "
                        f"'question'; this row has {sorted(row)}. Shapes: {'; '.join(SHAPES)}. Map other column "
                        "names with data.columns (e.g. data.columns: {messages: dialog}).")
    chat = isinstance(prompt, list)
    if chat:
        if not prompt:
            raise UserError(f"{where}: 'prompt' is an empty list of messages; give at least one user message.")
        if not canonical:  # a conversation's turns are already in the template's layout (data/chat.py)
            prompt = [_message(m, f"{where}: prompt[{i}]") for i, m in enumerate(prompt)]
    elif not isinstance(prompt, str) or not prompt.strip():
        raise UserError(f"{where}: 'prompt' must be non-empty text or a list of {{'role', 'content'}} messages, got "
                        f"{prompt!r:.60}.")
    answer = next((row[k] for k in ANSWER_KEYS if k in row), None)
    if answer is not None and not isinstance(answer, (str, int, float)):
        raise UserError(f"{where}: the reference answer must be text or a number, got {type(answer).__name__}.")
    tools = row.get("tools")
    if tools is not None and not (chat and isinstance(tools, list)):
        raise UserError(f"{where}: 'tools' must be a list of tool definitions, for a conversational prompt.")
    fields = {k: v for k, v in row.items() if k not in ("prompt", "question")}
    if answer is not None:
        fields["answer"] = str(answer)  # the built-in rewards' reference, whichever column held it
    reference = None if answer is None else str(answer)
    return PromptRow(prompt, reference, chat, fields, tools, written or reference)


def _conversation(row: dict, where: str, roles: dict[str, str]) -> tuple[list, dict, str | None]:
    """(the prompt: the turns before the final assistant turn, the row with that turn as its reference answer, that
    turn's text), read as SFT reads a conversation (data/chat.py: ShareGPT or OpenAI messages, a system column, the
    tools). A conversation that does not end with an assistant turn is all prompt, with no reference."""
    key = conversation_key(row)
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: '{key}' must be a non-empty list of messages ({{'role', 'content'}}).")
    last = turns[-1]
    tag = last.get("role", last.get("from")) if isinstance(last, dict) else None
    answered = (roles.get(tag) or ROLE_TAGS.get(tag)) == "assistant" if isinstance(tag, str) else False
    # an empty final assistant turn stands in for the answer to come: to_chat wants one, and it is dropped
    read = to_chat(row if answered else {**row, key: [*turns, {"role": "assistant", "content": ""}]}, where, roles)
    *prompt, final = read["messages"]
    if not prompt:
        raise UserError(f"{where}: '{key}' holds only an assistant turn; the prompt is the turns before the final "
                        "assistant turn, so give at least one user message before it.")
    rest = {k: v for k, v in row.items() if k not in (key, "system", "functions", "tools")}
    if read.get("tools"):
        rest["tools"] = read["tools"]  # in the layout chat templates take
    if not answered:
        return prompt, rest, None  # no reference: a prompt-only row (format and length rewards still apply)
    reference = final["content"]
    if not any(k in rest for k in ANSWER_KEYS):  # an answer column of the row's own wins
        rest["answer"] = gsm8k_answer(reference) if "####" in reference else reference
    return prompt, rest, reference


def encode_prompt(row: PromptRow, tokenizer, max_length: int, where: str) -> Prompt:
    """Token ids of the prompt; one longer than ``max_length`` keeps its end (the question next to the answer)."""
    if isinstance(row.prompt, list):  # row.chat
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{where}: conversational prompts need the tokenizer's chat template, and this tokenizer "
                            "has none; use an instruct model's tokenizer or give the prompts as text.")
        extra = {"tools": row.tools} if row.tools else {}
        text = render_chat_template(tokenizer, row.prompt, tokenize=False, add_generation_prompt=True, **extra)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = row.prompt
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    truncated = len(ids) > max_length
    return Prompt(tuple(ids[len(ids) - max_length:] if truncated else ids), text, row, where, truncated)


def encode_rows(rows, tokenizer, max_length: int, roles: dict[str, str] | None = None) -> list[Prompt]:
    """``rows``: ``(where, row)`` pairs as data/rows.read_rows gives them; ``roles``: data.roles."""
    return [encode_prompt(read_prompt(row, str(where), roles), tokenizer, max_length, str(where))
            for where, row in rows]


def prompt_set(prompts: list[Prompt]) -> PromptSet:
    h = hashlib.blake2b(digest_size=8)
    for p in prompts:
        h.update(repr((p.ids, p.row.answer)).encode())
    return PromptSet(tuple(prompts), h.hexdigest())


def split_prompts(prompts: list[Prompt], fraction: float, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """Hold out ``fraction`` of the prompts for eval (at least one when asked for and there are two or more)."""
    if fraction <= 0 or len(prompts) < 2:
        return prompts, []
    order = list(range(len(prompts)))
    random.Random(f"eval-prompts:{seed}").shuffle(order)
    held = set(order[:min(len(prompts) - 1, max(1, round(len(prompts) * fraction)))])
    return [p for i, p in enumerate(prompts) if i not in held], [p for i, p in enumerate(prompts) if i in held]


def reference_lengths(prompts, tokenizer) -> list[int]:
    """Tokens of each reference as the data wrote it (the rows that have one): about what an answer like it needs."""
    texts = [p.row.written for p in prompts if p.row.written]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


def read_sets(cfg, tokenizer, cache_root) -> tuple[PromptSet, PromptSet]:
    """(train prompts, eval prompts) of the run config ``cfg``: every row read and checked before anything is
    trained."""
    d = cfg.data
    train = encode_rows(read_rows(d.train_file, d, cache_root, "data.train_file"), tokenizer, d.max_length, d.roles)
    if not train:
        raise UserError(f"data.train_file={d.train_file} holds no prompts.")
    if d.eval_file:
        held = encode_rows(read_rows(d.eval_file, d, cache_root, "data.eval_file", True), tokenizer, d.max_length,
                           d.roles)
    else:
        train, held = split_prompts(train, d.eval_fraction, cfg.training.seed)
    return prompt_set(train), prompt_set(held)
