"""Fuzzing every input ksjax reads, with hypothesis: config overrides, the data readers (MATH
JSON, MATH-500 and HARP JSONL, CodeContests and TACO parquet, Arrow and JSON rows), GGUF headers
and checkpoint directories.

Whatever the bytes, a bad input ends in one of the project's input-error types (the ones
`ksjax.errors` turns into one line and exit status 2) with a one-line message, writes nothing
and ends in bounded time; a traceback of any other type is a bug in the reader. Inputs start
from a valid one and have fields replaced by garbage, removed, or the file's bytes cut or
flipped, so that every check along the way is reached, not only the first.

The subprocess cases (`python -m ksjax.main`) cost seconds each, so the config overrides are
fuzzed in process through the same parser and validation `ksjax.main` uses, and a handful of
them also through the binary.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from struct import error as struct_error

import gguf
import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet
import pytest
from absl import flags
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from ml_collections import config_dict, config_flags

from ksjax import config_validation, errors
from ksjax.model import gguf_io
from ksjax.run import checkpoints as run_checkpoints
from ksjax.run import spec as spec_lib
from ksjax.run.directory import RunDirectory
from ksjax.tasks import code_data, math_data

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG_FILE = str(REPO / "configs" / "pass_at_k.py")
# Per example: a reader that takes longer is taken to hang (generous: the machine is shared).
HANG_SECONDS = 20
MEMORY_BYTES = 2 << 30  # per call, beyond what the process holds
# More examples for a deeper search: KSJAX_FUZZ_SCALE=10 pytest tests/test_fuzz_inputs.py
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
# The data readers
# ---------------------------------------------------------------------------------------------

MATH_RECORD = {"problem": "What is $1 + 1$?", "level": "Level 2", "type": "Algebra",
               "solution": "It is $\\boxed{2}$."}
MATH_FIELDS = {"level": st.one_of(st.sampled_from(NASTY_STRINGS), st.integers(-2, 12).map(
    lambda n: f"Level {n}")), "solution": st.sampled_from(
        ["\\boxed{}", "\\boxed{2", "\\fbox{3}", "$\\boxed{\\frac{1}{2}}$", "no box", "\\boxed"])}


@FUZZ
@given(files=st.lists(st.one_of(mutated(MATH_RECORD, MATH_FIELDS).map(
    lambda r: json.dumps(r).encode()), st.sampled_from(RAW_LINES)).flatmap(damaged),
    min_size=1, max_size=3),
       names=st.lists(st.sampled_from(["1.json", "2.json", "x.json", "00.json", "3.txt"]),
                      min_size=3, max_size=3, unique=True))
def test_math_json_directories(files, names):
  with tempfile.TemporaryDirectory() as root:
    os.makedirs(os.path.join(root, "test", "algebra"))
    for name, data in zip(names, files):
      pathlib.Path(root, "test", "algebra", name).write_bytes(data)
    input_error_or_result(lambda: list(math_data.read_math_dir(root)), where=root)


MATH500_RECORD = {"problem": "What is $2 + 2$?", "solution": "$\\boxed{4}$", "answer": "4",
                  "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}
HARP_RECORD = {"problem": "Find $x$.", "answer": "3", "solution_1": "So $x = 3$.",
               "solution_2": "Or 3.", "year": "2019", "contest": "AMC", "number": 7,
               "level": 2, "subject": "algebra"}
IDS = {"unique_id": st.sampled_from(["a", "a", "b"]), "year": st.sampled_from(NASTY_STRINGS),
       "number": st.one_of(st.integers(), st.sampled_from(NASTY_STRINGS)),
       "level": st.one_of(st.integers(-2, 12), st.sampled_from(NASTY_STRINGS)),
       "answer": st.one_of(st.floats(), st.integers(), st.sampled_from(NASTY_STRINGS))}


@FUZZ
@given(data=st.sampled_from(["math500", "harp"]).flatmap(lambda fmt: st.tuples(
    st.just(fmt), jsonl_bytes(mutated(MATH500_RECORD if fmt == "math500" else HARP_RECORD,
                                      IDS)))))
def test_math500_and_harp_jsonl(data):
  fmt, content = data
  reader = {"math500": math_data.read_math500_jsonl, "harp": math_data.read_harp_jsonl}[fmt]
  with tempfile.TemporaryDirectory() as root:
    path = os.path.join(root, "test.jsonl")
    pathlib.Path(path).write_bytes(content)
    input_error_or_result(lambda: list(reader(path)), where=root)


def _cc_tests(n):
  return {"input": [f"{i}\n" for i in range(n)], "output": [f"{i}\n" for i in range(n)]}


CC_RECORD = {"name": "p", "description": "Echo.", "public_tests": _cc_tests(2),
             "private_tests": _cc_tests(2), "generated_tests": _cc_tests(1),
             "time_limit": {"seconds": 1, "nanos": 500}, "memory_limit_bytes": 1 << 28,
             "difficulty": 1, "source": 2, "input_file": "", "output_file": "",
             "solutions": {"language": [3, 2], "solution": ["print(input())", "x"]}}
CC_FIELDS = {
    "public_tests": st.one_of(st.integers(0, 6).map(_cc_tests), st.fixed_dictionaries(
        {"input": json_values, "output": json_values})),
    "time_limit": st.fixed_dictionaries({"seconds": json_values, "nanos": json_values}),
    "solutions": st.fixed_dictionaries({"language": json_values, "solution": json_values}),
    "memory_limit_bytes": st.one_of(st.integers(), st.floats()),
    "difficulty": st.one_of(st.integers(), st.text(max_size=5)),
}
TACO_SPEC = {"inputs": ["1\n"] * 5, "outputs": ["1\n"] * 5}
TACO_RECORD = {"question": "Echo.", "input_output": json.dumps(TACO_SPEC), "starter_code": "",
               "difficulty": "EASY", "solutions": json.dumps(["print(input())"]),
               "time_limit": "1 second", "memory_limit": "256 megabytes", "source": "x",
               "name": "echo"}
TACO_FIELDS = {
    "input_output": st.one_of(
        mutated({**TACO_SPEC, "fn_name": "f"}).map(json.dumps),
        st.sampled_from([raw.decode("utf-8", "replace") for raw in RAW_LINES])),
    "solutions": st.one_of(json_values.map(json.dumps),
                           st.sampled_from([raw.decode("utf-8", "replace") for raw in RAW_LINES])),
    "time_limit": st.one_of(st.floats(), st.integers(), st.sampled_from(NASTY_STRINGS)),
    "memory_limit": st.sampled_from(NASTY_STRINGS),
}
CODE_READERS = {"code_contests": (code_data.read_code_contests, CC_RECORD, CC_FIELDS),
                "taco": (code_data.read_taco, TACO_RECORD, TACO_FIELDS)}


def _json_rows(fmt):
  _, record, fields = CODE_READERS[fmt]
  return mutated(record, fields)


@FUZZ
@given(data=st.sampled_from(sorted(CODE_READERS)).flatmap(lambda fmt: st.tuples(
    st.just(fmt), st.sampled_from([".jsonl", ".json"]),
    st.lists(_json_rows(fmt), max_size=3), jsonl_bytes(_json_rows(fmt)),
    st.sampled_from(RAW_LINES))))
def test_code_readers_on_json_and_jsonl(data):
  fmt, suffix, rows, jsonl, raw = data
  content = jsonl if suffix == ".jsonl" else json.dumps(rows).encode() if rows else raw
  with tempfile.TemporaryDirectory() as root:
    path = os.path.join(root, "train" + suffix)
    pathlib.Path(path).write_bytes(content)
    input_error_or_result(lambda: list(CODE_READERS[fmt][0](path, min_tests=1)), where=root)


@pytest.mark.parametrize("solutions", [{"language": None, "solution": 1},
                                       {"language": [3], "solution": "print(1)"}, [3], "x"])
def test_code_contests_malformed_solutions_are_none(solutions, tmp_path):
  """Found by this fuzzing at KSJAX_FUZZ_SCALE=5 (a TypeError): the optional reference solutions,
  when not {language: [...], solution: [...]}, are none, as TACO's are."""
  path = tmp_path / "train.jsonl"
  path.write_text(json.dumps({**CC_RECORD, "solutions": solutions}) + "\n")
  (record,) = code_data.read_code_contests(str(path), min_tests=1)
  assert record["solutions"] == [] and len(record["tests"]) == 5


