"""The sandbox: correctness on honest programs, and the adversarial suite (the output judge:
test_code_judge.py).

Every adversarial program must end in a failing result within its limits, leave no process and no
file behind, and leave this (the calling) process unharmed. Where an attack could make a program
print the expected output (a leaked secret, a reachable socket), the expected output is exactly
what the attack would reveal, so a leak would turn the result into a pass.
"""

import dataclasses
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import uuid

import pytest

from ksjax.tasks import sandbox as sb

A_PLUS_B = "a, b = map(int, input().split())\nprint(a + b)\n"
ADDITION_TESTS = [{"input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in
                  [(1, 2), (10, 20), (-5, 5), (123456789, 987654321), (0, 0)]]
# Generous for a loaded shared machine: the slowest attack (wall clock of a sleeping program,
# 1 s CPU * 1.5 + 0.5 s) ends in 2 s of its own.
ATTACK_SECONDS = 8.0


@pytest.fixture(scope="module")
def temp_root(tmp_path_factory):
  return str(tmp_path_factory.mktemp("sandbox_root"))


@pytest.fixture(scope="module")
def sandbox(temp_root):
  config = sb.SandboxConfig(workers=2, time_limit_s=1.0, wall_time_factor=1.5,
                            wall_time_slack_s=0.5, program_timeout_s=20.0,
                            memory_bytes=128 << 20, output_bytes=1 << 20, scratch_bytes=4 << 20,
                            processes=8, temp_root=temp_root)
  with sb.Sandbox(config) as box:
    yield box


@pytest.fixture(scope="module")
def report(sandbox):
  return sandbox.isolation_report()


@pytest.fixture(scope="module")
def host_allows_namespaces():
  """Whether this host lets us create the namespaces, asked of util-linux's unshare, not of the
  code under test (None when unshare is not installed)."""
  flags = ["--mount", "--net", "--pid", "--fork"]
  if os.geteuid() != 0:
    flags = ["--user", "--map-current-user"] + flags
  try:
    return subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0
  except FileNotFoundError:
    return None


def _status_field(pid: str, field: str) -> int | None:
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except (OSError, ValueError):
    return None
  return None


def _cmdline(pid: str) -> bytes:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read()
  except OSError:
    return b""


def _leftovers(sandbox: sb.Sandbox) -> list[str]:
  """Processes running as one of this sandbox's uids (as root), and runners descending from this
  process. (Other children of this process, e.g. another module's worker pool, do not count.)"""
  pids = [pid for pid in os.listdir("/proc") if pid.isdigit()]
  parent = {pid: str(_status_field(pid, "PPid")) for pid in pids}

  def descends_from_us(pid):
    for _ in range(64):
      pid = parent.get(pid)
      if pid is None:
        return False
      if pid == str(os.getpid()):
        return True
    return False

  uids = set(sandbox.uids()) if os.geteuid() == 0 else set()
  return [pid for pid in pids if _status_field(pid, "Uid") in uids or (
      b"sandbox_runner" in _cmdline(pid) and descends_from_us(pid))]


def _assert_contained(sandbox: sb.Sandbox, temp_root: str) -> None:
  deadline = time.monotonic() + 3.0  # an init killed by its parent's death exits asynchronously
  while _leftovers(sandbox) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert _leftovers(sandbox) == []
  assert os.listdir(temp_root) == []  # working directories and stderr files are gone


def _run_attack(sandbox, temp_root, program, tests=None, fn_name=None,
                time_limit_s=None) -> sb.Result:
  tests = tests or [{"input": "1 2\n", "output": "3\n"}]
  start = time.monotonic()
  result = sandbox.run(sb.Job(program=program, tests=tests, fn_name=fn_name,
                              time_limit_s=time_limit_s))
  elapsed = time.monotonic() - start
  assert not result.passed
  assert result.verdict != "sandbox_error", result.detail
  assert elapsed < ATTACK_SECONDS
  _assert_contained(sandbox, temp_root)
  # The sandbox still works afterwards.
  assert sandbox.run(sb.Job(program=A_PLUS_B, tests=ADDITION_TESTS)).passed
  return result


# ---------------------------------------------------------------------------------------------
# Honest programs.


def test_correct_program_passes_every_test(sandbox, temp_root):
  result = sandbox.run(sb.Job(program=A_PLUS_B, tests=ADDITION_TESTS))
  assert result.passed and result.verdict == "passed"
  assert result.tests_run == len(ADDITION_TESTS)
  _assert_contained(sandbox, temp_root)


def test_wrong_answer_fails_at_the_first_failing_test(sandbox):
  program = "a, b = map(int, input().split())\nprint(a + b if a != 10 else 0)\n"
  result = sandbox.run(sb.Job(program=program, tests=ADDITION_TESTS))
  assert not result.passed and result.verdict == "wrong_answer"
  assert result.tests_run == 2  # test 1 (10 20) fails; tests 2.. never run


def test_runtime_error_and_syntax_error(sandbox):
  crash = sandbox.run(sb.Job(program="print(1 // 0)", tests=ADDITION_TESTS))
  assert crash.verdict == "runtime_error" and "ZeroDivisionError" in crash.detail
  syntax = sandbox.run(sb.Job(program="print(", tests=ADDITION_TESTS))
  assert syntax.verdict == "runtime_error" and "SyntaxError" in syntax.detail


def test_float_output_within_tolerance_passes(sandbox):
  program = "n = int(input())\nprint(f'{1 / n:.7f}')\n"
  tests = [{"input": f"{n}\n", "output": f"{1 / n:.12f}\n"} for n in (3, 7, 9)]
  assert sandbox.run(sb.Job(program=program, tests=tests)).passed
  rounded = "n = int(input())\nprint(f'{1 / n:.3f}')\n"  # off by more than 1e-5
  assert sandbox.run(sb.Job(program=rounded, tests=tests)).verdict == "wrong_answer"


def test_each_test_starts_fresh(sandbox):
  # Module state does not carry over: every test runs in a fresh child of the runner.
  program = ("import sys\ncount = getattr(sys, 'seen', 0) + 1\nsys.seen = count\n"
             "input()\nprint(count)\n")
  tests = [{"input": "x\n", "output": "1\n"}] * 3
  assert sandbox.run(sb.Job(program=program, tests=tests)).passed


def test_threads_for_deep_recursion_work(sandbox):
  # A common competitive-programming idiom: a thread with a big stack for deep recursion.
  program = (
      "import sys, threading\nsys.setrecursionlimit(100000)\nthreading.stack_size(64 << 20)\n"
      "def depth(n):\n  return 0 if n == 0 else 1 + depth(n - 1)\n"
      "def main():\n  print(depth(int(input())))\n"
      "t = threading.Thread(target=main)\nt.start()\nt.join()\n")
  tests = [{"input": "20000\n", "output": "20000\n"}]
  assert sandbox.run(sb.Job(program=program, tests=tests)).passed


CALL_TESTS = [{"input": [2, 3], "output": [5]}, {"input": [10, -4], "output": [6]},
              {"input": [0, 0], "output": [0]}]


@pytest.mark.parametrize("program, verdict", [
    ("def add(a, b):\n  return a + b\n", "passed"),
    ("class Solution:\n  def add(self, a, b):\n    print('debug output is ignored')\n"
     "    return a + b\n", "passed"),
    ("def add(a, b):\n  return (a + b,)\n", "passed"),  # a tuple is a list after JSON
    ("def add(a, b):\n  return a - b\n", "wrong_answer"),
    ("def plus(a, b):\n  return a + b\n", "runtime_error"),  # no function `add`
    ("def add(a, b):\n  return {a + b}\n", "runtime_error"),  # a set is not JSON
    ("import sys\nsys.exit(0)\ndef add(a, b):\n  return a + b\n", "runtime_error"),
])
def test_call_based(sandbox, program, verdict):
  result = sandbox.run(sb.Job(program=program, tests=CALL_TESTS, fn_name="add"))
  assert result.verdict == verdict, result.detail
  assert result.passed == (verdict == "passed")


def test_identical_behaviour_has_identical_digest(sandbox):
  tests = ADDITION_TESTS
  zero = sandbox.run(sb.Job(program="input()\nprint(0)", tests=tests))
  zero_too = sandbox.run(sb.Job(program="input()\nprint('0 ')", tests=tests))
  one = sandbox.run(sb.Job(program="input()\nprint(1)", tests=tests))
  assert zero.behaviour == zero_too.behaviour != one.behaviour


def test_isolation_report(report, host_allows_namespaces):
  assert report["probe"] == "passed"  # the self-test: an honest program importing stdlib modules
  assert "import" in sb.PROBE and report["stdlib"]
  assert report["level"] in ("full", "partial", "rlimits_only")
  assert report["rlimits"]["nproc"] == 8 and report["rlimits"]["core"] == 0
  if host_allows_namespaces is None:
    pytest.skip("util-linux unshare is not installed: cannot tell what the host allows")
  # Where the host allows namespaces, anything less than full isolation is a regression.
  assert (report["level"] == "full") == host_allows_namespaces, report
  if host_allows_namespaces:
    assert {"network", "pid", "mount"} <= set(report["namespaces"])


# ---------------------------------------------------------------------------------------------
# The adversarial suite.


def test_fork_bomb(sandbox, temp_root):
  program = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"
  result = _run_attack(sandbox, temp_root, program)
  assert result.verdict == "time_limit"


def test_fork_bomb_does_not_starve_a_concurrent_program(sandbox, temp_root):
  bomb = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"
  honest = "import os, time\ntime.sleep(0.3)\npid = os.fork()\nif pid == 0:\n  os._exit(0)\n" \
           "os.waitpid(pid, 0)\n" + A_PLUS_B
  results = sandbox.run_many([sb.Job(program=bomb, tests=ADDITION_TESTS[:1]),
                              sb.Job(program=honest, tests=ADDITION_TESTS)])
  assert [r.passed for r in results] == [False, True]
  _assert_contained(sandbox, temp_root)


def test_infinite_loop(sandbox, temp_root):
  assert _run_attack(sandbox, temp_root, "while True:\n  pass\n").verdict == "time_limit"


def test_sleeping_program_hits_the_wall_clock(sandbox, temp_root):
  assert _run_attack(sandbox, temp_root, "import time\ntime.sleep(1000)\n").verdict == "time_limit"


def test_memory_hog(sandbox, temp_root):
  program = "hog = []\nwhile True:\n  hog.append(bytearray(16 << 20))\n"
  # 3 s CPU (5 s wall): the memory limit, not the clock of a loaded machine, must end it. With the
  # fixture's 1 s (2 s wall) a CI run beside another job ended it by time before 128 MiB.
  result = _run_attack(sandbox, temp_root, program, time_limit_s=3.0)
  assert result.verdict == "runtime_error" and "MemoryError" in result.detail


def test_gigabyte_of_output(sandbox, temp_root):
  program = ("import sys\nchunk = 'x' * (1 << 20)\n"
             "for _ in range(1024):\n  sys.stdout.write(chunk)\n")
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
  start = time.monotonic()
  result = _run_attack(sandbox, temp_root, program)
  assert result.verdict in ("output_limit", "runtime_error")  # killed by SIGXFSZ or EFBIG
  assert time.monotonic() - start < 5.0  # stopped at 1 MiB, not after writing a gigabyte
  assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 << 10


def test_disk_hog_is_bounded(sandbox, temp_root):
  program = ("import os\nwritten = 0\n"
             "for directory in ('.', '/tmp', '/dev/shm', '/var/tmp'):\n"
             "  for i in range(200):\n"
             "    try:\n"
             "      with open(os.path.join(directory, f'f{i}'), 'wb') as f:\n"
             "        f.write(b'x' * (1 << 20))\n"
             "      written += 1\n"
             "    except OSError:\n"
             "      break\n"
             "print('wrote', written, 'MiB')\n")
  # Passing would need 800 MiB written; the scratch tmpfs holds 4 MiB, the others 4 MiB each.
  _run_attack(sandbox, temp_root, program, tests=[{"input": "", "output": "wrote 800 MiB"}])


def test_writing_outside_the_temporary_directory(sandbox, temp_root, tmp_path):
  name = f"ksjax-escape-{uuid.uuid4().hex}"
  targets = [str(tmp_path / name), f"/tmp/{name}", f"/var/tmp/{name}", f"/dev/shm/{name}",
             os.path.join(temp_root, name), f"/{name}", os.path.join(os.getcwd(), name)]
  program = (f"import os\ntargets = {targets!r}\nwritten = []\n"
             "for path in targets + ['../' + targets[0].rsplit('/', 1)[1]]:\n"
             "  try:\n"
             "    with open(path, 'w') as f:\n"
             "      f.write('escaped')\n"
             "    written.append(path)\n"
             "  except OSError:\n"
             "    pass\n"
             "print(len(written))\n")
  try:
    # Passing would need every write to land on the host.
    _run_attack(sandbox, temp_root, program, tests=[{"input": "", "output": str(len(targets) + 1)}])
    assert [t for t in targets if os.path.exists(t)] == []
  finally:
    for target in targets:
      if os.path.exists(target):
        os.remove(target)


def test_reading_the_parents_environment(sandbox, temp_root, monkeypatch):
  secret = uuid.uuid4().hex
  monkeypatch.setenv("KSJAX_SANDBOX_SECRET", secret)
  program = (
      "import os\nfound = os.environ.get('KSJAX_SANDBOX_SECRET', '')\n"
      f"for pid in ({os.getpid()}, os.getppid(), 1, 'self'):\n"
      "  try:\n"
      "    for item in open(f'/proc/{pid}/environ', 'rb').read().split(b'\\0'):\n"
      "      if item.startswith(b'KSJAX_SANDBOX_SECRET='):\n"
      "        found = item.split(b'=', 1)[1].decode()\n"
      "  except OSError:\n"
      "    pass\n"
      "print(found or 'nothing')\n")
  result = _run_attack(sandbox, temp_root, program, tests=[{"input": "", "output": secret}])
  assert result.verdict == "wrong_answer"
  assert os.environ["KSJAX_SANDBOX_SECRET"] == secret  # and ours is untouched


def test_opening_sockets(sandbox, temp_root, host_allows_namespaces):
  if not host_allows_namespaces:
    pytest.skip("this host allows no network namespace (util-linux unshare fails or is absent)")
  connections = []
  tcp = socket.create_server(("127.0.0.1", 0))
  unix = socket.socket(socket.AF_UNIX)
  abstract = f"ksjax-sandbox-test-{uuid.uuid4().hex}"
  unix.bind("\0" + abstract)
  unix.listen()
  for server in (tcp, unix):
    server.settimeout(0.2)

  def accept(server):
    deadline = time.monotonic() + ATTACK_SECONDS
    while time.monotonic() < deadline:
      try:
        connections.append(server.accept())
      except (TimeoutError, OSError):
        pass

  threads = [threading.Thread(target=accept, args=(s,), daemon=True) for s in (tcp, unix)]
  for thread in threads:
    thread.start()
  program = (
      "import socket\nreached = []\n"
      "try:\n"
      f"  socket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), timeout=1)\n"
      "  reached.append('tcp')\n"
      "except OSError:\n"
      "  pass\n"
      "try:\n"
      "  u = socket.socket(socket.AF_UNIX)\n"
      f"  u.connect('\\0{abstract}')\n"
      "  reached.append('unix')\n"
      "except OSError:\n"
      "  pass\n"
      "try:\n"
      "  socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))\n"
      "  reached.append('udp')\n"
      "except OSError:\n"
      "  pass\n"
      "print(' '.join(reached) or 'offline')\n")
  try:
    result = _run_attack(sandbox, temp_root, program,
                         tests=[{"input": "", "output": "tcp unix udp"}])
    assert result.verdict == "wrong_answer"
    time.sleep(0.3)
    assert connections == []
  finally:
    tcp.close()
    unix.close()


def test_signalling_the_parent_and_the_test_runner(sandbox, temp_root):
  program = (
      "import os, signal\nhit = []\n"
      f"for pid in (os.getppid(), {os.getpid()}, {os.getppid()}, 1, -1):\n"
      "  for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):\n"
      "    try:\n"
      "      os.kill(pid, sig)\n"
      "      hit.append(pid)\n"
      "    except OSError:\n"
      "      pass\n"
      "print('signalled', len(hit), flush=True)\n"
      # The runner's group is outside the PID namespace: getpgid gives 0, the program's own.
      "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)\n")
  result = _run_attack(sandbox, temp_root, program, tests=[{"input": "", "output": "signalled 15"}])
  assert result.verdict in ("wrong_answer", "runtime_error")


def test_os_system_and_subprocess(sandbox, temp_root, tmp_path):
  marker = tmp_path / "spawned"
  program = (
      "import os, subprocess\nstarted = []\n"
      f"if os.system('sleep 1000 & touch {marker}') == 0:\n"
      "  started.append('system')\n"
      "try:\n"
      "  subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
      "  started.append('popen')\n"
      "except OSError:\n"
      "  pass\n"
      "try:\n"
      "  out = subprocess.run(['echo', '3'], capture_output=True).stdout.decode()\n"
      "  started.append(out.strip())\n"
      "except OSError:\n"
      "  pass\n"
      "print(' '.join(started))\n")
  _run_attack(sandbox, temp_root, program, tests=[{"input": "", "output": "system popen 3"}])
  assert not marker.exists()


def test_background_processes_end_with_their_test(sandbox, temp_root):
  # A forked daemon (no exec needed) that outlives the program's main process.
  program = ("import os, time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(1000)\n"
             "print(0)\n")
  _run_attack(sandbox, temp_root, program)


@pytest.mark.parametrize("program", ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"])
def test_exit_before_any_test_runs_fails(sandbox, temp_root, program):
  result = _run_attack(sandbox, temp_root, program, tests=ADDITION_TESTS)
  assert result.verdict == "wrong_answer" and result.tests_run == 1


def test_ctypes_privilege_escalation(sandbox, temp_root):
  program = (
      "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\ngained = []\n"
      "if libc.setuid(0) == 0:\n  gained.append('root')\n"
      "if libc.unshare(0x10000000) == 0:\n  gained.append('userns')\n"  # CLONE_NEWUSER
      "if libc.chroot(b'/') == 0:\n  gained.append('chroot')\n"
      "if libc.kill(-1, 9) == 0:\n  gained.append('kill')\n"
      "if libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0:\n  gained.append('mount')\n"
      "print(' '.join(gained) or 'contained')\n")
  result = _run_attack(sandbox, temp_root, program,
                       tests=[{"input": "", "output": "root userns chroot kill mount"}])
  assert result.verdict == "wrong_answer"


def test_ctypes_segfault(sandbox, temp_root):
  result = _run_attack(sandbox, temp_root, "import ctypes\nctypes.string_at(0)\n")
  assert result.verdict == "runtime_error"


def test_program_timeout_kills_the_whole_sandbox(temp_root):
  config = sb.SandboxConfig(workers=1, time_limit_s=1.0, wall_time_factor=1.0,
                            wall_time_slack_s=0.5, program_timeout_s=1.5, temp_root=temp_root)
  with sb.Sandbox(config) as box:
    program = "import time\ntime.sleep(0.4)\n" + A_PLUS_B
    start = time.monotonic()
    result = box.run(sb.Job(program=program, tests=ADDITION_TESTS * 4))
    assert result.verdict == "time_limit" and not result.passed
    assert 1.5 <= time.monotonic() - start < 5.0
    assert result.tests_run < len(ADDITION_TESTS) * 4  # cut short (how far depends on load)
    _assert_contained(box, temp_root)


@pytest.mark.parametrize("python", ["/nonexistent/python3", "/bin/false"])
def test_a_broken_interpreter_is_refused_when_the_sandbox_is_made(temp_root, python):
  with pytest.raises(sb.SandboxUnavailable) as refused:
    sb.Sandbox(sb.SandboxConfig(workers=1, python=python, temp_root=temp_root))
  message = str(refused.value)
  assert "\n" not in message and python in message and "sandbox_error" in message
  assert os.listdir(temp_root) == []


@pytest.mark.parametrize("python", ["/nonexistent/python3", "/bin/false"])
def test_a_sandbox_broken_later_gives_a_failing_result_not_an_exception(temp_root, python):
  with sb.Sandbox(sb.SandboxConfig(workers=1, temp_root=temp_root)) as box:
    box.config = dataclasses.replace(box.config, python=python)  # broken after its self-test
    result = box.run(sb.Job(program=A_PLUS_B, tests=ADDITION_TESTS))
  assert not result.passed and result.verdict == "sandbox_error"
  assert result.detail  # why: cannot start, broken pipe or output ended (racing the exit)
  assert os.listdir(temp_root) == []


def test_a_failing_self_test_refuses_with_the_childs_error(temp_root, monkeypatch):
  monkeypatch.setattr(sb, "PROBE", "import ksjax_no_such_module\n")
  with pytest.raises(sb.SandboxUnavailable) as refused:
    sb.Sandbox(sb.SandboxConfig(workers=1, temp_root=temp_root))
  message = str(refused.value)
  assert "\n" not in message and "runtime_error" in message
  assert "No module named 'ksjax_no_such_module'" in message and sys.executable in message
  assert os.listdir(temp_root) == []


# ---------------------------------------------------------------------------------------------
# The fallback mode (no namespaces): resource limits and, as root, an unprivileged uid; programs
# import from the host's file system as that uid.

FALLBACK_IMPORTS = "import collections, heapq, json, math, re"


@pytest.fixture(scope="module")
def fallback_python():
  """An interpreter whose standard library the sandbox's uid can read: as root, one that uid
  nobody can import from (checked by running it as nobody, not by the code under test)."""
  if os.geteuid() != 0:
    return sys.executable  # the program runs as this user
  for candidate in dict.fromkeys([sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]):
    if not os.path.exists(candidate):
      continue
    check = f"import sys\n{FALLBACK_IMPORTS}\nassert sys.version_info >= (3, 9)\n"
    try:
      ran = subprocess.run([candidate, "-I", "-S", "-c", check], user=65534, group=65534,
                           extra_groups=[], cwd="/", capture_output=True)
    except PermissionError:  # nobody cannot even start it
      continue
    if ran.returncode == 0:
      return candidate
  pytest.skip("no Python 3.9+ here whose standard library an unprivileged uid can read")


@pytest.fixture(scope="module")
def fallback(temp_root, fallback_python):
  config = sb.SandboxConfig(workers=2, time_limit_s=1.0, wall_time_factor=1.5,
                            wall_time_slack_s=0.5, program_timeout_s=20.0,
                            memory_bytes=128 << 20, output_bytes=1 << 20, scratch_bytes=4 << 20,
                            processes=8, namespaces=False, python=fallback_python,
                            temp_root=temp_root)
  with sb.Sandbox(config) as box:
    yield box


def test_fallback_mode_self_test_passes(fallback):
  report = fallback.isolation_report()
  assert report["level"] == "rlimits_only" and report["namespaces"] == []
  assert report["probe"] == "passed" and report["errors"] == []
  assert report["stdlib"] and report["python"] == fallback.config.python
  if os.geteuid() == 0:
    assert report["program_uid"] in fallback.uids()


def test_fallback_mode_runs_honest_programs_importing_standard_modules(fallback, temp_root):
  programs = [
      ("import math\nprint(math.factorial(int(input())))\n", "5\n", "120\n"),
      ("import re\nprint(len(re.findall(r'[0-9]+', input())))\n", "a1 b22 c333\n", "3\n"),
      ("import json\nprint(json.loads(input())['a'])\n", '{"a": 7}\n', "7\n"),
      ("import heapq\nh = list(map(int, input().split()))\nheapq.heapify(h)\n"
       "print(heapq.heappop(h), heapq.heappop(h))\n", "5 3 9 1\n", "1 3\n"),
      ("import collections\nc = collections.Counter(input().split())\n"
       "print(c.most_common(1)[0][0])\n", "x y x z\n", "x\n"),
      ("import sys, bisect, itertools, functools, fractions, decimal, string, statistics\n"
       "from collections import deque\n"
       "n = int(sys.stdin.readline())\n"
       "print(bisect.bisect([1, 5, 9], n), len(list(itertools.combinations(range(n), 2))),\n"
       "      functools.reduce(lambda a, b: a * b, range(1, n + 1)), fractions.Fraction(n, 4),\n"
       "      decimal.Decimal(n) / 4, string.ascii_lowercase[n], statistics.median([1, n, 9]),\n"
       "      deque([n]).pop())\n", "6\n", "2 15 720 3/2 1.5 g 6 6\n"),
  ]
  jobs = [sb.Job(program=p, tests=[{"input": i, "output": o}]) for p, i, o in programs]
  results = fallback.run_many(jobs)
  assert [(r.verdict, r.detail) for r in results] == [("passed", "")] * len(programs)
  _assert_contained(fallback, temp_root)


@pytest.mark.parametrize("program, verdict, detail", [
    ("print(1 // 0)\n", "runtime_error", "ZeroDivisionError"),
    ("import json\njson.loads('{')\n", "runtime_error", "JSONDecodeError"),
    ("import sys\nsys.exit(3)\n", "runtime_error", "exit status 1, nothing on stderr"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "runtime_error",
     "killed by SIGSEGV"),
    ("print(2)\n", "wrong_answer", "wrong answer"),
])
def test_fallback_mode_failures_are_never_an_empty_error(fallback, program, verdict, detail):
  result = fallback.run(sb.Job(program=program, tests=[{"input": "", "output": "1"}]))
  assert result.verdict == verdict and detail in result.detail, result


def _private_interpreter(home) -> str:
  """This interpreter installed as a prefix in `home`, made 0700 (as pyenv or a virtual environment
  under a private home directory): the binary is a hard link or a copy, so Python finds its
  standard library as `lib/pythonX.Y` next to it (a link to the real one), and no other uid can
  enter `home`."""
  prefix = home / "python"
  os.makedirs(prefix / "bin")
  os.makedirs(prefix / "lib")
  binary = os.path.realpath(sys.executable)
  private = str(prefix / "bin" / "python3")
  try:
    os.link(binary, private)
  except OSError:
    shutil.copy2(binary, private)
  version = f"python{sys.version_info.major}.{sys.version_info.minor}"
  os.symlink(sysconfig.get_paths()["stdlib"], prefix / "lib" / version)
  os.chmod(home, 0o700)
  return private


@pytest.mark.skipif(os.geteuid() != 0, reason="only as root do programs run as another uid")
def test_fallback_mode_refuses_an_interpreter_its_uid_cannot_read(tmp_path, temp_root,
                                                                   host_allows_namespaces):
  home = tmp_path / "home"
  python = _private_interpreter(home)
  ran = subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.prefix)"],
                       capture_output=True, text=True, check=True)
  assert ran.stdout.strip() == str(home / "python")  # the simulation holds: the library is there
  config = sb.SandboxConfig(workers=1, namespaces=False, python=python, temp_root=temp_root)
  with pytest.raises(sb.SandboxUnavailable) as refused:
    sb.Sandbox(config)
  message = str(refused.value)
  assert "\n" not in message and "rlimits_only" in message
  assert python in message  # the interpreter,
  # The directory in the way: the home, or one of its own (pytest's are 0700 too).
  blocked = re.search(r"cannot read (/\S*) \(mode ([0-7]{4}), owner uid 0\)", message)
  assert blocked, message
  assert str(home).startswith(blocked[1]) and not int(blocked[2], 8) & 0o001
  assert "No module named" in message  # the child's own error,
  assert "SandboxConfig.python" in message and "chmod o+rx" in message  # and what to do
  assert os.listdir(temp_root) == []
  if host_allows_namespaces:
    # With namespaces the interpreter's prefix is mounted for the program: the same one works.
    with sb.Sandbox(dataclasses.replace(config, namespaces=True)) as box:
      assert box.isolation_report()["level"] == "full"
      assert box.run(sb.Job(program=f"{FALLBACK_IMPORTS}\nprint(math.isqrt(16))",
                            tests=[{"input": "", "output": "4"}])).passed
