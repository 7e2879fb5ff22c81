"""Runs a multi-process ksjax job on this machine: N processes, each with its own CPU devices.

  python -m ksjax.tools.local_cluster --processes=2 --devices_per_process=2 --logs=/tmp/run \
      -- --config=configs/pass_at_k.py --config.mesh='(4,1,1)'

Each process is `python -m ksjax.main` with the flags after `--`, joined to the others through
`ksjax.distributed`'s environment (a coordinator on a free localhost port), exactly as hosts of a
cluster are (`experiments/launch_gpu_cluster.sh --scheduler ssh`). For testing and measuring the
multi-host code paths without a cluster; process i writes `<logs>.<i>.log`. Exits with the first
non-zero exit status of the processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

from absl import app, flags

from ksjax import distributed, errors

_PROCESSES = flags.DEFINE_integer("processes", 2, "Processes to start.", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices_per_process", 1, "CPU devices of each process.",
                                lower_bound=1)
_LOGS = flags.DEFINE_string("logs", "local_cluster", "Log path prefix: <logs>.<i>.log.")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def start(main_args: Sequence[str], *, processes: int, devices_per_process: int, logs: str,
          env: Mapping[str, str] | None = None, cwd: str | None = None) -> list[subprocess.Popen]:
  """Starts the processes (not waiting); process i logs to `<logs>.<i>.log`."""
  base = {**os.environ, **(env or {}), "JAX_PLATFORMS": "cpu"}
  kept = [f for f in base.get("XLA_FLAGS", "").split()  # the caller's other flags stay
          if not f.startswith("--xla_force_host_platform_device_count")]
  base["XLA_FLAGS"] = " ".join(
      [*kept, f"--xla_force_host_platform_device_count={devices_per_process}"])
  coordinator = f"localhost:{free_port()}"
  out = []
  for index in range(processes):
    process_env = dict(base)
    if processes > 1:
      process_env.update({distributed.ENV_COORDINATOR: coordinator,
                          distributed.ENV_NUM_PROCESSES: str(processes),
                          distributed.ENV_PROCESS_ID: str(index)})
    with open(f"{logs}.{index}.log", "w", encoding="utf-8") as log:
      out.append(subprocess.Popen([sys.executable, "-m", "ksjax.main", *main_args], cwd=cwd,
                                  env=process_env, stdout=log, stderr=subprocess.STDOUT))
  return out


def wait(processes: Sequence[subprocess.Popen], timeout: float | None = None) -> int:
  """Waits for all; returns the first non-zero exit status (0 if none)."""
  codes = [p.wait(timeout=timeout) for p in processes]
  return next((c for c in codes if c), 0)


def main(argv):
  rc = wait(start(argv[1:], processes=_PROCESSES.value, devices_per_process=_DEVICES.value,
                  logs=_LOGS.value))
  sys.exit(rc)


if __name__ == "__main__":
  app.run(errors.boundary("local_cluster", main))
