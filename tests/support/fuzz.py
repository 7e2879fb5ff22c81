"""Fuzzing every input ksjax reads, with hypothesis: what the fuzz tests share.

The fuzz tests sit beside the package each reads with: the data readers in
`tests/tasks/test_fuzz_data.py`, GGUF headers and model checkpoints in
`tests/model/test_fuzz_model_files.py`, run checkpoint directories in
`tests/run/test_fuzz_checkpoints.py`, config overrides in `tests/test_fuzz_entry_points.py`.

Whatever the bytes, a bad input ends in one of the project's input-error types (the ones
`ksjax.errors` turns into one line and exit status 2) with a one-line message, writes nothing
and ends in bounded time; a traceback of any other type is a bug in the reader. Inputs start
from a valid one and have fields replaced by garbage, removed, or the file's bytes cut or
flipped, so that every check along the way is reached, not only the first.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import resource
import signal

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ksjax import errors

# Per example: a reader that takes longer is taken to hang (generous: the machine is shared).
HANG_SECONDS = 20
MEMORY_BYTES = 2 << 30  # per call, beyond what the process holds
# More examples for a deeper search: KSJAX_FUZZ_SCALE=10 python -m pytest tests -k fuzz
SCALE = int(os.environ.get("KSJAX_FUZZ_SCALE", "1"))
FUZZ = settings(max_examples=60 * SCALE, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Hang(Exception):
  pass


def _address_space() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[0]) * resource.getpagesize()


@contextlib.contextmanager
def bounded(seconds: float = HANG_SECONDS, memory_bytes: int | None = None):
  """The block raises Hang after `seconds` (SIGALRM; tests run in the main thread), and, given
  `memory_bytes`, MemoryError past that much address space more than it started with: a reader
  that runs away fails its test instead of taking the (shared) machine's memory. (Not around
  jax, XLA or tensorstore: their C++ allocators abort the process instead of raising.)"""
  def fire(*_):
    raise Hang(f"no result after {seconds} s")
  previous = signal.signal(signal.SIGALRM, fire)
  limits = resource.getrlimit(resource.RLIMIT_AS)
  if memory_bytes is not None:
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + memory_bytes, limits[1]))
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
    resource.setrlimit(resource.RLIMIT_AS, limits)


def tree(path) -> list[tuple[str, int, int]]:
  """(relative path, size, mtime) of everything under `path`: equal trees, nothing written."""
  out = []
  for root, dirs, names in os.walk(path):
    for name in sorted(dirs) + sorted(names):
      full = os.path.join(root, name)
      st_ = os.lstat(full)
      out.append((os.path.relpath(full, path), st_.st_size, st_.st_mtime_ns))
  return sorted(out)


def input_error_or_result(read, *args, where=None, memory_bytes=MEMORY_BYTES, **kwargs):
  """`read(*args)`'s result, or None when it refused the input: then its error must be an input
  error with a non-empty one-line message. Nothing may change under `where`; no hang (nor, given
  `memory_bytes`, a runaway allocation: see `bounded`)."""
  before = tree(where) if where is not None else None
  try:
    with bounded(memory_bytes=memory_bytes):
      return read(*args, **kwargs)
  except errors.input_error_types() as e:
    message = str(e)
    assert message.strip() and "\n" not in message, repr(message)
    return None
  finally:
    if where is not None:
      assert tree(where) == before


def assert_input_error(read, *args, match: str, memory_bytes=MEMORY_BYTES, **kwargs) -> str:
  """`read(*args)` refuses its input with an input error of one line matching `match`, in
  bounded time (and memory, given `memory_bytes`: see `bounded`)."""
  with pytest.raises(errors.input_error_types(), match=match) as e:
    with bounded(memory_bytes=memory_bytes):
      read(*args, **kwargs)
  assert "\n" not in str(e.value), str(e.value)
  return str(e.value)


# ---------------------------------------------------------------------------------------------
# Garbage
# ---------------------------------------------------------------------------------------------

# Strings that have broken readers elsewhere: digits that str.isdigit() accepts and int() does
# not, more digits than int() converts, empty and blank text, surrogates and control characters.
NASTY_STRINGS = ["", " ", "\n", "Level ?", "Level 0", "Level 10", "Level ²", "²", "٣", "Level ٣",
                 "Level -1", "Level 1.5", "1" * 5000, "Level " + "9" * 5000, "nan", "inf", "-0",
                 "\x00", "\ud800", "\\boxed{", "\\boxed{}", "\\boxed{1}", "{}", "[]", "null",
                 "1 second", "0 seconds", "-1 second", "1e999 seconds", "256 megabytes",
                 "0 megabytes", "99999999999999999999 gigabytes", "a b", "foo bar baz"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-3, 10),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from(NASTY_STRINGS))
json_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=8)
# Raw lines that json.dumps never writes: not JSON, numbers too long for int(), nesting deeper
# than the recursion limit, invalid UTF-8, NaN.
RAW_LINES = [b"{", b"not json", b"[1, 2]", b"\"text\"", b"{\"a\": " + b"1" * 5000 + b"}",
             b"[" * 100_000 + b"]" * 100_000, b"{\"a\": " + b"[" * 100_000 + b"]" * 100_000 + b"}",
             b"\xff\xfe\xb0", b"{\"problem\": \"\xff\"}", b"{\"a\": NaN}", b"{\"a\": 1e999}",
             b"\x00"]


@st.composite
def mutated(draw, record: dict, fields: dict | None = None):
  """`record` with some fields replaced by garbage (or by `fields[key]`'s plausible values),
  some removed, and maybe an unknown one added."""
  out = dict(record)
  for key in draw(st.lists(st.sampled_from(sorted(record)), unique=True, max_size=4)):
    choice = draw(st.integers(0, 3))
    if choice == 0:
      del out[key]
    elif choice == 1 and fields and key in fields:
      out[key] = draw(fields[key])
    else:
      out[key] = draw(json_values)
  if draw(st.booleans()):
    out[draw(st.text(max_size=6))] = draw(json_values)
  return out


@st.composite
def jsonl_bytes(draw, records):
  """A JSONL file: records, raw garbage lines, blank lines; maybe cut short or with bytes
  flipped."""
  lines = draw(st.lists(st.one_of(records.map(lambda r: json.dumps(r).encode()),
                                  st.sampled_from(RAW_LINES), st.just(b"")),
                        min_size=0, max_size=4))
  data = b"\n".join(lines) + (b"\n" if draw(st.booleans()) else b"")
  return draw(damaged(data))


@st.composite
def damaged(draw, data: bytes):
  """`data` as is, cut short, or with a few bytes replaced."""
  kind = draw(st.sampled_from(["as is", "as is", "cut", "flip"]))
  if kind == "cut" and data:
    return data[:draw(st.integers(0, len(data) - 1))]
  if kind == "flip" and data:
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 8))):
      data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)
  return data


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints
# ---------------------------------------------------------------------------------------------

@st.composite
def damage_to(draw, files: list[str]):
  """How to damage a checkpoint whose files (relative paths) are `files`: a list of
  (action, file, argument)."""
  actions = []
  for _ in range(draw(st.integers(1, 3))):
    action = draw(st.sampled_from(["delete", "truncate", "garbage", "flip", "json", "add"]))
    name = draw(st.sampled_from(files))
    if action == "add":
      name = os.path.join(os.path.dirname(name), draw(st.sampled_from(
          ["_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "junk", "checksums.sha256.json"])))
    argument = {"truncate": st.floats(0, 1), "garbage": st.binary(max_size=64),
                "flip": st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1,
                                 max_size=8),
                "json": json_values.map(lambda v: json.dumps(v).encode()),
                "add": st.one_of(st.binary(max_size=64),
                                 json_values.map(lambda v: json.dumps(v).encode())),
                "delete": st.none()}[action]
    actions.append((action, name, draw(argument)))
  return actions


def apply_damage(root: str, actions) -> None:
  """Applies `damage_to`'s actions to the checkpoint at `root`."""
  for action, name, argument in actions:
    path = os.path.join(root, name)
    if action == "add":
      os.makedirs(os.path.dirname(path), exist_ok=True)
      pathlib.Path(path).write_bytes(argument)
    elif not os.path.isfile(path):
      continue
    elif action == "delete":
      os.remove(path)
    elif action == "truncate":
      os.truncate(path, int(os.path.getsize(path) * argument))
    elif action in ("garbage", "json"):
      pathlib.Path(path).write_bytes(argument)
    elif action == "flip":
      data = bytearray(pathlib.Path(path).read_bytes())
      for where, value in argument:
        if data:
          data[min(len(data) - 1, int(len(data) * where))] = value
      pathlib.Path(path).write_bytes(bytes(data))


def relative_files(root: str) -> list[str]:
  """Every file under `root`, as paths relative to it (what `damage_to` picks from)."""
  return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root)
                for n in names)
