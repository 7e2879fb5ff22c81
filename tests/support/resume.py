"""The kill -9 and resume check shared by the trainer's exact-resume tests: two runs of the same
command side by side, one killed once it has a checkpoint of step `kill_after` or later, then
resumed; the caller compares the two work directories."""

import os
import signal
import subprocess
import time

from tests.support import REPO


def straight_and_killed(command, tmp_path, steps: int, env: dict, *, kill_after: int = 2):
  """(straight, killed) work directories, both finished: `command(workdir, **overrides)` is the
  command line of a run; the killed one was stopped with SIGKILL after a checkpoint and resumed
  with `resume=True`, which must say "resumed from step"."""
  straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
  run_straight = subprocess.Popen(command(straight, num_steps=steps), cwd=REPO, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  run_killed = subprocess.Popen(command(killed, num_steps=steps), cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  checkpoints = os.path.join(killed, "checkpoints")
  deadline = time.time() + 600
  while time.time() < deadline and run_killed.poll() is None:
    if os.path.isdir(checkpoints) and any(d.isdigit() and int(d) >= kill_after
                                          for d in os.listdir(checkpoints)):
      break
    time.sleep(0.02)
  assert run_killed.poll() is None, "the run ended before it could be killed"
  run_killed.send_signal(signal.SIGKILL)
  run_killed.wait()
  assert not os.path.isdir(os.path.join(killed, "final"))
  resumed = subprocess.run(command(killed, num_steps=steps, resume=True), cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step" in resumed.stdout
  _, err = run_straight.communicate(timeout=600)
  assert run_straight.returncode == 0, err[-3000:]
  return straight, killed
