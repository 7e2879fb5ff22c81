"""The trusted half of the code sandbox: runs one untrusted program on its tests.

`ksjax.tasks.sandbox` starts this file as `python -I -S -B sandbox_runner.py` in a fresh session
with an environment of PATH and LANG only and a fresh working directory, writes one job to its
stdin, and reads the results from its stdout. It imports only the standard library (it runs
without site-packages) and never sees expected outputs: it returns what the program printed and
the parent judges it, so a program that takes over the runner's memory learns nothing it could
not compute.

Isolation, as far as the host allows (what was achieved is reported in the `hello` header):

1. Namespaces. As root: new mount, network, PID, IPC and UTS namespaces; as another user: the
   same inside a new user namespace. The network namespace has only a downed loopback, so no
   socket reaches anything (abstract Unix sockets included). The program sees a minimal root
   (chroot): the system directories and the interpreter's prefix bind-mounted read-only, the
   directories of executables noexec (no shell, no subprocess), five devices, a fresh /proc that
   shows only the sandbox's processes, and private size-capped tmpfs for /tmp, /var/tmp,
   /dev/shm and the working directory; home directories, datasets and this repository do not
   exist in it, and nothing it writes outlives it. The runner forks an init process (PID 1 of
   the new PID namespace) that runs the tests: after each test it kills every other process in
   the namespace (`kill(-1)`), so daemons and `setsid` escapes end with the test, and when it
   exits the kernel kills whatever is left. PID 1 ignores signals sent from inside.
2. Privileges. The program runs as an unprivileged uid chosen by the parent (as root), or with
   all capabilities dropped (as another user), with no supplementary groups and `no_new_privs`.
3. Resource limits, set in the forked child before any program code runs: RLIMIT_CPU (per test),
   RLIMIT_AS (memory), RLIMIT_FSIZE (output and files), RLIMIT_CORE=0, RLIMIT_NOFILE and
   RLIMIT_NPROC. RLIMIT_NPROC counts the tasks of a uid and the kernel ignores it for root: it
   stops fork bombs because the program is not root (2.) and its uid (as root: a uid no other
   running program has) or user namespace (otherwise) is its own.

Without namespaces (a container that forbids them) only 2. and 3. hold, and the runner makes
itself a child subreaper so that escaped processes are still re-parented to it and killed. The
program then imports from the host's file system as its unprivileged uid: the interpreter's
standard library (reported in the hello as `stdlib`) must be readable by every user, which the
parent's self-test checks before the sandbox is used.

Each test runs in a child forked from the init process (about a millisecond, against tens for a
new interpreter), so every test starts from the same clean state with its own CPU limit and wall
clock. Stdin, stdout and stderr are anonymous memory files (memfd): RLIMIT_FSIZE caps what a
program can write, and no path exists that a program could swap for a symlink or a FIFO.

Protocol. stdin: one job, marshalled (see `ksjax.tasks.sandbox.Sandbox._run_as`). stdout: lines
of JSON; a line with key "test" is followed by exactly `bytes` bytes: the program's output (stdin/
stdout tests) or its JSON-encoded return value (call-based tests).
"""

import ctypes
import marshal
import os
import resource
import select
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 16384, 1 << 18, 1 << 21

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38

# What the sandbox's file system holds of the host, read-only (symbolic links are copied).
SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc")
EXECUTABLE_DIRS = ("/bin", "/sbin", "/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin")
DEVICES = ("null", "zero", "full", "random", "urandom")
# /tmp, /var/tmp and /dev/shm are private tmpfs of this size.
WRITABLE_DIR_BYTES = 4 << 20
STDERR_TAIL_BYTES = 2000

# The standard library's os module has no unshare (before 3.12), mount or capset; these are the
# plain libc calls.
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
  if result != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
  enc = lambda s: None if s is None else s.encode()
  _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
         f"mount {target}")


def _prctl(option, value):
  _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl {option}")


def _drop_capabilities():
  """capset(2) with empty sets: the caller keeps its uid but loses every capability."""

  class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

  class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]

  header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two Data structs
  data = (Data * 2)()
  _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


def _write(path, text):
  with open(path, "w") as f:
    f.write(text)


def _statvfs_flags(path):
  """The mount flags of the mount holding `path`, as mount(2) flags (a user namespace may only
  re-mount with the flags its creator could not clear, so a read-only re-mount keeps them)."""
  f_flag = os.statvfs(path).f_flag
  pairs = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
           (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
           (os.ST_RELATIME, MS_RELATIME))
  return sum(ms for st, ms in pairs if f_flag & st)


def _bind_read_only(source, target, flags=0):
  _mount(source, target, None, MS_BIND)
  _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _statvfs_flags(source) | flags)


