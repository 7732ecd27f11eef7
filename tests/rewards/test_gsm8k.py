import pytest

from posttrain.errors import ConfigError, RewardError
from posttrain.rewards.gsm8k import SOLUTION_CLIP_CHARS, compute_score, extract_solution


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("She has 12 + 60 = 72 apples.\n#### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### $18", "18", 1.0),
        ("#### 72.0", "72", 1.0),  # numeric comparison
        ("#### 72", "72.00", 1.0),
        ("####72", "72", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### 5 then I changed my mind #### 6", "6", 1.0),  # the last one
        ("#### 5 then I changed my mind #### 6", "5", 0.0),
        ("The answer is 72", "72", 0.0),  # strict: no #### -> no answer
        ("#### 0.5", "0.50", 1.0),
        # exact, not within a relative tolerance: large answers off by one are wrong
        ("#### 1000000001", "1000000000", 0.0),
        ("#### 123456789100", "123456789012", 0.0),
        ("#### 0", "0.000000001", 0.0),
        ("#### 123456789012345678901", "123456789012345678901", 1.0),
    ],
)
def test_strict(response, ground_truth, expected):
    assert compute_score(response, ground_truth) == expected


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("The answer is 72.", "72", 1.0),  # the sentence's full stop is not part of the number
        ("I think 70, no wait, 72", "72", 1.0),
        ("72 apples and 3 oranges", "72", 0.0),  # the last number decides
        ("It costs $1,234.50 in total", "1234.5", 1.0),
        ("#### 72", "72", 1.0),
        ("no digits at all", "72", 0.0),
    ],
)
def test_flexible(response, ground_truth, expected):
    assert compute_score(response, ground_truth, method="flexible") == expected


def test_format_score_only_when_an_answer_was_found():
    assert compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert compute_score("the answer is 71", "72", format_score=0.1) == 0.0
    assert compute_score("#### 72", "72", score=2.0) == 2.0


def test_only_the_tail_is_searched():
    assert SOLUTION_CLIP_CHARS == 300
    # the answer is 400 characters before the end: outside the searched tail
    assert compute_score("#### 72" + "x" * 400, "72") == 0.0
    # a long response with the answer at the end is found
    assert compute_score("#### 1 " + "y" * 5000 + "\n#### 72", "72") == 1.0


def test_extract_solution():
    assert extract_solution("so #### 1,000,000.", "strict") == "1000000"
    assert extract_solution("nothing", "flexible") is None
    with pytest.raises(ConfigError, match="unknown gsm8k method 'fuzzy'; valid: strict, flexible"):
        extract_solution("#### 1", "fuzzy")


def test_non_numeric_ground_truth_is_an_error():
    with pytest.raises(RewardError, match="gsm8k ground truth is not a number: 'seventy'"):
        compute_score("#### 70", "seventy")
