"""reasoning-gym's procedural datasets as a chat task: one dataset or a weighted mix of them.

reasoning-gym (`pip install -e ".[gym]"`, pinned to 0.1.25) generates problems with verifiers
from seeds: arithmetic, algebra, counting, puzzles, games. Each dataset's `score_answer(answer,
entry)` grades an extracted answer, some with partial credit (countdown gives 0.05 for a wrong
expression over the right numbers, gsm_symbolic 0.01 for any wrong number). This task serves
them to an instruct model in its own chat template and trains on the dataset's own grades.

Mix. `datasets` is one name ("chain_sum") or a weighted mix ("chain_sum:2,leg_counting:1"); each
dataset's options go to its reasoning-gym config (`options={"chain_sum": {"max_terms": 3}}`),
except seed and size, which the task sets. A dataset is a level here: `metadata["level"]` is its
name, so the trainer's and the evaluation's per-level breakdowns are per dataset. The training
split holds `train_per_level` problems times the dataset's weight (rounded, at least one), so the
trainer's uniform shuffle draws each dataset in proportion to its weight; the test split holds
`test_per_level` problems of each dataset, so that every dataset's held-out figures rest on the
same number of problems.

Splits. reasoning-gym makes item i of a dataset seeded s from `Random(s + i)`, so two datasets
with different seeds s and s' share items whenever |s - s'| is below their sizes: different
seeds alone do not keep the splits apart. Here each dataset gets a base seed from (seed, name);
test problems come from the generator seeded base, training problems from the one seeded
base + SEED_STRIDE, and neither draws SEED_STRIDE items, so the two splits never share a random
state. Small problem spaces still repeat a question from different states (leg counting with few
animals), so training also skips every question text that is in the test split (of any dataset)
and every question it already holds. The test split does not depend on the training split's size.

Prompts. The question, a blank line and `instruction` (reasoning-gym's answer format, the
`<answer>...</answer>` tags) form the user message, rendered by the checkpoint's chat template
(`ksjax.tasks.chat`) and tokenized with BOS never doubled, as in `ksjax.tasks.arithmetic`.

Extraction (`extract_answer`). The answer is the text inside the last `<answer>...</answer>`,
stripped, as reasoning-gym's `extract_answer` reads it; except that among nested opening tags the
innermost one counts (reasoning-gym takes the first), and the scan is linear. An opening tag after
the last closing one means the completion was cut off mid-answer: no answer, rather than a
fallback reading of an incomplete one. Without tags, a fallback: for a gold answer that is a
number, the number the completion states (`ksjax.tasks.arithmetic.extract_answer`: a box, "the
answer is", else the last number); otherwise its last non-empty line without Markdown emphasis.
`metrics()` reports how often each path was taken, so a policy that learns the format (or loses
it) shows in the logs rather than only in the reward.

Scoring. Rewards are the dataset's grades mapped onto the run's reward range:
reward = wrong_reward + (correct_reward - wrong_reward) * score, so correct_reward=1 and
wrong_reward=0 give `score_answer` itself, partial credit included; a completion is correct at
full credit (score >= 1). Completions without an answer get the grade of `score_answer(None)`.
Model output is adversarial input to the verifiers: some parse it with `Fraction` (whose
"1e999999999" is a ten-digit number with a billion zeros) and several pass it to `eval` or
SymPy's `parse_expr`, which executes Python. So the grades are computed in a pool of worker
processes (`ScorePool`), each call under a soft deadline (an interval timer, which stops Python
code such as that power) and a hard one (the pool is killed, for code deaf to signals), with an
address-space limit; a call that fails, times out or returns a non-finite grade scores 0. Datasets whose verifier runs the answer as code are refused (`EXCLUDED`), except the
two arithmetic-expression games whose answers are first checked against a grammar of integers,
+ - * / and parentheses (`GUARDED`; an answer outside it is graded as an empty one).

Answer classes (majority voting). Answers fall into the same class when the dataset's verifier
would compare them as equal: exact text for the datasets that use reasoning-gym's default
(string equality), the decimal value for those comparing decimals, lower case for those ignoring
case, and so on (`_CLASS_KEYS`); and the class also carries the grade, so completions in one
class always share a reward even where a verifier's partial credit is finer than the key.
Completions without an answer share one class.

No dataset fetches anything: reasoning-gym 0.1.25 generates in memory, and the few datasets that
read word lists or ARC tasks read files inside the installed package.
"""

