"""Start-up validation of ml_collections configs.

Every check raises `ConfigError` whose message names the field and what it accepts; entry points
catch it, print that one line and exit with status 2 before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
  """A config field holds a value the run cannot accept."""


_MISSING = object()


def get(config: Any, field: str, default: Any = _MISSING) -> Any:
  """Reads a dotted field (`"model.dtype"`), raising ConfigError if it is absent and required."""
  node = config
  for part in field.split("."):
    if part in node if hasattr(node, "__contains__") else hasattr(node, part):
      node = node[part]
    elif default is not _MISSING:
      return default
    else:
      raise ConfigError(f"config.{field} is missing")
  return node


def choice(config: Any, field: str, choices: Iterable[Any], default: Any = _MISSING) -> Any:
  value = get(config, field, default)
  choices = tuple(choices)
  if value not in choices:
    raise ConfigError(
        f"config.{field}={value!r} is not accepted; expected one of {', '.join(map(repr, choices))}")
  return value


def integer(config: Any, field: str, *, lo: int | None = None, hi: int | None = None,
            default: Any = _MISSING, allow_none: bool = False) -> int | None:
  value = get(config, field, default)
  if value is None and allow_none:
    return None
  if isinstance(value, bool) or not isinstance(value, int):
    raise ConfigError(f"config.{field}={value!r} is not accepted; expected an integer{_range(lo, hi)}")
  if (lo is not None and value < lo) or (hi is not None and value > hi):
    raise ConfigError(f"config.{field}={value!r} is out of range; expected an integer{_range(lo, hi)}")
  return value


def real(config: Any, field: str, *, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False, hi_open: bool = False, default: Any = _MISSING) -> float:
  value = get(config, field, default)
  bounds = _range(lo, hi, lo_open, hi_open)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ConfigError(f"config.{field}={value!r} is not accepted; expected a finite number{bounds}")
  below = lo is not None and (value <= lo if lo_open else value < lo)
  above = hi is not None and (value >= hi if hi_open else value > hi)
  if below or above:
    raise ConfigError(f"config.{field}={value!r} is out of range; expected a number{bounds}")
  return float(value)


def boolean(config: Any, field: str) -> bool:
  value = get(config, field)
  if not isinstance(value, bool):
    raise ConfigError(f"config.{field}={value!r} is not accepted; expected True or False")
  return value


def string(config: Any, field: str, *, allow_none: bool = False) -> str | None:
  value = get(config, field)
  if value is None and allow_none:
    return None
  if not isinstance(value, str) or not value:
    raise ConfigError(f"config.{field}={value!r} is not accepted; expected a non-empty string"
                      + (" or None" if allow_none else ""))
  return value


def optional_real(config: Any, field: str, **bounds) -> float | None:
  """`real`, or None when the field holds None."""
  return None if get(config, field) is None else real(config, field, **bounds)


def int_tuple(config: Any, field: str, *, length: int | None = None,
              lo: int | None = None) -> tuple[int, ...]:
  value = get(config, field)
  ok = isinstance(value, (tuple, list)) and all(
      isinstance(v, int) and not isinstance(v, bool) for v in value) and len(value) > 0
  if ok and length is not None:
    ok = len(value) == length
  if ok and lo is not None:
    ok = all(v >= lo for v in value)
  if not ok:
    what = f"{length} integers" if length else "a non-empty tuple of integers"
    raise ConfigError(f"config.{field}={value!r} is not accepted; expected {what}"
                      + (f" >= {lo}" if lo is not None else ""))
  return tuple(value)


def distinct_levels(config: Any, field: str, levels: tuple[int, ...]) -> tuple[int, ...]:
  """A task's levels: a non-empty tuple of distinct levels among `levels`."""
  value = int_tuple(config, field, lo=1)
  if any(level not in levels for level in value) or len(set(value)) != len(value):
    raise ConfigError(f"config.{field}={value!r} is not accepted; expected distinct levels among "
                      f"{', '.join(map(str, levels))}")
  return value


