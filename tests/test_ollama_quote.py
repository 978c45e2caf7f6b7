"""Modelfile values read back by Ollama exactly as written. The reader below follows the rules of Ollama's
Modelfile parser (parser/parser.go): nothing is unescaped; a value ends at the first newline after which the text so
far, trimmed, is a whole ``"..."`` or ``\"\"\"...\"\"\"`` string; the quotes are then cut off."""

from __future__ import annotations

import pytest

from rocktune.errors import UserError
from rocktune.export.ollama import _quote


def ollama_reads(line_rest: str) -> str:
    """The value Ollama's parser takes from ``line_rest`` (the text after ``PARAMETER stop `` up to EOF)."""
    buf = ""
    for ch in line_rest + "\n":
        if ch in "\r\n":
            value = _unquote(buf.strip())
            if value is not None:
                return value
        buf += ch
    raise AssertionError("Ollama would report an unexpected end of file")


def _unquote(s: str) -> str | None:
    if s.startswith('"""'):
        return s[3:-3] if len(s) >= 6 and s.endswith('"""') else None
    if s.startswith('"'):
        return s[1:-1] if len(s) >= 2 and s.endswith('"') else None
    return s


@pytest.mark.parametrize("text", ["<|im_end|>", 'say "hi" now', "back\\slash \\\"", '""starts with two', "</s>",
                                  "two\nlines", 'line one ends "\nline two', 'ends in a quote"', "  padded  ",
                                  'a"\n"b', "\"\"\"\"", "x\n\nz"])
def test_value_reads_back_as_written(text):
    assert ollama_reads(_quote(text) + "\nPARAMETER temperature 0") == text


def test_unwritable_value_is_refused():
    with pytest.raises(UserError, match="Ollama reads it back"):
        _quote('first line """\nsecond')


def test_the_old_escaping_would_not_read_back():
    """The reason for the rule: backslash escapes are kept verbatim by Ollama."""
    escaped = '"' + 'say \\"hi\\"' + '"'
    assert ollama_reads(escaped) != 'say "hi"'