@pytest.mark.parametrize("seconds", ["1e999", "-1e999", "NaN", "Infinity"])
def test_code_contests_non_finite_time_limit_is_a_data_error(seconds, tmp_path):
  """JSON's 1e999 reads as inf (and Python's json takes NaN and Infinity): no time limit."""
  path = tmp_path / "train.jsonl"
  path.write_text(json.dumps(CC_RECORD).replace('"seconds": 1', f'"seconds": {seconds}') + "\n")
  message = assert_input_error(lambda: list(code_data.read_code_contests(str(path), min_tests=1)),
                               match=r"time_limit .* is not a finite number of seconds")
  assert str(path) in message


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e999])
def test_taco_non_finite_time_limit_is_none(value, tmp_path):
  """TACO's time limit is free text, read leniently: one it cannot read is none."""
  path = tmp_path / "train.jsonl"
  path.write_text(json.dumps({**TACO_RECORD, "time_limit": value}) + "\n")
  (record,) = code_data.read_taco(str(path), min_tests=1)
  assert record["time_limit_s"] is None


# Arrow columns: each field gets one type per file (a column has one type), values of that type.
ARROW_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)  # Arrow: UTF-8
ARROW_TYPES = {
    "string": (pa.string(), st.one_of(ARROW_TEXT, st.sampled_from(
        [t for t in NASTY_STRINGS if t.isascii() or t.isprintable()]))),
    "int": (pa.int64(), st.integers(-2**63, 2**63 - 1)),
    "float": (pa.float64(), st.floats()),
    "bool": (pa.bool_(), st.booleans()),
    "binary": (pa.binary(), st.binary(max_size=8)),
    "strings": (pa.list_(pa.string()), st.lists(ARROW_TEXT, max_size=3)),
    "ints": (pa.list_(pa.int64()), st.lists(st.integers(-5, 5), max_size=3)),
    "tests": (pa.struct([("input", pa.list_(pa.string())), ("output", pa.list_(pa.string()))]),
              st.fixed_dictionaries({"input": st.lists(ARROW_TEXT, max_size=6),
                                     "output": st.lists(ARROW_TEXT, max_size=6)})),
    "time": (pa.struct([("seconds", pa.int64()), ("nanos", pa.int64())]),
             st.fixed_dictionaries({"seconds": st.integers(-2**40, 2**40),
                                    "nanos": st.integers(-2**40, 2**40)})),
}