def known_fields(config: Any, reference: Any, what: str, prefix: str = "") -> None:
  """Refuses fields that `reference` (the base config) does not define: a typo in a config
  file."""
  for key in config.keys():
    if key not in reference:
      raise ConfigError(f"config.{prefix}{key} is not a field of {what}; the fields "
                        f"are {', '.join(sorted(prefix + k for k in reference.keys()))}")
    value, ref = config[key], reference[key]
    if hasattr(ref, "keys") and hasattr(value, "keys"):
      known_fields(value, ref, what, f"{prefix}{key}.")


def _range(lo, hi, lo_open=False, hi_open=False) -> str:
  if lo is None and hi is None:
    return ""
  if hi is None:
    return f" {'>' if lo_open else '>='} {lo}"
  if lo is None:
    return f" {'<' if hi_open else '<='} {hi}"
  return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def parse_flags_or_exit(argv: list[str]) -> list[str]:
  """An absl `flags_parser` for binaries taking `--config=<file>` and `--config.field=value`.

  ml_collections loads the config file and applies overrides while absl parses the command line,
  so a config file that is missing or not valid Python, a misspelled field or a value of the wrong
  type surfaces there, as a traceback (a missing file only later, when the config is first read).
  This turns each into the one line and exit status 2 that every other bad input gets.
  """
  # Imported here: absl is only needed by binaries, not by library users of this module.
  import sys  # pylint: disable=g-import-not-at-top

  from absl import flags  # pylint: disable=g-import-not-at-top

  def refuse(what: str) -> None:
    print(f"ksjax: {what}", file=sys.stderr, flush=True)
    sys.exit(2)

  try:
    rest = flags.FLAGS(argv)
  except SyntaxError as e:  # raised by the config file's own code, which ml_collections executes
    refuse(f"config file {e.filename!r} is not valid Python (line {e.lineno}: {e.msg}); expected "
           "a Python file whose get_config() returns the config")
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError, OSError) as e:
    problem = config_file_problem(flags.FLAGS, argv, e)
    if problem:
      refuse(problem)
    if isinstance(e, OSError):
      raise
    lines = str(e).strip().strip('"').splitlines() or [type(e).__name__]
    what = (f"config has no field {lines[-1]}" if isinstance(e, (AttributeError, KeyError))
            else lines[-1])
    refuse(f"bad command-line flag or config override: {what}; expected a field of the config "
           "file with a value of its type")
  problem = config_file_problem(flags.FLAGS, argv)
  if problem:
    refuse(problem)
  return rest


def config_file_problem(flag_values: Any, argv: list[str],
                        error: BaseException | None = None) -> str | None:
  """One line for a config-file flag whose file could not be loaded, or None.

  ml_collections keeps a failed load as a placeholder object that raises OSError when first used
  (holding the load's error as `_error`), and when `--config.field=value` overrides are given,
  that OSError (`error`) ends the parse before the flag holds any value; so the file is also
  looked for on the command line.
  """
  import os  # pylint: disable=g-import-not-at-top

  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  for name in flag_values:
    flag = flag_values[name]
    try:
      config_flags.get_config_filename(flag)
    except TypeError:  # not a config flag
      continue
    except Exception:  # pylint: disable=broad-except
      pass  # a config flag that holds no value yet (its parse failed)
    try:
      load_error = vars(flag.value).get("_error") if flag.present else None
    except TypeError:  # a value without __dict__: not the placeholder
      load_error = None
    if not isinstance(load_error, OSError):
      load_error = error if isinstance(error, OSError) else None
    if load_error is None:
      continue
    given = [a.split("=", 1)[1] if "=" in a else b for a, b in zip(argv[1:], argv[2:] + [""])
             if a.startswith((f"--{name}=", f"-{name}=")) or a in (f"--{name}", f"-{name}")]
    path = (given[-1] if given else "").split(":", 1)[0]
    expected = "expected the path of an ml_collections config file (ksjax's are in configs/)"
    if not path:
      return f"--{name} names no config file; {expected}"
    if not os.path.exists(path):
      return f"config file {path!r} (--{name}) does not exist; {expected}"
    while load_error.__cause__ is not None:  # the load's own error, not the placeholder's
      load_error = load_error.__cause__
    return (f"config file {path!r} (--{name}) cannot be loaded "
            f"({one_line_of(load_error)}); {expected}")
  return None


def one_line_of(error: BaseException) -> str:
  """The last non-empty line of an error's message (ml_collections' carry a listing first)."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  return lines[-1] if lines else type(error).__name__
