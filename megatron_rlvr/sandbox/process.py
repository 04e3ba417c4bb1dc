"""Run a Python program, an argv or a function call in a sandbox process and return a typed outcome.

Each run: a fresh working directory (removed afterwards); an environment of PATH, LANG, HOME and one-thread BLAS
settings only; no inherited
file descriptors (stdin from the given text or empty); its own session and process group; its own pids cgroup,
network and mount namespaces and user id where the machine allows (:mod:`megatron_rlvr.sandbox.limits`); rlimits.
The parent reads stdout and stderr with a byte cap (a program printing 100 MB is killed at the cap, the parent
holds at most the cap), and at the end, whatever happened (exit, timeout, an exception in the parent such as the
reward pool's SIGALRM), every process of the run is killed: the process group, the cgroup's members (they may have
left the group with setsid) or, without a cgroup, every process of the run's own user id.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rlvr.sandbox.limits import CGROUP_PIDS_ROOT, Guards, SandboxLimits, detect_guards
from megatron_rlvr.sandbox.runner import SETUP_EXIT

__all__ = [
    "STATUSES",
    "SandboxOutcome",
    "call_function",
    "describe_function",
    "run_argv",
    "run_python",
    "sweep_stale_runs",
]

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "process_limit", "sandbox_error")
"""A run's outcome: exit 0; a non-zero exit or a signal; past wall_s or cpu_s; out of memory (MemoryError);
stdout or stderr past output_bytes; a fork refused at max_processes; a guard could not be applied."""

_SANDBOX_UID_BASE = 0x40000000
"""Each run gets its own user id, base + (parent pid << 6) + a counter: runs never share RLIMIT_NPROC's count, files
or the right to signal each other, and a run's processes are found by their user id."""
_counter = itertools.count()

_RUNNER_SRC: str | None = None

_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""numpy's BLAS starts a thread per core at import: on a large machine that alone would pass max_processes."""

_SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
_TMP_SIZE = "64m"
"""Each private tmp directory (mount namespace) is a tmpfs of at most this size."""


@dataclass(frozen=True)
class SandboxOutcome:
    """What one sandboxed run did."""

    status: str
    """One of STATUSES."""
    stdout: str
    """Standard output, at most ``output_bytes`` bytes of it (decoded as UTF-8, undecodable bytes replaced)."""
    stderr: str
    """Standard error, likewise capped."""
    truncated: bool
    """stdout or stderr was cut at the cap."""
    exit_code: int | None
    """The main process's exit status; None when a signal ended it."""
    signal: int | None
    """The signal that ended the main process (SIGKILL at a timeout or the output cap), else None."""
    seconds: float
    """Wall time from start to the last process killed."""
    guards: tuple[str, ...]
    """The guards that held for this run (:meth:`Guards.names`)."""
    result: object = None
    """A function call's JSON result (``call_function``, ``describe_function``); None otherwise."""
    message: str = ""
    """One line saying why the status is not "ok"."""
    pid: int | None = None
    """The main process's id, which is also the run's process group id."""
    uid: int | None = None
    """The run's own user id (guard ``own_user``), else None."""
    limits: SandboxLimits = field(default_factory=SandboxLimits, repr=False)

    @property
    def error_line(self) -> str:
        """The last non-empty line of stderr (a Python error's ``Type: message``)."""
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        return lines[-1].strip() if lines else ""


def _runner_source() -> str:
    global _RUNNER_SRC
    if _RUNNER_SRC is None:
        _RUNNER_SRC = (Path(__file__).with_name("runner.py")).read_text()
    return _RUNNER_SRC