@st.composite
def arrow_table(draw, fmt):
  _, record, _ = CODE_READERS[fmt]
  names = draw(st.lists(st.sampled_from(sorted(record) + ["extra"]), unique=True, min_size=1))
  rows = draw(st.integers(0, 3))
  columns = {}
  for name in names:
    kind, values = ARROW_TYPES[draw(st.sampled_from(sorted(ARROW_TYPES)))]
    columns[name] = pa.array(draw(st.lists(st.one_of(st.none(), values), min_size=rows,
                                           max_size=rows)), type=kind)
  return pa.table(columns)


@FUZZ
@given(data=st.sampled_from(sorted(CODE_READERS)).flatmap(lambda fmt: st.tuples(
    st.just(fmt), st.sampled_from([".parquet", ".arrow"]), arrow_table(fmt),
    st.sampled_from(["as is", "as is", "cut", "flip"]), st.randoms(use_true_random=False))))
def test_code_readers_on_parquet_and_arrow(data):
  fmt, suffix, table, damage, rng = data
  with tempfile.TemporaryDirectory() as root:
    path = os.path.join(root, "train-00000-of-00001" + suffix)
    if suffix == ".parquet":
      pyarrow.parquet.write_table(table, path)
    else:
      with pa.OSFile(path, "wb") as sink, pyarrow.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    content = bytearray(pathlib.Path(path).read_bytes())
    if damage == "cut":
      content = content[:rng.randrange(len(content))]
    elif damage == "flip":
      for _ in range(rng.randint(1, 8)):
        content[rng.randrange(len(content))] = rng.randrange(256)
    pathlib.Path(path).write_bytes(bytes(content))
    # The shard prefix, as Hugging Face's files are named.
    input_error_or_result(lambda: list(CODE_READERS[fmt][0](os.path.join(root, "train"),
                                                            min_tests=1)), where=root)


