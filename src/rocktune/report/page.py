"""One self-contained HTML page: inline CSS, images as data URIs, no script and nothing fetched, so it opens
offline, from a mail attachment, or in a browser that blocks everything external."""

from __future__ import annotations

import base64
import html


CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5em 0; } td, th { padding: 2px 10px; border-bottom: 1px solid #eee;
text-align: left; vertical-align: top; overflow-wrap: anywhere; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f6f6f6; padding: .6em; overflow-x: auto; font-size: 12px; }
img.plot { max-width: 100%; border: 1px solid #eee; margin: .4em 0; }
.tok { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 13px; background: #fafafa;
padding: .5em; border: 1px solid #eee; } .trained { background: #c8f0c8; } .prompt { color: #888; }
.special { font-weight: bold; outline: 1px solid #999; } .error { color: #b00; } .warning { color: #a60; }
"""


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def document(title: str, body: list[str]) -> str:
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head>\n<body>\n<h1>{esc(title)}</h1>\n" + "\n".join(body) + "\n</body></html>\n")


def table(rows: list[tuple], header: tuple | None = None) -> str:
    def cell(v) -> str:
        return f"<td class=\"num\">{esc(v)}</td>" if isinstance(v, (int, float)) else f"<td>{esc(v)}</td>"

    head = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>" if header else ""
    return "<table>" + head + "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows) + "</table>"


def image(png: bytes, alt: str) -> str:
    return f"<img class=\"plot\" alt=\"{esc(alt)}\" src=\"data:image/png;base64,{base64.b64encode(png).decode()}\">"
