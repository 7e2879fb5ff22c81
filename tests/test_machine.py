"""ksjax.machine: the provenance line names the CPU model and its matmul instruction sets; the
bfloat16 note names the CPUs that emulate bfloat16 dots."""

import json
import subprocess
import sys

from ksjax import machine
from tests import support


def test_describe_reads_model_and_matmul_flags(tmp_path):
  info = tmp_path / "cpuinfo"
  info.write_text("processor\t: 0\nmodel name\t: Some CPU 9000\n"
                  "flags\t\t: fpu sse2 avx2 fma avx512f amx_bf16 amx_tile\n")
  line = machine.describe(str(info))
  assert line.startswith("Some CPU 9000, ") and line.endswith(", amx_bf16 avx512f avx2")
  assert machine.describe(str(tmp_path / "missing")).endswith("CPUs")  # no cpuinfo: still a line


def test_bfloat16_operand_note_only_where_the_cpu_lacks_bfloat16_dots(tmp_path):
  avx2, amx = tmp_path / "avx2", tmp_path / "amx"
  avx2.write_text("model name\t: A\nflags\t\t: fpu avx2 fma avx512f\n")
  amx.write_text("model name\t: B\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
  note = machine.bfloat16_operand_note("bfloat16", "cpu", str(avx2))
  assert note and "matmul_dtype=float32" in note
  assert machine.bfloat16_operand_note("bfloat16", "cpu", str(amx)) is None
  assert machine.bfloat16_operand_note("float32", "cpu", str(avx2)) is None
  assert machine.bfloat16_operand_note("bfloat16", "gpu", str(avx2)) is None
  assert machine.bfloat16_operand_note("bfloat16", "cpu", str(tmp_path / "none")) is None
  # The same flags decide where ksjax.model.layers widens bfloat16 product operands.
  assert machine.lacks_bfloat16_dots(str(avx2)) and not machine.lacks_bfloat16_dots(str(amx))
  assert not machine.lacks_bfloat16_dots(str(tmp_path / "none"))  # no flags: XLA's own choice


def test_machine_loads_by_path_with_the_standard_library_only():
  """As `.ci/run` loads it, before the install: by path, importing nothing outside the standard
  library."""
  code = ("import sys; before = set(sys.modules); sys.path.insert(0, 'ksjax'); import machine; "
          "new = {m.split('.')[0] for m in set(sys.modules) - before} - {'machine'}; "
          "assert new <= set(sys.stdlib_module_names), new; print(machine.describe())")
  out = subprocess.run([sys.executable, "-I", "-c", code], cwd=support.REPO, capture_output=True,
                       text=True, timeout=60, check=False)
  assert out.returncode == 0 and "CPUs" in out.stdout, out.stderr




def test_run_child_measures_that_child_alone():
  # On Linux a child's ru_maxrss starts from the launching process's resident pages at the fork
  # (a CI worker's can be gigabytes after heavy tests), so the children are launched from a small
  # process of their own, which loads ksjax/machine.py by path as `.ci/run` does. The big child
  # holds 100 MiB more than that launcher's high-water mark; it spins a while and exits with
  # status 3. The next child's figures are its own, not the largest or the sum over the
  # launcher's children (which `resource.getrusage(RUSAGE_CHILDREN)` would give).
  launcher = """
import dataclasses, json, sys
sys.path.insert(0, "ksjax")
import machine
with open("/proc/self/status", encoding="ascii") as f:
  hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
big = hwm + 100 * 2**20
code = (f"import time\\nb = bytearray({big})\\nfor i in range(0, len(b), 4096): b[i] = 1\\n"
        "t = time.process_time()\\nwhile time.process_time() - t < 0.3: pass\\n"
        "raise SystemExit(3)")
runs = [machine.run_child([sys.executable, "-c", code]),
        machine.run_child([sys.executable, "-c", "pass"])]
print(json.dumps({"big": big, "runs": [dataclasses.asdict(r) for r in runs]}))
"""
  out = subprocess.run([sys.executable, "-I", "-c", launcher], cwd=support.REPO,
                       capture_output=True, text=True, timeout=120, check=False)
  assert out.returncode == 0, out.stderr
  figures = json.loads(out.stdout)
  big, (run, small) = figures["big"], [machine.ChildRun(**r) for r in figures["runs"]]
  assert run.exit_status == 3
  assert run.peak_rss_bytes >= big
  assert run.cpu_seconds >= 0.3 and run.wall_seconds >= run.cpu_seconds * 0.5
  assert small.exit_status == 0 and small.peak_rss_bytes < big
  assert small.cpu_seconds < 0.3
