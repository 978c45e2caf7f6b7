"""Checks on tokenised training data that stop a run before it wastes hours.

Each catches a masking mistake users of fine-tuning tools keep finding only after training: nothing carries loss;
everything does although only completions should; the end-of-sequence / end-of-turn token never carries loss (the
model never learns to stop: a rule for answers — chat turns, completions, instruction outputs — not for text, whose
documents are cut into windows and whose end token closes each document wherever its last window falls); the
conversation as rocktune tokenises it differs from the tokenizer's own chat template.
``train`` raises on an error; ``rocktune data preview`` shows every problem.
"""

from __future__ import annotations

from dataclasses import dataclass

from rocktune.data import encode, turnend
from rocktune.errors import UserError
from rocktune.readers.template import render_chat_template

TEMPLATE_PROBES = 16  # conversations compared with the tokenizer's own rendering: a template bug shows in any of them
UNBOUNDED = 1 << 40  # a max_length no conversation reaches: the template comparison sees it untruncated


@dataclass
class Problem:
    level: str  # "error" stops training; "warning" is shown
    code: str
    message: str


def check_training_data(examples, tokenizer, shape: str, train_on_prompt: bool,
                        probes: list[tuple[str, dict]] | None = None) -> list[Problem]:
    """Problems of ``examples`` (token ids + labels, as training sees them); ``probes`` (the first records of the
    source, ``DataStats.probes``) enable the template comparison for chat data."""
    problems = _masking(examples.labels, examples.input_ids, shape, train_on_prompt)
    if any(p.code == "no-loss-tokens" for p in problems):
        return problems
    if shape != "text":  # a corpus is continued, not answered: its end token ends a document, not a reply
        problems += _stop_token(examples.labels, tokenizer, shape)
    if shape == "messages" and probes:
        problems += _template(probes[:TEMPLATE_PROBES], tokenizer)
        problems += _default_system(probes, tokenizer)
    return problems


def enforce(problems: list[Problem], where: str) -> list[str]:
    """Raise ``UserError`` on any error; return the warnings' messages (to log)."""
    errors = [p.message for p in problems if p.level == "error"]
    if errors:
        raise UserError(f"{where}: " + " Also: ".join(errors) + " (rocktune data preview -c CONFIG shows the "
                        "trained tokens of each example.)")
    return [f"warning: {p.message}" for p in problems]


def loss_positions(labels: list[int]) -> int:
    """Tokens that carry loss: a label at position 0 never does (nothing precedes it), as in the batching.
    Counted with list methods (C loops): train runs this over every example before it starts."""
    return len(labels) - labels.count(encode.IGNORE) - (bool(labels) and labels[0] != encode.IGNORE)


def _masking(labels, input_ids, shape: str, train_on_prompt: bool) -> list[Problem]:
    trained = labels.loss_counts().tolist() if hasattr(labels, "loss_counts") else [loss_positions(x) for x in labels]
    if not any(trained):
        return [Problem("error", "no-loss-tokens", "no example has a loss-bearing token, so there is nothing to "
                        "learn; check that completions / assistant turns are not empty and fit data.max_length.")]
    out = []
    empty = trained.count(0)
    if empty:
        out.append(Problem("warning", "empty-examples", f"{empty} of {len(labels)} examples carry no loss."))
    completion_only = shape != "text" and not train_on_prompt
    if completion_only and all(lab == ids for lab, ids in zip(labels, input_ids)):
        out.append(Problem("error", "all-trained", "every token of every example carries loss although "
                           f"data.train_on_prompt is false for {shape} data: the prompts are not masked (empty "
                           "prompts, or a chat template that puts whole conversations in the assistant turn); fix "
                           "the data, or set data.format=text if whole texts are meant to be trained."))
    return out


def stop_token_ids(tokenizer, shape: str) -> dict[int, str]:
    """The tokens that end a reply, by id: for chat data the chat template's end-of-turn marker, or, for a template
    that writes none (GLM-4.5), the stop tokens it opens the next turn with; else EOS."""
    if shape == "messages":
        ends = turnend.reply_end(tokenizer).ids(tokenizer)
        if ends:
            return ends
    eos = tokenizer.eos_token_id
    return {} if eos is None else {eos: tokenizer.eos_token}


def end_of_turn_id(tokenizer) -> int | None:
    """The token that ends an assistant reply: the first special token the chat template writes after it (e.g.
    <|im_end|>, <|eot_id|>), or where it writes none, the stop token a following user turn opens with (GLM-4.5's
    <|user|>, trained as the reply's end); None when there is neither."""
    ends = turnend.reply_end(tokenizer)
    if ends.written is not None:
        return ends.written
    return tokenizer.convert_tokens_to_ids(ends.opens["user"]) if "user" in ends.opens else None