# ---------------------------------------------------------------------------------------------
# Config overrides: `--config.<field>=<garbage>`
# ---------------------------------------------------------------------------------------------

def _leaf_fields(config, prefix=""):
  out = []
  for key in sorted(config.keys()):
    value = config[key]
    if isinstance(value, config_dict.ConfigDict):
      out += _leaf_fields(value, f"{prefix}{key}.")
    else:
      out.append(prefix + key)
  return out


FIELDS = _leaf_fields(spec_lib.run_config.embedded_task_config())
# What a user might type: numbers of every kind, tuples, Python literals, text; no NUL (argv
# cannot hold it).
override_values = st.one_of(
    st.integers().map(str), st.floats().map(repr), st.sampled_from(
        ["None", "True", "False", "''", "()", "(0,)", "(1,2,3)", "(-1,1,1)", "[]", "{}", "(",
         "1e999", "-0", "nan", "inf", "-1", "0", "1" * 5000, "0x10", "1_000", "Level 2",
         "pass_at_k", "loo", "math", "bandit", "float16", "/nonexistent", "a,b", "1,2", ",",
         "'a'", "\"", "(1,)*1000"]),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
            max_size=12))


def _parse(argv):
  """`ksjax.main`'s flag parsing in process: the config flag and its overrides (on a FlagValues
  of their own), through `config_validation.parse_flags_or_exit`. (config, None) or (None,
  (exit status, stderr))."""
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config file", flag_values=values,
                                  lock_config=True, sys_argv=argv)
  stderr = io.StringIO()
  saved, flags.FLAGS = flags.FLAGS, values
  try:
    with contextlib.redirect_stderr(stderr):
      config_validation.parse_flags_or_exit(argv)
    return values.config, None
  except SystemExit as e:
    return None, (e.code, stderr.getvalue())
  finally:
    flags.FLAGS = saved


def _validate(config):
  """What `ksjax.main` does with a parsed trainer config before anything else, through its
  error boundary: the TrainSpec, or (exit status, stderr)."""
  stderr = io.StringIO()
  try:
    with contextlib.redirect_stderr(stderr):
      return errors.boundary("ksjax", lambda argv: spec_lib.from_config(config))(["ksjax"]), None
  except SystemExit as e:
    return None, (e.code, stderr.getvalue())


def _one_line_exit_2(failure):
  code, stderr = failure
  lines = [line for line in stderr.splitlines() if line.strip()]
  assert code == 2 and len(lines) == 1 and lines[0].startswith("ksjax: "), (code, stderr)


