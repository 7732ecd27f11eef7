"""Shared fixtures: a small corpus and one tiny model directory built per test module."""

from pathlib import Path

import pytest

from posttrain.models import make_tiny_model

CORPUS = [
    f"Question: what is {a} + {b}? Answer: {a + b}.\nThe sum of {a} and {b} is {a + b}."
    for a in range(0, 200, 7)
    for b in range(3, 90, 11)
] + [
    "The quick brown fox jumps over the lazy dog.",
    "  Indented text,\ttabs and\n\nblank lines.",
    "Unicode: café, naïve, 日本語, emoji 🚀.",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A "tiny" preset model directory written by make_tiny_model."""
    return make_tiny_model("tiny", tmp_path_factory.mktemp("tiny") / "model", CORPUS, seed=0)
