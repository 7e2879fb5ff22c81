"""ksjax.machine: the provenance line names the CPU model and its matmul instruction sets."""

from ksjax import machine


def test_describe_reads_model_and_matmul_flags(tmp_path):
  info = tmp_path / "cpuinfo"
  info.write_text("processor\t: 0\nmodel name\t: Some CPU 9000\n"
                  "flags\t\t: fpu sse2 avx2 fma avx512f amx_bf16 amx_tile\n")
  line = machine.describe(str(info))
  assert line.startswith("Some CPU 9000, ") and line.endswith(", amx_bf16 avx512f avx2")
  assert machine.describe(str(tmp_path / "missing")).endswith("CPUs")  # no cpuinfo: still a line
