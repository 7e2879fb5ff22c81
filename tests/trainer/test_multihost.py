"""Multi-host on one machine: 2 processes x 2 CPU devices train exactly as 1 process x 4 devices.

Both runs use the same global mesh (data=4) and the same seed. In the 2-process run each process
reads half of every prompt batch, scores half of the completions, and the processes meet in
gloo collectives (JAX's CPU default) and in Orbax checkpoints written by both. It stops after 2
steps and is resumed by two new processes to step 4. Loss, reward, gradient norm, KL and entropy
at every step, and the final held-out evaluation, must equal the single-process run's (1e-5).
"""

import json
import os
import re
import signal
import time

import numpy as np
import pytest

from ksjax import distributed
from ksjax.config_validation import ConfigError
from ksjax.tools import local_cluster
from tests import support

ROOT = str(support.REPO)
TINY = [
    "--config=configs/pass_at_k.py", "--config.model.hidden_size=32",
    "--config.model.num_layers=1", "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
    "--config.model.head_dim=16", "--config.model.intermediate_size=64", "--config.mesh=(4,1,1)",
    "--config.synthetic.levels=(1,2)", "--config.synthetic.train_per_level=24",
    "--config.synthetic.test_per_level=2", "--config.batch_prompts=4", "--config.k=2",
    "--config.max_new_tokens=8", "--config.checkpoint_every=2", "--config.sft_warmup.steps=0",
    "--config.eval.at_start=False", "--config.eval.num_samples=2", "--config.eval.ks=(1,2)",
    "--config.eval.batch_prompts=4", "--config.progress_bar=False",
    "--config.learning_rate=3e-2",
    # The mean objective without a baseline: every completion has a non-zero weight, so every
    # step updates the (untrained, always wrong) policy and the curves move.
    "--config.aggregator=mean", "--config.baseline=none",
]
COMPARED = ("loss/total", "loss/policy", "reward/mean", "optim/grad_norm", "kl/k1", "kl/k3",
            "entropy/per_token", "completion/length_mean")


def start(workdir, *, processes: int, devices: int, cache: str, flags=()):
  """Trainer processes on localhost; programs compiled by one run are reused by the next."""
  return local_cluster.start(
      [*TINY, f"--config.workdir={workdir}", *flags], processes=processes,
      devices_per_process=devices, logs=workdir, cwd=ROOT,
      env={"JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})


def wait(runs, workdir: str) -> None:
  if local_cluster.wait(runs, timeout=300):
    logs = [open(f"{workdir}.{i}.log", encoding="utf-8").read()[-3000:] for i in range(len(runs))]
    pytest.fail("a trainer process failed:\n" + "\n".join(logs))


def curves(workdir: str) -> dict[str, np.ndarray]:
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]  # each step once: only process 0 writes
  return {name: np.asarray([r[name] for r in rows]) for name in COMPARED}


# Five trainer processes, three at once: the suite's longest set-up (80 s of 2 cores), so `slow`
# (`python -m pytest -m slow`); the mesh arithmetic they rest on runs in the default suite on fake
# devices (tests/model/test_sharding.py, tests/trainer/test_update.py).
two_processes = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("multihost")
  cache = str(tmp / "compilation_cache")
  one, two = str(tmp / "one_process"), str(tmp / "two_processes")
  single = start(one, processes=1, devices=4, cache=cache, flags=["--config.num_steps=4"])
  first = start(two, processes=2, devices=2, cache=cache,
                flags=["--config.num_steps=2", "--config.eval.at_end=False"])
  wait(first, two)
  resumed = start(two, processes=2, devices=2, cache=cache,
                  flags=["--config.num_steps=4", "--config.resume=True"])
  wait(resumed, two)
  wait(single, one)
  assert "resumed from step 2" in open(f"{two}.0.log", encoding="utf-8").read()
  return one, two


@two_processes
def test_two_processes_train_as_one_and_resume_from_their_checkpoint(runs):
  one, two = runs
  a, b = curves(one), curves(two)
  for name in COMPARED:
    np.testing.assert_allclose(b[name], a[name], atol=1e-5, rtol=1e-5, err_msg=name)
  assert np.ptp(a["loss/total"]) > 1e-3  # the curves move: the comparison is not vacuous
  with open(os.path.join(one, "eval_end.json"), encoding="utf-8") as f:
    eval_one = json.load(f)
  with open(os.path.join(two, "eval_end.json"), encoding="utf-8") as f:
    eval_two = json.load(f)
  assert eval_two["num_correct"] == eval_one["num_correct"]
  for name, value in eval_one["metrics"].items():
    assert eval_two["metrics"][name] == pytest.approx(value, abs=1e-5), name


@two_processes
def test_both_processes_checkpoint_together_each_with_its_data_position(runs):
  _, two = runs
  step = os.path.join(two, "checkpoints", "2")
  data_files = sorted(os.listdir(os.path.join(step, "data")))
  assert len([f for f in data_files if "process_0" in f]) == 1, data_files
  assert len([f for f in data_files if "process_1" in f]) == 1, data_files
  assert os.path.isdir(os.path.join(step, "state"))


@pytest.mark.parametrize("env, message", [
    ({distributed.ENV_COORDINATOR: "h:1", distributed.ENV_NUM_PROCESSES: "2"},
     "KSJAX_PROCESS_ID not set"),
    ({distributed.ENV_COORDINATOR: "h", distributed.ENV_NUM_PROCESSES: "2",
      distributed.ENV_PROCESS_ID: "0"}, "expected host:port"),
    ({distributed.ENV_COORDINATOR: "h:1", distributed.ENV_NUM_PROCESSES: "2",
      distributed.ENV_PROCESS_ID: "2"}, "0 <= id < count"),
    ({distributed.ENV_COORDINATOR: "h:1", distributed.ENV_NUM_PROCESSES: "two",
      distributed.ENV_PROCESS_ID: "0"}, "expected integers"),
])
def test_bad_coordinator_settings_are_config_errors(monkeypatch, env, message):
  for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
               distributed.ENV_PROCESS_ID):
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(ConfigError, match=message):
    distributed.environment_settings()


