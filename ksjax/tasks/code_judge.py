"""The CodeContests output judge: whether what a program printed (or, for call-based TACO
problems, returned) is the expected output of a test.

Comparison follows the official CodeContests checker: outputs are split on whitespace and
lower-cased; token lists equal, or of equal length with every pair equal, where two numeric tokens
are equal if both are integers with the same value, or else if they differ by at most 1e-5
(absolutely; CodeContests uses only the absolute test, we also accept a relative 1e-5 so large
floats printed with fewer digits pass). Integers are compared exactly at any size.

The sandbox (`ksjax.tasks.sandbox`) runs the programs and calls `judge` in the trainer's process,
so expected outputs never reach the untrusted runner.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

FLOAT_TOLERANCE = 1e-5
_INT_RE = re.compile(r"[+-]?[0-9]+", re.ASCII)
_FLOAT_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)


def _tokens(text: str) -> list[str]:
  return text.lower().split()


def _integer_text(token: str) -> str:
  """An integer token without "+" and leading zeros ("-0" is "0"): equal texts, equal values.
  (int() refuses more than 4300 digits.)"""
  sign = "-" if token[0] == "-" else ""
  digits = token.lstrip("+-").lstrip("0") or "0"
  return digits if digits == "0" else sign + digits


def _numbers_match(a: str, b: str, tolerance: float) -> bool | None:
  """True/False for two numeric tokens; None when either is not a number."""
  if _INT_RE.fullmatch(a) and _INT_RE.fullmatch(b):
    return _integer_text(a) == _integer_text(b)
  if not (_FLOAT_RE.fullmatch(a) and _FLOAT_RE.fullmatch(b)):
    return None
  x, y = float(a), float(b)
  if not (math.isfinite(x) and math.isfinite(y)):
    return a == b
  return abs(x - y) <= tolerance or abs(x - y) <= tolerance * abs(y)


def outputs_match(output: str, expected: str, tolerance: float = FLOAT_TOLERANCE) -> bool:
  """The CodeContests checker (see the module docstring); `expected` is the reference."""
  got, want = _tokens(output), _tokens(expected)
  if got == want:
    return True
  if len(got) != len(want):
    return False
  for a, b in zip(got, want):
    if a != b and not _numbers_match(a, b, tolerance):
      return False
  return True


def values_match(got: Any, want: Any, tolerance: float = FLOAT_TOLERANCE) -> bool:
  """Equality of JSON values for call-based tests, with floats within `tolerance`; booleans
  equal only booleans (Python's True == 1 would let `return 1` pass for `true`)."""
  if isinstance(got, bool) or isinstance(want, bool):
    return isinstance(got, bool) and isinstance(want, bool) and got == want
  if isinstance(got, (int, float)) and isinstance(want, (int, float)):
    if isinstance(got, int) and isinstance(want, int):
      return got == want
    if not (math.isfinite(got) and math.isfinite(want)):
      return got == want
    return abs(got - want) <= tolerance or abs(got - want) <= tolerance * abs(want)
  if isinstance(got, list) and isinstance(want, list):
    return len(got) == len(want) and all(values_match(a, b, tolerance) for a, b in zip(got, want))
  if isinstance(got, dict) and isinstance(want, dict):
    return got.keys() == want.keys() and all(values_match(got[k], want[k], tolerance) for k in got)
  return got == want


def call_result_matches(got: Any, want: Any) -> bool:
  """As the APPS/TACO harness: the return value equals the expected output, or its only element
  when the expected output is a one-element list (how the datasets wrap return values)."""
  if values_match(got, want):
    return True
  return isinstance(want, list) and len(want) == 1 and values_match(got, want[0])


def _canonical(text: str) -> bytes:
  """Output as the checker reads it: the lower-cased whitespace tokens."""
  return " ".join(_tokens(text)).encode()


def as_text(value: Any) -> str:
  """Stdin as text; lists of lines (as some TACO problems store them) are joined."""
  if isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(v, str) for v in value):
    return "\n".join(value)
  raise ValueError(f"a stdin/stdout test is a string or a list of lines, not {type(value)}")


def judge(verdict: str, payload: bytes, test: Mapping[str, Any], call_based: bool
          ) -> tuple[bool, bytes]:
  """(passed, canonical behaviour bytes) of one test, from the runner's verdict ("ok" when the
  program ended normally) and what it printed (call-based: the return value as JSON). The
  behaviour bytes are what majority voting groups wrong programs by (`sandbox.Result.behaviour`):
  the output as the checker reads it, or how the test ended."""
  if verdict != "ok":
    return False, b"\x00" + verdict.encode()
  text = payload.decode("utf-8", errors="replace")
  if not call_based:
    return outputs_match(text, as_text(test["output"])), _canonical(text) + b"\x00"
  try:
    value = json.loads(text)
  except ValueError:
    return False, b"\x00unparsable"
  return call_result_matches(value, test["output"]), text.encode() + b"\x00"