def _build_root(root, job):
  """A minimal file system under `root`: the system directories and the interpreter's prefix
  read-only, a handful of devices, and private size-capped tmpfs for /tmp, /var/tmp, /dev/shm
  and the working directory. Nothing else of the host (home directories, datasets, this
  repository) exists in it."""
  _mount("tmpfs", root, "tmpfs", MS_NOSUID, "size=1m,mode=0755")
  for name in SYSTEM_DIRS:
    host = "/" + name
    if os.path.islink(host):
      os.symlink(os.readlink(host), root + host)
    elif os.path.isdir(host):
      os.mkdir(root + host)
      _bind_read_only(host, root + host)
  os.makedirs(root + "/dev/shm")
  for device in DEVICES:
    open(root + "/dev/" + device, "w").close()
    _mount("/dev/" + device, root + "/dev/" + device, None, MS_BIND)
  for i, name in enumerate(("stdin", "stdout", "stderr")):
    os.symlink(f"/proc/self/fd/{i}", root + "/dev/" + name)
  os.symlink("/proc/self/fd", root + "/dev/fd")
  os.makedirs(root + "/var/tmp")
  os.mkdir(root + "/proc")
  for directory in ("/tmp", "/var/tmp", "/dev/shm"):
    os.makedirs(root + directory, exist_ok=True)
    _mount("tmpfs", root + directory, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={WRITABLE_DIR_BYTES},mode=1777")
  prefix = os.path.realpath(sys.base_prefix)
  # After the private tmpfs, which would hide an interpreter under /tmp; the standard library
  # too, where it lies outside the prefix (a prefix whose lib/pythonX.Y links elsewhere).
  for directory in (prefix, os.path.realpath(os.path.dirname(os.__file__))):
    if not os.path.isdir(root + directory) or not os.listdir(root + directory):
      os.makedirs(root + directory, exist_ok=True)
      _bind_read_only(directory, root + directory)
  # Directories of executables are mounted noexec: the interpreter is already running, and no
  # program needs a shell or another binary (libraries stay executable for extension modules).
  for directory in EXECUTABLE_DIRS + (prefix + "/bin",):
    inside = root + directory
    if os.path.isdir(directory) and not os.path.islink(directory) and os.path.isdir(inside):
      _bind_read_only(directory, inside, MS_NOEXEC)
  workdir = root + job["workdir"]
  os.makedirs(workdir, exist_ok=True)
  owner = f",uid={job['uid']},gid={job['gid']}" if os.geteuid() == 0 else ""
  _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
         f"size={job['scratch_bytes']},mode=0700{owner}")
  _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def _isolate(job):
  """Enters new namespaces and builds the sandbox's file system; returns what is in force."""
  report = {"namespaces": [], "minimal_root": False, "errors": []}
  if not job["namespaces"]:
    return report
  as_root = os.geteuid() == 0
  flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
  uid, gid = os.getuid(), os.getgid()
  try:
    _check(_libc.unshare(flags if as_root else flags | CLONE_NEWUSER), "unshare")
    if not as_root:
      _write("/proc/self/setgroups", "deny")
      _write("/proc/self/uid_map", f"{uid} {uid} 1")
      _write("/proc/self/gid_map", f"{gid} {gid} 1")
  except OSError as e:
    report["errors"].append(str(e))
    return report
  report["namespaces"] = ([] if as_root else ["user"]) + ["mount", "network", "pid", "ipc", "uts"]
  try:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
    _build_root(job["workdir"], job)
    report["minimal_root"] = True
  except OSError as e:
    report["errors"].append(str(e))
  return report


_JSON_ESCAPES = {i: f"\\u{i:04x}" for i in range(32)} | {ord('"'): '\\"', ord("\\"): "\\\\"}


def _json(value):
  """JSON for the flat values of a header. (The json package costs more to import, with `re`
  and `enum`, than the rest of a short program's run; the parent parses it with json.)"""
  if isinstance(value, dict):
    return "{" + ", ".join(f"{_json(str(k))}: {_json(v)}" for k, v in value.items()) + "}"
  if isinstance(value, (list, tuple)):
    return "[" + ", ".join(_json(v) for v in value) + "]"
  if isinstance(value, str):
    return '"' + value.translate(_JSON_ESCAPES) + '"'
  if value is None or isinstance(value, bool):
    return {None: "null", True: "true", False: "false"}[value]
  if isinstance(value, int):
    return str(value)
  return repr(float(value))


def _send(out, header, payload=b""):
  out.write(_json(header).encode() + b"\n")
  out.write(payload)
  out.flush()


def _memfd(name, content=b""):
  fd = os.memfd_create(name, 0)  # close-on-exec off: the child dup2()s it anyway
  if content:
    os.write(fd, content)
    os.lseek(fd, 0, os.SEEK_SET)
  return fd


