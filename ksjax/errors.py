"""The error boundary every ksjax entry point shares.

A failure caused by the user's input (a config file or value, a data set, a checkpoint, a model
directory, a GGUF file) prints one line, `<program>: <what was wrong and what is accepted>`, exits
with status 2 and writes nothing; any other failure is a bug and keeps its traceback. The
binaries (`ksjax.main`, `ksjax.eval`, `ksjax.tools.*`, `python -m ksjax.tasks.data`) wrap their
`main` in `boundary`; the places that read an input turn a library's exception into one of the
project's input-error types (`INPUT_ERRORS`) with a message naming the file and what is accepted.
A host the code sandbox cannot run honest programs on (`SandboxUnavailable`, from its self-test)
is answered the same way: one line saying what failed and what to do.

Libraries log while they read (Orbax warns about missing metadata files before raising, tfds about
a folder without dataset_info.json), and such a line printed before the one line would bury it. So
while a program starts, log records (absl's, Orbax's, tfds's, jax's: all reach the root logger)
and Python warnings are held: dropped if the start ends in an input error, whose line says what
went wrong, and printed, in order, as soon as the program has read its inputs (`inputs_read()`),
prints its first line to stdout, fails with a bug, or ends.

Nor do library INFO lines print unasked: absl's `app.run` turns verbosity up to INFO when the
command line names none, and jax then opens every run on a CPU or GPU host with "Unable to
initialize backend 'tpu'", an alarm about nothing. The boundary sets absl's verbosity to WARNING
unless the user chose it or asked for log lines (`quiet_library_info`); warnings and errors print.

The boundary is also where every binary turns on JAX's persistent compilation cache, before its
first compilation (`ksjax.compilation_cache`; KSJAX_COMPILATION_CACHE moves it or turns it off).

A full disk. A write that fails for want of space (ENOSPC, EDQUOT, or EFBIG: a file larger than
the file system or the process's file size limit allows) is neither bad input nor a bug: it is
one line too, `<program>: <what failed>, how much space it needed, what is left whole`, with exit
status 74 (sysexits' EX_IOERR) and no traceback. The places that know what they were writing
raise `ksjax.files.DiskFull` with that line (`files.disk_full`: a checkpoint, the step log, any
file of `ksjax.files`); a disk-full error from anywhere else gets a line naming the error. The libraries'
own reports of the same failure are dropped, since the line says it: Orbax's ERROR log record of
its failed write thread, and the unraisable exceptions a failed Orbax save or restore leaves
behind (`is_orbax_leftover`).

A run stopped by SIGTERM or SIGINT after saving (`ksjax.stopping.Stopped`) is a SystemExit with
status 128 + the signal, and passes the boundary as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ksjax import compilation_cache, files

EXIT_INPUT = 2
EXIT_DISK_FULL = 74  # sysexits' EX_IOERR: an input/output error (a full disk), not bad input

# (module, class) of each exception type that means "the input is not what ksjax accepts".
# Resolved only among modules already imported (`input_error_types`): an exception can only have
# been raised if its module was loaded, and importing e.g. ksjax.run.checkpoints (Orbax, jax) just
# to name its type would slow down binaries that never use it (the bandit study, --help).
INPUT_ERRORS = (
    ("ksjax.config_validation", "ConfigError"),          # a config value
    ("ksjax.tasks.base", "DataError"),                    # a data set or record
    ("ksjax.model.checkpoint", "CheckpointError"),        # a model: Orbax, HF directory, GGUF
    ("ksjax.run.checkpoints", "CheckpointInputError"),   # a run's step checkpoints (eval)
    ("ksjax.run.checkpoints", "CheckpointError"),        # none of a run's checkpoints readable
    ("ksjax.tasks.sandbox", "SandboxUnavailable"),       # the host: the sandbox's self-test
    ("ksjax.compilation_cache", "CompilationCacheError"),  # KSJAX_COMPILATION_CACHE
)


def input_error_types(extra: tuple[type[BaseException], ...] = ()) -> tuple[type, ...]:
  """The input-error types of the loaded modules, and `extra`."""
  found = []
  for module_name, name in INPUT_ERRORS:
    module = sys.modules.get(module_name)
    if module is not None and isinstance(getattr(module, name, None), type):
      found.append(getattr(module, name))
  return tuple(found) + tuple(extra)


def one_line(error: BaseException) -> str:
  """The error's message on one line (a message of several lines is joined with '; ')."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  return "; ".join(lines) or type(error).__name__


def message(prog: str, error: BaseException) -> str:
  """`<prog>: bad config: ...` for a config value, `<prog>: ...` for any other input."""
  config_error = sys.modules.get("ksjax.config_validation")
  bad_config = config_error is not None and isinstance(error, config_error.ConfigError)
  return f"{prog}: {'bad config: ' if bad_config else ''}{one_line(error)}"


def exit_input_error(prog: str, error: BaseException) -> None:
  """Prints the one line on stderr and exits with status 2."""
  print(message(prog, error), file=sys.stderr, flush=True)
  sys.exit(EXIT_INPUT)


# ---------------------------------------------------------------------------------------------
# A full disk
# ---------------------------------------------------------------------------------------------

