"""An Ollama ``Modelfile`` beside the GGUF: FROM, TEMPLATE in Ollama's Go-template language, stop tokens and
sampling defaults, ready for ``ollama create NAME -f Modelfile``.

Jinja chat templates cannot be translated in general; every family the GGUF export supports is recognised by its
markers and gets a TEMPLATE written for it (``export/ollama_templates.py``: ChatML for Qwen and SmolLM, Llama 3 and
3.1, Mistral/Mixtral, Gemma 2/3, Phi-3, Granite, OLMo 2; ``export/ollama_recent.py``: Qwen3.5, gpt-oss, GLM-4.5,
Granite 4, Gemma 4, Llama 4), tools included where the family's template has them. A
run trained on raw prompts gets a raw template, whatever the tokenizer's chat template says, because that is what the
model learned.
"""

from __future__ import annotations

from rocktune.data.encode import ALPACA_NO_INPUT
from rocktune.errors import UserError
from rocktune.export import ollama_templates
from rocktune.readers.template import render_chat_template


def template_family(chat_template: str | None) -> str | None:
    return ollama_templates.family_of(chat_template)


def modelfile(gguf_name: str, style: str, tokenizer, generation_config, adapter_name: str | None = None,
              projector_name: str | None = None) -> tuple[str, list[str]]:
    """The Modelfile text and notes for the user (e.g. a template that could not be translated). A vision-language
    model's projector (mmproj GGUF) is a second FROM: Ollama files a GGUF of type mmproj as the model's projector."""
    notes: list[str] = []
    stops = _stops(tokenizer, generation_config)
    lines = [f"FROM ./{gguf_name}"] + ([f"FROM ./{projector_name}"] if projector_name else [])
    if adapter_name:
        lines.append(f"ADAPTER ./{adapter_name}")
    if style == "chat":
        family = template_family(getattr(tokenizer, "chat_template", None))
        if family is None:
            notes.append("the tokenizer's chat template is not one rocktune translates (ChatML, Llama 3/3.1/4, "
                         "Mistral, Gemma 2/3/4, Phi-3, Granite 3/4, OLMo 2, Qwen3.5, gpt-oss, GLM-4.5), so the "
                         "Modelfile has no TEMPLATE: Ollama falls "
                         "back to the template it recognises in the GGUF, if any. Add a TEMPLATE line by hand if "
                         "replies look unformatted.")
        else:
            user = _render_user(tokenizer)
            template = ollama_templates.template_for(family, user, renders_tools(tokenizer))
            lines.append(f'TEMPLATE """{template}"""')
            stops += [ollama_templates.FAMILIES[family].stop, *ollama_templates.FAMILIES[family].more_stops]
            system = _default_system(user, family)
            if system:
                lines.append(f"SYSTEM {_quote(system)}")
    elif style == "alpaca":
        lines.append('TEMPLATE """' + ALPACA_NO_INPUT.replace("{instruction}", "{{ .Prompt }}") + '"""')
    else:
        lines.append('TEMPLATE """{{ .Prompt }}"""')
    lines += [f"PARAMETER stop {_quote(s)}" for s in dict.fromkeys(stops)]
    lines += [f"PARAMETER {k} {v}" for k, v in _sampling(generation_config).items()]
    return "\n".join(lines) + "\n", notes


def _render_user(tokenizer) -> str | None:
    """The Jinja template's rendering of one user turn "x" (None where the template refuses it)."""
    try:
        return render_chat_template(tokenizer, [{"role": "user", "content": "x"}], tokenize=False,
                                    add_generation_prompt=False)
    except UserError:
        return None


PROBE_TOOL = {"type": "function", "function": {"name": "rocktune_probe_tool", "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}


def renders_tools(tokenizer) -> bool:
    """Whether the Jinja template writes a ``tools=`` list into the prompt (rendered with and without one)."""
    user = [{"role": "user", "content": "x"}]
    try:
        return len({render_chat_template(tokenizer, user, tokenize=False, add_generation_prompt=True, **extra)
                    for extra in ({}, {"tools": [PROBE_TOOL]})}) == 2
    except UserError:
        return False


def _default_system(rendered_user: str | None, family: str) -> str | None:
    """Ollama's TEMPLATE only sees the messages it is given; a default the Jinja template adds goes in SYSTEM."""
    import re

    pattern = ollama_templates.FAMILIES[family].system
    found = re.search(pattern, rendered_user, re.DOTALL) if pattern and rendered_user else None
    return found.group(1) if found else None


def _stops(tokenizer, generation_config) -> list[str]:
    ids = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.insert(0, tokenizer.eos_token_id)
    return [tokenizer.convert_ids_to_tokens(i) for i in dict.fromkeys(ids)]


def _sampling(generation_config) -> dict[str, object]:
    """The base's own sampling defaults when it has them; greedy (temperature 0) otherwise, like rocktune generate."""
    gc = generation_config
    if gc is None or not getattr(gc, "do_sample", False):
        return {"temperature": 0}
    out = {"temperature": gc.temperature}
    if getattr(gc, "top_p", None) is not None:
        out["top_p"] = gc.top_p
    if getattr(gc, "top_k", None):
        out["top_k"] = gc.top_k
    return out


def _quote(text: str) -> str:
    """``text`` as a Modelfile value that Ollama reads back unchanged. Its parser unescapes nothing (a ``\\"``
    stays two characters) and ends a value at the first newline after which the text so far is a whole quoted
    string, so: one line in plain quotes (inner quotes are harmless there), several lines in triple quotes, and a
    value whose inner line would end the string early is refused rather than written cut."""
    lines = text.split("\n")
    if len(lines) == 1 and not text.startswith('""'):
        return f'"{text}"'
    if any(line.rstrip().endswith('"""') for line in lines[:-1]):
        raise UserError(f"the Modelfile value {text[:60]!r} cannot be written so that Ollama reads it back as "
                        "written (a line of it ends in three quotes); edit the Modelfile by hand.")
    return f'"""{text}"""'
