"""Told to stop: SIGTERM (a preemption notice) and SIGINT (Ctrl-C) end a run where it can resume.

Preemptible TPU VMs and spot GPUs announce a preemption with SIGTERM and about 30 seconds of
grace. While the trainer's steps or the eval binary's checkpoints run, `Signals` holds both:
  * the first signal only sets a flag (Python runs a handler between bytecodes of the main thread,
    which may be inside a long compiled call; a flag is all that is safe there). The loop asks
    `reached(step)` at its step boundary, finishes the step (or the record) in progress, saves
    it, prints one line naming what was saved and how to continue, and exits with 128 + the
    signal's number (143 for SIGTERM, 130 for SIGINT), by raising `Stopped`;
  * a second signal ends the process at once (`os._exit`, status 128 + the signal), without
    waiting for anything: what is on disk is whole, as Orbax saves a step into a temporary
    directory that it renames when every item is written, and every other file ksjax writes is
    written whole or not at all (`ksjax.files`);
  * outside them (start-up, the final evaluation), a signal keeps its default: nothing is lost
    that a checkpoint held.

Several processes (`ksjax.distributed`). Every process must stop after the same step, and
saving is collective. JAX's coordination service has the protocol for this: when one process
gets a preemption notice, the notice goes to all, and `reached_preemption_sync_point(step)`
(which Orbax's `CheckpointManager.should_save` also consults) turns True on every process at the
same step, the first after every process's current one. `jax.distributed.initialize` installs
its own C-level SIGTERM handler that feeds that protocol (XLA's SigtermNotifier), and a Python
handler installed after it replaces it (both are `sigaction`s of the same signal). So the
handler here chains to it: in a multi-process run it calls the handler it found, as a C function
(ctypes), for SIGTERM and SIGINT alike, and `reached` asks JAX's sync point rather than the
local flag. Without that call there would be no way to feed JAX's notifier from Python (its
Python binding exposes `reached_sync_point` only), and leaving JAX's handler in place would
leave a second SIGTERM with no effect (JAX's handler only sets its flag) and SIGINT unsynced.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
  """The shell's convention for a process ended by signal `signum`: 128 + its number."""
  return 128 + signum


class Stopped(SystemExit):
  """A run stopped on a signal, after saving what it had; exits with `exit_status(signum)`.

  A SystemExit, so that it passes every `except Exception` on its way out and the process ends
  with the conventional status; the one line saying what was saved is printed before it is
  raised (by process 0 alone, as every other line of a run)."""

  def __init__(self, signum: int, message: str):
    super().__init__(exit_status(signum))
    self.signum = signum
    self.message = message


def signal_name(signum: int | None) -> str:
  return "a preemption notice" if signum is None else signal.Signals(signum).name


# ---------------------------------------------------------------------------------------------
# A C handler installed by a library (JAX's preemption notifier), to chain to
# ---------------------------------------------------------------------------------------------

_SA_SIGINFO = 4  # Linux's value, on every architecture


class _Sigaction(ctypes.Structure):
  """glibc's (and musl's) `struct sigaction` on Linux: the handler, a 1024-bit mask, the flags
  and the restorer. Only the first and third fields are read."""
  _fields_ = [("handler", ctypes.c_void_p),
              ("mask", ctypes.c_ulong * (128 // ctypes.sizeof(ctypes.c_ulong))),
              ("flags", ctypes.c_int),
              ("restorer", ctypes.c_void_p)]


def _installed(signum: int) -> _Sigaction | None:
  """The C-level disposition of `signum`, when it is a handler installed outside Python (by a
  library: Python's `signal.getsignal` then says SIG_DFL, or None); None otherwise, and on any
  system but Linux, whose struct layout is the one read here."""
  if not sys.platform.startswith("linux") or signal.getsignal(signum) not in (signal.SIG_DFL,
                                                                               None):
    return None
  action = _Sigaction()
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.sigaction(signum, None, ctypes.byref(action)) != 0:
    return None
  if action.handler in (None, int(signal.SIG_DFL), int(signal.SIG_IGN)):
    return None
  return action


def _caller(action: _Sigaction):
  """A Python callable that runs `action`'s handler as the kernel would for SIGTERM."""
  if action.flags & _SA_SIGINFO:
    handler = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
        action.handler)
    return lambda: handler(signal.SIGTERM, None, None)
  handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(action.handler)
  return lambda: handler(signal.SIGTERM)


def _restore(signum: int, action: _Sigaction) -> None:
  ctypes.CDLL(None, use_errno=True).sigaction(signum, ctypes.byref(action), None)


def _process_count() -> int:
  if "jax" not in sys.modules:  # a process that never loaded jax has one process
    return 1
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_count()


class Signals:
  """Holds SIGTERM and SIGINT while entered (module docstring); `reached(step)` says when to stop.

  Entered outside the main thread (a library caller's worker), it holds nothing: Python accepts
  signal handlers from the main thread only, and a signal then keeps its default.

  Args:
    prog: the program's name, for the line a second signal prints.
    second: what a second signal abandons, for that line.
  """

  def __init__(self, prog: str, second: str = "the step in progress"):
    self.prog = prog
    self.second = second
    self.signum: int | None = None  # the first signal received
    self._previous: dict[int, object] = {}
    self._c_previous: _Sigaction | None = None
    self._notify = None  # JAX's preemption notifier, in a multi-process run

  def __enter__(self) -> "Signals":
    if threading.current_thread() is not threading.main_thread():
      return self
    if _process_count() > 1:
      self._c_previous = _installed(signal.SIGTERM)
      if self._c_previous is None:
        # No notifier of JAX's to chain to (its preemption service is off, or not Linux): a
        # flag set here would stop this process alone, so the signals keep their dispositions
        # (JAX's handler, where it has one, still stops every process at the sync point).
        return self
      self._notify = _caller(self._c_previous)
    for signum in SIGNALS:
      self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, signal.SIG_DFL if previous is None else previous)
    if self._c_previous is not None:
      _restore(signal.SIGTERM, self._c_previous)  # JAX's notifier, as it was
    self._previous.clear()

  def _handle(self, signum: int, frame: FrameType | None) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signum is not None:
      # os.write: print() could re-enter a write the main thread was in when the signal came.
      os.write(2, f"{self.prog}: a second {name}: stopping now, abandoning {self.second}; what "
                  "is on disk is whole (the last complete checkpoint is where a resume "
                  "starts)\n".encode())
      os._exit(exit_status(signum))  # pylint: disable=protected-access
    self.signum = signum
    if self._notify is not None:
      self._notify()  # every process hears of it, and stops at JAX's sync point
    os.write(2, f"{self.prog}: {name}: finishing {self.second}, then saving and stopping (a "
                f"second {name} stops at once)\n".encode())

  def reached(self, step: int) -> bool:
    """Whether to stop after step `step` (called once per step, with increasing steps, on
    every process): one process, when it got a signal; several, at JAX's preemption sync point
    (the same step on all of them, whichever got the signal)."""
    if _process_count() == 1:
      return self.signum is not None
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    try:
      return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:  # the preemption service is off (jax_enable_preemption_service)
      return False


__all__ = ["SIGNALS", "Signals", "Stopped", "exit_status", "signal_name"]