from __future__ import annotations

import collections
import dataclasses
import decimal
import math
import multiprocessing
import os
import queue
import re
import resource
import signal
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ksjax import config_fields as cf
from ksjax import config_validation as cv
from ksjax.config_validation import ConfigError
from ksjax.tasks import arithmetic
from ksjax.tasks.base import GroupScore, Prompt, Task, answer_classes
from ksjax.tasks.chat import ChatTemplate
from ksjax.tokenization import Tokenizer

SPLITS = ("train", "test")
INSTALL = 'pip install -e ".[gym]"'
DEFAULT_INSTRUCTION = "Give your final answer between <answer> and </answer> tags."
# Test problems come from seeds base .. base + SEED_STRIDE - 1, training ones from base +
# SEED_STRIDE on (module docstring); neither split draws more than this many items.
SEED_STRIDE = 1 << 24
RESERVED_OPTIONS = ("seed", "size")  # set by the task, per split

# Datasets this task does not serve, and why.
EXCLUDED = {
    "composite": "a mix of its own: list the datasets in config.reasoning_gym.datasets",
    **{name: "its verifier runs the model's answer as Python code (eval)" for name in (
        "binary_matrix", "n_queens", "spiral_matrix", "string_insertion")},
    **{name: "its verifier parses the model's answer with SymPy's parse_expr, which runs code"
       for name in ("polynomial_multiplication", "simple_integration",
                    "intermediate_integration")},
}
# Verifiers that parse the answer with parse_expr, served behind a grammar: integers, + - * /,
# parentheses and spaces, at most 200 characters, no "**" (a power tower would not finish).
_EXPRESSION = re.compile(r"[0-9+\-*/() ]{1,200}")
GUARDED = ("countdown", "puzzle24")

_NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:,[0-9]{3})*(?:\.[0-9]*)?|\.[0-9]+)")
_FIRST_NUMBER = re.compile(r"\b-?\d+(?:\.\d+)?\b")  # gsm_symbolic's own reading of an answer
_OPEN, _CLOSE = "<answer>", "</answer>"
_EMPHASIS = " \t*_`"

# How an answer was read (`extract_answer`); `metrics()` reports the share of each.
TAGGED, FALLBACK, NONE, CUT = "tagged", "fallback", "none", "cut_off"


def _decimal_key(answer: str, *, commas: bool) -> Any:
  text = answer.replace(",", "") if commas else answer.strip()
  try:
    value = decimal.Decimal(text)
  except (decimal.InvalidOperation, ValueError):
    return answer
  return ("decimal", str(value.normalize())) if value.is_finite() else answer


def _first_number_key(answer: str) -> Any:
  match = _FIRST_NUMBER.search(answer)
  return ("number", float(match.group(0))) if match else answer


# How answers are told apart for majority voting: the key each verifier effectively compares
# (module docstring). The default, exact text, is reasoning-gym's base `score_answer`.
_CLASS_KEYS: dict[str, Callable[[str], Any]] = {
    "chain_sum": lambda a: _decimal_key(a, commas=True),   # utils.compute_decimal_reward
    "products": lambda a: _decimal_key(a, commas=True),
    "decimal_chain_sum": lambda a: _decimal_key(a, commas=False),
    "gsm_symbolic": _first_number_key,                     # the first number, as a float
    "spell_backward": str.lower,
    "family_relationships": lambda a: a.strip().lower(),
    "dice": lambda a: a.lower().replace("\n", ""),
    "countdown": lambda a: "".join(a.split()),             # an expression: spacing is no matter
    "puzzle24": lambda a: "".join(a.split()),
}


