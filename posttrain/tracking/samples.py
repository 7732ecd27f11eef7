"""Samples tables: rows of (prompt, response, reward, ground truth, ...) as JSONL and a small HTML page.

The page is self-contained (inline CSS, no scripts, no external resources) and every text is HTML-escaped, so
a model's output or a dataset's prompt is shown as text, never run as markup. Large tables show their first
HTML_ROWS rows; the JSONL has all of them. Must not import anything from posttrain except errors
(tracking is the bottom layer).
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HTML_ROWS = 200  # rows shown on the page; the JSONL keeps every row
# columns of the page, in this order, when the rows have them; other keys are in the JSONL only
HTML_COLUMNS = ("index", "data_source", "prompt", "response", "ground_truth", "reward", "stop_reason")
_WIDE = {"prompt", "response"}

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } p.summary { color: #555; }
table { border-collapse: collapse; width: 100%; table-layout: fixed; }
th, td { border: 1px solid #ccc; padding: 4px 6px; vertical-align: top; text-align: left; font-size: 0.9em; }
th { background: #f0f0f0; position: sticky; top: 0; }
td.text { white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, monospace; }
th.wide { width: 32%; }
tr.correct td { background: #eef8ee; }
"""


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str, ensure_ascii=False)


def samples_html(rows: Sequence[Mapping[str, Any]], title: str, summary: str = "") -> str:
    """A self-contained HTML page of `rows` (first HTML_ROWS), every text escaped."""
    columns = [c for c in HTML_COLUMNS if any(c in row for row in rows)]
    esc = html.escape  # quote=True: safe in text and in attribute values
    head = "".join(f'<th class="{"wide" if c in _WIDE else ""}">{esc(c)}</th>' for c in columns)
    body = []
    for row in rows[:HTML_ROWS]:
        cls = ' class="correct"' if row.get("correct") else ""
        cells = "".join(
            f'<td class="{"text" if c in _WIDE or c == "ground_truth" else ""}">{esc(_cell(row.get(c)))}</td>'
            for c in columns
        )
        body.append(f"<tr{cls}>{cells}</tr>")
    shown = f"showing the first {HTML_ROWS} of {len(rows)} rows; " if len(rows) > HTML_ROWS else ""
    note = f"{shown}{len(rows)} rows in all"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{_STYLE}</style></head><body>\n"
        f"<h1>{esc(title)}</h1>\n"
        f'<p class="summary">{esc(summary)}{" · " if summary else ""}{esc(note)}</p>\n'
        f"<table><thead><tr>{head}</tr></thead><tbody>\n" + "\n".join(body) + "\n</tbody></table>\n"
        "</body></html>\n"
    )


def write_samples(
    rows: Sequence[Mapping[str, Any]], out_dir: str | Path, name: str, title: str, summary: str = ""
) -> tuple[Path, Path]:
    """`out_dir/<name>.jsonl` (every row) and `out_dir/<name>.html` (the page); returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jsonl, page = out / f"{name}.jsonl", out / f"{name}.html"
    with jsonl.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(dict(row), default=str, ensure_ascii=False) + "\n")
    page.write_text(samples_html(rows, title, summary), encoding="utf-8")
    return jsonl, page
