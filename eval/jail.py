"""What a jailed interpreter runs before the program: a root of its own, then no privileges.

Runs inside the namespaces ``unshare`` made (as their root), from ``python -I -c``: the harness
(:mod:`kvshare.eval.sandbox`) sends this file's text followed by ``enter(SETTINGS)``. It is
never imported for its effects; importing it defines functions and does nothing else.

The new root is an allow-list, so nothing the program does not need can leak into its output
(a model cache, ``HF_HOME``, a data folder, a user's token): an empty tmpfs that shows, read-only,
the system's programs and libraries (``/usr``, ``/bin``, ``/lib*``), the interpreter's own folders
wherever they live (under ``/tmp``, ``/root``, a path with spaces) and what the harness names; a
``/dev`` of five devices; the jail's own ``/proc``; and one size-capped tmpfs that holds every
place the program may write (a copy of its folder, ``/tmp``, ``/var/tmp``, ``/dev/shm``), so the
cap holds in total. The machine's own tree is made read-only before the switch and no handle to
it is kept open, so there is no way back to it.
"""

import ctypes
import os
import shutil
import stat
import sys

MS_NOSUID, MS_NODEV, MS_BIND, MS_MOVE, MS_REC = 2, 4, 4096, 8192, 16384
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 1, 2
MNT_DETACH = 2
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("null", "zero", "full", "random", "urandom")
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")  # writable beside the program's folder, on the same tmpfs
STAGE = "/.kvshare-writable"  # where the writable tmpfs is first mounted, then detached

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    def encode(text):
        return None if text is None else text.encode()
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def _set_attr(path: str, recursive: bool, attr_set: int) -> None:
    """mount_setattr(2) (syscall 442 on every architecture): flags that only restrict."""
    attr = (ctypes.c_uint64 * 4)(attr_set, 0, 0, 0)
    _check(_libc.syscall(ctypes.c_long(442), ctypes.c_long(-100), ctypes.c_char_p(path.encode()),
                         ctypes.c_long(0x8000 if recursive else 0), attr, ctypes.c_long(32)), f"mount_setattr {path}")


def _under(path: str, tops) -> bool:
    return any(path == top or path.startswith(top.rstrip("/") + "/") for top in tops)


def needed_paths(extra) -> list:
    """The interpreter's folders (as written in ``sys.path`` and as resolved) and ``extra``,
    outermost first, none inside another or inside a system folder that is shown whole."""
    found = set()
    for path in (sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path, *extra):
        if path and os.path.exists(path):
            found.update({os.path.abspath(path), os.path.realpath(path)})
    found = {p for p in found if p != "/" and not _under(p, [s for s in SYSTEM if not os.path.islink(s)])}
    return sorted(p for p in found if not any(p != q and _under(p, [q]) for q in found))


def _bind(fd: int, target: str, is_dir: bool) -> None:
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)


def _open_all(paths) -> list:
    """(path, O_PATH handle, is a folder) for each path that exists; links kept as links."""
    opened = []
    for path in paths:
        if os.path.islink(path):
            opened.append((path, os.readlink(path), None))
        elif os.path.exists(path):
            opened.append((path, os.open(path, os.O_PATH), os.path.isdir(path)))
    return opened


def _show(root: str, opened) -> None:
    """Each opened path seen again at the same place under ``root`` (read-only, like its source)."""
    for path, handle, is_dir in opened:
        target = root + path
        if is_dir is None:  # a link such as /bin -> usr/bin
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(handle, target)
        else:
            _bind(handle, target, is_dir)
            os.close(handle)


def _writable(root: str, here: str, source: int, disk_bytes: int, uid: int) -> None:
    """One tmpfs of ``disk_bytes`` for every writable place: the program's folder (a copy of
    the regular files of ``source``), /tmp, /var/tmp and /dev/shm."""
    stage = root + STAGE
    os.makedirs(stage)
    _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_bytes},mode=0755")
    for path in (*SCRATCH, here):
        inner = stage + "/" + path.strip("/").replace("/", "_")
        os.mkdir(inner)
        os.chmod(inner, 0o755 if path == here else 0o1777)  # not mkdir's mode: it passes through the umask
        os.makedirs(root + path, exist_ok=True)
        _mount(inner, root + path, None, MS_BIND)
    _copy_files(source, root + here, uid)
    _check(_libc.umount2(stage.encode(), MNT_DETACH), "umount " + stage)
    os.rmdir(stage)


def _copy_files(source: int, folder: str, uid: int) -> None:
    """The regular files of the folder ``source`` (links and the like skipped) copied into
    ``folder``, which and whose files then belong to ``uid`` (>= 0)."""
    for name in os.listdir(source):
        with os.fdopen(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=source), "rb") as src:
            if stat.S_ISREG(os.fstat(src.fileno()).st_mode):
                with open(f"{folder}/{name}", "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    if uid >= 0:
        for path in [folder, *(f"{folder}/{name}" for name in os.listdir(folder))]:
            os.chown(path, uid, uid)


def _devices(root: str) -> list:
    os.makedirs(root + "/dev", exist_ok=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    return _open_all(f"/dev/{name}" for name in DEVICES)


def _drop_privileges(uid: int) -> None:
    """No capability left, now or after an exec; as root of the machine, a fresh uid."""
    for cap in range(int(open("/proc/sys/kernel/cap_last_cap").read()) + 1):
        _check(_libc.prctl(24, cap, 0, 0, 0), "drop capability")  # PR_CAPBSET_DROP
    if uid >= 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    else:  # mapped root of a user namespace: empty its capability sets
        _check(_libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()), "capset")
    _check(_libc.prctl(38, 1, 0, 0, 0), "no_new_privs")  # setuid binaries grant nothing
    _check(_libc.prctl(1, 9, 0, 0, 0), "pdeathsig")  # dies with unshare (a uid change cleared it)


def enter(settings: dict) -> None:
    """Switch this process (root of fresh mount, PID, network, IPC and UTS namespaces, in its
    program's folder) into the jail; ``settings``: ``uid`` (>= 0: become it), ``disk_bytes``
    (the writable tmpfs) and ``extra`` (more paths to show read-only)."""
    here = os.getcwd()
    source = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    shown = _open_all([*SYSTEM, "/proc", *needed_paths(settings["extra"])])
    _set_attr("/", True, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)  # the machine's tree, whatever happens next
    _mount("tmpfs", here, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    root = here
    _writable(root, here, source, settings["disk_bytes"], settings["uid"])
    os.close(source)
    devices = _devices(root)
    _show(root, [entry for entry in shown if entry[0] == "/proc" or not _under(entry[0], [here])])
    _show(root, devices)
    os.chdir(root)
    _mount(root, "/", None, MS_MOVE)
    os.chroot(".")
    _set_attr("/", False, MOUNT_ATTR_RDONLY)  # the new root itself: no new names at the top
    os.chdir(here)
    _drop_privileges(settings["uid"])
