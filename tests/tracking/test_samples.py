"""Samples tables: JSONL rows and a self-contained HTML page whose texts are escaped."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

from posttrain.tracking.samples import HTML_ROWS, write_samples

EVIL = '<script>alert("x")</script> & <img src=x onerror=alert(1)>'


class Cells(HTMLParser):
    """The page's tags and the text of its table cells, as a browser would parse them."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.cells: list[str] = []
        self._in_cell = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append(tag)
        if tag == "td":
            self._in_cell, self.cells = True, [*self.cells, ""]

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._in_cell = False

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.cells[-1] += data


def test_samples_html_escapes_model_and_data_text(tmp_path: Path) -> None:
    rows = [
        {"index": 0, "prompt": EVIL, "response": "</td></tr></table><script>bad()</script>", "ground_truth": "42",
         "reward": 1.0, "correct": True},
        {"index": 1, "prompt": "2+2=", "response": "4\n\n<b>", "ground_truth": {"answer": "<4>"}, "reward": 0.0,
         "correct": False},
    ]  # fmt: skip
    jsonl, page = write_samples(rows, tmp_path / "samples", "val_step_3", "Validation <step 3>", "acc 0.5")
    assert [json.loads(line) for line in jsonl.read_text().splitlines()] == rows
    text = page.read_text()
    assert "<script>" not in text and "<img" not in text and "<b>" not in text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in text
    parsed = Cells()
    parsed.feed(text)
    assert "script" not in parsed.tags and "img" not in parsed.tags
    assert parsed.tags.count("tr") == 3 and parsed.tags.count("table") == 1  # the header row and 2 rows
    assert EVIL in parsed.cells and "</td></tr></table><script>bad()</script>" in parsed.cells
    assert '{"answer": "<4>"}' in parsed.cells
    assert "Validation &lt;step 3&gt;" in text
    # self-contained: no scripts, styles or images loaded from anywhere
    assert "src=" not in text.replace("src=x", "") and "href" not in text and "@import" not in text


def test_large_tables_show_the_first_rows(tmp_path: Path) -> None:
    rows = [{"index": i, "prompt": f"p{i}", "response": "r", "reward": 0.0} for i in range(HTML_ROWS + 5)]
    jsonl, page = write_samples(rows, tmp_path, "t", "t")
    assert len(jsonl.read_text().splitlines()) == HTML_ROWS + 5
    text = page.read_text()
    assert f"showing the first {HTML_ROWS} of {HTML_ROWS + 5} rows" in text
    assert text.count("<tr") == HTML_ROWS + 1