@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")  # ml_collections
@settings(max_examples=300 * SCALE, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(overrides=st.lists(st.tuples(st.sampled_from(FIELDS), override_values), min_size=1,
                          max_size=3))
def test_config_overrides_in_process(overrides, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("cwd", numbered=True)
  argv = ["ksjax", f"--config={CONFIG_FILE}"] + [f"--config.{f}={v}" for f, v in overrides]
  with contextlib.chdir(workdir), bounded():
    config, failure = _parse(argv)
    if config is not None:
      spec, failure = _validate(config)
      assert (spec is None) == (failure is not None)
  event("accepted" if failure is None else "refused by the parser" if config is None else
        "refused by the validation")
  if failure is not None:
    _one_line_exit_2(failure)
  assert os.listdir(workdir) == []  # nothing written (the default workdir is relative)


@pytest.mark.parametrize("override, named", [
    ("--config.k=two", "config.k=two"),              # refused by the parser
    ("--config.eval.ks=(0,)", "config.eval.ks=(0,)"),  # refused by the validation
])
def test_config_overrides_through_the_binary(override, named, tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  result = subprocess.run([sys.executable, "-m", "ksjax.main", f"--config={CONFIG_FILE}",
                           override], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env)
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
  assert named in lines[0]
  assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# GGUF headers
# ---------------------------------------------------------------------------------------------

GGUF_CFG = dict(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=4, intermediate_size=16)
GGUF_TOKENS = ["a", "b", "c", "ab", "abc", "<s>", "</s>", "Ġ"]
GGUF_META = {  # key -> (value, GGUFValueType)
    "llama.block_count": (1, gguf.GGUFValueType.UINT32),
    "llama.context_length": (64, gguf.GGUFValueType.UINT32),
    "llama.embedding_length": (8, gguf.GGUFValueType.UINT32),
    "llama.feed_forward_length": (16, gguf.GGUFValueType.UINT32),
    "llama.attention.head_count": (2, gguf.GGUFValueType.UINT32),
    "llama.attention.head_count_kv": (1, gguf.GGUFValueType.UINT32),
    "llama.attention.key_length": (4, gguf.GGUFValueType.UINT32),
    "llama.rope.freq_base": (10000.0, gguf.GGUFValueType.FLOAT32),
    "llama.attention.layer_norm_rms_epsilon": (1e-5, gguf.GGUFValueType.FLOAT32),
    "tokenizer.ggml.model": ("gpt2", gguf.GGUFValueType.STRING),
    "tokenizer.ggml.pre": ("llama-bpe", gguf.GGUFValueType.STRING),
    "tokenizer.ggml.tokens": (GGUF_TOKENS, gguf.GGUFValueType.ARRAY),
    "tokenizer.ggml.token_type": ([1] * 5 + [3, 3, 1], gguf.GGUFValueType.ARRAY),
    "tokenizer.ggml.merges": (["a b", "ab c"], gguf.GGUFValueType.ARRAY),
    "tokenizer.ggml.bos_token_id": (5, gguf.GGUFValueType.UINT32),
    "tokenizer.ggml.eos_token_id": (6, gguf.GGUFValueType.UINT32),
    "tokenizer.ggml.add_bos_token": (True, gguf.GGUFValueType.BOOL),
    "tokenizer.chat_template": ("{{ messages }}", gguf.GGUFValueType.STRING),
}
SCALAR_TYPES = [gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32, gguf.GGUFValueType.INT64,
                gguf.GGUFValueType.UINT64, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.BOOL,
                gguf.GGUFValueType.STRING]
gguf_values = st.one_of(
    st.tuples(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 9)),
              st.just(gguf.GGUFValueType.UINT32)),
    st.tuples(st.integers(-2**31, 2**31 - 1), st.just(gguf.GGUFValueType.INT32)),
    st.tuples(st.integers(-2**63, 2**63 - 1), st.just(gguf.GGUFValueType.INT64)),
    st.tuples(st.floats(width=32), st.just(gguf.GGUFValueType.FLOAT32)),
    st.tuples(st.booleans(), st.just(gguf.GGUFValueType.BOOL)),
    st.tuples(st.one_of(st.text(max_size=8), st.sampled_from(["llama", "gpt2", "none", "linear"])),
              st.just(gguf.GGUFValueType.STRING)),
    st.tuples(st.lists(st.text(max_size=4), max_size=10), st.just(gguf.GGUFValueType.ARRAY)),
    st.tuples(st.lists(st.integers(-3, 9), min_size=1, max_size=10),
              st.just(gguf.GGUFValueType.ARRAY)),
)


def _gguf_tensors(shape_changes):
  """GGUF name -> float32 zeros of a tiny llama's tensors (numpy order), with `shape_changes`
  (name -> new shape, or None to leave the tensor out)."""
  from ksjax.model import hf_io  # pylint: disable=g-import-not-at-top
  from ksjax.model.config import LlamaConfig  # pylint: disable=g-import-not-at-top
  cfg = LlamaConfig(**GGUF_CFG, tie_embeddings=True)
  tensors = {gguf_io.gguf_name(m.hf_name): m.hf_shape for m in hf_io.tensor_maps(cfg)}
  tensors.update(shape_changes)
  return {name: np.zeros(shape, np.float32) for name, shape in tensors.items() if shape is not None}


def write_tiny_gguf(path, meta, tensors, arch="llama"):
  writer = gguf.GGUFWriter(str(path), arch)
  for key, (value, kind) in meta.items():
    sub = None
    if kind == gguf.GGUFValueType.ARRAY and value and isinstance(value[0], int):
      sub = gguf.GGUFValueType.INT32
    writer.add_key_value(key, value, kind, sub_type=sub)
  for name, array in tensors.items():
    writer.add_tensor(name, array)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@st.composite
def gguf_files(draw):
  meta = dict(GGUF_META)
  for key in draw(st.lists(st.sampled_from(sorted(GGUF_META)), unique=True, max_size=3)):
    if draw(st.booleans()):
      del meta[key]
    else:
      meta[key] = draw(gguf_values)
  names = sorted(_gguf_tensors({}))
  shape_changes = {}
  for name in draw(st.lists(st.sampled_from(names + ["rope_freqs.weight", "blk.9.x.weight"]),
                            unique=True, max_size=2)):
    shape_changes[name] = draw(st.one_of(st.none(), st.lists(st.integers(1, 9), min_size=1,
                                                             max_size=3).map(tuple)))
  arch = draw(st.sampled_from(["llama", "llama", "llama", "qwen2", ""]))
  return meta, shape_changes, arch, draw(st.sampled_from(["as is", "as is", "cut", "flip"])), \
      draw(st.randoms(use_true_random=False))


@FUZZ
@given(data=gguf_files())
def test_gguf_headers(data):
  meta, shape_changes, arch, damage, rng = data
  with tempfile.TemporaryDirectory() as root:
    path = os.path.join(root, "model.gguf")
    try:
      write_tiny_gguf(path, meta, _gguf_tensors(shape_changes), arch)
    except (ValueError, TypeError, OverflowError, struct_error):  # gguf cannot write it
      return
    content = bytearray(pathlib.Path(path).read_bytes())
    header = min(len(content), 2048)  # the metadata and tensor list, not the weights
    if damage == "cut":
      content = content[:rng.randrange(len(content))]
    elif damage == "flip":
      for _ in range(rng.randint(1, 8)):
        content[rng.randrange(header)] = rng.randrange(256)
    pathlib.Path(path).write_bytes(bytes(content))
    input_error_or_result(gguf_io.check_gguf, path, where=root)
    input_error_or_result(gguf_io.read_gguf_tokenizer, path, where=root)


# Bugs this fuzzing found in the GGUF reader, each pinned by an example.

def _gguf_with(path, *, meta=None, shape_changes=None):
  write_tiny_gguf(path, {**GGUF_META, **(meta or {})}, _gguf_tensors(shape_changes or {}))
  return str(path)


def test_gguf_one_dimensional_embedding_is_an_input_error(tmp_path):
  assert_input_error(gguf_io.check_gguf, _gguf_with(
      tmp_path / "m.gguf", shape_changes={"token_embd.weight": (8,)}),
                     match=r"'token_embd.weight' has shape \(8,\); expected 2 dimensions")


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
def test_gguf_token_lists_of_integers_are_an_input_error(tmp_path, key):
  assert_input_error(gguf_io.read_gguf_tokenizer, _gguf_with(
      tmp_path / "m.gguf", meta={key: ([1] * 8, gguf.GGUFValueType.ARRAY)}),
                     match=rf"metadata '{key}' holds 1 \(int\); expected a list of str")


def test_gguf_string_that_is_not_utf8_is_an_input_error(tmp_path):
  path = _gguf_with(tmp_path / "m.gguf",
                    meta={"tokenizer.ggml.pre": ("llama-bpX", gguf.GGUFValueType.STRING)})
  content = pathlib.Path(path).read_bytes()
  pathlib.Path(path).write_bytes(content.replace(b"llama-bpX", b"llama-bp\xff"))
  assert_input_error(gguf_io.read_gguf_tokenizer, path,
                     match=r"'tokenizer.ggml.pre' holds text that is not UTF-8")


def test_gguf_merge_of_unknown_tokens_is_an_input_error(tmp_path):
  path = _gguf_with(tmp_path / "m.gguf",
                    meta={"tokenizer.ggml.merges": (["a c"], gguf.GGUFValueType.ARRAY)})
  assert_input_error(gguf_io.read_gguf_tokenizer, path,
                     match=r"merges holds 'a c', whose 'ac' is not in tokenizer.ggml.tokens")


@pytest.mark.parametrize("count, match", [
    (9, r"run past the end of the file"),  # one more: the next field read as its last element
    (2**40, r"claims 1099511627776 elements, more than the \d+-byte file holds"),
    (2**64 - 1, r"claims 18446744073709551615 elements, more than the \d+-byte file holds")])
def test_gguf_array_longer_than_the_file_is_an_input_error(tmp_path, count, match):
  """An array length past what the file holds (a flipped byte) made gguf's reader loop over
  that many elements, reading past the end, until the memory ran out."""
  path = _gguf_with(tmp_path / "m.gguf")
  content = bytearray(pathlib.Path(path).read_bytes())
  key = b"tokenizer.ggml.token_type"
  at = content.index(key) + len(key) + 4 + 4  # the value's type (ARRAY), the items' (INT32)
  assert int.from_bytes(content[at:at + 8], "little") == 8
  content[at:at + 8] = count.to_bytes(8, "little")
  pathlib.Path(path).write_bytes(bytes(content))
  for read in (gguf_io.check_gguf, gguf_io.read_gguf_tokenizer):
    assert_input_error(read, path, match=r"truncated or corrupt GGUF file .*" + match)


@pytest.mark.parametrize("count", [0, 2, 4_000_000, 2**32 - 1])
def test_gguf_block_count_is_checked_against_the_blocks_present(tmp_path, count):
  """A block count in the millions (one flipped byte) used to build per-block tensor lists until
  the memory ran out; it is refused from the tensor list, before anything is built per block."""
  path = _gguf_with(tmp_path / "m.gguf",
                    meta={"llama.block_count": (count, gguf.GGUFValueType.UINT32)})
  assert_input_error(gguf_io.check_gguf, path,
                     match=rf"llama.block_count={count} but the file has tensors of blocks 0 to 0")


# ---------------------------------------------------------------------------------------------
# Checkpoint directories
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


def _damage(root: str, actions) -> None:
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


def _files(root: str) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root)
                for n in names)


