"""Text data as a stream: each document tokenised whole, its end token appended, cut into ``max_length`` windows.

A corpus is continued, not answered: truncating a document to ``max_length`` (what a chat answer gets) would throw
away all but its first window. Here a document (a ``{"text"}`` record, a text column's cell, or a blank-line block,
line or file of a .txt/.md source per ``data.text_split``) becomes as many windows as its tokens need. Window ``k``
starts at ``k * stride``; a token an earlier window already trained is context in the later one (label -100), so
every token after a document's first is a target exactly once. The default stride, ``max_length - 1``, repeats one
token: the first position of a window never carries loss (nothing precedes it), so the previous window's last
token is the context that lets the next one be predicted.

Windows are examples: batching packs short ones together (``training.batching=tokens``, ``data.packing``) with
attention kept inside each (the packed collate's segments, varlen's ``cu_seq_lens``), so no token attends across
a document's bound.
"""

from __future__ import annotations

from rocktune.data.encode import IGNORE, Encoded
from rocktune.data.ids import token_ids
from rocktune.errors import UserError, first_line


def stride_for(max_length: int, text_stride: int | None) -> int:
    """The stride of ``data.text_stride`` (default ``max_length - 1``), refused where tokens would go untrained."""
    stride = max_length - 1 if text_stride is None else text_stride
    if not 1 <= stride < max_length:
        raise UserError(f"data.text_stride={text_stride} with data.max_length={max_length}: windows must overlap by "
                        "at least one token (the first position of a window is never a target), so the stride must "
                        f"be 1 to {max_length - 1}; leave it unset for {max_length - 1}.")
    return stride


def windows(ids: list[int], max_length: int, stride: int) -> list[Encoded]:
    """The windows of one document's tokens (its BOS and end token included), in order."""
    out = []
    start = trained_to = 0  # tokens before ``trained_to`` were targets (or the document's first) in a window
    while True:
        end = min(start + max_length, len(ids))
        part = ids[start:end]
        context = max(trained_to - start, 0)
        out.append(Encoded(part, [IGNORE] * context + part[context:], False))
        if end >= len(ids):
            return out
        trained_to, start = end, start + stride


def encode_documents(texts: list[str], tokenizer, max_length: int, stride: int, locs: list) -> list[list[Encoded]]:
    """Windows of each text, from one batched call into the tokenizer (its own specials, e.g. a BOS, included) with
    the end-of-sequence token appended to each; ``locs`` name the records in an error."""
    import transformers

    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # "sequence longer than the model's maximum": windows cut it below
    try:
        ids = _tokenize(texts, tokenizer, locs)
    finally:
        transformers.logging.set_verbosity(level)
    return [windows(list(doc) + eos, max_length, stride) for doc in ids]


def _tokenize(texts: list[str], tokenizer, locs: list) -> list[list[int]]:
    def call(batch):
        return token_ids(tokenizer, batch, True)

    try:
        return call(texts)
    except Exception:  # noqa: BLE001 - find the record the tokenizer refuses, one by one, to name it
        out = []
        for text, loc in zip(texts, locs):
            try:
                out += call([text])
            except Exception as exc:  # noqa: BLE001 - tokenizers raise many types; the record is the cause
                raise UserError(f"{loc}: this record cannot be tokenised ({type(exc).__name__}: "
                                f"{first_line(exc)}); fix or remove it.") from None
        return out


def describe(n_documents: int, n_windows: int, max_length: int, stride: int) -> str:
    """The line the preview and the log give a text set."""
    overlap = max_length - stride
    return (f"{n_documents:,} document{'s' if n_documents != 1 else ''} cut into {n_windows:,} window"
            f"{'s' if n_windows != 1 else ''} of up to {max_length} tokens (stride "
            f"{stride}: {overlap} token{'s' if overlap != 1 else ''} of context repeated, never trained twice); every "
            "token after a document's first is trained")