def parse_mix(text: Any, field: str = "config.reasoning_gym.datasets") -> tuple[tuple[str, float],
                                                                              ...]:
  """(name, weight) pairs of "name" or "name:weight,name:weight" (weight 1 when not given).

  Raises ConfigError naming `field` for anything else: empty names or items, a weight that is
  not a finite number > 0, a name given twice.
  """
  accepted = ("expected a reasoning-gym dataset name or a weighted mix such as "
              "'chain_sum:2,leg_counting:1' (weights finite and > 0, each name once)")
  if not isinstance(text, str) or not text.strip():
    raise ConfigError(f"{field}={text!r} is not accepted; {accepted}")
  mix = []
  for item in text.split(","):
    name, _, weight = item.strip().partition(":")
    name = name.strip()
    try:
      value = float(weight) if weight.strip() else 1.0
    except ValueError:
      value = math.nan
    if not re.fullmatch(r"[a-z0-9_]+", name) or not (math.isfinite(value) and value > 0):
      raise ConfigError(f"{field}={text!r} is not accepted (item {item.strip()!r}); {accepted}")
    if name in dict(mix):
      raise ConfigError(f"{field}={text!r} is not accepted ({name!r} twice); {accepted}")
    mix.append((name, value))
  return tuple(mix)


def _frozen(value: Any) -> Any:
  if isinstance(value, (list, tuple)):
    return tuple(_frozen(v) for v in value)
  return value


def freeze_options(value: Any, field: str = "config.reasoning_gym.options") -> tuple:
  """{dataset: {option: value}} (dicts or ConfigDicts; None for none) as a hashable, sorted
  ((dataset, ((option, value), ...)), ...), lists made tuples. ConfigError naming `field` for
  anything that is not a mapping of option mappings."""
  if isinstance(value, tuple) and all(isinstance(v, tuple) and len(v) == 2 for v in value):
    value = thaw_options(value)  # already frozen (a spec made from another spec's fields)
  value = value.to_dict() if hasattr(value, "to_dict") else value
  if value is None:
    return ()
  accepted = "expected None or {dataset: {option: value}} for the datasets it names"
  if not isinstance(value, Mapping):
    raise ConfigError(f"{field}={value!r} is not accepted; {accepted}")
  frozen = []
  for name, opts in sorted(value.items()):
    opts = {} if opts is None else opts
    if not isinstance(opts, Mapping) or not all(isinstance(k, str) for k in opts):
      raise ConfigError(f"{field}.{name}={opts!r} is not accepted; {accepted}")
    frozen.append((str(name), tuple(sorted((k, _frozen(v)) for k, v in opts.items()))))
  return tuple(frozen)


def thaw_options(frozen: tuple) -> dict[str, dict[str, Any]]:
  """`freeze_options`' result as {dataset: {option: value}}."""
  return {name: dict(opts) for name, opts in frozen}


def _import_reasoning_gym(field: str):
  try:
    import reasoning_gym  # pylint: disable=import-outside-toplevel
    from reasoning_gym import factory  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ConfigError(f"{field}: the reasoning_gym task needs the reasoning-gym package; "
                      f"install it with {INSTALL}") from None
  return reasoning_gym, factory.DATASETS