TINY_LLAMA = dict(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=4, intermediate_size=16)


@pytest.fixture(scope="module")
def model_checkpoint_dir(tmp_path_factory):
  """A ksjax.model checkpoint (what config.init_checkpoint names) of a tiny Llama."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from ksjax import model  # pylint: disable=g-import-not-at-top
  cfg = model.LlamaConfig(**TINY_LLAMA)
  path = str(tmp_path_factory.mktemp("model_checkpoint") / "checkpoint")
  model.save_checkpoint(path, model.Llama(cfg, rngs=nnx.Rngs(0)))
  return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A run's checkpoints/ with two steps (manifests included), as the trainer saves them."""
  import grain  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  workdir = tmp_path_factory.mktemp("run")
  checkpointer = run_checkpoints.Checkpointer(str(workdir / "checkpoints"), save_every=1, keep=2,
                                              use_async=False)
  iterator = grain.MapDataset.source(list(range(8))).batch(2).to_iter_dataset().__iter__()
  for step in (1, 2):
    next(iterator)
    state = {"params": {"w": jnp.full((16,), float(step)), "b": jnp.zeros((2, 3))},
             "step": jnp.int32(step)}
    checkpointer.save(step, state, iterator, {"step": step})
  checkpointer.close()
  return str(workdir)


