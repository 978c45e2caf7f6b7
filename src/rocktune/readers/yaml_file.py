"""YAML config files without unbounded aliases. An anchor and its aliases are one node in PyYAML's graph, but
everything after parsing (pydantic's validation, ``repr`` in an error message, ``yaml.safe_dump`` of the saved
config) walks them as a tree: nine levels of nine aliases ("billion laughs") are a few hundred bytes of text and
387 million values once walked. The size of that tree is counted on the composed graph, each shared node once,
before anything is constructed, and a document larger than ``MAX_VALUES`` is refused; aliases that reuse a value a
few times, as configs do, stay allowed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rocktune.errors import UserError

# A full rocktune config is about 100 values; this leaves room for long lists (target modules, resolutions) in hand
# written and saved configs while a bomb is refused in milliseconds.
MAX_VALUES = 100_000


def read_yaml(path: Path, fix: str) -> tuple[Any, yaml.Node | None]:
    """The constructed document and its node graph (None for an empty file); each problem a ``UserError`` naming
    ``path`` (with line and column for a syntax error); ``fix`` says how to repair or replace the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} cannot be read ({getattr(exc, 'strerror', None) or exc}); {fix}") from None
    return parse_yaml(text, path, fix)


def parse_yaml(text: str, path: Path | str, fix: str) -> tuple[Any, yaml.Node | None]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        size = expanded_size(node)
        if size > MAX_VALUES:
            raise UserError(f"{path}: its aliases (*name) expand to more than {MAX_VALUES:,} values, a "
                            "YAML alias bomb or a runaway config; refused before reading it. Write the values out, "
                            f"or reuse each anchor only a few times; {fix}")
        return loader.construct_document(node), node
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)  # yaml's own text names "<unicode string>", not the file
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
        raise UserError(f"{where}: not valid YAML ({what or exc}); check the indentation and quoting there.") from None
    except RecursionError:
        raise UserError(f"{path}: the YAML is nested too deeply to read (deeper than Python's recursion limit, "
                        f"about 1,000 levels); {fix}") from None
    finally:
        loader.dispose()


def expanded_size(node: yaml.Node) -> int:
    """How many values the document holds once every alias is expanded (capped at ``MAX_VALUES + 1``), computed on
    the graph in linear time: each shared node's size is counted once and reused. An anchor that contains its own
    alias (``a: &a [*a]``) expands without end and counts as over the cap."""
    sizes: dict[int, int] = {}
    entered: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:  # iterative post-order: nesting depth costs no Python stack
        current, children_done = stack.pop()
        key = id(current)
        if key in sizes:
            continue
        kids = _children(current)
        if children_done or not kids:
            # capped: a thousand levels of aliases would otherwise make numbers of a thousand digits
            sizes[key] = min(1 + sum(sizes[id(k)] for k in kids), MAX_VALUES + 1)
            continue
        if key in entered:
            return MAX_VALUES + 1  # reached again while its children are still open: a cycle
        entered.add(key)
        stack.append((current, True))
        stack.extend((k, False) for k in kids if id(k) not in sizes)
    return sizes[id(node)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []
