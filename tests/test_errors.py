"""The error boundary of every entry point (ksjax.errors): bad input of each kind is exactly one
line on stderr naming it, exit status 2 and nothing written; library log lines never precede it;
a bug keeps its traceback."""

import logging
import os
import pathlib
import subprocess
import sys

import pytest

from ksjax import errors
from ksjax.config_validation import ConfigError
from tests.run.test_checkpoint_checksums import _save, flip_middle_of_largest_file
from tests import support
from tests.support import eval_run

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--config.model.hidden_size=32", "--config.model.num_layers=1",
        "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
        "--config.model.head_dim=16", "--config.model.intermediate_size=64",
        "--config.mesh=(1,1,1)", "--config.num_steps=1", "--config.sft_warmup.steps=0",
        "--config.eval.at_start=False", "--config.eval.at_end=False",
        "--config.progress_bar=False"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  """Bad inputs of every kind, and a tokenizer and a good HF directory to damage."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from ksjax import model  # pylint: disable=g-import-not-at-top
  from tests.support.chat import make_tokenizer  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("inputs")
  make_tokenizer("<s>").save(str(root / "tokenizer"))
  (root / "syntax_error.py").write_text("def get_config(:\n")
  (root / "empty_data").mkdir()
  garbage = root / "garbage_checkpoint"
  garbage.mkdir()
  for name in ("_METADATA", "_CHECKPOINT_METADATA", "junk"):
    (garbage / name).write_bytes(os.urandom(4096))
  (root / "binary_config").mkdir()
  (root / "binary_config" / "config.json").write_bytes(b"\xb0\xe4" + os.urandom(510))
  cfg = model.preset("tiny", vocab_size=512)
  model.save_hf(model.Llama(cfg, rngs=nnx.Rngs(0)), cfg, str(root / "truncated_hf"))
  weights = root / "truncated_hf" / "model.safetensors"
  os.truncate(weights, os.path.getsize(weights) // 2)
  (root / "garbage.gguf").write_bytes(b"GGUF" + os.urandom(60))
  return root


def _tokenizer(inputs):
  return [f"--config.tokenizer.path={inputs / 'tokenizer'}", "--config.tokenizer.eos=('<s>',)"]


# name -> (command after `python -m`, what the line must name)
CASES = {
    "missing config file": (lambda i, w: ["ksjax.main", "--config=configs/does_not_exist.py",
                                          f"--config.workdir={w}"],
                            "config file 'configs/does_not_exist.py' (--config) does not exist"),
    "config file with a syntax error": (
        lambda i, w: ["ksjax.main", f"--config={i / 'syntax_error.py'}"],
        "syntax_error.py' is not valid Python (line 1"),
    "math with an empty data_dir": (
        lambda i, w: ["ksjax.main", "--config=configs/pass_at_k.py", "--config.task=math",
                      f"--config.data.data_dir={i / 'empty_data'}",
                      f"--config.init_hf={i / 'no_such_model'}", f"--config.workdir={w}",
                      *_tokenizer(i), *TINY],
        "dataset 'math' is not built at"),
    "init_checkpoint of garbage files": (
        lambda i, w: ["ksjax.main", "--config=configs/pass_at_k.py",
                      f"--config.init_checkpoint={i / 'garbage_checkpoint'}",
                      f"--config.workdir={w}", *TINY],
        "config.init_checkpoint"),
    "init_hf with a binary config.json": (
        lambda i, w: ["ksjax.main", "--config=configs/pass_at_k.py",
                      f"--config.init_hf={i / 'binary_config'}", f"--config.workdir={w}",
                      *_tokenizer(i), *TINY],
        "config.json' is not JSON text (UnicodeDecodeError"),
    "init_hf with a truncated model.safetensors": (
        lambda i, w: ["ksjax.main", "--config=configs/pass_at_k.py",
                      f"--config.init_hf={i / 'truncated_hf'}", f"--config.workdir={w}",
                      *_tokenizer(i), *TINY],
        "model.safetensors' is not a readable safetensors file (SafetensorError"),
    "init_gguf of a garbage file": (
        lambda i, w: ["ksjax.main", "--config=configs/pass_at_k.py",
                      f"--config.init_gguf={i / 'garbage.gguf'}", f"--config.workdir={w}",
                      *TINY],
        "garbage.gguf"),
    "data builder without its files": (
        lambda i, w: ["ksjax.tasks.data", "--dataset=math", f"--data_dir={w}",
                      f"--manual_dir={i / 'no_such_dir'}"],
        "dataset 'math'"),
    "convert_hf of a truncated model.safetensors": (
        lambda i, w: ["ksjax.tools.convert_hf", f"--hf_dir={i / 'truncated_hf'}", f"--out={w}"],
        "is not a readable safetensors file"),
    "plan with a missing config file": (
        lambda i, w: ["ksjax.tools.plan", "--config=configs/nope.py", f"--json_out={w}"],
        "config file 'configs/nope.py' (--config) does not exist"),
}


def _run(args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": support.xla_flags(1)}
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                        timeout=300, check=False, env=env)


def _tree(path):
  return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, inputs, tmp_path):
  command, named = CASES[case]
  out = tmp_path / "out"
  before = _tree(inputs)
  result = _run(command(inputs, out))
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert result.returncode == 2, result.stderr[-3000:]
  assert len(lines) == 1, result.stderr[-3000:]
  assert named in lines[0], lines[0]
  prog = command(inputs, out)[0]
  assert lines[0].split(":")[0] in (prog.split(".")[-1], prog, "ksjax"), lines[0]
  assert not out.exists()
  assert _tree(inputs) == before


def test_eval_of_a_checkpoint_that_fails_its_checksums_is_one_line(tmp_path):
  workdir = tmp_path / "run"
  _save(str(workdir / "checkpoints"), (1, 2))
  flip_middle_of_largest_file(str(workdir / "checkpoints" / "2"))
  before = _tree(workdir)
  result = eval_run.run_eval(workdir, "--config.steps=latest")
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert result.returncode == 2, result.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("ksjax.eval: checkpoint step 2"), lines
  assert "fails its checksums" in lines[0]
  assert _tree(workdir) == before


def test_the_boundary_drops_held_log_lines_on_bad_input(capsys):
  def main(argv):
    del argv
    logging.getLogger("orbax").warning("Metadata file does not exist")
    raise ConfigError("config.k=0 is out of range; expected an integer >= 1")

  with pytest.raises(SystemExit) as exit_info:
    errors.boundary("prog", main)(["prog"])
  assert exit_info.value.code == 2
  assert capsys.readouterr().err.splitlines() == [
      "prog: bad config: config.k=0 is out of range; expected an integer >= 1"]


def test_a_host_the_sandbox_refuses_is_one_line(capsys, tmp_path):
  from ksjax.tasks import sandbox  # pylint: disable=g-import-not-at-top

  def main(argv):
    del argv
    sandbox.Sandbox(sandbox.SandboxConfig(workers=1, python="/bin/false", temp_root=str(tmp_path)))

  with pytest.raises(SystemExit) as exit_info:
    errors.boundary("prog", main)(["prog"])
  assert exit_info.value.code == 2
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith("prog: the code sandbox refuses to start: ")
  assert "/bin/false" in lines[0] and os.listdir(tmp_path) == []


def test_a_bug_keeps_its_traceback_after_the_held_log_lines(caplog):
  def main(argv):
    del argv
    logging.getLogger("orbax").warning("logged before the bug")
    raise ZeroDivisionError("a bug")

  with caplog.at_level(logging.WARNING):
    with pytest.raises(ZeroDivisionError):
      errors.boundary("prog", main)(["prog"])
  assert [r.getMessage() for r in caplog.records] == ["logged before the bug"]
  assert logging.getLogger().handlers and not any(
      type(h).__name__ == "_Keep" for h in logging.getLogger().handlers)


def test_a_good_run_prints_its_output_through_the_boundary(tmp_path):
  """The boundary's hold ends at the first line on stdout, which must come out whole."""
  result = _run(["ksjax.tools.plan", "--config=configs/pass_at_k.py", "--exact_only",
                 "--fake_devices=4", "--config.mesh=(1,4,1)", "--prompt_len=10"])
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("model: ") and "eval KV cache" in result.stdout


def _drop_failed_future(error: BaseException) -> None:
  """What a failed Orbax save leaves: a future that failed and is dropped unread; asyncio logs
  "exception was never retrieved" as it is garbage collected."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top
  loop = asyncio.new_event_loop()
  try:
    future = loop.create_future()
    future.set_exception(error)
    del future
    gc.collect()
  finally:
    loop.close()


def test_a_dropped_future_of_a_full_disk_logs_nothing_but_other_failures_still_log(caplog):
  errors.quiet_disk_full_reports()
  caplog.set_level(logging.ERROR, logger="asyncio")
  _drop_failed_future(ValueError("OUT_OF_RANGE: Error writing \"x\": Failed to write 107000 "
                                 "bytes to file 7: File too large [os_error_code='27']"))
  assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
  _drop_failed_future(ValueError("OUT_OF_RANGE: something else [os_error_code='5']"))
  assert [r for r in caplog.records if r.name == "asyncio"], caplog.text