def check_datasets(mix: Sequence[tuple[str, float]], options: Mapping[str, Mapping[str, Any]],
                   prefix: str = "config.reasoning_gym") -> dict[str, dict[str, Any]]:
  """Each dataset's options, checked against reasoning-gym: known, served names (`EXCLUDED`),
  option names its config defines (not `RESERVED_OPTIONS`), values its `validate()` accepts.

  Raises ConfigError naming the field under `prefix` and what it accepts.
  """
  reasoning_gym, registered = _import_reasoning_gym(f"{prefix}.datasets")
  names = [name for name, _ in mix]
  served = sorted(n for n in registered if n not in EXCLUDED)
  for name in names:
    if name in EXCLUDED:
      raise ConfigError(f"{prefix}.datasets names {name!r}, which this task does not serve: "
                        f"{EXCLUDED[name]}")
    if name not in registered:
      raise ConfigError(f"{prefix}.datasets names {name!r}, which is not a reasoning-gym "
                        f"dataset; expected one of {', '.join(served)}")
  unknown = [name for name in options if name not in names]
  if unknown:
    raise ConfigError(f"{prefix}.options.{unknown[0]} is not accepted: {unknown[0]!r} is not in "
                      f"{prefix}.datasets ({', '.join(names)}); expected options of those")
  checked = {}
  for name in names:
    given = dict(options.get(name) or {})
    config_cls = registered[name][1]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED_OPTIONS]
    for key in given:
      if key not in fields:
        raise ConfigError(f"{prefix}.options.{name}.{key} is not accepted; expected options of "
                          f"{config_cls.__name__}: {', '.join(fields)} (seed and size are the "
                          "task's)")
    try:  # a config's validate() misses some combinations: its first problem is the test
      reasoning_gym.create_dataset(name, **given, seed=0, size=1)[0]
    except Exception as e:  # pylint: disable=broad-except
      raise ConfigError(f"{prefix}.options.{name}={given!r} is not accepted by reasoning-gym's "
                        f"{config_cls.__name__}: {type(e).__name__}: {e}") from None
    checked[name] = given
  return checked


def _held_mix(config: Any, name: str) -> str:
  """Config field `name` as written, if `parse_mix` accepts it."""
  text = cv.get(config, name)
  parse_mix(text, f"config.{name}")
  return text


@dataclasses.dataclass(frozen=True)
class ReasoningGymOptions(cf.Spec, path="reasoning_gym"):
  """The task's options in a run's config (config.reasoning_gym); also `ReasoningGymTask`'s
  defaults. A level is a dataset: its name is the per-level breakdown's key."""
  datasets: str = cf.field("chain_sum", "a dataset, or a weighted mix \"chain_sum:2,dice:1\"",
                           check=_held_mix)
  # A config file sets it to a dict; --config.reasoning_gym.options.<d>.<o>= then overrides the
  # options it names. Held frozen: ((dataset, ((option, value), ...)), ...).
  options: Any = cf.field(None, "{dataset: {option: value}} for each dataset's reasoning-gym "
                          "config (not seed or size); None: the defaults",
                          check=lambda c, name: freeze_options(cv.get(c, name), f"config.{name}"))
  seed: int = cf.field(0, "fixes the train and test problems (independent of the run's seed)",
                       lo=0, hi=2**32 - 1)
  train_per_level: int = cf.field(500, "training problems of a dataset of weight 1", lo=1)
  test_per_level: int = cf.field(32, "test problems of each dataset", lo=1)

  def values(self) -> dict[str, Any]:
    """The options as `ReasoningGymTask` takes them (`options` a mapping)."""
    return {**super().values(), "options": thaw_options(self.options)}

  def check_served(self) -> None:
    """`check_datasets` on reasoning-gym itself: needs the package, so it runs only for a run of
    this task (ConfigError)."""
    check_datasets(parse_mix(self.datasets), thaw_options(self.options), f"config.{self.PATH}")


def extract_answer(completion: str, gold: str = "") -> tuple[str | None, str]:
  """(answer, how): the answer a completion states and the rule that found it, one of TAGGED,
  FALLBACK, NONE (nothing found) and CUT (an answer tag left open: cut off mid-answer).

  `gold` chooses the fallback: a number's reading for a numeric gold, else the last line.
  Linear in the completion's length.
  """
  if not isinstance(completion, str):
    return None, NONE
  close = completion.rfind(_CLOSE)
  if completion.find(_OPEN, close + 1 if close >= 0 else 0) >= 0:
    return None, CUT
  if close >= 0:
    start = completion.rfind(_OPEN, 0, close)
    if start >= 0:
      return completion[start + len(_OPEN):close].strip(), TAGGED
  if _NUMBER.fullmatch(gold.strip()):
    answer = arithmetic.extract_answer(completion)
  else:
    lines = [line.strip(_EMPHASIS) for line in completion.splitlines()]
    answer = next((line for line in reversed(lines) if line), None)
  return (answer, FALLBACK) if answer else (None, NONE)


