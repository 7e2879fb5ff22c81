"""No compiling in steady state: the binaries' persistent compilation cache (a second identical run
and a resumed run compile at most a tenth of the first run's seconds), its switch and its errors,
the log's count of compilations per program, and the bound on the update's row buckets."""

import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from ksjax import compilation_cache
from ksjax.run import config as run_config
from ksjax.run import spec as spec_lib
from ksjax.run.directory import RunDirectory
from ksjax.trainer import draw as draw_lib
from ksjax.trainer import metrics, sparse
from tests import support
from tests.trainer import test_run

SUMMARY = re.compile(r"^compiled: (\d+) programs, (\d+) compilations"
                     r"(?: \((\d+) read from the persistent cache\))?, ([\d.]+) s")


def _compiled(stdout: str) -> dict[str, float]:
  """The numbers of a run's `compiled: ...` line."""
  found = [SUMMARY.match(line) for line in stdout.splitlines()]
  found = [m for m in found if m]
  assert len(found) == 1, stdout[-3000:]
  programs, count, hits, seconds = found[0].groups()
  return {"programs": int(programs), "count": int(count), "hits": int(hits or 0),
          "seconds": float(seconds)}


def _train(workdir, env, **overrides) -> dict[str, float]:
  result = subprocess.run(test_run._main(str(workdir), **overrides), cwd=support.REPO, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return _compiled(result.stdout)


def _compiles_at_most_a_tenth(run, first) -> None:
  """A run compiles at most a tenth of the first run's seconds. A program read from the cache is
  not compiled: where every one was a hit, the seconds left are reads, which a loaded machine
  stretches (2.1 s against 17.6 s seen under a load average of 8 on 2 cores), so they are not
  held to the tenth."""
  assert run["hits"] == run["count"] or run["seconds"] <= 0.1 * first["seconds"], (first, run)


@pytest.mark.slow  # three trainer runs in subprocesses; `python -m pytest -m slow`
def test_a_second_run_and_a_resumed_run_read_their_programs_from_the_cache(tmp_path):
  cache = tmp_path / "cache"
  env = {**test_run._env(), compilation_cache.ENV: str(cache)}
  first = _train(tmp_path / "first", env, num_steps=2)
  assert first["hits"] == 0 and first["count"] >= first["programs"] > 0
  assert len(os.listdir(cache)) >= first["programs"]

  second = _train(tmp_path / "second", env, num_steps=2)
  assert second["programs"] == first["programs"] and second["hits"] > 0
  _compiles_at_most_a_tenth(second, first)
  lines = metrics.read_jsonl(RunDirectory(str(tmp_path / "second")).metrics_jsonl)
  assert lines[0]["compile/cache_hits"] > 0

  # The second run, stopped at its checkpoint of step 2, resumed for one more step: its
  # restore's programs are new, the rest come from the cache.
  resumed = _train(tmp_path / "second", env, num_steps=3, resume=True)
  assert resumed["hits"] > 0
  _compiles_at_most_a_tenth(resumed, first)
  lines = metrics.read_jsonl(RunDirectory(str(tmp_path / "second")).metrics_jsonl)
  assert [line["step"] for line in lines] == [1, 2, 3]


# A binary in miniature: one compilation through the boundary; prints what JAX was told.
PROBE = """
import jax, jax.numpy as jnp
from ksjax import errors
def main(argv):
  jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()
  print(jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
errors.boundary("probe", main)(["probe"])
"""


def _probe(tmp_path, value=None, **extra):
  env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), **extra}
  env.pop(compilation_cache.ENV, None)
  if value is not None:
    env[compilation_cache.ENV] = value
  return subprocess.run([sys.executable, "-c", PROBE], cwd=support.REPO, env=env,
                        capture_output=True, text=True, timeout=300, check=False)


def test_the_cache_is_on_by_default_in_the_users_cache_directory_and_off_writes_nothing(tmp_path):
  default = tmp_path / "xdg" / "ksjax" / "jax"
  default = default / os.path.basename(compilation_cache.default_dir(
      {"XDG_CACHE_HOME": str(tmp_path / "xdg")}))  # one directory per CPU kind
  assert os.path.dirname(compilation_cache.default_dir({"XDG_CACHE_HOME": "/x"})) == (
      "/x/ksjax/jax")
  result = _probe(tmp_path)
  assert result.returncode == 0 and result.stderr == "", result.stderr
  assert result.stdout.split() == ["True", str(default)]
  assert os.listdir(default) and (os.stat(default).st_mode & 0o777) == 0o700

  off = tmp_path / "off"
  result = _probe(off, "off")
  assert result.returncode == 0 and result.stderr == "", result.stderr
  assert result.stdout.split()[0] == "False"
  assert not (off / "xdg").exists()

  moved = tmp_path / "moved"
  result = _probe(tmp_path, str(moved))
  assert result.returncode == 0 and result.stdout.split() == ["True", str(moved)]
  assert os.listdir(moved)


