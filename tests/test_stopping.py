"""`ksjax.stopping.Signals`: the first SIGTERM or SIGINT is a flag, a second ends the process at
once with 128 + the signal, and leaving puts the handlers back; and a full disk reaching an entry
point's boundary is one line and exit status 74, never a traceback (`ksjax.errors`)."""

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ksjax import errors, files, stopping
from tests import support


def test_the_first_signal_is_a_flag_and_leaving_puts_the_handlers_back():
  before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  with stopping.Signals("prog") as stop:
    assert not stop.reached(1)
    os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: the handler only sets the flag
    assert stop.signum == signal.SIGINT and stop.reached(2)
  assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_second_signal_exits_at_once_with_128_plus_the_signal():
  # In a child (it ends the process): nothing after the second signal runs, not even `finally`.
  script = textwrap.dedent("""
      import os, signal, time
      from ksjax import stopping
      with stopping.Signals("prog", second="the record in progress") as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        print("flag", stop.signum, flush=True)
        try:
          os.kill(os.getpid(), signal.SIGTERM)
          time.sleep(5)
        finally:
          print("not reached", flush=True)
  """)
  result = subprocess.run([sys.executable, "-c", script], cwd=support.REPO, capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 143
  assert result.stdout == f"flag {int(signal.SIGTERM)}\n"
  assert result.stderr.splitlines() == [
      "prog: SIGTERM: finishing the record in progress, then saving and stopping (a second "
      "SIGTERM stops at once)",
      "prog: a second SIGTERM: stopping now, abandoning the record in progress; what is on disk "
      "is whole (the last complete checkpoint is where a resume starts)"]


@pytest.mark.parametrize("code, reason", [(errno.ENOSPC, "No space left on device"),
                                          (errno.EFBIG, "File too large")])
def test_a_full_disk_at_the_boundary_is_one_line_and_exit_74(tmp_path, capsys, code, reason):
  target = tmp_path / "out.json"
  target.write_text("old\n")

  def main(argv):
    del argv
    def write(tmp):
      with open(tmp, "w", encoding="utf-8") as f:
        f.write("x" * 10)
      raise OSError(code, os.strerror(code))
    files.atomic_write(str(target), write, size=1536)

  with pytest.raises(SystemExit) as exit_:
    errors.boundary("prog", main)(["prog"])
  assert exit_.value.code == errors.EXIT_DISK_FULL
  err = capsys.readouterr().err
  assert err.startswith(f"prog: writing {target} failed ({reason}") and err.count("\n") == 1
  assert "it needs 1.5 KiB, " in err and " free there; out.json is as it was" in err
  assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["out.json"]


def test_tensorstores_report_of_a_full_disk_and_one_under_a_later_error_are_found():
  tensorstore = ValueError("OUT_OF_RANGE: Failed to write 3368 bytes to file 7: File too large "
                           "[os_error_code='27']")
  assert files.disk_full_errno(tensorstore) == errno.EFBIG
  assert files.disk_full_errno(ValueError("[os_error_code='2']")) is None
  try:
    try:
      raise files.DiskFull("saving checkpoint 3 failed")
    finally:
      raise OSError(errno.ENOSPC, "No space left on device")  # a `finally` on the same disk
  except OSError as e:
    assert errors.disk_full_line(e) == "saving checkpoint 3 failed"
  assert errors.disk_full_line(RuntimeError("a bug")) is None
