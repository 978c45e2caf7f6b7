"""Where a chat template ends an assistant reply, learned once per tokenizer from probe conversations.

Most templates write an end-of-turn token after every reply (ChatML's <|im_end|>, Llama 3's <|eot_id|>): it is the
reply's last trained token. GLM-4.5's writes nothing there: the model ends a reply by writing the next turn's role
token, <|user|> (or <|observation|> after a tool call), and its generation config stops on both. For such a template
the token it writes right after a reply is trained as the reply's end when the model stops on it, and after the
conversation's last reply, where the template writes nothing, it is appended: every reply then teaches the model to
stop where transformers, ``rocktune generate``, llama.cpp and Ollama stop. A template that writes nothing the model
stops on gives a reply no end, and the data check refuses its chat data (``checks.py``: stop-never-trained).

gpt-oss's Harmony template ends the conversation's last reply with <|return|> and a reply in the history with
<|end|>: the model writes <|return|> (generation stops there) and a client rewrites it to <|end|> when it keeps the
reply as history, so <|end|> after a past reply is prompt, never trained (<|end|> also closes an analysis message
in the middle of a turn, so no runtime stops on it: a model trained to write it after its answer would run on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rocktune.errors import UserError
from rocktune.readers.json_file import read_json
from rocktune.readers.template import render_chat_template

PROBE = "rocktune-probe-reply"
NEXT = "rocktune-probe-next"
PROBE_CALL = {"type": "function", "function": {"name": "rocktune_probe", "arguments": {"x": 1}}}
_CACHE = "_rocktune_reply_end"  # the tokenizer's attribute holding what was learned, per chat template text


@dataclass(frozen=True)
class ReplyEnd:
    written: int | None = None  # the special token the template writes after every reply (<|im_end|>)
    # templates that write none: the role of the turn after a reply -> the stop token that opens it, written right
    # after the reply (GLM-4.5: user -> <|user|>, tool -> <|observation|>); openings the model does not stop on left out
    opens: dict[str, str] = field(default_factory=dict)
    opening: str = ""  # the first special token a following user turn opens with, stop or not (for the refusal)
    # the generation prompt (after one user turn) as the header a past reply starts with, and what it writes after
    # that header which a past reply does not start with: Qwen3.5's "<think>\n", Gemma 4's empty thought channel
    header: str = ""
    opener: str = ""
    # what ends a reply, in whole tokens, as (a reply in the history, the conversation's last reply): the text the
    # template writes after a reply either way ("<|im_end|>\n" for ChatML; Phi-3.5's "<|end|>\n", before the EOS it
    # closes a conversation with), or where the two differ from their first token on, each one's first special
    # token (Harmony: "<|end|>", "<|return|>"); empty where the template writes none (GLM-4.5)
    closing: tuple[str, str] = ("", "")

    @property
    def kept(self) -> str:
        """The end token of a reply in the history where the conversation's last reply ends with another one
        (Harmony's <|end|>): history's spelling of the end, which the model never writes, so it is not trained."""
        return self.closing[0] if self.closing[0] != self.closing[1] else ""

    def after(self, rest: str) -> str:
        """The stop token the rendering continues with right after a reply (``rest``), which ends that reply."""
        return next((s for s in self.opens.values() if rest.startswith(s)), "")

    def appended(self, messages: list[dict]) -> str:
        """What is appended after the conversation when it ends on a reply: the stop token the template would write
        next (a tool result's opening after a tool call, else a user turn's)."""
        if not messages or messages[-1]["role"] != "assistant":
            return ""
        role = "tool" if messages[-1].get("tool_calls") and "tool" in self.opens else "user"
        return self.opens.get(role, "")

    def ids(self, tokenizer) -> dict[int, str]:
        """The tokens that end a reply, by id (empty: the template writes none the model stops on)."""
        if self.written is not None:
            return {self.written: tokenizer.convert_ids_to_tokens(self.written)}
        return {tokenizer.convert_tokens_to_ids(s): s for s in dict.fromkeys(self.opens.values())}


def reply_end(tokenizer) -> ReplyEnd:
    """How the tokenizer's chat template ends a reply (learned on first use, kept on the tokenizer per template)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        return ReplyEnd()
    learned = vars(tokenizer).setdefault(_CACHE, {})
    if template not in learned:
        learned[template] = _probe(tokenizer)
    return learned[template]


def _probe(tokenizer) -> ReplyEnd:
    user, reply = {"role": "user", "content": "u"}, {"role": "assistant", "content": PROBE}
    alone = _render(tokenizer, [user, reply])
    if alone is None or PROBE not in alone:
        return ReplyEnd()
    past = _render(tokenizer, [user, reply, {"role": "user", "content": NEXT}])
    header, opener = _prompt(tokenizer, user, past)
    special = special_ids(tokenizer)
    last = alone.split(PROBE, 1)[1]
    written = next((i for i in _ids(tokenizer, last) if i in special), None)
    if written is not None:
        more = past.split(PROBE, 1)[1] if past and PROBE in past else ""
        common = _common_tokens(tokenizer, last, more)
        first = next((i for i in _ids(tokenizer, more) if i in special), written)
        closing = (common, common) if first == written or common.strip() else tuple(
            _through(tokenizer, text, token) for text, token in ((more, first), (last, written)))
        return ReplyEnd(written, header=header, opener=opener, closing=closing)
    call = {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}
    follow = {"user": ([user, reply], {"role": "user", "content": NEXT}),
              "tool": ([user, call], {"role": "tool", "content": NEXT})}
    stops = model_stop_ids(tokenizer)
    opens, first = {}, ""
    for role, (before, nxt) in follow.items():
        token = _opening(tokenizer, before, nxt, special)
        if role == "user":
            first = token
        if token and tokenizer.convert_tokens_to_ids(token) in stops:
            opens[role] = token
    return ReplyEnd(None, opens, first, header, opener)


def _common_tokens(tokenizer, a: str, b: str) -> str:
    """The longest common start of ``a`` and ``b`` that ends between two tokens of both: a template writing
    <|end|>\n<|endoftext|> after the last reply and <|end|>\n<|user|> before the next turn (Phi-3.5) shares
    "<|end|>\n", not the "<|" of the next special token."""
    common = a[:next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))]
    ids_a, ids_b = _ids(tokenizer, a), _ids(tokenizer, b)
    while common:
        ids = _ids(tokenizer, common)
        if ids == ids_a[:len(ids)] == ids_b[:len(ids)]:
            break
        common = common[:-1]
    return common


