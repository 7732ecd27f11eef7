"""The shapes task's rule scorer, registered under the task's data_source; expected scores worked out by hand."""

from __future__ import annotations

import pytest

from posttrain.data.tasks.shapes import DATA_SOURCE, write_shapes_dataset
from posttrain.errors import RewardError
from posttrain.rewards import default_compute_score, get_scorer
from posttrain.rewards.shapes import compute_score, last_color


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("3", "3", 1.0),  # what the SFT model answers: the number alone
        ("There are 3 squares.", "3", 1.0),
        ("2 or 3? 4", "4", 1.0),  # the last integer decides
        ("4", "3", 0.0),
        ("three", "3", 0.0),  # digits only, as the rows' answers
        ("", "1", 0.0),
        ("3.5", "3", 0.0),  # a decimal is not a count
        ("red", "red", 1.0),
        ("The square is Blue.", "blue", 1.0),  # any case, punctuation around the word
        ("red, no: green", "green", 1.0),  # the last colour name decides
        ("green, no: red", "green", 0.0),
        ("reddish", "red", 0.0),  # whole words only
        ("yellow", "YELLOW ", 1.0),  # ground truth compared lower-cased and stripped
        ("1", "red", 0.0),
    ],
)
def test_scores(response: str, ground_truth: str, expected: float) -> None:
    assert compute_score(response, ground_truth) == expected


def test_registered_under_the_tasks_data_source() -> None:
    assert DATA_SOURCE == "shapes"
    assert get_scorer("shapes") is compute_score
    assert default_compute_score("shapes", "2", "2", extra_info={"kind": "count"}) == 1.0


def test_last_color() -> None:
    assert last_color("Red then BLUE then purple") == "blue"  # purple is not one of the task's colours
    assert last_color("no colour here") is None


def test_bad_ground_truth_is_an_error() -> None:
    with pytest.raises(RewardError, match="shapes ground truth 'purple' is neither an integer count nor"):
        compute_score("purple", "purple")


def test_scores_the_rows_the_task_writes(tmp_path) -> None:
    """Each written row's own answer scores 1, another row's wrong answer 0 (both kinds)."""
    import pyarrow.parquet as pq

    for kind in ("count", "color"):
        files = write_shapes_dataset(tmp_path / kind, n_train=8, n_test=2, kind=kind, seed=1)
        rows = pq.read_table(files["train"]).to_pylist()
        for row in rows:
            truth = row["reward_model"]["ground_truth"]
            assert row["data_source"] == "shapes"
            assert default_compute_score("shapes", row["extra_info"]["answer"], truth) == 1.0
            wrong = "9" if kind == "count" else next(c for c in ("red", "blue") if c != truth)
            assert default_compute_score("shapes", wrong, truth) == 0.0
