"""Instruction records (Alpaca, prompt/completion) as single-turn conversations for a chat model's template
(``data.chat_template``), the way LLaMA-Factory renders Alpaca data: a chat model stays a chat model."""

from __future__ import annotations

from rocktune.errors import UserError


def from_instruction(rec: dict, shape: str) -> dict:
    """An Alpaca or prompt/completion record as a single-turn conversation (LLaMA-Factory's rendering of Alpaca
    through the model's template: instruction and input joined by a newline; ``history`` pairs before it)."""
    if shape == "alpaca":
        user = rec["instruction"] + ("\n" + rec["input"] if rec.get("input") else "")
        reply = rec["output"]
    else:
        user, reply = rec["prompt"], rec["completion"]
    messages = [{"role": "system", "content": rec["system"]}] if isinstance(rec.get("system"), str) and \
        rec["system"].strip() else []
    for pair in (rec.get("history") or []) if shape == "alpaca" else []:
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return {"messages": messages + [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def uses_template(setting: str, shape: str, tokenizer) -> bool:
    """Whether instruction records are rendered through the chat template (data.chat_template). auto: Alpaca yes,
    where the tokenizer has a template (LLaMA-Factory renders Alpaca data through the model's template);
    prompt/completion no (TRL trains plain prompt/completion strings as they are)."""
    if shape not in ("alpaca", "prompt_completion") or setting == "never":
        return False
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting == "always":
        if not has:
            raise UserError("data.chat_template=always, but this tokenizer has no chat template; use an instruct "
                            "model's tokenizer, or set data.chat_template=auto.")
        return True
    return shape == "alpaca" and has
