"""ksjax.allocator: the entry points' re-execution with a faster allocator (jemalloc, or glibc on
huge pages)."""

import os
import platform
import subprocess
import sys

import pytest

from ksjax import allocator


def _thp(tmp_path, mode):
  path = tmp_path / "enabled"
  path.write_text({"madvise": "always [madvise] never\n", "always": "[always] madvise never\n",
                   "never": "always madvise [never]\n"}[mode])
  return str(path)


def test_hugepages_environment_adds_the_tunable_where_glibc_and_the_kernel_take_it(tmp_path):
  env = {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
  got = allocator.hugepages_environment(env, ("glibc", "2.36"), _thp(tmp_path, "madvise"))
  assert got == {"PATH": "/bin",
                 "GLIBC_TUNABLES": "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"}
  assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=4"  # the caller's dict is untouched
  assert allocator.hugepages_environment({}, ("glibc", "2.35"), _thp(tmp_path, "always")) == {
      "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


@pytest.mark.parametrize("env,libc,mode", [
    ({}, ("glibc", "2.34"), "madvise"),       # before the tunable existed
    ({}, ("", ""), "madvise"),                # not glibc (musl, macOS)
    ({}, ("glibc", "2.36"), "never"),         # huge pages off
    ({}, ("glibc", "2.36"), None),            # no such kernel file
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, ("glibc", "2.36"), "madvise"),  # user's choice
])
def test_hugepages_environment_leaves_the_process_alone(tmp_path, env, libc, mode):
  thp = _thp(tmp_path, mode) if mode else str(tmp_path / "missing")
  assert allocator.hugepages_environment(env, libc, thp) is None


_GLIBC = ("glibc", "2.36")


def test_malloc_environment_prefers_jemalloc_and_falls_back_to_huge_pages(tmp_path):
  thp = _thp(tmp_path, "madvise")
  env = {"PATH": "/bin", "LD_PRELOAD": "libfoo.so"}
  got = allocator.malloc_environment(env, _GLIBC, thp, jemalloc="libjemalloc.so.2")
  assert got == {"PATH": "/bin", "LD_PRELOAD": "libjemalloc.so.2:libfoo.so",
                 "MALLOC_CONF": allocator.JEMALLOC_CONF}
  assert "dirty_decay_ms:-1" in allocator.JEMALLOC_CONF  # keeps freed pages: what buys the speed
  assert env == {"PATH": "/bin", "LD_PRELOAD": "libfoo.so"}  # the caller's dict is untouched
  mine = {"MALLOC_CONF": "narenas:1"}  # the user's settings win
  assert allocator.malloc_environment(mine, _GLIBC, thp, jemalloc="libjemalloc.so.2") == {
      "MALLOC_CONF": "narenas:1", "LD_PRELOAD": "libjemalloc.so.2"}
  # no jemalloc: glibc on huge pages, as `hugepages_environment`
  assert allocator.malloc_environment({}, _GLIBC, thp, jemalloc="") == {
      "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
  assert allocator.malloc_environment({"KSJAX_MALLOC": "glibc"}, _GLIBC, thp,
                                    jemalloc="libjemalloc.so.2") == {
      "KSJAX_MALLOC": "glibc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
  library = tmp_path / "libje.so"
  library.write_bytes(b"")
  assert allocator.malloc_environment({"KSJAX_MALLOC": str(library)}, _GLIBC, thp, jemalloc="")[
      "LD_PRELOAD"] == str(library)


@pytest.mark.parametrize("env", [
    {"KSJAX_MALLOC": "off"},
    {"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"},  # the user's own allocator
    {"LD_PRELOAD": "libjemalloc.so.2", "MALLOC_CONF": allocator.JEMALLOC_CONF},  # re-executed
])
def test_malloc_environment_leaves_the_process_alone(tmp_path, env):
  assert allocator.malloc_environment(env, _GLIBC, _thp(tmp_path, "madvise"),
                                    jemalloc="libjemalloc.so.2") is None


@pytest.mark.parametrize("choice,error", [
    ("tcmalloc", "KSJAX_MALLOC='tcmalloc' is not accepted; expected one of auto, jemalloc, glibc, "
                 "off, or the path of a jemalloc shared library"),
    ("/no/such/libjemalloc.so", "KSJAX_MALLOC='/no/such/libjemalloc.so': no such file"),
    ("jemalloc", "KSJAX_MALLOC=jemalloc: no jemalloc library found"),
])
def test_malloc_environment_rejects_what_it_cannot_do_in_one_line(tmp_path, choice, error):
  with pytest.raises(ValueError) as e:
    allocator.malloc_environment({"KSJAX_MALLOC": choice}, _GLIBC, _thp(tmp_path, "madvise"),
                               jemalloc="")
  assert str(e.value).startswith(error) and "\n" not in str(e.value)


@pytest.mark.parametrize("env", [
    {}, {"PATH": "/bin", "LD_PRELOAD": "libfoo.so", "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"},
    {"MALLOC_CONF": "narenas:1"}, {"KSJAX_MALLOC": "glibc"},
    {"KSJAX_MALLOC": "path", "LD_PRELOAD": "libfoo.so"}])
@pytest.mark.parametrize("jemalloc", ["libjemalloc.so.2", ""])
def test_without_allocator_undoes_malloc_environment(tmp_path, env, jemalloc):
  if env.get("KSJAX_MALLOC") == "path":
    library = tmp_path / "libje.so"
    library.write_bytes(b"")
    env = {**env, "KSJAX_MALLOC": str(library)}
  got = allocator.malloc_environment(env, _GLIBC, _thp(tmp_path, "madvise"), jemalloc=jemalloc)
  assert got is not None and got != env
  assert allocator.without_allocator(got) == env


def _libc_path() -> str:
  """The file this process's C library was loaded from: a real library that is harmless to
  preload (it is loaded anyway)."""
  with open("/proc/self/maps", encoding="utf-8") as f:
    return next(line.split()[-1] for line in f if "/libc.so" in line or "/libc-" in line)


def _run_reexecuting_child(env):
  code = ("import os, sys; print('run', os.environ.get('LD_PRELOAD'), "
          "os.environ.get('GLIBC_TUNABLES'), flush=True); from ksjax import allocator; "
          "allocator.reexec_with_allocator('child'); print('done', sys.argv[1:])")
  return subprocess.run([sys.executable, "-c", code, "arg"], env=env, capture_output=True,
                        text=True, timeout=60)


def test_reexec_runs_the_same_command_once_with_the_chosen_library():
  """A child that re-executes itself: its second run sees the preloaded library, and does not
  re-execute again (a loop would never print 'done')."""
  libc = _libc_path()
  env = {**allocator.without_allocator(os.environ), "KSJAX_MALLOC": libc}
  env.pop("LD_PRELOAD", None)
  out = _run_reexecuting_child(env)
  assert out.returncode == 0, out.stderr
  assert out.stdout.splitlines() == ["run None None", f"run {libc} None", "done ['arg']"]


def test_reexec_runs_the_same_command_once_with_the_default_allocator():
  env = {k: v for k, v in allocator.without_allocator(os.environ).items() if k != "KSJAX_MALLOC"}
  env.pop("LD_PRELOAD", None)
  out = _run_reexecuting_child(env)
  assert out.returncode == 0, out.stderr
  want = allocator.malloc_environment(env)
  if want is None:  # this machine can take neither: one plain run
    assert out.stdout.splitlines() == ["run None None", "done ['arg']"]
  else:
    assert out.stdout.splitlines() == [
        "run None None", f"run {want.get('LD_PRELOAD')} {want.get('GLIBC_TUNABLES')}",
        "done ['arg']"]


def test_reexec_rejects_a_bad_choice_with_one_line_and_status_2():
  env = {**allocator.without_allocator(os.environ), "KSJAX_MALLOC": "fast"}
  out = _run_reexecuting_child(env)
  assert out.returncode == 2
  assert out.stdout.splitlines() == ["run None None"]
  assert out.stderr.strip().splitlines() == [
      "child: KSJAX_MALLOC='fast' is not accepted; expected one of auto, jemalloc, glibc, off, "
      "or the path of a jemalloc shared library"]


_TRIM_SCRIPT = """
import os, sys
sys.path.insert(0, sys.argv[1])
import allocator
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
blocks = [b"x" * (64 * 1024) for _ in range(4000)]  # 250 MiB written, below the mmap threshold
keep = b"y" * (64 * 1024)  # above them: the heap's top stays in use, so free() cannot shrink it
del blocks
before = rss()
print(allocator.release_free_memory(), (before - rss()) / 2**20)
"""


def test_release_free_memory_hands_back_the_pages_glibc_kept_after_frees():
  """What the trainer calls between phases: after 250 MiB of freed blocks that glibc keeps (the
  heap's top is still in use), the call gives most of them back; elsewhere it does nothing and
  says so."""
  out = subprocess.run([sys.executable, "-c", _TRIM_SCRIPT, os.path.dirname(allocator.__file__)],
                       capture_output=True, text=True, check=True).stdout.split()
  has_trim, released_mib = out[0] == "True", float(out[1])
  if platform.libc_ver()[0] == "glibc":
    assert has_trim and released_mib > 150, out
  else:
    assert not has_trim and released_mib == 0, out


def test_allocated_bytes_follows_glibcs_allocations_and_declines_another_malloc(monkeypatch):
  monkeypatch.delenv("LD_PRELOAD", raising=False)
  before = allocator.allocated_bytes()
  if platform.libc_ver()[0] != "glibc":
    assert before is None
    return
  block = bytearray(128 * 2**20)
  held = allocator.allocated_bytes() - before
  del block
  # Less what the process's other threads (a suite worker's XLA pools) free meanwhile: a few MiB.
  assert 120 * 2**20 <= held < 136 * 2**20
  assert allocator.allocated_bytes() - before < 8 * 2**20
  # With jemalloc preloaded glibc's figures would count only its own idle arenas.
  monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
  assert allocator.allocated_bytes() is None