def _world_traversable(path: str) -> bool:
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return True  # not there: nothing to bind


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _mount_plan(workdir: str, read_paths: Sequence[str]) -> tuple[list[list], list[str]]:
    """Covers (fresh tmpfs: the shared tmp directories, and directories others cannot enter on the way to a path
    the interpreter needs) and the directories to bind back under them (the working directory; those paths)."""
    tmp_covers = [d for d in _SHARED_TMP if os.path.isdir(d) and not os.path.islink(d)]
    covers: dict[str, int] = {d: 0o1777 for d in tmp_covers}
    binds: list[str] = [workdir]
    for p in read_paths:
        p = os.path.realpath(p)
        if not os.path.isdir(p):
            continue
        if any(_under(p, t) for t in tmp_covers):
            binds.append(p)
            continue
        parts = Path(p).parts
        for i in range(2, len(parts)):
            ancestor = str(Path(*parts[:i]))
            if not _world_traversable(ancestor):
                covers.setdefault(ancestor, 0o755)
                binds.append(p)
                break
    binds = sorted(set(binds), key=len)
    kept: list[str] = []
    for b in binds:
        if not any(_under(b, k) for k in kept):
            kept.append(b)
    cover_list = [[c, covers[c], _TMP_SIZE if covers[c] == 0o1777 else "1m"] for c in sorted(covers, key=len)]
    return cover_list, kept


def _interpreter_paths() -> list[str]:
    paths = [sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    return paths + [p for p in sys.path if p]


@functools.cache
def sweep_stale_runs() -> int:
    """Kill what runs of dead parents left (a reward worker SIGKILLed mid-run never reached its clean-up) and
    remove their pids cgroups; returns how many processes were killed. Done once per process, at its first run."""
    base = os.path.join(CGROUP_PIDS_ROOT, "megatron-rlvr-sandbox")
    killed = 0
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    for name in names:
        owner = name.partition("-")[0]
        path = os.path.join(base, name)
        if not owner.isdigit() or not os.path.isdir(path) or _alive(int(owner)):
            continue
        for _ in range(200):
            pids = _cgroup_pids(path)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.002)
        try:
            os.rmdir(path)
        except OSError:
            pass
    return killed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _make_cgroup(max_processes: int) -> str:
    sweep_stale_runs()
    path = os.path.join(CGROUP_PIDS_ROOT, "megatron-rlvr-sandbox", f"{os.getpid()}-{next(_counter)}")
    os.makedirs(path)
    with open(os.path.join(path, "pids.max"), "w") as f:
        f.write(str(max_processes))
    return path


