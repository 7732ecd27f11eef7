import pytest

from posttrain.errors import RewardError
from posttrain.rewards.arithmetic import compute_score, extract_last_integer


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("The answer is 42.", "42", 1.0),
        ("3 + 4 = 7", "7", 1.0),
        ("x = -5", "-5", 1.0),
        ("10-3=7", "7", 1.0),  # "-3" is a number but the last one is 7
        ("7, or maybe 8", "7", 0.0),  # the last integer decides
        ("I don't know", "7", 0.0),
        ("", "0", 0.0),
        ("3.5", "5", 0.0),  # a decimal is not read as its fractional digits
        ("19.0", "19", 1.0),  # an integral decimal counts
        ("1,234", "1234", 1.0),  # thousands separators
        ("answer: 42", 42, 1.0),  # an int ground truth
        ("answer: 42", " 42\n", 1.0),
        ("answer: 0042", "42", 1.0),
    ],
)
def test_scores(response, ground_truth, expected):
    assert compute_score(response, ground_truth) == expected


def test_extract_last_integer():
    assert extract_last_integer("a 1 b -2 c") == -2
    assert extract_last_integer("none") is None
    assert extract_last_integer("pi is 3.14") is None


def test_non_integer_ground_truth_is_an_error():
    with pytest.raises(RewardError, match="arithmetic ground truth is not an integer: 'abc'"):
        compute_score("1", "abc")


def test_long_integers_are_read_exactly():
    """long_addition's long tail writes 20-digit sums: a float holds every integer only up to 2**53, so a
    correct answer scored 0 and a wrong neighbour 1."""
    assert compute_score("answer 12345678901234567890", "12345678901234567890") == 1.0
    assert compute_score("answer 1815072237673070562", "1815072237673070562") == 1.0
    for wrong in ("4611687117939015681", "4611687117939015780", "4611687117939015425"):
        assert compute_score(f"answer {wrong}", "4611687117939015680") == 0.0
    assert extract_last_integer("12345678901234567890.000") == 12345678901234567890
    assert extract_last_integer("12345678901234567890.5") is None