def _through(tokenizer, text: str, token: int) -> str:
    """``text`` up to and including the special token ``token``."""
    name = tokenizer.convert_ids_to_tokens(token)
    return text[:text.find(name) + len(name)] if name in text else ""


def _prompt(tokenizer, user: dict, past: str | None) -> tuple[str, str]:
    """(header, opener): the generation prompt split where a reply in the history departs from it (the opener ""
    for most templates): the prompt for one user turn against ``past``, the same turn followed by a reply and
    another user turn."""
    bare, prompted = _render(tokenizer, [user]), _render(tokenizer, [user], True)
    if bare is None or prompted is None or past is None or not (prompted.startswith(bare) and past.startswith(bare)):
        return "", ""
    gen, after = prompted[len(bare):], past[len(bare):]
    common = next((k for k, (x, y) in enumerate(zip(gen, after)) if x != y), min(len(gen), len(after)))
    return (gen[:common], gen[common:]) if PROBE in after[common:] else ("", "")


def _opening(tokenizer, before: list[dict], nxt: dict, special: set[int]) -> str:
    """The special token the template writes first after ``before`` when ``nxt`` follows, right at the reply's end
    ("" when it writes something else first, or renders the two inconsistently)."""
    head, whole = _render(tokenizer, before), _render(tokenizer, [*before, nxt])
    if head is None or whole is None or not whole.startswith(head) or NEXT not in whole:
        return ""
    between = whole[len(head):].split(NEXT, 1)[0]
    ids = _ids(tokenizer, between)
    if not ids or ids[0] not in special:
        return ""
    token = tokenizer.convert_ids_to_tokens(ids[0])
    return token if between.startswith(token) else ""


def special_ids(tokenizer) -> set[int]:
    """The special tokens: the named ones and every added token marked special (transformers 5's
    ``all_special_ids`` leaves out added role tokens such as GLM-4.5's <|user|>)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def _render(tokenizer, messages: list[dict], gen: bool = False) -> str | None:
    try:
        return render_chat_template(tokenizer, messages, tokenize=False, add_generation_prompt=gen)
    except UserError:
        return None
    except Exception:  # noqa: BLE001 - a template that cannot take a probe shape (a VLM's parts): nothing learned
        return None


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def model_stop_ids(tokenizer) -> set[int]:
    """The tokens generation stops on: the tokenizer's EOS and the ``eos_token_id`` of the model's
    generation_config.json and config.json (GLM-4.5 lists <|user|> and <|observation|> there), from the model the
    tokenizer was loaded from (a local directory, or a hub id's files)."""
    ids = {tokenizer.eos_token_id} - {None}
    for name in ("generation_config.json", "config.json"):
        found = _model_file(getattr(tokenizer, "name_or_path", "") or "", name).get("eos_token_id")
        ids.update([found] if isinstance(found, int) else found if isinstance(found, list) else [])
    return {i for i in ids if isinstance(i, int)}


def _model_file(name_or_path: str, name: str) -> dict:
    """A JSON file of the model, {} where there is none (a tokenizer built in memory, a hub model not at hand)."""
    if not name_or_path:
        return {}
    local = Path(name_or_path).expanduser()
    path = local / name if local.is_dir() else _hub_file(name_or_path, name)
    if path is None or not path.is_file():
        return {}
    try:
        return read_json(path, "")
    except UserError:  # a damaged file: loading the model names it; here it just lists no stops
        return {}


def _hub_file(repo_id: str, name: str) -> Path | None:
    from transformers.utils import cached_file

    try:
        found = cached_file(repo_id, name, _raise_exceptions_for_missing_entries=False,
                            _raise_exceptions_for_connection_errors=False)
    except Exception:  # noqa: BLE001 - an id the hub does not know, no network: no stop tokens from it
        return None
    return Path(found) if found else None
