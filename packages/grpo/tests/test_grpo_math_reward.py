"""``--reward math`` on a fixed table of answer forms, as math-verify documents its behaviour.

math-verify (Hugging Face) extracts the final answer from the response (every ``\\boxed{}``
first, else the last LaTeX or plain expression) and compares it with the gold answer
symbolically and numerically (``float_rounding=6``); units and ``\\text{}`` are stripped,
thousands separators read as one number, percentages as the number before ``%``. The table
pins the behaviour this build relies on; a math-verify upgrade that changes it fails here.
"""

from __future__ import annotations

import pytest

from posttrain.grpo.scoring import load_reward, math_reward, score
from posttrain.interface import RewardInput

# (label, response, reward)
TABLE: list[tuple[str, str, float]] = [
    # plain integers, with and without a marker or a box
    ("3", "3", 1.0),
    ("3", "The answer is 3.", 1.0),
    ("3", "\\boxed{3}", 1.0),
    ("3", "\\boxed{3}.", 1.0),
    ("3", "$3$", 1.0),
    ("42", "\\(42\\)", 1.0),
    ("7", "First I got 5, then the final answer is 7", 1.0),
    ("3", "4", 0.0),
    ("3", "so \\boxed{4}", 0.0),
    ("-2", "\\boxed{-2}", 1.0),
    ("-2", "2", 0.0),
    # several boxes are read together (boxed="all"): the set {7, 8}, neither answer alone
    ("8", "\\boxed{7} wait no \\boxed{8}", 0.0),
    ("7", "\\boxed{7} wait no \\boxed{8}", 0.0),
    # decimals
    ("3", "3.0", 1.0),
    ("3", "3.00", 1.0),
    ("1.5", "\\frac{3}{2}", 1.0),
    ("\\frac{3}{2}", "1.5", 1.0),
    # fractions
    ("0.5", "\\frac{1}{2}", 1.0),
    ("0.5", "1/2", 1.0),
    ("1/2", "0.5", 1.0),
    ("2/3", "\\frac{2}{3}", 1.0),
    ("\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}", 1.0),
    ("\\frac{1}{2}", "\\boxed{\\frac{2}{4}}", 1.0),
    ("\\frac{1}{3}", "0.333333", 1.0),  # equal to 6 decimal places
    ("\\frac{1}{3}", "0.33", 0.0),
    # thousands separators
    ("1000", "1,000", 1.0),
    ("1000", "\\boxed{1{,}000}", 1.0),
    ("1234567", "1,234,567", 1.0),
    ("1000", "1 000", 1.0),
    # units and text
    ("5", "5 apples", 1.0),
    ("5", "\\boxed{5 \\text{ apples}}", 1.0),
    ("12", "\\boxed{12\\text{ cm}}", 1.0),
    ("12", "12 cm", 1.0),
    ("30", "30\\%", 1.0),
    ("10", "\\boxed{ten}", 0.0),
    # equations, powers, roots, constants
    ("2", "x = 2", 1.0),
    ("2", "\\boxed{x=2}", 1.0),
    ("100", "10^2", 1.0),
    ("8", "2^3", 1.0),
    ("\\sqrt{2}", "\\boxed{\\sqrt{2}}", 1.0),
    ("\\sqrt{2}", "1.41421356", 1.0),
    ("\\pi", "\\boxed{\\pi}", 1.0),
    ("2\\pi", "\\boxed{2\\pi}", 1.0),
    # symbolic expressions, tuples, sets, intervals
    ("x+1", "\\boxed{1+x}", 1.0),
    ("x^2", "\\boxed{x \\cdot x}", 1.0),
    ("(1,2)", "\\boxed{(1, 2)}", 1.0),
    ("\\{1,2\\}", "\\boxed{\\{2,1\\}}", 1.0),
    ("[0,1]", "\\boxed{[0, 1]}", 1.0),
    # no answer at all
    ("42", "", 0.0),
    ("42", "I don't know", 0.0),
]


def test_the_table_is_big_enough() -> None:
    assert len(TABLE) >= 40
    assert {r for _, _, r in TABLE} == {0.0, 1.0}


@pytest.mark.parametrize(("label", "response", "expected"), TABLE)
def test_math_reward_table(label: str, response: str, expected: float) -> None:
    assert math_reward(response, label) == expected


def test_numeric_labels_and_the_named_builtin() -> None:
    reward = load_reward("math")
    inputs = [
        RewardInput(response="\\boxed{12}", prompt="q", label=12),
        RewardInput(response="12.5", prompt="q", label=12.5),
        RewardInput(response="13", prompt="q", label=12),
    ]
    assert [s.reward for s in score([reward], inputs)] == [1.0, 1.0, 0.0]


def test_an_unparsable_label_fails_the_sample_not_the_run() -> None:
    (scored,) = score([load_reward("math")], [RewardInput(response="3", prompt="q", label=None)])
    assert scored.reward is None
    assert scored.failure is not None
    assert scored.failure.reason == "ValueError"
    assert "label None" in str(scored.failure)