def _cgroup_pids(cg: str) -> list[int]:
    try:
        with open(os.path.join(cg, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _cgroup_hit_max(cg: str) -> bool:
    try:
        with open(os.path.join(cg, "pids.events")) as f:
            return any(line.split()[0] == "max" and int(line.split()[1]) > 0 for line in f if line.strip())
    except (OSError, ValueError, IndexError):
        return False


def _pids_of_user(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            found.append(int(entry))
                        break
        except (OSError, ValueError):
            continue
    return found


def _kill_everything(proc: subprocess.Popen | None, cg: str | None, uid: int | None) -> None:
    """SIGKILL every process of the run: its process group, then its cgroup's members or its user id's processes
    (which may have left the group), until none is left."""
    if proc is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for _ in range(200):  # a fork loop may add processes between the listing and the kill: list again
        pids = _cgroup_pids(cg) if cg else _pids_of_user(uid) if uid is not None else []
        if proc is not None and proc.poll() is None and proc.pid not in pids:
            pids.append(proc.pid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc is not None:
            try:
                proc.wait(timeout=0.01)
            except subprocess.TimeoutExpired:
                pass
        if cg or uid is not None:
            time.sleep(0.002)
    if proc is not None:
        proc.wait()


def _remove_tree(path: str) -> None:
    def unlock(func, p, _exc):  # a program may have made its files read-only
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=unlock)


def _rlimits(limits: SandboxLimits, own_user: bool) -> dict[str, list[int]]:
    cpu = max(1, int(limits.cpu_s + 0.999))
    out = {
        "RLIMIT_CPU": [cpu, cpu + 1],  # SIGXCPU at the soft limit, SIGKILL one second later
        "RLIMIT_AS": [limits.memory_mb << 20] * 2,
        "RLIMIT_FSIZE": [limits.file_bytes] * 2,
        "RLIMIT_NOFILE": [limits.max_open_files] * 2,
        "RLIMIT_CORE": [0, 0],
    }
    if own_user:  # counted per user id, ignored for root: it holds only under the run's own user id
        out["RLIMIT_NPROC"] = [limits.max_processes] * 2
    return out


def _status(
    proc: subprocess.Popen, over: bool, timed_out: bool, stderr: str, process_max: bool, limits: SandboxLimits
) -> tuple[str, str]:
    code = proc.returncode
    tail = [ln for ln in stderr.splitlines() if ln.strip()]
    last = tail[-1].strip() if tail else ""
    if over:
        return "output_limit", f"output past {limits.output_bytes} bytes: killed"
    if code == SETUP_EXIT and last.startswith("sandbox:"):
        return "sandbox_error", last
    if code == 0 and not timed_out:
        return "ok", ""
    forked_out = process_max or "BlockingIOError: [Errno 11]" in stderr
    if forked_out:
        return "process_limit", f"a new process was refused at max_processes={limits.max_processes}"
    if timed_out:
        return "timeout", f"ran past wall_s={limits.wall_s:g} s: killed"
    if code == -signal.SIGXCPU:
        return "timeout", f"ran past cpu_s={limits.cpu_s:g} s of CPU time: killed"
    if "MemoryError" in last or last.startswith("MemoryError"):
        return "memory", f"out of memory at memory_mb={limits.memory_mb}"
    if code is not None and code < 0:
        return "error", f"killed by signal {signal.Signals(-code).name}"
    return "error", last or f"exit status {code}"


def _run(
    spec: dict,
    limits: SandboxLimits,
    stdin: str | bytes = b"",
    files: Mapping[str, str | bytes] | None = None,
    read_paths: Sequence[str] = (),
) -> SandboxOutcome:
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    guards: Guards = detect_guards()
    uid = _SANDBOX_UID_BASE + (os.getpid() << 6) + (next(_counter) & 63) if guards.own_user else None
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="rlvr-sandbox-")
    proc: subprocess.Popen | None = None
    cg: str | None = None
    result_r = result_w = None
    stdin_file = None
    try:
        for name, content in (files or {}).items():
            target = os.path.join(workdir, name)
            if os.path.dirname(os.path.normpath(name)) or name.startswith("."):
                raise ValueError(f"sandbox file name {name!r} must be a plain file name")
            with open(target, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        if uid is not None:
            for p in [workdir, *(os.path.join(workdir, n) for n in files or {})]:
                os.chown(p, uid, uid)
        if guards.pids_cgroup:
            cg = _make_cgroup(limits.max_processes)
        covers, binds = ([], [])
        if guards.mount_namespace:
            covers, binds = _mount_plan(workdir, [*_interpreter_paths(), *read_paths])
        pass_fds: tuple[int, ...] = ()
        if spec["mode"] in ("call", "describe"):
            result_r, result_w = os.pipe()
            pass_fds = (result_w,)
        cfg = {
            **spec,
            "workdir": workdir,
            "cgroup": cg,
            "net_namespace": not limits.network and guards.net_namespace,
            "user_namespace": not guards.root,
            "mount_namespace": guards.mount_namespace,
            "covers": covers,
            "binds": binds,
            "rlimits": _rlimits(limits, uid is not None),
            "uid": uid,
            "result_fd": result_w,
        }
        stdin_file = tempfile.TemporaryFile()
        stdin_file.write(stdin.encode() if isinstance(stdin, str) else stdin)
        stdin_file.seek(0)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, **_ONE_THREAD}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", _runner_source(), json.dumps(cfg)],
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=env,
            close_fds=True,
            pass_fds=pass_fds,
            start_new_session=True,
        )
        if result_w is not None:
            os.close(result_w)
            result_w = None
        streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        if result_r is not None:
            streams[result_r] = bytearray()
        caps = {fd: limits.output_bytes for fd in streams}
        if result_r is not None:
            caps[result_r] = max(limits.output_bytes, 1 << 16) * 4  # the JSON of a result string of up to the cap
        over = timed_out = False
        deadline = start + limits.wall_s
        exited_at: float | None = None
        sel = selectors.DefaultSelector()
        for fd in streams:
            sel.register(fd, selectors.EVENT_READ)
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ)
        except (AttributeError, OSError):
            pidfd = None
        try:
            while len(sel.get_map()) > (1 if pidfd is not None and pidfd in sel.get_map() else 0):
                now = time.monotonic()
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                    _kill_everything(proc, cg, uid)  # what it left running goes now; its pipes reach EOF
                if now >= deadline and exited_at is None:
                    timed_out = True
                    break
                if exited_at is not None and now - exited_at > 1.0:  # a pipe held past every kill: stop reading
                    break
                wait = min(deadline - now, 0.05 if pidfd is None or exited_at is not None else deadline - now)
                for key, _ in sel.select(timeout=max(0.0, wait)):
                    fd = key.fd
                    if fd == pidfd:
                        sel.unregister(pidfd)
                        continue
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        sel.unregister(fd)
                        continue
                    buf = streams[fd]
                    room = caps[fd] - len(buf)
                    buf += chunk[: max(0, room)]
                    if len(chunk) > room:
                        over = True
                if over:
                    break
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
        _kill_everything(proc, cg, uid)
        seconds = time.monotonic() - start
        out = streams[proc.stdout.fileno()].decode("utf-8", "replace")
        err = streams[proc.stderr.fileno()].decode("utf-8", "replace")
        status, message = _status(proc, over, timed_out, err, cg is not None and _cgroup_hit_max(cg), limits)
        result = None
        if result_r is not None and status == "ok":
            try:
                result = json.loads(streams[result_r].decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                status, message = "error", "the call's result could not be read"
        code = proc.returncode
        return SandboxOutcome(
            status=status,
            stdout=out,
            stderr=err,
            truncated=over,
            exit_code=code if code is not None and code >= 0 else None,
            signal=-code if code is not None and code < 0 else None,
            seconds=seconds,
            guards=guards.names(),
            result=result,
            message=message,
            pid=proc.pid,
            uid=uid,
            limits=limits,
        )
    finally:
        # also on an exception here (the reward pool's SIGALRM, Ctrl-C): nothing of the run outlives it
        _kill_everything(proc, cg, uid)
        for fd in (result_r, result_w):
            if fd is not None:
                os.close(fd)
        if proc is not None:
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        if stdin_file is not None:
            stdin_file.close()
        if cg is not None:
            try:
                os.rmdir(cg)
            except OSError:
                pass
        _remove_tree(workdir)


def run_python(
    code: str, limits: SandboxLimits, stdin: str | bytes = b"", files: Mapping[str, str | bytes] | None = None
) -> SandboxOutcome:
    """Run ``code`` as ``python main.py`` in a sandbox, with ``stdin`` as its standard input and ``files`` (plain
    names -> contents) beside it in its working directory."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    return _run({"mode": "python", "main": "main.py"}, limits, stdin, {**(files or {}), "main.py": code})


def run_argv(
    argv: Sequence[str], limits: SandboxLimits, stdin: str | bytes = b"", files: Mapping[str, str | bytes] | None = None
) -> SandboxOutcome:
    """Run a command (looked up on PATH=/usr/local/bin:/usr/bin:/bin) in a sandbox."""
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty list of str, got {argv!r}")
    return _run({"mode": "argv", "argv": list(argv)}, limits, stdin, files)


def _user_sys_path() -> list[str]:
    # as the reward workers: the parent's sys.path, and the working directory (found as with `python -m`); "" is
    # the parent's working directory, which is not the sandbox's
    cwd = os.getcwd()
    path = [cwd if p == "" else p for p in sys.path]
    return path if cwd in path else [*path, cwd]


def call_function(module: str, function: str, kwargs: Mapping[str, object], limits: SandboxLimits) -> SandboxOutcome:
    """Call ``module:function(**kwargs)`` in a sandbox; ``result`` is ``{"result": <the returned str>}``. The module
    is imported there (before the drop to the run's user id), so nothing of it runs in this process."""
    json.dumps(dict(kwargs))  # arguments must be JSON: raises TypeError here, not in the sandbox
    path = _user_sys_path()
    spec = {"mode": "call", "module": module, "function": function, "kwargs": dict(kwargs), "sys_path": path}
    return _run(spec, limits, read_paths=path)


def describe_function(module: str, function: str, limits: SandboxLimits) -> SandboxOutcome:
    """Import ``module`` in a sandbox and return ``function``'s docstring and parameters as ``result``."""
    path = _user_sys_path()
    spec = {"mode": "describe", "module": module, "function": function, "sys_path": path}
    return _run(spec, limits, read_paths=path)