def class_key(dataset: str, answer: str) -> Any:
  """The key under which `dataset`'s verifier compares `answer` (module docstring)."""
  return _CLASS_KEYS.get(dataset, lambda a: a)(answer)


def guard(dataset: str, answer: str | None) -> str | None:
  """The answer as the verifier may see it: for `GUARDED` datasets, "" unless it is an
  arithmetic expression of the grammar (module docstring)."""
  if dataset in GUARDED and answer is not None:
    if not _EXPRESSION.fullmatch(answer) or "**" in answer:
      return ""
  return answer


def dataset_seed(seed: int, name: str) -> int:
  """The base seed of dataset `name`: a function of the task's seed and the name only, so that
  adding a dataset to the mix leaves the others' test problems as they were."""
  state = np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(1)
  return int(state[0]) >> 1  # 31 bits: base + SEED_STRIDE + draws stays far from any limit


def train_counts(mix: Sequence[tuple[str, float]], train_per_level: int) -> dict[str, int]:
  """Training problems per dataset: `train_per_level` times its weight, rounded, at least one."""
  return {name: max(1, round(train_per_level * weight)) for name, weight in mix}


@dataclasses.dataclass(frozen=True)
class Problem:
  """One reasoning-gym item: its dataset and the entry its verifier scores (question, answer,
  metadata)."""
  dataset: str
  entry: Mapping[str, Any]

  @property
  def question(self) -> str:
    return self.entry["question"]


def generate_split_problems(mix: Sequence[tuple[str, float]],
                            options: Mapping[str, Mapping[str, Any]], *, seed: int,
                            train_per_level: int, test_per_level: int) -> dict[str, list[Problem]]:
  """Deterministic, disjoint train and test problems (module docstring): every test split first,
  then the training splits, which skip every test question. A dataset with fewer distinct
  questions than its test split asks for is an error; one that runs out of training questions
  gives fewer."""
  import reasoning_gym  # pylint: disable=import-outside-toplevel
  if train_per_level < 1 or test_per_level < 1:
    raise ValueError(f"train_per_level={train_per_level} and test_per_level={test_per_level} must "
                     "be >= 1")
  draws = lambda wanted: min(SEED_STRIDE, 20 * wanted + 200)
  splits: dict[str, list[Problem]] = {"train": [], "test": []}
  test_questions: set[str] = set()
  for name, _ in mix:
    base = dataset_seed(seed, name)
    generator = reasoning_gym.create_dataset(name, **options.get(name, {}), seed=base,
                                             size=draws(test_per_level))
    found = 0
    for i in range(len(generator)):
      if found == test_per_level:
        break
      entry = generator[i]
      if entry["question"] not in test_questions:
        test_questions.add(entry["question"])
        splits["test"].append(Problem(name, entry))
        found += 1
    if found < test_per_level:
      raise ValueError(f"dataset {name!r} gave only {found} distinct questions in "
                       f"{len(generator)} draws; test_per_level={test_per_level} asks for more")
  for name, wanted in train_counts(mix, train_per_level).items():
    generator = reasoning_gym.create_dataset(name, **options.get(name, {}),
                                             seed=dataset_seed(seed, name) + SEED_STRIDE,
                                             size=draws(wanted))
    seen: set[str] = set()
    for i in range(len(generator)):
      if len(seen) == wanted:
        break
      entry = generator[i]
      question = entry["question"]
      if question not in test_questions and question not in seen:
        seen.add(question)
        splits["train"].append(Problem(name, entry))
  return splits


# ---------------------------------------------------------------------------------------------
# The verifiers' worker processes. Everything up to `ScorePool` runs only inside them.

_VERIFIERS: dict[str, Any] = {}


class _SoftTimeout(BaseException):
  """Raised by the worker's interval timer; a BaseException, so that the verifiers' own `except
  Exception` clauses let it through."""


def _on_alarm(signum, frame):
  raise _SoftTimeout()


