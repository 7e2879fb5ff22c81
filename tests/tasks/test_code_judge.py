"""The CodeContests output judge (`ksjax.tasks.code_judge`): pure functions, no sandbox."""

import pytest

from ksjax.tasks import code_judge


@pytest.mark.parametrize("output, expected, match", [
    ("3\n", "3", True),
    ("  1 2\n3  \n\n", "1 2 3", True),  # whitespace-separated tokens, line breaks free
    ("YES", "yes", True),  # case-insensitive, as the CodeContests checker
    ("1 2", "1 2 3", False),
    ("", "0", False),
    ("0.3333343", "0.333333", True),  # within 1e-5 absolutely
    ("0.33335", "0.33333", False),
    ("123456789.5", "123456790.0", True),  # within 1e-5 relatively
    ("1e-7", "0", True),
    ("1.00002", "1", False),
    ("3.0", "3", True),  # a float and an integer token compare as numbers
    ("100000000000000000001", "100000000000000000000", False),  # integers exactly, any size
    ("-0", "0", True),
    ("+007", "7", True),
    ("9" * 5000, "9" * 5000, True),  # beyond int()'s 4300 digits
    ("9" * 5000 + "8", "9" * 5000 + "9", False),
    ("nan", "nan", True),
    ("nan", "0", False),
    ("inf", "1e400", False),
    ("1_000", "1000", False),  # not a number token in the checker's sense
    ("abc", "abd", False),
])
def test_outputs_match(output, expected, match):
  assert code_judge.outputs_match(output, expected) is match


@pytest.mark.parametrize("got, want, match", [
    (3, [3], True),  # APPS/TACO wrap return values in a list
    ([3], [3], True),
    ([1, 2], [[1, 2]], True),
    ([1, 2], [1, 2, 3], False),
    (0.1 + 0.2, 0.3, True),
    (1.0, 1.1, False),
    (True, 1, False),
    ({"a": [1.0000001]}, {"a": [1]}, True),
    ("x", "X", False),
    (None, None, True),
])
def test_call_result_matches(got, want, match):
  assert code_judge.call_result_matches(got, want) is match


def test_judge_gives_the_verdict_and_the_behaviour_majority_voting_groups_by():
  test = {"input": "1 2\n", "output": "3\n"}
  assert code_judge.judge("ok", b"  3 \n", test, call_based=False) == (True, b"3\x00")
  assert code_judge.judge("ok", b"4\n", test, call_based=False) == (False, b"4\x00")
  assert code_judge.judge("time_limit", b"3\n", test, call_based=False) == (
      False, b"\x00time_limit")
  call = {"input": [1, 2], "output": [3]}
  assert code_judge.judge("ok", b"3", call, call_based=True) == (True, b"3\x00")
  assert code_judge.judge("ok", b"not json", call, call_based=True) == (False, b"\x00unparsable")
  assert code_judge.as_text(["1 2", "3"]) == "1 2\n3"
  with pytest.raises(ValueError, match="a string or a list of lines"):
    code_judge.as_text(3)