def disk_full_line(error: BaseException) -> str | None:
  """The one line for a disk-full failure that reached the boundary: the first `DiskFull`
  among `error` and the exceptions it was raised while handling (a `finally` block that failed
  in turn on the same full disk), else a line naming the error; None for any other failure."""
  e: BaseException | None = error
  while e is not None:
    if isinstance(e, files.DiskFull):
      return one_line(e)
    e = e.__context__
  code = files.disk_full_errno(error)
  if code is None:
    return None
  return (f"a write failed ({os.strerror(code)}): {one_line(error)[:300]}; free space and run "
          "the command again (a training run: with --config.resume=True)")


def _no_disk_full_report(record: logging.LogRecord) -> bool:
  """A logging filter: False for a library's log record of a disk-full failure (the boundary's
  line says it)."""
  try:
    if record.exc_info and files.disk_full_errno(record.exc_info[1]) is not None:
      return False  # (Orbax's "Save Finalize thread failed", with the write's error)
    return files.disk_full_errno(Exception(record.getMessage())) is None
  except Exception:  # pylint: disable=broad-except
    return True


# Orbax logs through absl's logger; asyncio logs "Future exception was never retrieved" for each
# of Orbax's write futures that failed and was then dropped, as it is garbage collected (at any
# time after the failure, often at exit, after the boundary's line).
DISK_FULL_QUIET_LOGGERS = ("absl", "asyncio")


def quiet_disk_full_reports() -> None:
  """Adds `_no_disk_full_report` to the loggers that report a failed write on their own."""
  for name in DISK_FULL_QUIET_LOGGERS:
    logger = logging.getLogger(name)
    if _no_disk_full_report not in logger.filters:
      logger.addFilter(_no_disk_full_report)


def is_orbax_leftover(unraisable) -> bool:
  """Whether an unraisable exception is what a failed Orbax save or restore leaves behind: a
  TensorStore callback onto Orbax's event loop, already closed ("Event loop is closed", raised in
  asyncio's `_check_closed`), or one of Orbax's read coroutines, abandoned by the failure, raising
  as it is finalized. ksjax does not use asyncio or coroutines itself; Orbax does."""
  error = unraisable.exc_value
  if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return bool(frames) and frames[-1].name == "_check_closed" and "asyncio" in frames[-1].filename
  code = getattr(unraisable.object, "cr_code", None)  # a coroutine's
  return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def drop_orbax_leftovers() -> None:
  """Installs a sys.unraisablehook that drops `is_orbax_leftover` exceptions (tracebacks about a
  failure already reported) and passes every other one to the hook it replaces."""
  report = sys.unraisablehook
  if getattr(report, "drops_orbax_leftovers", False):  # installed already
    return

  def hook(unraisable) -> None:
    if not is_orbax_leftover(unraisable):
      report(unraisable)

  hook.drops_orbax_leftovers = True
  sys.unraisablehook = hook


# ---------------------------------------------------------------------------------------------
# Holding library log lines
# ---------------------------------------------------------------------------------------------

class _Keep(logging.Handler):
  """Keeps every record it is handed for the handlers it stands in for; once `forward` is set,
  hands records straight to those (a hold released while a nested one still has it installed)."""

  def __init__(self):
    super().__init__(logging.NOTSET)
    self.records: list[logging.LogRecord] = []
    self.forward: list[logging.Handler] | None = None

  def emit(self, record: logging.LogRecord) -> None:
    if self.forward is None:
      # Formatted now, as logging.handlers.QueueHandler.prepare does: the arguments may be
      # objects that change or die (a jax client, a mesh) before the record is printed.
      record = logging.makeLogRecord(record.__dict__)
      record.msg, record.args = record.getMessage(), None
      if record.exc_info:
        record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.exc_info = None
      self.records.append(record)
      return
    for handler in self.forward:
      if record.levelno >= handler.level:
        handler.handle(record)


class LogHold:
  """Holds what would reach the root logger's handlers, and Python warnings, until `release()`
  (passed on, in order) or `discard()` (dropped).

  The standard library has no handler that buffers for other handlers and can drop what it
  buffered (logging.handlers.MemoryHandler flushes into one target, and always does), hence this
  one. Holds nest: an inner hold releases into the outer one. With `release_on_stdout`, the first
  write to stdout releases: a program that has started to report is past reading its inputs.
  """

  def __init__(self, *, release_on_stdout: bool = False):
    self._root = logging.getLogger()
    self._handlers = self._root.handlers[:]
    self._keep = _Keep()
    self._warnings: list[tuple[Any, ...]] = []
    self._showwarning = warnings.showwarning
    self._root.handlers = [self._keep]
    warnings.showwarning = self._warn
    self._stdout = None
    if release_on_stdout:
      self._stdout = sys.stdout
      sys.stdout = _ReleaseOnWrite(sys.stdout, self.release)
    self.active = True

  def _warn(self, *args, **kwargs) -> None:
    if self.active:
      self._warnings.append((args, kwargs))
    else:
      self._showwarning(*args, **kwargs)

  def _restore(self) -> None:
    self.active = False
    self._keep.forward = self._handlers
    if self._root.handlers == [self._keep]:
      self._root.handlers = self._handlers
    if warnings.showwarning == self._warn:
      warnings.showwarning = self._showwarning
    if self._stdout is not None and isinstance(sys.stdout, _ReleaseOnWrite):
      # Kept alive: print() holds only a borrowed reference to sys.stdout while it writes, and
      # this runs inside the first of its writes.
      _RETIRED_STREAMS.append(sys.stdout)
      sys.stdout = self._stdout

  def release(self) -> None:
    if not self.active:
      return
    self._restore()
    for record in self._keep.records:
      self._keep.emit(record)  # forwarded, now that the hold is over
    for args, kwargs in self._warnings:
      warnings.showwarning(*args, **kwargs)
    self._keep.records.clear()
    self._warnings.clear()

  def discard(self) -> None:
    if self.active:
      self._restore()
      self._keep.records.clear()
      self._warnings.clear()