def _worker_init(specs: tuple[tuple[str, dict], ...], memory_limit_bytes: int) -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's; it closes the pool.
  signal.signal(signal.SIGALRM, _on_alarm)
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  _, hard = resource.getrlimit(resource.RLIMIT_AS)
  resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, hard))
  import reasoning_gym  # pylint: disable=import-outside-toplevel
  for name, options in specs:
    _VERIFIERS[name] = reasoning_gym.create_dataset(name, **options, seed=0, size=1)


def _worker_score(name: str, answer: str | None, entry: Mapping[str, Any], timeout_s: float,
                  hard_timeout_s: float) -> float | None:
  """The verifier's grade of `answer`, or None if it raised, ran past `timeout_s` or is not a
  finite number. A failed allocation ends the worker (its heap may be damaged); the parent sees
  the missing reply as a timeout."""
  # Orphan guard: if the parent dies mid-call nobody kills us; the kernel does, by CPU time.
  used = resource.getrusage(resource.RUSAGE_SELF)
  _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
  resource.setrlimit(resource.RLIMIT_CPU,
                     (math.ceil(used.ru_utime + used.ru_stime + hard_timeout_s) + 1, cpu_hard))
  signal.setitimer(signal.ITIMER_REAL, timeout_s)
  try:
    score = float(_VERIFIERS[name].score_answer(answer, dict(entry)))
  except MemoryError:
    os._exit(1)  # pylint: disable=protected-access
  except BaseException:  # pylint: disable=broad-except
    return None
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
  return score if math.isfinite(score) else None


def _warm(_: int) -> int:
  return len(_VERIFIERS)


def _terminate(holder: list) -> None:
  for pool in holder:
    pool.terminate()
    pool.join()
  holder.clear()


class ScorePool:
  """`score_answer` calls in killable worker processes; `score` never raises for any answer.

  At most `workers` calls are in flight, so each starts when it is sent and its hard deadline is
  `timeout_s + kill_grace_s` after that. A call past it is a failure; its pool is terminated (a
  worker stuck in C code is only stopped by a kill), the other calls in flight are sent again
  to a fresh one. Thread-safe: concurrent calls are serialised.
  """

  def __init__(self, specs: Mapping[str, dict], *, workers: int, timeout_s: float,
               memory_limit_bytes: int, kill_grace_s: float = 2.0,
               startup_timeout_s: float = 300.0, call: Callable[..., float | None] | None = None):
    self.specs = tuple((name, dict(opts)) for name, opts in specs.items())
    # What a worker runs per job: (dataset, answer, entry, timeout_s, hard_timeout_s) -> grade.
    # A module-level function (workers import it by name); tests put a hanging one here.
    self.call = call or _worker_score
    self.workers, self.timeout_s, self.kill_grace_s = workers, timeout_s, kill_grace_s
    self.memory_limit_bytes, self.startup_timeout_s = memory_limit_bytes, startup_timeout_s
    self.stats: collections.Counter[str] = collections.Counter()
    self._holder: list = []  # the running pool, if any
    self._lock = threading.Lock()
    self._ctx = multiprocessing.get_context("forkserver")
    # The fork server imports reasoning-gym once (ignored if a fork server already runs).
    self._ctx.set_forkserver_preload([__name__, "reasoning_gym"])
    self._finalizer = weakref.finalize(self, _terminate, self._holder)

  def start(self) -> None:
    """Starts the workers and waits until they are ready (idempotent; `score` starts them too)."""
    with self._lock:
      self._pool()

  def close(self) -> None:
    """Kills the workers. A later `score` starts new ones."""
    with self._lock:
      _terminate(self._holder)

  def worker_pids(self) -> list[int]:
    # multiprocessing.Pool keeps its processes in `_pool` and offers no public view of them.
    return [p.pid for pool in self._holder for p in pool._pool]  # pylint: disable=protected-access

  def _pool(self):
    if not self._holder:
      pool = self._ctx.Pool(self.workers, initializer=_worker_init,
                            initargs=(self.specs, self.memory_limit_bytes))
      self._holder.append(pool)
      pool.map_async(_warm, range(self.workers), chunksize=1).get(self.startup_timeout_s)
    return self._holder[0]

  def score(self, jobs: Sequence[tuple[str, str | None, Mapping[str, Any]]]) -> list[float | None]:
    """The grade of each (dataset, answer, entry), None where the call failed."""
    out: list[float | None] = [None] * len(jobs)
    hard = self.timeout_s + self.kill_grace_s
    with self._lock:
      todo = collections.deque(range(len(jobs)))
      replies: queue.SimpleQueue = queue.SimpleQueue()
      running: dict[int, float] = {}  # job -> deadline
      generation = 0
      while todo or running:
        pool = self._pool()
        while todo and len(running) < self.workers:
          i = todo.popleft()
          running[i] = time.monotonic() + hard
          tag = (generation, i)
          pool.apply_async(self.call, (*jobs[i], self.timeout_s, hard),
                           callback=lambda r, tag=tag: replies.put((tag, r)),
                           error_callback=lambda e, tag=tag: replies.put((tag, None)))
        try:
          (reply_generation, i), result = replies.get(
              timeout=max(0.0, min(running.values()) - time.monotonic()))
        except queue.Empty:
          late = min(running, key=running.get)
          self.stats["hard_kills"] += 1
          del running[late]
          todo.extendleft(running)  # the others were in flight on the killed pool: resend
          running.clear()
          _terminate(self._holder)
          generation += 1
          continue
        if reply_generation == generation and i in running:
          del running[i]
          out[i] = result
    self.stats["failed"] += sum(r is None for r in out)
    self.stats["calls"] += len(out)
    return out


