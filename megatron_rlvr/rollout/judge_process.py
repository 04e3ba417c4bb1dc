"""A generative judge's rollout engine in a child process of its own, driven over a socket pair.

Why a process: vLLM keeps process-global state (its parallel groups, its current config, the engine core), so a
second vLLM engine cannot live in the process of the policy's vLLM engine; in a child of its own the judge's engine
has its own vLLM globals and, on a GPU, its own memory share (``gpu_memory_utilization``). The transformers engine
runs the same way when ``reward.judge.isolate`` asks for it.

Parent side (:class:`JudgeProcess`): ``generate(prompt_ids, params, should_stop) -> replies | None`` sends one
batched request and waits, polling ``should_stop`` (the judge's wall-clock limit or a stop request):

- ``should_stop`` while the child is still starting: None (the caller scores the batch as timed out); the child
  keeps starting for the next call.
- ``should_stop`` while the child is generating: the child is killed (with its process group: nothing it started
  is left), a fresh one is started at once (it loads while the policy trains), and None is returned.
- the child dies, fails to start, or does not start within ``start_timeout_s``: RuntimeError (the caller scores
  every item of the batch as an error) and a fresh child is started; after ``max_restarts`` such failures in a
  row the judge is unreachable: every later call raises at once, without starting anything.
- an engine error inside a live child: RuntimeError with the child's message; the child stays.

:meth:`JudgeProcess.close` (idempotent; also registered with ``atexit``) asks the child to exit and kills its
process group when it has not within a few seconds. The child watches its parent: if the parent dies without
closing it (SIGKILL), the child exits within a second.

Child side (``python -m megatron_rlvr.rollout.judge_process FD MODEL PARENT_PID``): receives the spec (a dict:
``engine`` "hf" | "vllm", ``model`` folder, ``dtype``, ``device``, ``max_batch_rows``, ``gpu_memory_utilization``,
``seed``, ``max_model_len``), builds the engine with the folder's weights, answers ``("ready", pid)`` (or
``("error", traceback)``), then serves ``("generate", prompt_ids, sampling params dict)`` -> ``("ok", replies)`` /
``("error", message)`` until ``("close",)`` or the end of the socket.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

__all__ = ["JudgeProcess", "child_env"]

_DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
"""torchrun's variables: the child is not a rank of the run (vLLM would read them as its own world)."""

POLL_S = 0.05
"""How often a waiting parent checks ``should_stop`` and the child's liveness."""