def test_a_bad_cache_directory_is_one_line_and_exit_2(tmp_path):
  afile = tmp_path / "a_file"
  afile.write_text("")
  workdir = tmp_path / "run"
  result = subprocess.run(test_run._main(str(workdir)), cwd=support.REPO,
                          env={**test_run._env(), compilation_cache.ENV: str(afile)},
                          capture_output=True, text=True, timeout=300, check=False)
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert result.returncode == 2, result.stderr
  assert lines == [f"ksjax: {compilation_cache.ENV}={str(afile)!r} cannot hold the compilation "
                   "cache: it is not a directory; expected a writable directory (created if "
                   "missing) or 'off'"]
  assert not workdir.exists()
  if os.geteuid() != 0:  # root writes anywhere
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o500)
    result = _probe(tmp_path, str(read_only))
    assert result.returncode == 2 and "it is not writable" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_default_directory_that_cannot_be_made_warns_once_and_runs_without(tmp_path):
  (tmp_path / "xdg").write_text("")  # XDG_CACHE_HOME is a file: nothing can be made under it
  result = _probe(tmp_path)
  assert result.returncode == 0, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("probe: warning: running without a compilation "
                                                 "cache:"), result.stderr
  assert result.stdout.split()[0] == "False"


def test_importing_ksjax_leaves_jax_configured_as_it_was():
  code = ("import jax, ksjax.main, ksjax.trainer, ksjax.errors; "
          "print(jax.config.jax_compilation_cache_dir, "
          "jax.config.jax_persistent_cache_min_compile_time_secs)")
  result = subprocess.run([sys.executable, "-c", code], cwd=support.REPO, capture_output=True,
                          text=True, timeout=300, check=True)
  assert result.stdout.split() == ["None", "1.0"]


def test_compilations_are_counted_per_program_with_the_caches_hits():
  counter = metrics.CompileCounter()

  def never_compiled_before(x):
    return jnp.cumsum(x) * 7

  jax.jit(never_compiled_before)(jnp.arange(11.0)).block_until_ready()
  jax.jit(never_compiled_before)(jnp.arange(13.0)).block_until_ready()  # a new shape
  # What JAX records for a program read from the persistent cache (jax/_src/compiler.py).
  jax.monitoring.record_event(metrics.CACHE_HIT_EVENT)
  jax.monitoring.record_event_duration_secs(metrics.BACKEND_COMPILE_EVENT, 0.5,
                                            fun_name="jit(update)")
  programs = counter.programs()
  assert programs["never_compiled_before"].count == 2
  assert programs["never_compiled_before"].cache_hits == 0
  assert programs["update"] == metrics.Compiled(1, 0.5, 1)
  step = counter.take()
  assert step["compile/count"] == counter.total().count >= 3
  assert step["compile/cache_hits"] == 1
  line = counter.summary(most=len(programs))
  assert line.startswith(f"compiled: {len(programs)} programs, {counter.total().count} "
                         "compilations (1 read from the persistent cache), ")
  assert "never_compiled_before 2x" in line and "update 1x 0.5 s" in line
  assert counter.take()["compile/count"] == 0


def _update_shapes(rows: int, shards: int, min_rows: int, micro_batch: int) -> set:
  """The [micro-batches, rows per micro-batch] shapes the update is compiled for, over every
  number of kept rows (`learner.learn`'s sparse path), and the counts it runs of them."""
  shapes, counts = set(), set()
  for kept in range(1, rows + 1):
    selection = sparse.select_rows([1.0] * kept + [0.0] * (rows - kept), shards, min_rows,
                                   micro_batch)
    shapes.add((len(selection.rows) // selection.micro, selection.micro))
    counts.add(selection.count)
  return shapes, counts


def test_the_update_compiles_a_bounded_number_of_row_buckets():
  # The SmolLM2 configs' sizes: 8 prompts x 4 completions, buckets from 1 row, micro-batches of 2.
  spec = spec_lib.from_config(run_config.smollm2_config())
  rows, min_rows = spec.sampling.rows, spec.loss.sparse_min_rows
  assert (rows, min_rows, spec.loss.micro_batch_size, spec.loss.use_sparse) == (32, 1, 2, True)
  shapes, counts = _update_shapes(rows, 1, min_rows, spec.loss.micro_batch_size)
  assert len(shapes) <= math.log2(spec.loss.micro_batch_size / min_rows) + 1
  assert shapes == {(32, 1), (16, 2)}  # 2 programs per prompt width, whatever is kept
  assert sparse.micro_sizes(rows, 1, min_rows, 2) == (1, 2)  # what the memory plan compiles
  assert counts == set(range(1, 17))  # the micro-batches run: ceil(kept / 2), at run time
  # Micro-batches of 4 (the configs' size before 2): 3 programs.
  shapes, counts = _update_shapes(rows, 1, min_rows, 4)
  assert shapes == {(32, 1), (16, 2), (8, 4)} and counts == set(range(1, 9))
  for total, multiple, min_rows, micro in [(32, 1, 1, 4), (128, 2, 8, 32), (96, 4, 1, 96),
                                           (24, 8, 8, 8)]:
    shapes, _ = _update_shapes(total, multiple, min_rows, micro)
    assert sparse.micro_sizes(total, multiple, min_rows, micro) == tuple(sorted(
        m for _, m in shapes))
  # Any sizes: ceil(log2(total / min_rows)) + 1 buckets at most (a total that is not a power of
  # two adds its own); the groups of dynamic sampling are bucketed the same way.
  for total, multiple, min_rows in [(32, 1, 8), (128, 2, 8), (128, 2, 1), (96, 4, 1), (24, 8, 8),
                                    (1, 1, 1)]:
    sizes = {sparse.bucket_rows(kept, total, multiple, min_rows) for kept in range(total + 1)}
    assert len(sizes) <= math.ceil(math.log2(max(total / min_rows, 1))) + 1, (total, sizes)
  groups = {draw_lib.bucket_groups(kept, 8) for kept in range(1, 9)}
  assert groups == {1, 2, 4, 8}