def test_one_process_helpers_are_identities():
  assert distributed.gather({"a": 1}) == [{"a": 1}]
  assert distributed.gather_list([1, 2]) == [1, 2]
  assert distributed.is_writer()


@two_processes
def test_a_sigterm_to_one_process_stops_both_after_the_same_step_and_both_resume(
    tmp_path):
  """#66: the notice reaches the other process through JAX's preemption sync point, both save
  the same step, and both resume from it together."""
  cache, workdir = str(tmp_path / "compilation_cache"), str(tmp_path / "run")
  log = os.path.join(workdir, "metrics.jsonl")
  runs = start(workdir, processes=2, devices=2, cache=cache,
               flags=["--config.num_steps=40", "--config.checkpoint_every=1000",
                      "--config.eval.at_end=False"])
  deadline = time.time() + 300
  while time.time() < deadline and all(p.poll() is None for p in runs):
    if os.path.exists(log) and sum(1 for _ in open(log, encoding="utf-8")) >= 2:
      break
    time.sleep(0.05)
  runs[1].send_signal(signal.SIGTERM)
  codes = [p.wait(timeout=300) for p in runs]
  logs = [open(f"{workdir}.{i}.log", encoding="utf-8").read() for i in range(2)]
  assert codes == [143, 143], "\n".join(text[-3000:] for text in logs)
  saved = re.search(r"stopped by a preemption notice after step (\d+): checkpoint \1 is saved",
                    logs[0])
  assert saved, logs[0][-3000:]
  step = int(saved.group(1))
  assert "ksjax: SIGTERM: finishing the step in progress" in logs[1]
  assert sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))) == [1, step]
  data_files = os.listdir(os.path.join(workdir, "checkpoints", str(step), "data"))
  assert [any(f"process_{i}" in f for f in data_files) for i in range(2)] == [True, True]
  resumed = start(workdir, processes=2, devices=2, cache=cache,
                  flags=[f"--config.num_steps={step + 2}", "--config.checkpoint_every=1000",
                         "--config.eval.at_end=False", "--config.resume=True"])
  wait(resumed, workdir)
  assert f"resumed from step {step}" in open(f"{workdir}.0.log", encoding="utf-8").read()
  with open(log, encoding="utf-8") as f:
    assert [json.loads(line)["step"] for line in f] == list(range(1, step + 3))
