"""Turn one validated record into ``(input_ids, labels)``.

A record is first rendered into text segments, each marked as loss-bearing or not; segments are tokenised one by
one so the boundary between prompt and completion is exact in tokens. ``labels`` copies ``input_ids`` where the
segment carries loss and holds -100 elsewhere (the value PyTorch's cross-entropy ignores). An example longer than
``max_length`` is cut by ``data/truncate.py``: by default the prompt side first, keeping the end of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from rocktune.data import fidelity, turnend
from rocktune.data.chat import REASONING_KEYS
from rocktune.data.truncate import fit, tokenize_bounded, uncut_calls
from rocktune.errors import UserError
from rocktune.readers.template import render_chat_template

IGNORE = -100
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool
    prompt_cut: int = 0  # prompt-side tokens removed to fit max_length
    completion_cut: int = 0  # completion-side tokens removed (the completion alone did not fit)


def encode(record: dict, shape: str, tokenizer, max_length: int, train_on_prompt: bool, loc: str,
           truncation: str = "prompt", train_reasoning: bool = False) -> Encoded:
    segments = _segments(record, shape, tokenizer, loc, train_reasoning)
    ids: list[int] = []
    labels: list[int] = []
    is_prompt: list[bool] = []
    sizes: list[int] = []
    for i, (text, bears_loss) in enumerate(segments):
        # Only the first segment of a non-chat record gets the tokenizer's own specials (e.g. Llama's BOS);
        # chat templates already render them.
        special = i == 0 and shape != "messages"
        keep_end = truncation == "prompt" and not bears_loss
        seg = tokenize_bounded(tokenizer, text, special, max_length, keep_end) if text else []
        ids.extend(seg)
        labels.extend(seg if (bears_loss or train_on_prompt) else [IGNORE] * len(seg))
        is_prompt.extend([not bears_loss] * len(seg))
        sizes.append(len(seg))
    if shape != "messages" and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
        is_prompt.append(False)
    bos = tokenizer.bos_token_id
    keep_first = shape != "messages" and bos is not None and bool(ids) and ids[0] == bos
    out = uncut_calls(fit(ids, labels, is_prompt, max_length, truncation, keep_first), sizes,
                      call_segments(record) if shape == "messages" else set(), IGNORE)
    return Encoded(out.input_ids, out.labels, len(ids) > max_length, out.prompt_cut, out.completion_cut)


def _turn_end(full: str, start: str, ends: turnend.ReplyEnd, last: bool, opening: str = "") -> str | None:
    """``full`` up to the end of the assistant turn that begins after ``start``: the first end of a reply after it
    (``ends.closing``: what the template writes after a reply in the history, or after the conversation's ``last``
    one); for a template that writes none (GLM-4.5), up to ``opening``, the token the next turn opens with. None
    when it is not found."""
    if not full.startswith(start):
        return None
    eot = ends.closing[1 if last else 0]
    if not eot.strip():
        at = full.find(opening, len(start)) if opening else -1
        return full[:at] if at >= 0 else None
    at = full.find(eot, len(start))
    return full[:at + len(eot)] if at >= 0 else None


def reasoning_split(before: list[dict], msg: dict, start: str, reply: str, render, header: str = "") -> str:
    """The head of ``reply`` that is the turn's reasoning written as a message of its own: what rendering the turn
    without its reasoning leaves off the front, ending where a new reply opens with the generation prompt's
    ``header`` (Harmony's ``<|channel|>analysis<|message|>...<|end|><|start|>assistant`` before the final answer or
    the tool call); "" where the reasoning sits inside the reply (Qwen's think block, kept as the template renders
    it, whose generation prompt may open it: Qwen3.5), where the template drops it, or where the turn has none."""
    if not msg.get("reasoning_content"):
        return ""
    plain = {k: v for k, v in msg.items() if k not in REASONING_KEYS}
    bare = render([*before, plain], False)
    answer = bare[len(start):] if bare.startswith(start) else ""
    thought = reply[:-len(answer)] if answer and answer != reply and reply.endswith(answer) else ""
    return thought if thought.endswith(header) else ""


def _as_later(messages: list[dict], full: str) -> list[dict]:
    """``messages`` without the reasoning the whole conversation's rendering ``full`` does not show: templates drop a
    reply's reasoning once a later turn comes (Qwen3.5 and GLM-4.5 before the last user turn, Harmony a tool call's
    analysis once a final answer follows), while a prefix that ends before that turn still shows it. ``messages``
    itself where no reasoning is dropped."""
    key = REASONING_KEYS[0]
    gone = {j for j, m in enumerate(messages) if (m.get(key) or "").strip() and m[key].strip() not in full}
    if not gone:
        return messages
    return [{k: v for k, v in m.items() if k not in REASONING_KEYS} if j in gone else m for j, m in enumerate(messages)]


def _reply_start(full: str, done: str, prompts, ends: turnend.ReplyEnd) -> str:
    """Where a reply starts in ``full``, the conversation rendered up to the previous reply's end being ``done``:
    the first of ``prompts`` (the conversation up to the reply rendered with the generation prompt; again without
    the reasoning a later turn drops) that continues ``done`` inside ``full``, without the generation prompt's
    opener where the reply as rendered lacks it (Qwen3.5's "<think>\n" before a later query, Gemma 4's empty
    thought channel); else the generation prompt's header found after ``done`` (Qwen3.5 renders a reply's think
    block only while no later query follows, so a prefix shows earlier replies otherwise), with the opener where
    ``full`` has it there. The first prompt when nothing fits (the caller refuses it)."""
    def fits(text):
        return text.startswith(done) and full.startswith(text)
    opener, first = ends.opener, None
    for prompt in prompts:  # rendered one by one: the second only when the first does not fit
        first = prompt if first is None else first
        for text in (prompt, prompt[:-len(opener)] if opener and prompt.endswith(opener) else None):
            if text is not None and fits(text):
                return text
    at = full.find(ends.header, len(done)) if ends.header.strip() else -1
    if at < 0:
        return first
    start = full[:at + len(ends.header)]
    return start + opener if opener and full.startswith(opener, len(start)) else start


def _fitting(text: str, later: str, after: str, within: str) -> str:
    """``text``, or the rendering ``later`` (reasoning dropped as after a later user turn) when only that one
    continues ``after`` and starts ``within`` ("": no bound); ``text`` when neither fits (the caller refuses it)."""
    def fits(t):
        return t.startswith(after) and (not within or within.startswith(t))
    return later if not fits(text) and fits(later) else text


def call_segments(record: dict) -> set[int]:
    """The segments (of ``_chat_segments``: a prompt and a reply per assistant turn) that are tool calls."""
    replies = [m for m in record["messages"] if m["role"] == "assistant"]
    return {2 * k + 1 for k, m in enumerate(replies) if m.get("tool_calls")}


def _segments(record: dict, shape: str, tokenizer, loc: str, train_reasoning: bool = False) -> list[tuple[str, bool]]:
    if shape == "text":
        return [(record["text"], True)]
    if shape == "prompt_completion":
        return [(record["prompt"], False), (record["completion"], True)]
    if shape == "alpaca":
        template = ALPACA_WITH_INPUT if record.get("input") else ALPACA_NO_INPUT
        prompt = template.format(instruction=record["instruction"], input=record.get("input", ""))
        return [(prompt, False), (record["output"], True)]
    return _chat_segments(record, tokenizer, loc, train_reasoning)


class Unlocated(UserError):
    """An assistant turn that the rendering of the whole conversation does not show as its own prefix did."""


def _unlocated(loc: str, i: int, alone: str, full: str) -> Unlocated:
    """The refusal of messages[i], quoting where the conversation rendered up to it (``alone``) and the whole
    conversation (``full``) part: the template moves or rewrites what comes before the turn once later turns
    follow (Mistral Nemo writes the tool list before the last user turn only)."""
    k = next((j for j, (x, y) in enumerate(zip(alone, full)) if x != y), min(len(alone), len(full)))

    def near(text):
        return repr(("..." if k > 30 else "") + text[max(0, k - 30):k + 40] + ("..." if len(text) > k + 40 else ""))

    return Unlocated(
        f"{loc}: messages[{i}] (assistant): the chat template renders the conversation up to this turn differently "
        f"once later turns follow (up to it: {near(alone)}; in the whole conversation: {near(full)}), so the turn "
        "cannot be located as the model sees it when it writes it. Give each assistant turn a record of its own (the "
        "conversation up to and including it), or use a chat template that renders earlier turns as it rendered "
        "them then (data.chat_template naming a .jinja file).")


def _chat_segments(record: dict, tokenizer, loc: str, train_reasoning: bool = False) -> list[tuple[str, bool]]:
    """``chat_segments`` of a canonical conversation, checked against the record (``fidelity``): a part of it the
    template does not render (tool calls, the tool list, a system prompt) is refused, not trained as if absent."""
    tools = record.get("tools")
    try:
        segments = chat_segments(record["messages"], tokenizer, loc, tools, record.get("untrained", ()),
                                 train_reasoning)
    except Unlocated:
        # a turn the template drops (Mistral Nemo's system prompt, written only into a conversation that ends on a
        # user turn) is what makes the turns unlocatable: name it rather than the symptom
        whole = render_chat_template(tokenizer, record["messages"], tokenize=False, add_generation_prompt=False,
                                     **({"tools": tools} if tools else {}))
        fidelity.check(record, [(whole, False)], loc, located=True)
        raise
    shown = True
    if tools:  # a template that ignores tools= renders the same text without them
        shown = len({render_chat_template(tokenizer, record["messages"], tokenize=False, add_generation_prompt=False,
                                          **extra) for extra in ({}, {"tools": tools})}) == 2
    fidelity.check(record, segments, loc, shown, opener=turnend.reply_end(tokenizer).opener)
    return segments


def chat_segments(messages: list[dict], tokenizer, loc: str, tools: list | None = None,
                  untrained=(), train_reasoning: bool = False) -> list[tuple[str, bool]]:
    """Split the rendered conversation at each assistant turn by rendering growing prefixes of it.

    The text between "prefix + generation prompt" and "prefix + assistant turn" is exactly what the model must
    produce for that turn (its text or its tool calls), end-of-turn marker included; that is what carries loss.
    Tool results and the tool list are prompt. ``tools`` go to the template as ``tools=``; the assistant turns at
    ``untrained`` (loss_weight 0) are prompt too. Reasoning the template writes as a message of its own ahead of
    the answer (gpt-oss's analysis channel) is prompt unless ``train_reasoning`` (``reasoning_split``).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"{loc}: chat 'messages' need the tokenizer's chat template, and this tokenizer has none; "
            "use an instruct model's tokenizer or convert the data to prompt/completion."
        )

    extra = {"tools": tools} if tools else {}

    def render(msgs, gen):
        return render_chat_template(tokenizer, msgs, tokenize=False, add_generation_prompt=gen, **extra)

    segments: list[tuple[str, bool]] = []
    done = ""
    full = render(messages, False)
    ends = turnend.reply_end(tokenizer)
    later = _as_later(messages, full)
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        views = (messages,) if later is messages else (messages, later)
        start = _reply_start(full, done, (render(view[:i], True) for view in views), ends) if i else ""
        end = alone = render(messages[: i + 1], False)
        if not (full.startswith(end) and end.startswith(start)) and later is not messages:
            end = _fitting(end, render(later[: i + 1], False), start, full)
        if not (full.startswith(end) and end.startswith(start)):
            # the turn renders differently as the last one (Qwen3's empty think block, a closing EOS; GLM-4.5's
            # reasoning before a later user turn): its end is the template's end-of-turn text after it in the whole
            # conversation, or the opening of the turn after it
            nxt = messages[i + 1]["role"] if i + 1 < len(messages) else ""
            end = _turn_end(full, start, ends, not nxt, ends.opens.get(nxt, ""))
        if end is None or not (start.startswith(done) and end.startswith(start)):
            raise _unlocated(loc, i, start if not full.startswith(start) else alone, full)
        # a template that writes no end of turn (GLM-4.5): the stop token opening the next turn ends the reply, and
        # after the last message, where the template writes nothing, it is appended
        stop = ends.after(full[len(end):]) if i + 1 < len(messages) else ends.appended(messages)
        # history's spelling of a reply's end (Harmony's <|end|>, where the last reply ends <|return|>) is not what
        # the model writes: it opens the next prompt instead of being trained
        kept = ends.kept if i + 1 < len(messages) and ends.kept and end.endswith(ends.kept) else ""
        end = end[:len(end) - len(kept)]
        reply = end[len(start):]
        thought = "" if train_reasoning else reasoning_split(messages[:i], msg, start, reply, render, ends.header)
        segments += [(start[len(done):] + thought, False), (reply[len(thought):] + stop, i not in untrained)]
        done = end + stop
    if full.startswith(done) and len(full) > len(done):
        segments.append((full[len(done):], False))
    return segments