@settings(max_examples=25 * SCALE, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_init_checkpoint_directories(model_checkpoint_dir, data):
  from ksjax import model  # pylint: disable=g-import-not-at-top
  from ksjax.run import policy  # pylint: disable=g-import-not-at-top
  actions = data.draw(damage_to(_files(model_checkpoint_dir)))
  with tempfile.TemporaryDirectory() as root:
    path = os.path.join(root, "checkpoint")
    shutil.copytree(model_checkpoint_dir, path)
    _damage(path, actions)
    spec = spec_lib.ModelSpec(init_checkpoint=path)
    cfg = input_error_or_result(policy.policy_config, spec, 16, value_head=False, where=root,
                                memory_bytes=None)
    if cfg is not None:  # the config read: the weights next (ksjax.run.policy.build_model)
      input_error_or_result(model.load_checkpoint, path, where=root, memory_bytes=None)


@settings(max_examples=25 * SCALE, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_run_checkpoint_directories_as_the_eval_binary_reads_them(run_dir, data):
  """The eval binary's checks before it writes anything: the step list, then the manifest and
  the parameters' shapes of each selected step."""
  import jax  # pylint: disable=g-import-not-at-top
  actions = data.draw(damage_to(_files(run_dir)))
  target = {"w": jax.ShapeDtypeStruct((16,), np.float32),
            "b": jax.ShapeDtypeStruct((2, 3), np.float32)}
  with tempfile.TemporaryDirectory() as root:
    workdir = os.path.join(root, "run")
    shutil.copytree(run_dir, workdir)
    _damage(workdir, actions)
    run = RunDirectory(workdir)
    available = input_error_or_result(run_checkpoints.steps, run, where=root, memory_bytes=None)
    for step in available or ():
      input_error_or_result(run_checkpoints.check_shapes, run, step, target, "the model",
                            where=root, memory_bytes=None)


# Bugs this fuzzing found in ksjax.model.checkpoint, each pinned by an example.

def test_init_checkpoint_with_metadata_of_another_shape_is_an_input_error(model_checkpoint_dir,
                                                                          tmp_path):
  from ksjax.run import policy  # pylint: disable=g-import-not-at-top
  path = tmp_path / "checkpoint"
  shutil.copytree(model_checkpoint_dir, path)
  (path / "_METADATA").write_text('{"x": 1}')
  message = assert_input_error(
      policy.policy_config, spec_lib.ModelSpec(init_checkpoint=str(path)), 16, value_head=False,
      match="cannot be read as a checkpoint", memory_bytes=None)
  assert str(path) in message


def test_init_checkpoint_with_damaged_array_metadata_is_an_input_error(model_checkpoint_dir,
                                                                       tmp_path):
  from ksjax import model  # pylint: disable=g-import-not-at-top
  path = tmp_path / "checkpoint"
  shutil.copytree(model_checkpoint_dir, path)
  (path / "array_metadatas" / "process_0").write_bytes(b"")
  message = assert_input_error(model.load_checkpoint, str(path),
                               match="cannot be read as a checkpoint", memory_bytes=None)
  assert str(path) in message
