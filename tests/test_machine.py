"""ksjax.machine: the provenance line names the CPU model and its matmul instruction sets; the
entry points' re-execution with transparent huge pages for glibc's malloc."""

import os
import subprocess
import sys

import pytest

from ksjax import machine


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


def _thp(tmp_path, mode):
  path = tmp_path / "enabled"
  path.write_text({"madvise": "always [madvise] never\n", "always": "[always] madvise never\n",
                   "never": "always madvise [never]\n"}[mode])
  return str(path)


def test_hugepages_environment_adds_the_tunable_where_glibc_and_the_kernel_take_it(tmp_path):
  env = {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
  got = machine.hugepages_environment(env, ("glibc", "2.36"), _thp(tmp_path, "madvise"))
  assert got == {"PATH": "/bin",
                 "GLIBC_TUNABLES": "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"}
  assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=4"  # the caller's dict is untouched
  assert machine.hugepages_environment({}, ("glibc", "2.35"), _thp(tmp_path, "always")) == {
      "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


@pytest.mark.parametrize("env,libc,mode", [
    ({}, ("glibc", "2.34"), "madvise"),       # before the tunable existed
    ({}, ("", ""), "madvise"),                # not glibc (musl, macOS)
    ({}, ("glibc", "2.36"), "never"),         # huge pages off
    ({}, ("glibc", "2.36"), None),            # no such kernel file
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, ("glibc", "2.36"), "madvise"),  # user's choice
    ({"KSJAX_HUGEPAGES": "0"}, ("glibc", "2.36"), "madvise"),                      # opted out
])
def test_hugepages_environment_leaves_the_process_alone(tmp_path, env, libc, mode):
  thp = _thp(tmp_path, mode) if mode else str(tmp_path / "missing")
  assert machine.hugepages_environment(env, libc, thp) is None


def test_reexec_runs_the_same_command_once_with_the_tunable():
  """A child that re-executes itself: its second run sees the tunable, and does not re-execute
  again (a loop would never print)."""
  code = ("import os, sys; print('run', os.environ.get('GLIBC_TUNABLES'), flush=True); "
          "from ksjax import machine; machine.reexec_with_hugepages(); print('done', sys.argv[1:])")
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "KSJAX_HUGEPAGES")}
  out = subprocess.run([sys.executable, "-c", code, "arg"], env=env, capture_output=True,
                       text=True, check=True, timeout=60).stdout.splitlines()
  if machine.hugepages_environment(env) is None:  # this machine cannot take it: one plain run
    assert out == ["run None", "done ['arg']"]
  else:
    assert out == ["run None", "run glibc.malloc.hugetlb=1", "done ['arg']"]
