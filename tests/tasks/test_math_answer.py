"""Final-answer extraction: "The final answer is X" versus \\boxed{X}, and the edge cases of each."""

import pytest

from ksjax.tasks.math_answer import braced_end, canonical, clean_answer, extract_answer, last_boxed

EXTRACTION_CASES = [
    # (completion, extracted answer)
    ("So the answer is \\boxed{5}.", "5"),
    ("The final answer is $\\boxed{\\frac{1}{2}}$. I hope it is correct.", "\\frac{1}{2}"),
    # The marker that starts last wins, whichever kind it is.
    ("Thus x=\\boxed{3}. Checking again... The final answer is 4.", "4"),
    ("The final answer is 4. Hmm, actually \\boxed{3}", "3"),
    ("\\boxed{a} then \\boxed{b}", "b"),
    ("The final answer is 7. Let me redo it. The final answer is 8.", "8"),
    # Phrase forms.
    ("The final answer is: $\\frac{\\sqrt{3}}{2}$", "\\frac{\\sqrt{3}}{2}"),
    ("The Final Answer Is 3.5.", "3.5"),
    ("The final answer is 42. I hope it is correct.", "42"),
    ("The final answer is\n$$x^2$$\n", "x^2"),
    ("The final answer is $5$ dollars.", "5"),
    ("The final answer is \\(2\\sqrt{2}\\).", "2\\sqrt{2}"),
    ("The final answer is \\[(1, 2]\\]", "(1, 2]"),
    ("The final answer is \\boxed 5", "5"),
    ("Therefore, the final answer is: $\\boxed{-\\infty}$. I hope it is correct.", "-\\infty"),
    # Boxes: nested and escaped braces, \fbox, unclosed.
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{\\frac{\\sqrt{3}}{\\sqrt{2}}}", "\\frac{\\sqrt{3}}{\\sqrt{2}}"),
    ("\\fbox{7}", "7"),
    ("\\boxed{12", None),  # cut off by the length limit: no answer
    ("The final answer is 5 \\boxed{12", None),
    ("nothing stated, though 5 appears", None),
    ("The final answer is", None),
    ("", None),
]


@pytest.mark.parametrize("completion,expected", EXTRACTION_CASES)
def test_extract_answer(completion, expected):
  assert extract_answer(completion) == expected


def test_last_boxed_skips_other_commands_and_reports_position():
  text = "\\fboxsep=2pt \\boxed{1} and \\fbox{2} \\fboxrule"
  start, content = last_boxed(text)
  assert content == "2" and text[start:].startswith("\\fbox{2}")
  assert last_boxed("no box") is None


def test_braced_end_counts_only_unescaped_braces():
  text = "{a\\}b{c}d}e"
  assert braced_end(text, 0) == len(text) - 2
  assert braced_end("{\\\\}", 0) == 3  # "\\\\" is a line break, the brace after it closes
  assert braced_end("{{}", 0) is None


def test_deeply_nested_and_huge_completions_are_handled():
  depth = 50_000
  nested = "\\boxed{" + "{" * depth + "1" + "}" * depth + "}"
  assert extract_answer("x" * 1_000_000 + nested) == "{" * depth + "1" + "}" * depth
  assert extract_answer("The final answer is " + "1" * 1_000_000) == "1" * 1_000_000


def test_clean_answer_and_canonical():
  assert clean_answer(" $\\boxed{5}$. ") == "5"
  assert clean_answer("\\boxed{5} + 1") == "\\boxed{5} + 1"  # the box is not the whole answer
  assert clean_answer("$3$ and $5$") == "$3$ and $5$"  # not one wrapped expression
  assert canonical("  \\frac{1}{2}\n +  x ") == "\\frac{1}{2} + x"