def _read_all(fd, limit, tail=False):
  size = os.fstat(fd).st_size
  start = max(0, size - limit) if tail else 0
  os.lseek(fd, start, os.SEEK_SET)
  chunks, left = [], min(size - start, limit)
  while left > 0:
    chunk = os.read(fd, min(left, 1 << 20))
    if not chunk:
      break
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)


def _vm_bytes():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[0]) * resource.getpagesize()


def _run_program(job, input_bytes):
  """In the forked child: limit, drop privileges, run the program; never returns."""
  code = 1
  try:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # ends with the runner, PID namespace or not
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_s"], job["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + job["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (job["output_bytes"] + 1,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (job["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (job["processes"],) * 2)
    if os.geteuid() == 0:
      os.setgroups([])
      os.setresgid(job["gid"], job["gid"], job["gid"])
      os.setresuid(job["uid"], job["uid"], job["uid"])
    elif job["in_user_namespace"]:
      _drop_capabilities()
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, signal.SIG_DFL)
    sys.stdin = sys.__stdin__ = open(0, "r", encoding="utf-8", errors="replace", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", closefd=False)
    sys.argv = ["solution.py"]
    module = type(sys)("__main__")
    module.__file__ = "solution.py"
    sys.modules["__main__"] = module
    program = compile(job["program"], "solution.py", "exec")
    if job["fn_name"] is None:
      try:
        exec(program, module.__dict__)
        code = 0
      except SystemExit as e:
        code = 0 if e.code is None or e.code == 0 else 1
      sys.stdout.flush()
    else:
      import json  # pylint: disable=g-import-not-at-top  (imported by init for call-based jobs)
      args = json.loads(input_bytes)
      result_fd = os.dup(1)
      os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the program's prints are not its answer
      exec(program, module.__dict__)
      function = module.__dict__.get(job["fn_name"])
      if function is None and isinstance(module.__dict__.get("Solution"), type):
        function = getattr(module.__dict__["Solution"](), job["fn_name"], None)
      if not callable(function):
        raise NameError(f"the program defines no function {job['fn_name']!r}")
      result = function(*args) if isinstance(args, list) else function(args)
      sys.stdout.flush()
      with open(result_fd, "w", encoding="utf-8") as f:
        json.dump(result, f)
      code = 0
  except BaseException as error:  # the program's own failure: its traceback is its stderr
    try:
      import traceback  # pylint: disable=g-import-not-at-top  (only failing tests pay for it)
      traceback.print_exc()
      sys.stderr.flush()
    except BaseException as unavailable:  # e.g. the uid cannot read the standard library
      _report_bare(error, unavailable)
  os._exit(code)


def _report_bare(error, unavailable):
  """The failure's type and message on fd 2 when no traceback can be printed (`traceback` and
  `linecache` are not imported yet, and the program's uid may be unable to read them): a failed
  test never ends with an empty stderr."""
  def describe(e):
    try:
      return f"{type(e).__name__}: {e}"
    except BaseException:  # a program's exception whose __str__ fails
      return "an exception"
  try:
    text = (f"(no traceback: importing traceback failed: {describe(unavailable)})\n"
            f"{describe(error)}\n")
    os.write(2, text.encode("utf-8", "replace"))
  except BaseException:
    pass


def _wait(pid, deadline):
  """Waits for `pid` until `deadline`; returns (status, rusage) or None on timeout."""
  fd = os.pidfd_open(pid)
  try:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while not poller.poll(max(0, (deadline - time.monotonic()) * 1000)):
      if time.monotonic() >= deadline:
        return None
  finally:
    os.close(fd)
  _, status, usage = os.wait4(pid, 0)
  return status, usage


def _reap_namespace():
  """PID 1 of the namespace: kill every other process in it and reap them all."""
  try:
    os.kill(-1, signal.SIGKILL)
  except ProcessLookupError:
    pass
  while True:
    try:
      os.waitpid(-1, 0)
    except ChildProcessError:
      return


def _reap_children(pid):
  """Without a PID namespace: the runner is a child subreaper, so every process the test left
  (after setsid or a double fork too) is re-parented to it. Kill and reap its children until
  none remain."""
  try:
    os.killpg(pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  me = str(os.getpid())
  while True:
    for child in os.listdir("/proc"):
      if child.isdigit() and _ppid_of(child) == me:
        try:
          os.kill(int(child), signal.SIGKILL)
        except ProcessLookupError:
          pass
    try:
      os.waitpid(-1, 0)
    except ChildProcessError:
      return


def _ppid_of(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[1]
  except (OSError, IndexError):
    return None


# The running test's pid, for the SIGTERM handler of a runner without a PID namespace.
_current_test = [0]


def _stop_without_namespace(*_):
  if _current_test[0]:
    _reap_children(_current_test[0])
  os._exit(1)


def _run_test(job, index, input_bytes, in_pid_namespace):
  in_fd = _memfd("stdin", b"" if job["fn_name"] else input_bytes)
  out_fd, err_fd = _memfd("stdout"), _memfd("stderr")
  start = time.monotonic()
  pid = os.fork()
  if pid == 0:
    os.setpgid(0, 0)
    for target, fd in ((0, in_fd), (1, out_fd), (2, err_fd)):
      os.dup2(fd, target)
    os.closerange(3, 1 << 16)
    _run_program(job, input_bytes)
  _current_test[0] = pid
  waited = _wait(pid, start + job["wall_s"])
  if waited is None:
    os.kill(pid, signal.SIGKILL)
    waited = os.wait4(pid, 0)[1:]
    timed_out = True
  else:
    timed_out = False
  wall = time.monotonic() - start
  if in_pid_namespace:
    _reap_namespace()
  else:
    _reap_children(pid)
  _current_test[0] = 0
  status, usage = waited
  cpu = usage.ru_utime + usage.ru_stime
  size = os.fstat(out_fd).st_size
  signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
  exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
  if timed_out or signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu >= job["cpu_s"]):
    verdict = "time_limit"
  elif size > job["output_bytes"]:
    verdict = "output_limit"
  elif exit_code == 0:
    verdict = "ok"
  else:
    verdict = "runtime_error"
  payload = _read_all(out_fd, job["output_bytes"]) if verdict == "ok" else b""
  header = {"test": index, "verdict": verdict, "exit_code": exit_code, "signal": signum,
            "cpu_s": round(cpu, 4), "wall_s": round(wall, 4), "bytes": len(payload)}
  if verdict != "ok":
    header["stderr"] = _read_all(err_fd, STDERR_TAIL_BYTES, tail=True).decode("utf-8", "replace")
  for fd in (in_fd, out_fd, err_fd):
    os.close(fd)
  return header, payload


def _init(job, report, out):
  """The test loop; PID 1 of the sandbox's PID namespace when there is one."""
  in_pid_namespace = "pid" in report["namespaces"]
  if in_pid_namespace:
    try:
      if report["minimal_root"]:
        _mount("proc", job["workdir"] + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        os.chroot(job["workdir"])
        os.chdir(job["workdir"])
        report["private_proc"] = True
    except OSError as e:
      report["errors"].append(str(e))
      report["minimal_root"] = False
  else:
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGTERM, _stop_without_namespace)
  _prctl(PR_SET_DUMPABLE, 0)  # no /proc/<pid>/fd or ptrace into the runner for anyone unprivileged
  job["in_user_namespace"] = "user" in report["namespaces"]
  report["euid"] = os.geteuid()
  report["program_uid"] = job["uid"] if os.geteuid() == 0 else os.getuid()
  report["capabilities_dropped"] = os.geteuid() == 0 or job["in_user_namespace"]
  report["python"] = sys.executable
  report["stdlib"] = os.path.dirname(os.__file__)  # the program's imports come from here
  if job["fn_name"] is not None:
    import json  # pylint: disable=g-import-not-at-top,unused-import  (once, not in every test)
  # Warm up what every test child would otherwise initialise afresh after fork (the compiler,
  # text streams), a cost each test would pay (benchmarks/rewards.py times sandboxed programs).
  # A fixed snippet: the program itself is compiled only in the child, under its limits.
  compile("def f(x):\n  return [i for i in range(x)]\nprint(f(int(input())))\n", "warm-up", "exec")
  open(os.devnull, "w", encoding="utf-8").close()
  _send(out, {"hello": report})
  for index, test_input in enumerate(job["inputs"]):
    header, payload = _run_test(job, index, test_input.encode("utf-8"), in_pid_namespace)
    _send(out, header, payload)
  _send(out, {"done": True})


def main():
  job = marshal.loads(sys.stdin.buffer.read())  # from the trusted parent
  out = sys.stdout.buffer
  report = _isolate(job)
  if "pid" not in report["namespaces"]:
    _init(job, report, out)
    return 0
  child = os.fork()  # PID 1 of the new namespace
  if child == 0:
    code = 1
    try:
      _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the runner's death ends the namespace
      _init(job, report, out)
      code = 0
    except BaseException:
      import traceback  # pylint: disable=g-import-not-at-top
      traceback.print_exc()
    finally:
      sys.stderr.flush()
      os._exit(code)
  # Asked to stop (SIGTERM from the parent), kill the namespace's init: the kernel then kills the
  # rest, and this process reaps init, so nothing is left for anyone else to reap.
  signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
  while True:
    try:
      _, status = os.waitpid(child, 0)
      break
    except InterruptedError:
      continue
  return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1


if __name__ == "__main__":
  sys.exit(main())
