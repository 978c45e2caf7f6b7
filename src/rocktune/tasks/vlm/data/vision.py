"""Vision-language records -> conversations with image parts -> (input_ids, labels, images).

The shapes the ecosystem writes, each normalised to HF's canonical conversation (``{"type": "image"}`` parts in
the order the images come) plus the list of images:

- OpenAI / HF messages whose content is a list of parts: ``{"type": "image_url", "image_url": {"url": ...}}``,
  ``{"type": "image", "image" | "url" | "path": ...}``, ``{"type": "text", "text": ...}`` (and the Responses API's
  ``input_image`` / ``input_text``);
- TRL's vision datasets: ``messages`` with bare ``{"type": "image"}`` placeholders and an ``images`` column that
  fills them in order;
- LLaVA / ShareGPT: ``conversations`` of ``{"from", "value"}`` turns with ``<image>`` markers in the text and an
  ``image`` (one) or ``images`` (several) key.

The conversation is rendered by the tokenizer's chat template and cut at the assistant turns as text conversations
are (``encode.chat_segments``): loss is on the assistant's tokens only. The template writes one image placeholder
token per image; it is widened to the image's tokens as the model's processor does, by its family's rule
(tasks/vlm/data/vision_rules.py: Qwen's patches / merge_size^2 from the image processor's own grid, Gemma 3's fixed soft
tokens, Idefics3's tiles), and image tokens never carry loss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rocktune.data.encode import IGNORE, chat_segments
from rocktune.tasks.vlm.data.images import ImageRef, load, resolve
from rocktune.tasks.vlm.data.vision_rules import ImageRule
from rocktune.errors import UserError
from rocktune.readers.template import render_chat_template

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
         "model": "assistant"}
MARKER = "<image>"


@dataclass(frozen=True)
class VisionTokens:
    """What the encoder needs of the model's processor: its image processor, its vision tokens and its family's
    rule for widening a placeholder (tasks/vlm/data/vision_rules.py)."""

    image_processor: Any  # transformers' image processor, pixel limits applied
    image_token_id: int  # the token whose embeddings the image features replace
    placeholder: str  # what the chat template writes once per image, widened to the image's tokens by ``rule``
    masked_ids: frozenset[int]  # image tokens and their markers: never trained
    rule: ImageRule


@dataclass(frozen=True)
class VisionExample:
    input_ids: list[int]
    labels: list[int]
    images: tuple[ImageRef, ...]
    grids: tuple[tuple[int, ...], ...]  # per image, what its rule sizes it by (Qwen: the image_grid_thw)
    truncated: bool = False
    image_tokens: int = 0  # of all its images


def to_conversation(rec: dict, base: Path, loc: str) -> tuple[list[dict], list[ImageRef]]:
    """A record in any of the module's shapes -> (canonical messages, images in order)."""
    column = rec.get("images", rec.get("image"))
    pool = [] if column is None else list(column) if isinstance(column, (list, tuple)) else [column]
    turns = rec.get("messages", rec.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{loc}: a vision-language record needs a non-empty 'messages' (OpenAI/HF content parts, "
                        "TRL) or 'conversations' (LLaVA/ShareGPT) list.")
    messages, sources = [], []
    for k, turn in enumerate(turns):
        where = f"{loc}, turn {k + 1}"
        if not isinstance(turn, dict):
            raise UserError(f"{where}: a turn must be an object with role/content (or from/value).")
        name = turn["role"] if "role" in turn else turn.get("from", "")  # neither key: "", no role (as None was)
        role = ROLES.get(name)
        if role is None:
            raise UserError(f"{where}: unknown role {turn.get('role', turn.get('from'))!r} (user, assistant, system; "
                            "ShareGPT's human, gpt).")
        parts = _parts(turn.get("content", turn.get("value")), where)
        for part in parts:
            if part["type"] == "image":
                sources.append(part.pop("source", None))
        messages.append({"role": role, "content": parts})
    return messages, _fill(sources, pool, base, loc)


def _parts(content, where: str) -> list[dict]:
    if isinstance(content, str):  # LLaVA: <image> markers in the text
        pieces = content.split(MARKER)
        parts = [{"type": "text", "text": pieces[0]}]
        for piece in pieces[1:]:
            parts += [{"type": "image"}, {"type": "text", "text": piece}]
        return [p for p in parts if p["type"] == "image" or p["text"]]
    if not isinstance(content, list):
        raise UserError(f"{where}: content must be text or a list of parts, not {type(content).__name__}.")
    return [_part(p, where) for p in content]


def _part(part, where: str) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("text", "input_text") and isinstance(part.get("text"), str):  # input_*: OpenAI's Responses API
        return {"type": "text", "text": part["text"]}
    if kind in ("image_url", "input_image"):
        url = part.get("image_url")
        return {"type": "image", "source": url.get("url") if isinstance(url, dict) else url}
    if kind == "image":
        return {"type": "image", "source": next((part[k] for k in ("image", "url", "path") if part.get(k)), None)}
    raise UserError(f"{where}: a content part must be {{'type': 'text', 'text': ...}}, {{'type': 'image_url', "
                    f"'image_url': {{'url': ...}}}} or {{'type': 'image', ...}}; got {str(part)[:80]!r}.")


def _fill(sources: list, pool: list, base: Path, loc: str) -> list[ImageRef]:
    """Each image part's source: its own, or the next of the record's images column (TRL, LLaVA)."""
    bare = sum(s is None for s in sources)
    if bare != len(pool):
        raise UserError(f"{loc}: {bare} image placeholders ({MARKER} markers or bare image parts) but "
                        f"{len(pool)} images in the record's images/image key; they must match one to one.")
    taken = iter(pool)
    return [resolve(s if s is not None else next(taken), base, f"{loc}, image {i + 1}")
            for i, s in enumerate(sources)]


def encode(rec: dict, base: Path, tokenizer, vision: VisionTokens, max_length: int, loc: str) -> VisionExample:
    messages, refs = to_conversation(rec, base, loc)
    grids = tuple(_grid(vision, ref, f"{loc}, image {i + 1}") for i, ref in enumerate(refs))
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{loc}: the conversation has no assistant turn, so nothing would be trained.")
    segments = chat_segments(messages, tokenizer, loc)
    _check_placeholders(sum(text.count(vision.placeholder) for text, _ in segments), grids, loc)
    ids: list[int] = []
    labels: list[int] = []
    k = 0
    for text, bears_loss in segments:
        text, k = _widen(text, vision, grids, k)
        seg = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids += seg
        labels += [IGNORE if not bears_loss or t in vision.masked_ids else t for t in seg]
    example = _checked(ids, labels, refs, grids, vision, loc)
    truncated = len(ids) > max_length
    if truncated:
        _check_cut(ids, max_length, vision, loc)
        ids, labels = ids[:max_length], labels[:max_length]
    if all(label == IGNORE for label in labels[1:]):
        raise UserError(f"{loc}: no assistant token is left to train on within data.max_length={max_length}.")
    return replace(example, input_ids=ids, labels=labels, truncated=truncated)


def encode_prompt(messages: list[dict], refs: list[ImageRef], tokenizer, vision: VisionTokens,
                  loc: str) -> VisionExample:
    """A conversation to be answered (``messages`` canonical, as ``to_conversation`` makes them), rendered with the
    template's generation prompt and widened as in training: the input of ``rocktune generate --image``."""
    grids = tuple(_grid(vision, ref, f"{loc}, image {i + 1}") for i, ref in enumerate(refs))
    text = render_chat_template(tokenizer, messages, tokenize=False, add_generation_prompt=True)
    _check_placeholders(text.count(vision.placeholder), grids, loc)
    ids = tokenizer(_widen(text, vision, grids, 0)[0], add_special_tokens=False)["input_ids"]
    return _checked(ids, [IGNORE] * len(ids), refs, grids, vision, loc)


def _grid(vision: VisionTokens, ref: ImageRef, loc: str) -> tuple[int, ...]:
    out = vision.image_processor(images=[load(ref, loc, verify=True)], return_tensors="pt",
                                 **vision.rule.process_kwargs())
    return vision.rule.grid(out, 0)


def _check_placeholders(found: int, grids, loc: str) -> None:
    if found != len(grids):
        raise UserError(f"{loc}: the chat template rendered {found} image placeholders for {len(grids)} images; "
                        "use the model's own chat template (it must render {'type': 'image'} parts).")


def _widen(text: str, vision: VisionTokens, grids, k: int) -> tuple[str, int]:
    """Each placeholder in ``text`` -> its image's text (the ``k``-th image's first), as the model's processor
    replaces it before tokenising: the tokens then merge with their neighbours exactly as the processor's do."""
    pieces = text.split(vision.placeholder)
    out = [pieces[0]]
    for piece in pieces[1:]:
        out += [vision.rule.text(grids[k]), piece]
        k += 1
    return "".join(out), k


def _checked(ids, labels, refs, grids, vision: VisionTokens, loc: str) -> VisionExample:
    """The example, once its image tokens are as many as its images' features (a tokenizer that splits the image
    token would misplace every image)."""
    want = sum(vision.rule.tokens(g) for g in grids)
    if ids.count(vision.image_token_id) != want:
        raise UserError(f"{loc}: {ids.count(vision.image_token_id)} image tokens for {len(grids)} images that make "
                        f"{want}; the tokenizer must keep {vision.rule.image_token!r} as one special token (use the "
                        "model's own tokenizer).")
    return VisionExample(ids, labels, tuple(refs), grids, image_tokens=want)


def _check_cut(ids: list[int], max_length: int, vision: VisionTokens, loc: str) -> None:
    """An example is cut at its end only: a cut through an image's tokens would leave the model features without
    their tokens (or tokens without features)."""
    last = max((i for i, t in enumerate(ids) if t == vision.image_token_id), default=-1)
    if last >= max_length - 1:
        raise UserError(f"{loc}: {len(ids)} tokens, and data.max_length={max_length} would cut through an image's "
                        "tokens; raise data.max_length or lower data.max_pixels (fewer tokens per image).")