_RETIRED_STREAMS: list[Any] = []


class _ReleaseOnWrite:
  """stdout until its first write, which releases the hold and puts the real stdout back."""

  def __init__(self, stream, release: Callable[[], None]):
    self._stream = stream
    self._release = release

  def write(self, text: str) -> int:
    self._release()
    return self._stream.write(text)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._stream, name)


@contextlib.contextmanager
def quiet_if_it_fails() -> Iterator[None]:
  """Around the reading of one input: the libraries' log lines are dropped if the block raises
  (the caller turns the exception into its own message, reason included), passed on otherwise."""
  hold = LogHold()
  try:
    yield
  except BaseException:
    hold.discard()
    raise
  hold.release()


_BOUNDARY: list[LogHold] = []  # the running entry point's hold (at most one)


def inputs_read() -> None:
  """Says that the program has read its inputs: held log lines are printed from here on."""
  while _BOUNDARY:
    _BOUNDARY.pop().release()


# ---------------------------------------------------------------------------------------------
# Library INFO lines
# ---------------------------------------------------------------------------------------------

# absl flags by which a user asks for library log lines (`-v` is `--verbosity` by another name).
ASK_FOR_LOGS = ("verbosity", "logtostderr", "alsologtostderr")


def quiet_library_info() -> None:
  """Library INFO lines off (absl verbosity WARNING) under absl's `app.run`, unless asked for.

  absl's `app.run` raises verbosity from WARNING to INFO when the command line gives none, so
  every run would print jax's backend probing (the TPU it did not find) and Orbax's every save.
  Set here, once for every entry point, and before a `LogHold` is installed: absl moves the root
  logger's level only while its own handler is on the root logger, which the hold replaces (under
  it, `set_verbosity` changes only the "absl" logger's level, and jax's INFO records still pass).

  Left as they are: a command line with `--verbosity`/`-v`, `--logtostderr` or
  `--alsologtostderr` (the user asked); jax's own JAX_LOGGING_LEVEL and JAX_DEBUG_LOG_MODULES,
  and absl's `--logger_levels`, which give loggers a level of their own and so pass the root's;
  and any process not started by `app.run` (a library user's or a test's logging is theirs).
  """
  from absl import flags, logging as absl_logging  # pylint: disable=g-import-not-at-top
  if absl_logging.get_absl_handler() not in logging.root.handlers:
    return
  if any(name in flags.FLAGS and flags.FLAGS[name].present for name in ASK_FOR_LOGS):
    return
  absl_logging.set_verbosity(absl_logging.WARNING)


# ---------------------------------------------------------------------------------------------
# The boundary
# ---------------------------------------------------------------------------------------------

def boundary(prog: str, main: Callable[[list[str]], Any],
             extra: tuple[type[BaseException], ...] = ()) -> Callable[[list[str]], Any]:
  """`main` (for `absl.app.run`) with the boundary: an input error (`INPUT_ERRORS`, or one of
  `extra`) becomes one line on stderr and exit status 2, with the libraries' log lines of the
  start dropped; a full disk one line and exit status 74 (`disk_full_line`); anything else
  propagates with its traceback, after the held lines. Library INFO
  lines print only when asked for (`quiet_library_info`). JAX's persistent compilation cache is
  set up here, before `main` compiles anything (`ksjax.compilation_cache`)."""

  def wrapped(argv: list[str]) -> Any:
    quiet_library_info()  # before the hold: see there
    quiet_disk_full_reports()
    drop_orbax_leftovers()
    hold = LogHold(release_on_stdout=True)
    _BOUNDARY.append(hold)
    try:
      compilation_cache.configure(prog)
      return main(argv)
    except Exception as e:  # pylint: disable=broad-except
      full = disk_full_line(e)
      if full is not None:
        hold.discard()
        print(f"{prog}: {full}", file=sys.stderr, flush=True)
        sys.exit(EXIT_DISK_FULL)
      if not isinstance(e, input_error_types(extra)):
        raise
      hold.discard()
      exit_input_error(prog, e)
    finally:
      if hold in _BOUNDARY:
        _BOUNDARY.remove(hold)
      hold.release()  # a no-op after discard(); the held lines before a bug's traceback

  return wrapped