class ReasoningGymTask(Task):
  """reasoning-gym datasets in a chat template, graded by their own verifiers (module docstring).

  Args:
    tokenizer: the model's tokenizer.
    chat_template: the model's template (`ChatTemplate`, or its Jinja source).
    datasets: one dataset name or a weighted mix, "chain_sum:2,leg_counting:1" (`parse_mix`).
    options: {dataset: {option: value}} for the datasets' reasoning-gym configs.
    seed: fixes both splits.
    train_per_level: training problems of a dataset of weight 1 (a level is a dataset).
    test_per_level: test problems of each dataset.
    correct_reward, wrong_reward: the rewards of score 1 and score 0 (linear in between).
    workers, timeout_s, memory_limit_bytes: the verifiers' worker pool.
    system_prompt: a system message before each question (None: the template's own).
    instruction: put after each question in the user message.
  """

  name = "reasoning_gym"

  def __init__(self, *, tokenizer: Tokenizer, chat_template: ChatTemplate | str,
               datasets: str = ReasoningGymOptions.datasets,
               options: Mapping[str, Mapping[str, Any]] | None = None,
               seed: int = ReasoningGymOptions.seed,
               train_per_level: int = ReasoningGymOptions.train_per_level,
               test_per_level: int = ReasoningGymOptions.test_per_level,
               correct_reward: float = 1.0, wrong_reward: float = -1.0, workers: int = 2,
               timeout_s: float = 5.0, memory_limit_bytes: int = 2 << 30,
               system_prompt: str | None = None, instruction: str = DEFAULT_INSTRUCTION):
    if not isinstance(tokenizer, Tokenizer):
      raise ValueError(f"tokenizer is a {type(tokenizer).__name__}; expected a "
                       "ksjax.tokenization.Tokenizer (the model's)")
    if isinstance(chat_template, str):
      chat_template = ChatTemplate.from_string(chat_template)
    if system_prompt is not None:
      chat_template = chat_template.with_system_prompt(system_prompt)
    self.tokenizer = tokenizer
    self.chat_template = chat_template
    self.instruction = instruction
    self.correct_reward = float(correct_reward)
    self.wrong_reward = float(wrong_reward)
    self.mix = parse_mix(datasets)
    self.options = check_datasets(self.mix, options or {})
    self._problems = generate_split_problems(self.mix, self.options, seed=seed,
                                             train_per_level=train_per_level,
                                             test_per_level=test_per_level)
    self._prompts = {split: self._split_prompts(problems)
                     for split, problems in self._problems.items()}
    self._extraction: collections.Counter[str] = collections.Counter()
    self._counts_lock = threading.Lock()
    self.checker = ScorePool(self.options, workers=workers, timeout_s=timeout_s,
                             memory_limit_bytes=memory_limit_bytes)

  def user_message(self, problem: Problem) -> str:
    question = problem.question.strip()
    return f"{question}\n\n{self.instruction}" if self.instruction else question

  def _split_prompts(self, problems: Sequence[Problem]) -> tuple[Prompt, ...]:
    counts: dict[str, int] = {}
    prompts = []
    for problem in problems:
      index = counts[problem.dataset] = counts.get(problem.dataset, -1) + 1
      text = self.chat_template.render_user(self.user_message(problem))
      prompts.append(Prompt(
          id=f"{problem.dataset}-{index:05d}", text=text, tokens=self.encode_prompt(text),
          metadata={"level": problem.dataset}, reference=problem,
          solution=f"{_OPEN}{problem.entry['answer']}{_CLOSE}"))
    return tuple(prompts)

  # One definition for the chat tasks: the BOS rule (never twice) and the split accessors over
  # `_problems` and `_prompts`, {"train": ..., "test": ...}.
  encode_prompt = arithmetic.ArithmeticTask.encode_prompt
  problems = arithmetic.ArithmeticTask.problems
  prompts = arithmetic.ArithmeticTask.prompts

  def levels(self) -> Sequence[str]:
    return tuple(name for name, _ in self.mix)

  def close(self) -> None:
    self.checker.close()

  def metrics(self) -> dict[str, float]:
    """How answers were read since the last call, as fractions of the completions scored:
    "extraction/tagged" (inside answer tags), "extraction/fallback" (without tags),
    "extraction/cut_off" (a tag left open), "extraction/none"; and "extraction/score_failed",
    the verifier calls that raised or timed out. Empty before any scoring."""
    with self._counts_lock:
      counts, self._extraction = self._extraction, collections.Counter()
    total = counts.pop("completions", 0)
    if not total:
      return {}
    return {f"extraction/{how}": counts[how] / total
            for how in (TAGGED, FALLBACK, CUT, NONE, "score_failed")}

  def score(self, prompts: Sequence[Prompt],
            completions: Sequence[Sequence[str]]) -> list[GroupScore]:
    if len(prompts) != len(completions):
      raise ValueError(f"{len(prompts)} prompts but {len(completions)} completion groups")
    counts: collections.Counter[str] = collections.Counter()
    extracted, jobs, index = [], [], {}
    for g, (prompt, group) in enumerate(zip(prompts, completions)):
      problem: Problem = prompt.reference
      row = []
      for completion in group:
        answer, how = extract_answer(completion, str(problem.entry["answer"]))
        counts[how] += 1
        row.append(answer)
        # One verifier call per distinct answer of a problem; None is the unanswered grade.
        key = (g, answer)
        if key not in index:
          index[key] = len(jobs)
          jobs.append((problem.dataset, guard(problem.dataset, answer), problem.entry))
      extracted.append(row)
    grades = self.checker.score(jobs)
    counts["score_failed"] = sum(grades[index[(g, a)]] is None
                                 for g, row in enumerate(extracted) for a in row)
    counts["completions"] = sum(len(row) for row in extracted)
    with self._counts_lock:
      self._extraction.update(counts)
    out = []
    span = self.correct_reward - self.wrong_reward
    for g, (prompt, row) in enumerate(zip(prompts, extracted)):
      dataset = prompt.reference.dataset
      scores = np.asarray([grades[index[(g, a)]] or 0.0 for a in row], np.float64)
      keys = [None if a is None else (float(s), class_key(dataset, a))
              for a, s in zip(row, scores)]
      out.append(GroupScore(
          rewards=(self.wrong_reward + span * scores).astype(np.float32),
          correct=scores >= 1.0, answers=tuple(row), answer_ids=answer_classes(keys)))
    return out
