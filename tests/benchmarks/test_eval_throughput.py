"""benchmarks/eval_throughput.py at a toy size: the embedded task's tiny model (configs/eval.py's
default run, float32 products), both designs and both paths, one checkpoint each: it reports a
figure per design and path with the CPU, and finds the two paths' records equal. 15-30 s, most
of it compiling both paths' programs, so it is marked slow."""

import os

import pytest
from tests import support

SCRIPT = os.path.join(str(support.REPO), "benchmarks", "eval_throughput.py")


@pytest.mark.slow
def test_the_benchmark_runs_at_a_toy_size(capsys):
  bench = support.load_module(SCRIPT, "ksjax_benchmarks_eval_throughput")
  bench.main(["--train_config=", "--max_new_tokens=6", "--eval_problems=3",
              "--ladder_per_level=1", "--checkpoints=1", "--call_rows=128"])
  out = capsys.readouterr().out
  for design in ("eval", "ladder"):
    assert f"{design} checkpoint 1: per-problem counts and answer classes of the two paths equal" \
        in out
    assert f"{design}: new is " in out
  assert out.count("CPU: ") >= 2 and "avx512_bf16" in out and "amx" in out


def test_the_designs_select_their_problems():
  bench = support.load_module(SCRIPT, "ksjax_benchmarks_eval_throughput")

  class P:  # pylint: disable=too-few-public-methods
    def __init__(self, level):
      self.metadata = {"level": level}

  prompts = [P(level) for level in (1, 2, 3, 4) for _ in range(40)]
  spread = bench.select(prompts, "eval", 8, 0)
  assert [p.metadata["level"] for p in spread] == [1, 1, 2, 2, 3, 3, 4, 4]
  ladder = bench.select(prompts, "ladder", 0, 2)
  assert ladder == [prompts[0], prompts[1], prompts[40], prompts[41], prompts[80], prompts[81],
                    prompts[120], prompts[121]]