def child_env(device: str) -> dict[str, str]:
    """The child's environment: the parent's without torchrun's rank variables; for a CUDA ``device`` only that
    GPU visible (the child then addresses it as cuda:0)."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS and not k.startswith("TORCHELASTIC_")}
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [x for x in visible.split(",") if x.strip()] if visible else None
        env["CUDA_VISIBLE_DEVICES"] = ids[index] if ids and index < len(ids) else str(index)
    # the parent's import path (a source checkout on PYTHONPATH, or sys.path edits) reaches the child as well
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


class JudgeProcess:
    """The parent's handle on one judge child process (module docstring). ``spec``: what the child builds."""

    def __init__(self, spec: dict, start_timeout_s: float = 600.0, max_restarts: int = 3):
        self.spec = dict(spec)
        self.start_timeout_s = float(start_timeout_s)
        self.max_restarts = int(max_restarts)
        self.failures_in_a_row = 0
        self.restarts = 0
        """Children started after the first (a kill at the wall-clock limit, a death, a failed start)."""
        self.unreachable: str | None = None
        """Why the judge was given up (``max_restarts`` failures in a row), or None."""
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._started_at = 0.0
        self._closed = False
        atexit.register(self.close)
        self._start()

    @property
    def pid(self) -> int | None:
        """The live child's process id (None when there is none)."""
        return None if self._proc is None else self._proc.pid

    def _start(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        fd = child_sock.fileno()
        device = str(self.spec.get("device", "cpu"))
        cmd = [
            sys.executable,
            "-m",
            "megatron_rlvr.rollout.judge_process",
            str(fd),
            str(self.spec["model"]),
            str(os.getpid()),
        ]
        try:
            # its own session: the whole group (vLLM's helpers included) is killed together, and a Ctrl-C meant
            # for the run reaches the judge only through close()
            self._proc = subprocess.Popen(
                cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL, env=child_env(device), start_new_session=True
            )
        finally:
            child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._ready = False
        self._started_at = time.monotonic()
        self._conn.send(self.spec if not device.startswith("cuda") else {**self.spec, "device": "cuda:0"})

    def _kill(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._ready = False
        if conn is not None:
            conn.close()
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()

    def _fail(self, why: str) -> RuntimeError:
        """A dead or unstartable child: kill what is left, restart or give up; the error to raise."""
        self._kill()
        self.failures_in_a_row += 1
        if self.failures_in_a_row >= self.max_restarts:
            self.unreachable = f"{why}; given up after {self.failures_in_a_row} failures in a row"
            return RuntimeError(f"the judge process is unreachable: {self.unreachable}")
        self.restarts += 1
        self._start()
        return RuntimeError(f"the judge process failed ({why}); restarted")

    def _receive(self, should_stop: Callable[[], bool], limit_at: float | None):
        """The child's next message; None when ``should_stop`` said so first. Raises EOFError when the child is
        gone, TimeoutError past ``limit_at``."""
        while True:
            if should_stop():  # first: a batch past its limit is abandoned even if its reply is on the way
                return None
            if self._conn.poll(POLL_S):
                return self._conn.recv()  # EOFError when the child closed its end
            if self._proc.poll() is not None:
                raise EOFError(f"exit status {self._proc.returncode}")
            if limit_at is not None and time.monotonic() > limit_at:
                raise TimeoutError

    def generate(self, prompt_ids: list[list[int]], params: dict, should_stop: Callable[[], bool]):
        """Replies (one text per prompt) from one request to the child; None when ``should_stop`` interrupted."""
        if self._closed:
            raise RuntimeError("the judge process is closed")
        if self.unreachable is not None:
            raise RuntimeError(f"the judge process is unreachable: {self.unreachable}")
        if self._proc is None:
            self._start()
        if not self._ready:
            try:
                msg = self._receive(should_stop, self._started_at + self.start_timeout_s)
            except TimeoutError:
                raise self._fail(f"not ready within start_timeout_s={self.start_timeout_s:g} s") from None
            except (EOFError, OSError) as e:
                raise self._fail(f"it exited while starting ({e})") from None
            if msg is None:
                return None  # still starting: this batch is late, the child keeps loading
            if msg[0] != "ready":
                raise self._fail(f"it could not start the judge engine: {str(msg[1])[-2000:]}")
            self._ready = True
        try:
            self._conn.send(("generate", prompt_ids, params))
            msg = self._receive(should_stop, None)
        except (EOFError, OSError) as e:
            raise self._fail(f"it died while judging ({e})") from None
        if msg is None:  # past the wall-clock limit mid-batch: a fresh child rather than waiting for this one
            self._kill()
            self.restarts += 1
            self._start()
            return None
        if msg[0] == "error":
            raise RuntimeError(f"the judge engine failed: {msg[1]}")
        self.failures_in_a_row = 0
        return msg[1]

    def close(self) -> None:
        """Ask the child to exit, then kill its process group if it has not within 5 s; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        proc, conn = self._proc, self._conn
        if proc is not None and conn is not None:
            try:
                conn.send(("close",))
                proc.wait(timeout=5.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()


# ---------------------------------------------------------------------------------------------------------------
# the child


def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone (we were re-parented: it died without closing us). The end of the socket tells
    an idle child as much, but not one that is loading or generating, nor one whose parent's end of the socket
    outlives the parent (a forked process holding a copy)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def _build_engine(spec: dict):
    """(engine, tokenizer) of ``spec`` with the folder's weights."""
    import torch
    from transformers import AutoTokenizer

    model_dir, device = spec["model"], str(spec.get("device", "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if spec["engine"] == "hf":
        from transformers import AutoModelForCausalLM

        from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine

        on_cpu = device == "cpu"
        dtype = torch.float32 if on_cpu or spec.get("dtype") == "float32" else torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        cfg = HFEngineConfig(max_batch_rows=int(spec["max_batch_rows"]), device=device)
        return HFRolloutEngine(model, tokenizer, config=cfg), tokenizer
    if spec["engine"] == "vllm":
        from safetensors.torch import load_file

        from megatron_rlvr.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine

        cfg = VLLMEngineConfig(
            gpu_memory_utilization=float(spec["gpu_memory_utilization"]),
            dtype=str(spec.get("dtype", "bfloat16")),
            max_model_len=spec.get("max_model_len"),
            max_num_seqs=int(spec["max_batch_rows"]),
            seed=int(spec.get("seed", 0)),
        )
        engine = VLLMRolloutEngine(model_dir, tokenizer=model_dir, config=cfg)
        try:
            files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
            if not files:
                raise ValueError(f"{model_dir} has no .safetensors weights")

            def tensors():  # one file at a time: a big judge's shards are not all in memory at once
                for f in files:
                    yield from load_file(os.path.join(model_dir, f)).items()

            # one update over all files: a fused layer whose parts sit in two files is written whole
            engine.update_weights(tensors())
        except BaseException:
            engine.close()
            raise
        return engine, tokenizer
    raise ValueError(f"unknown judge engine {spec['engine']!r}")


def _serve(fd: int, parent: int) -> int:
    conn = Connection(fd)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        spec = conn.recv()
        engine, tokenizer = _build_engine(spec)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()[-4000:]))
        except OSError:
            pass
        return 1
    from megatron_rlvr.rollout.engine import SamplingParams

    try:
        conn.send(("ready", os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg[0] == "close":
                break
            _, prompt_ids, params = msg
            try:
                outputs = engine.generate(prompt_ids, SamplingParams(**params))
                replies = []
                for out in outputs:
                    c = out.completions[0]
                    text = c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True)
                    replies.append(text)
                conn.send(("ok", replies))
            except Exception as e:  # one bad batch: say so and keep serving
                conn.send(("error", f"{type(e).__name__}: {e}"[:2000]))
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[1]), int(sys.argv[3])))