def _stop_token(labels: list[list[int]], tokenizer, shape: str) -> list[Problem]:
    stops = stop_token_ids(tokenizer, shape)
    if not stops:
        return [Problem("error", "no-eos", "the tokenizer has no end-of-sequence token, so no example can teach the "
                        "model to stop; use a tokenizer with an eos_token.")]
    names = " / ".join(stops.values())
    learned = labels.rows_with(list(stops)) if hasattr(labels, "rows_with") else \
        sum(any(s in lab[1:] for s in stops) for lab in labels)
    if learned == 0:
        return [Problem("error", "stop-never-trained", f"the end token {names} never carries loss in any example, so "
                        "the model would not learn to stop generating (masked as padding, or left out by the "
                        "chat template); the end token of each completion must be trained (a rule for chat and "
                        "instruction answers, where a model must learn to stop; text data is exempt)."
                        + (_no_turn_end(tokenizer) if shape == "messages" else ""))]
    if learned < len(labels) / 2:
        return [Problem("warning", "stop-rarely-trained", f"the end token {names} carries loss in only {learned} of "
                        f"{len(labels)} examples (truncated by data.max_length?).")]
    return []


def _no_turn_end(tokenizer) -> str:
    """Why a chat template gives a reply no end token: it writes none after a reply, and what it writes next is not
    a token the model stops on (with the ways out)."""
    ends = turnend.reply_end(tokenizer)
    if ends.written is not None or ends.opens:
        return ""
    opening = f", and the token it opens the next turn with ({ends.opening}) is not one the model stops on" \
        if ends.opening else ""
    stops = " / ".join(tokenizer.convert_ids_to_tokens(sorted(turnend.model_stop_ids(tokenizer)))) or "none"
    return (f" The chat template writes no end-of-turn token after a reply{opening} (the model stops on: {stops}, "
            "its EOS and generation_config.json's eos_token_id). Use a chat template that ends each reply with a "
            "token the model stops on (data.chat_template), add the token that opens the next turn to "
            "generation_config.json's eos_token_id if the model was trained to stop there, or train "
            "prompt/completion data (EOS appended).")


def _template(recs: list[tuple[str, dict]], tokenizer) -> list[Problem]:
    """Compare rocktune's per-turn tokenisation with the tokenizer's own rendering of the same conversation.

    Both sides are compared whole: truncation (data.truncation=prompt cuts the oldest turns) is not a template
    difference, and comparing a truncated example with the start of the own rendering flagged every long chat."""
    for loc, rec in recs:
        ours = encode.encode(rec, "messages", tokenizer, UNBOUNDED, True, loc).input_ids
        extra = {"tools": rec["tools"]} if rec.get("tools") else {}
        own = render_chat_template(tokenizer, rec["messages"], tokenize=True, add_generation_prompt=False, **extra)
        own = list(own["input_ids"] if hasattr(own, "keys") else own)
        # a template that writes no end of turn (GLM-4.5): the reply's end token is appended after the last reply
        appended = turnend.reply_end(tokenizer).appended(rec["messages"])
        own += tokenizer(appended, add_special_tokens=False)["input_ids"] if appended else []
        if ours == own:
            continue
        if tokenizer.decode(ours) != tokenizer.decode(own):
            return [Problem("error", "template-differs", f"{loc}: the conversation as trained differs from the "
                            "tokenizer's own chat template rendering (the template renders earlier turns "
                            "differently once later ones follow): give each assistant turn a record of its own (the "
                            "conversation up to it), convert the data to prompt/completion, or name a template that "
                            "renders turns alike with data.chat_template.")]
        return [Problem("warning", "template-tokens-differ", f"{loc}: the same text is split into different tokens "
                        "than the tokenizer's own chat template would (turns are tokenised one by one); inference "
                        "will see slightly different token sequences.")]
    return []


SYSTEM_PROBE = "rocktune-probe-system"


def template_default_system(tokenizer) -> str:
    """The system prompt the chat template writes into a conversation that has none ("" when it writes none): the
    rendering of one user turn, less what frames a system turn of our own (Qwen2.5's "You are Qwen, created by
    Alibaba Cloud..."). A template that takes no system turn gives ""."""
    user = [{"role": "user", "content": "x"}]
    try:
        alone = render_chat_template(tokenizer, user, tokenize=False, add_generation_prompt=False)
        framed = render_chat_template(tokenizer, [{"role": "system", "content": SYSTEM_PROBE}, *user],
                                      tokenize=False, add_generation_prompt=False)
    except UserError:
        return ""
    before, found, after = framed.partition(SYSTEM_PROBE)
    if not found or not (alone.startswith(before) and alone.endswith(after)) or len(alone) < len(before + after):
        return ""
    return alone[len(before):len(alone) - len(after)].strip()


def _default_system(recs: list[tuple[str, dict]], tokenizer) -> list[Problem]:
    """A default system prompt the template adds is trained into every conversation without one, and the model
    learns whoever it names (an identity a borrowed template brings along): said, with the way out."""
    without = [loc for loc, rec in recs if not any(m.get("role") == "system" for m in rec.get("messages", []))]
    default = template_default_system(tokenizer) if without else ""
    if not default:
        return []
    return [Problem("warning", "template-default-system", f"the chat template adds a system prompt the data does not "
                    f"have to every conversation without one ({len(without)} of the {len(recs)} checked, e.g. "
                    f"{without[0]}): {default[:160]!r}. The model is trained with it and learns what it says (an "
                    "identity too). Write the system prompt you want into the data, or, if the template is not the "
                    "model's own, use data.chat_template: builtin-tools (it adds none).")]

