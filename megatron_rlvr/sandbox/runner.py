"""The first code of a sandbox process: joins its pids cgroup, enters its namespaces, sets its rlimits, drops to its
own user id, then runs the program (a Python file, an argv, or a function call).

Run by :mod:`megatron_rlvr.sandbox.process` as ``python -I -B -c <this file's text> <JSON config>``, so it imports
only the standard library and nothing of the package. Every guard the parent asks for is applied or the process
exits at once with SETUP_EXIT and one ``sandbox:`` line on stderr: a run never goes on with less than was promised.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

SETUP_EXIT = 121
"""Exit status of a sandbox process that could not apply a guard it was asked for."""

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_BIND = 4096
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_PDEATHSIG = 1
_PARENT = os.getppid()


def _fail(msg: str) -> None:
    os.write(2, f"sandbox: {msg}\n".encode())
    os._exit(SETUP_EXIT)


def _mount(libc, source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        _fail(f"mount {source} on {target}: {os.strerror(err)}")


def _mounts(libc, covers: list[list], binds: list[str]) -> None:
    """Private mount tree; each cover (path, mode) gets a fresh tmpfs, then each bind path (a directory reached
    through a cover) is mounted back at its own path from a handle opened before anything was covered."""
    _mount(libc, "none", "/", None, _MS_REC | _MS_PRIVATE, None)
    handles = {}
    for path in binds:
        try:
            handles[path] = os.open(path, os.O_PATH | os.O_DIRECTORY)
        except OSError as e:
            _fail(f"cannot open {path} to bind it: {e}")
    for path, mode, size in covers:
        _mount(libc, "tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode={mode:o},size={size}")
    for path in binds:
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
        except OSError as e:
            _fail(f"cannot recreate {path} under its cover: {e}")
        _mount(libc, f"/proc/self/fd/{handles[path]}", path, None, _MS_BIND | _MS_REC, None)
        os.close(handles[path])


def _setup(cfg: dict) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    import signal

    # dispositions ignored in the parent (a reward worker ignores TERM and USR1) survive exec: back to the defaults,
    # so that RLIMIT_CPU's SIGXCPU ends the program
    for sig in (signal.SIGXCPU, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    if cfg["cgroup"]:
        try:
            with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:
            _fail(f"cannot join the pids cgroup {cfg['cgroup']}: {e}")
    flags = 0
    if cfg["net_namespace"]:
        flags |= _CLONE_NEWNET | (_CLONE_NEWUSER if cfg["user_namespace"] else 0)
    if cfg["mount_namespace"]:
        flags |= _CLONE_NEWNS
    if flags and libc.unshare(flags) != 0:
        _fail(f"unshare({flags:#x}): {os.strerror(ctypes.get_errno())}")
    if cfg["mount_namespace"]:
        _mounts(libc, cfg["covers"], cfg["binds"])
    os.chdir(cfg["workdir"])  # after the mounts: the working directory is the one bound back
    for name, value in cfg["rlimits"].items():
        try:
            resource.setrlimit(getattr(resource, name), tuple(value))
        except (OSError, ValueError) as e:
            _fail(f"setrlimit({name}, {value}): {e}")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # no setuid binary can give privileges back
        _fail(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")


def _drop_user(uid: int | None) -> None:
    if uid is None:
        return
    try:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    except OSError as e:
        _fail(f"cannot drop to user id {uid}: {e}")
    if os.geteuid() != uid or os.getuid() != uid:
        _fail(f"still user id {os.getuid()} after setresuid({uid})")


def _die_with_parent(libc) -> None:
    # after the drop (a change of credentials clears it): a parent SIGKILLed mid-run (a hung reward worker) takes
    # the run's main process with it; what that process started is swept by the next run's start
    # (process.sweep_stale_runs)
    if libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0) != 0 or os.getppid() != _PARENT:
        os._exit(SETUP_EXIT)


def _load(module: str, function: str):
    import importlib

    obj = importlib.import_module(module)
    for part in function.split("."):
        obj = getattr(obj, part)
    return obj


def _send(fd: int, payload) -> None:
    data = json.dumps(payload).encode()
    while data:
        data = data[os.write(fd, data) :]


def _describe(fn) -> dict:
    import inspect

    params = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            params.append({"name": p.name, "kind": p.kind.name})
            continue
        ann = p.annotation
        ann = ann if isinstance(ann, str) else getattr(ann, "__name__", "") if ann is not p.empty else ""
        params.append({"name": p.name, "kind": p.kind.name, "annotation": ann, "required": p.default is p.empty})
    return {"doc": inspect.getdoc(fn) or "", "params": params}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    _setup(cfg)
    mode = cfg["mode"]
    if mode in ("call", "describe"):
        # The user's module is imported before the drop (its files may be readable only by the parent's user id),
        # inside the namespaces and rlimits; the function itself runs under the sandbox's user id.
        sys.path[:] = cfg["sys_path"]
        fn = _load(cfg["module"], cfg["function"])
        if mode == "describe":
            _send(cfg["result_fd"], _describe(fn))
            return
        _drop_user(cfg["uid"])
        _die_with_parent(ctypes.CDLL(None, use_errno=True))
        result = fn(**cfg["kwargs"])
        if not isinstance(result, str):
            raise TypeError(f"the tool returned {type(result).__name__}, not a str")
        _send(cfg["result_fd"], {"result": result})
        return
    _drop_user(cfg["uid"])
    _die_with_parent(ctypes.CDLL(None, use_errno=True))
    if mode == "argv":
        os.execvpe(cfg["argv"][0], cfg["argv"], dict(os.environ))
    # mode "python": the program file in the working directory, as `python main.py` would run it
    import runpy

    sys.argv = [cfg["main"]]
    sys.path.insert(0, cfg["workdir"])
    runpy.run_path(cfg["main"], run_name="__main__")


if __name__ == "__main__":
    main()
