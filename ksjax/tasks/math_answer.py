"""Pulling the final answer out of a solution or a model completion.

Two markers state an answer: the phrase the paper's prompt asks for ("The final answer is X") and
LaTeX's `\\boxed{X}` (or `\\fbox{X}`), which MATH's reference solutions and Llama-style answers use,
often together ("The final answer is $\\boxed{5}$").

Precedence: the marker that starts LAST in the text wins, whichever kind it is. Models revise
themselves ("... \\boxed{3}. Wait, ... The final answer is 4."), so the last statement is the final
one; and a `\\boxed{}` inside the final-answer phrase starts after the phrase, so it yields the same
answer either way. This is one rule ("the last answer stated counts") rather than a ranking of
marker kinds.

A `\\boxed{` whose braces never close (a completion cut off by the length limit) yields no answer:
the statement is incomplete, and falling back to an earlier box would reward a superseded answer.

Everything here is a linear scan over the text (no backtracking regular expressions, no recursion),
so a million-character completion or thousands of nested braces are cheap in the trainer process;
everything that could be expensive (parsing, comparing) happens in the checker's worker processes.
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_PHRASE = "final answer is"
_HOPE = "i hope it is correct"
# Math delimiters that may wrap the answer after the phrase: opening -> closing.
_DELIMITERS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))
# An escape (backslash and the character after it) or a brace: what brace matching looks at.
_BRACE_TOKENS = re.compile(r"\\.|[{}]", re.DOTALL)


def braced_end(text: str, open_index: int) -> int | None:
  """Index of the brace closing the group opened at `text[open_index] == "{"`, None if unclosed.

  Escaped braces (`\\{`, `\\}`: literal braces in LaTeX) do not count towards the nesting.
  """
  depth = 0
  for match in _BRACE_TOKENS.finditer(text, open_index):
    token = match.group()
    if token == "{":
      depth += 1
    elif token == "}":
      depth -= 1
      if depth == 0:
        return match.start()
  return None


def _box_argument(text: str, command_end: int) -> tuple[str | None, int]:
  """(argument, index after it) of a `\\boxed` command whose name ends at `command_end`.

  The argument is None when its braces never close.
  """
  i = command_end
  n = len(text)
  while i < n and text[i] in " \t":
    i += 1
  if i < n and text[i] == "{":
    end = braced_end(text, i)
    return (None, n) if end is None else (text[i + 1:end], end + 1)
  # `\boxed 5` (TeX takes one token as the argument): up to whitespace or a math delimiter.
  j = i
  while j < n and not text[j].isspace() and text[j] not in "$}":
    j += 1
  return (text[i:j] if j > i else None), j


def last_boxed(text: str) -> tuple[int, str | None] | None:
  """(start index, content) of the last `\\boxed`/`\\fbox` in `text`; None if there is none.

  The content is None when the last box's braces never close.
  """
  best = -1
  best_command = ""
  for command in _BOX_COMMANDS:
    pos = text.rfind(command)
    # `\fboxsep` and the like are other commands: the name must not continue with a letter.
    while pos >= 0 and pos + len(command) < len(text) and text[pos + len(command)].isalpha():
      pos = text.rfind(command, 0, pos)
    if pos > best:
      best, best_command = pos, command
  if best < 0:
    return None
  return best, _box_argument(text, best + len(best_command))[0]


def clean_answer(answer: str) -> str:
  """Removes what surrounds a stated answer: math delimiters, a `\\boxed{}` that is the whole
  answer, a final period, "I hope it is correct." (`"$\\boxed{5}$."` -> `"5"`)."""
  previous = None
  while answer != previous:
    previous = answer
    answer = answer.strip()
    lowered = answer.lower()
    hope = lowered.rfind(_HOPE)
    if hope >= 0 and not lowered[hope + len(_HOPE):].strip(" .!"):
      answer = answer[:hope]
      continue
    answer = answer.rstrip(".").strip()
    for opening, closing in _DELIMITERS:
      inner = answer[len(opening):len(answer) - len(closing)]
      # "$3$ and $5$" is not wrapped: its first delimiter closes before the end.
      if (len(answer) >= len(opening) + len(closing) and answer.startswith(opening)
          and answer.endswith(closing) and closing not in inner):
        answer = inner
        break
    for command in _BOX_COMMANDS:
      if answer.startswith(command):
        content, end = _box_argument(answer, len(command))
        # Only unwrap when the box is the whole answer (`\\boxed{5}`, not `\\boxed{5} + 1`).
        if content is not None and end == len(answer):
          answer = content
        break
  return answer


def _phrase_answer(text: str, start: int) -> str | None:
  """The answer stated after the phrase that ends at `start`."""
  rest = text[start:]
  stripped = rest.lstrip(" \t:")
  if stripped.startswith("\n"):
    stripped = stripped.lstrip()  # "The final answer is\n$$x$$": the answer is on the next line.
  for opening, closing in _DELIMITERS:
    if stripped.startswith(opening):
      end = stripped.find(closing, len(opening))
      if end >= 0:
        return stripped[len(opening):end]
      break
  for command in _BOX_COMMANDS:
    if stripped.startswith(command):
      return _box_argument(stripped, len(command))[0]
  line = stripped.split("\n", 1)[0]
  sentence_end = line.find(". ")
  if sentence_end >= 0:
    line = line[:sentence_end]
  return line


def extract_answer(text: str) -> str | None:
  """The final answer stated in `text` (see the module docstring for the rules), or None."""
  box = last_boxed(text)
  phrase_pos = text.lower().rfind(_PHRASE)
  if box is not None and box[0] > phrase_pos:
    answer = box[1]
  elif phrase_pos >= 0:
    answer = _phrase_answer(text, phrase_pos + len(_PHRASE))
  else:
    return None
  if answer is None:
    return None
  answer = clean_answer(answer)
  return answer or None


def canonical(answer: str) -> str:
  """A key under which textually identical answers (up to runs of whitespace) coincide.

  Only whitespace is normalised: anything more (dropping `\\left`, `\\!`, ...) belongs to the
  mathematical comparison, and two answers with the same key must be equal for certain.
  """
  return " ".join(answer.split())
