"""What crosses between the roles of the disaggregated layout (groups from megatron_rlvr.megatron.roles):

- rollout batches, rollout rank 0 -> training rank 0, as pickled objects over the ``data`` group (point to point);
- versioned weights, training rank 0 -> every rollout rank, over the ``weights`` group (broadcast), in the weight
  stream's buckets: per bucket one header (names, shapes, dtypes) and one flat byte buffer, then an end-of-version
  header. A ``stop`` header ends the rollout ranks' loop (with the training ranks' exit code).

With ``rollout.weight_delta`` a version carries, per tensor, only the words that changed since the version every
rollout rank holds (``rollout.weight_delta``'s module), with the digest of the whole new tensor. Each rollout rank
rebuilds the tensors from its copy of the previous version, checks the digests, and all ranks agree on the outcome
(one all-reduce at the version's end): if any rank's rebuilt bytes differ, the version is sent again whole, so a lost
or misapplied delta costs one full sync, never a wrong weight.

The receiving side of each channel is a thread that is always posted on its group, so a sender never blocks on the
other role's main loop (a blocking send into a busy peer would deadlock the two loops): the trainer's
:class:`BatchReceiver` queues batches, each rollout rank's :class:`WeightReceiver` keeps the complete versions not yet
applied (the schedule applies exactly version s - 1 - k for step s; taking a version drops the older ones). Host
memory on a rollout rank: at most k = rollout.max_staleness versions waiting (while step s rolls out with version
s - 1 - k, the trainer can publish up to version s - 1) plus the one being received.

A peer that dies closes its sockets: the receiving thread's collective raises, and the main loop re-raises it as
:class:`PeerLost` naming the other role, so the job ends (the launcher stops the other ranks) instead of waiting.
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rlvr.rollout import weight_check, weight_delta


class PeerLost(RuntimeError):
    """The other role's rank went away (its process died or its connection closed)."""


class Stopped(Exception):
    """The training ranks ended the run (normally or on a stop signal); ``code`` is their exit code."""

    def __init__(self, code: int):
        super().__init__(f"stopped by the training ranks (exit code {code})")
        self.code = code


# ------------------------------------------------------------------------------------------------------------------
# Objects over a group
# ------------------------------------------------------------------------------------------------------------------


def send_object(pg, obj, dst: int, device: str = "cpu") -> int:
    """Send ``obj`` (pickled) to group rank ``dst``; returns the bytes sent."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    pg.send([size], dst, 0).wait()
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    pg.send([payload], dst, 0).wait()
    return len(data)


def recv_object(pg, src: int, device: str = "cpu"):
    size = torch.zeros(1, dtype=torch.int64, device=device)
    pg.recv([size], src, 0).wait()
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    pg.recv([payload], src, 0).wait()
    return pickle.loads(payload.cpu().numpy().tobytes())


def broadcast_object(pg, obj, root: int = 0, device: str = "cpu"):
    """``obj`` of group rank ``root`` on every rank of ``pg`` (pass None elsewhere)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if pg.rank() == root else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    _bcast(pg, size, root)
    if pg.rank() == root:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _bcast(pg, payload, root)
    return obj if pg.rank() == root else pickle.loads(payload.cpu().numpy().tobytes())


def _bcast(pg, tensor: torch.Tensor, root: int) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    pg.broadcast([tensor], opts).wait()


# ------------------------------------------------------------------------------------------------------------------
# Versioned weights
# ------------------------------------------------------------------------------------------------------------------


def publish_weights(
    pg,
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    version: int,
    device: str = "cpu",
    with_digests=False,
    delta: DeltaPublisher | None = None,
):
    """Training rank 0: broadcast every bucket of one weight version to the rollout ranks; returns (bytes, tensors).
    ``with_digests``: each header carries its tensors' digests (rollout.weight_check), which the receiver checks
    against what arrived and the rollout rank against its engine. ``delta``: send each tensor as its changes since
    the version the rollout ranks hold (the publisher's state; its ``last`` holds this publish's figures)."""
    if delta is not None:
        return delta.publish(pg, buckets, version, device, with_digests)
    nbytes = ntensors = 0
    for bucket in buckets:
        flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
        header = {
            "version": version,
            "names": [n for n, _ in bucket],
            "shapes": [tuple(t.shape) for _, t in bucket],
            "dtypes": [str(t.dtype) for _, t in bucket],
            "sizes": [f.numel() for f in flat],
        }
        if with_digests:
            header["digests"] = [weight_check.digest(f) for f in flat]
        buf = torch.cat(flat).to(device) if flat else torch.empty(0, dtype=torch.uint8, device=device)
        with _weight_channel():
            broadcast_object(pg, header, device=device)
            _bcast(pg, buf, 0)
        nbytes += buf.numel()
        ntensors += len(bucket)
        del flat, buf, bucket
    with _weight_channel():
        broadcast_object(pg, {"version": version, "end": True}, device=device)
    return nbytes, ntensors


@dataclass
class DeltaStats:
    """One delta publish, summed over its tensors (and its whole resend, if one was needed)."""

    full_bytes: int = 0
    """The version's bytes as a full sync sends them."""
    sent_bytes: int = 0
    """The payload bytes actually broadcast (sparse indices and values, tensors sent whole, a resend)."""
    words: int = 0
    """Elements in the version."""
    changed: int = 0
    """Elements whose bytes differ from the version the rollout ranks held."""
    resends: int = 0
    """Times the version was sent again whole because a rollout rank's rebuilt digests differed."""


class DeltaPublisher:
    """Training rank 0's side of delta syncs: the bytes of every tensor as the rollout ranks last confirmed them
    (host memory: one copy of the published weights), and the figures of the last publish."""

    def __init__(self, corrupt: Callable[[str, weight_delta.Encoded], weight_delta.Encoded] | None = None):
        self.base: dict[str, torch.Tensor] = {}
        """name -> uint8 bytes on the host, as of the last confirmed version."""
        self.last = DeltaStats()
        self.corrupt = corrupt
        """Tests only: a hook that may alter an encoded tensor before it is sent (a misapplied delta)."""

    def publish(self, pg, buckets, version: int, device: str, with_digests: bool) -> tuple[int, int]:
        stats = self.last = DeltaStats()
        sent: list[tuple[list[str], list[tuple], list[str], list[torch.Tensor]]] = []
        for bucket in buckets:
            names = [n for n, _ in bucket]
            cpu = [t.detach().contiguous().reshape(-1).view(torch.uint8).to("cpu", copy=True) for _, t in bucket]
            meta = (names, [tuple(t.shape) for _, t in bucket], [str(t.dtype) for _, t in bucket], cpu)
            sizes = [t.element_size() for _, t in bucket]
            encoded = [weight_delta.encode(self.base.get(n), f, e) for n, f, e in zip(names, cpu, sizes)]
            if self.corrupt is not None:
                encoded = [self.corrupt(n, x) for n, x in zip(names, encoded)]
            self._send(pg, version, meta, encoded, device, with_digests, stats)
            stats.words += sum(f.numel() // e for f, e in zip(cpu, sizes))
            stats.changed += sum(x.changed for x in encoded)
            sent.append(meta)
            del bucket
        if not self._confirm(pg, version, device):
            stats.resends += 1
            for meta in sent:  # whole, from the copies kept: the stream's tensors may have moved on
                full = [weight_delta.Encoded("full", f, f.numel()) for f in meta[3]]
                self._send(pg, version, meta, full, device, with_digests, stats)
            if not self._confirm(pg, version, device):
                raise weight_check.WeightSyncError(
                    f"weight sync of version {version}: a rollout rank's tensors differ from the trainer's even after "
                    "a full resend (rollout.weight_delta): the weight channel corrupts data"
                )
        for names, _, _, cpu in sent:
            self.base.update(zip(names, cpu))
        stats.full_bytes = sum(f.numel() for meta in sent for f in meta[3])
        return stats.sent_bytes, sum(len(meta[0]) for meta in sent)

    @staticmethod
    def _send(pg, version, meta, encoded, device, with_digests, stats: DeltaStats) -> None:
        names, shapes, dtypes, cpu = meta
        header = {
            "version": version,
            "delta": True,
            "verify": bool(with_digests),
            "names": names,
            "shapes": shapes,
            "dtypes": dtypes,
            "kinds": [x.kind for x in encoded],
            "nbytes": [f.numel() for f in cpu],
            "sizes": [x.payload.numel() for x in encoded],
            "digests": [weight_check.digest(f) for f in cpu],
        }
        parts = [x.payload for x in encoded]
        buf = (torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)).to(device)
        with _weight_channel():
            broadcast_object(pg, header, device=device)
            _bcast(pg, buf, 0)
        stats.sent_bytes += buf.numel()

    @staticmethod
    def _confirm(pg, version: int, device: str) -> bool:
        """End the version and learn whether every rollout rank rebuilt it exactly."""
        with _weight_channel():
            broadcast_object(pg, {"version": version, "end": True, "confirm": True}, device=device)
            return _any_failed(pg, False, device) is False


def _any_failed(pg, failed: bool, device: str) -> bool:
    """Whether any rank of ``pg`` reports a failure (one all-reduce of a flag)."""
    flag = torch.tensor([int(failed)], dtype=torch.int64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([flag], opts).wait()
    return bool(flag.item())


@contextlib.contextmanager
def _weight_channel():
    """A send on the weights group that fails (a rollout rank died, or stopped: the send times out) names the channel
    and the role behind it, as the receiving sides do, instead of a bare gloo error read as any collective's."""
    try:
        yield
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise PeerLost(
            f"the weight channel to the rollout ranks failed ({type(e).__name__}: {first}); a rollout rank has died, "
            "stopped or lost its connection"
        ) from e


def publish_stop(pg, code: int, device: str = "cpu") -> None:
    """Training rank 0: end the rollout ranks' loop."""
    broadcast_object(pg, {"stop": int(code)}, device=device)


_DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)}


class WeightReceiver:
    """A rollout rank's thread on the weights group: keeps the complete versions not yet applied."""

    def __init__(self, pg, device: str = "cpu"):
        self.pg, self.device = pg, device
        self.cond = threading.Condition()
        self.complete: dict[int, tuple[list, float, int]] = {}
        """version -> (buckets, seconds receiving, bytes) of the complete versions not yet taken."""
        self.digests: dict[int, dict[str, int]] = {}
        """version -> the digests its publisher sent (verified publishes only), checked on receipt."""
        self.taken_digests: dict[str, int] = {}
        """The digests of the buckets the last ``take`` returned (empty: not a verified publish)."""
        self.newest = -1
        """The newest complete version so far."""
        self.base: dict[str, torch.Tensor] = {}
        """Delta syncs: name -> uint8 bytes of the newest confirmed version (what the next delta applies to)."""
        self.stop_code: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="weight-receiver", daemon=True)

    def start(self) -> WeightReceiver:
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            buckets, t0, nbytes = [], None, 0
            pending: dict[str, torch.Tensor] = {}  # delta syncs: this version's rebuilt bytes, kept once confirmed
            failed = False  # delta syncs: a rebuilt tensor's digest differs from the trainer's
            while True:
                header = broadcast_object(self.pg, None, device=self.device)
                if "stop" in header:
                    with self.cond:
                        self.stop_code = header["stop"]
                        self.pg = None  # nothing more arrives: the group can be destroyed (Roles.close)
                        self.cond.notify_all()
                    return
                t0 = t0 if t0 is not None else time.perf_counter()
                if header.get("end"):
                    if header.get("confirm") and _any_failed(self.pg, failed, self.device):
                        buckets, pending, failed = [], {}, False  # the trainer sends the version again, whole
                        continue
                    self.base.update(pending)
                    with self.cond:
                        self.complete[header["version"]] = (buckets, time.perf_counter() - t0, nbytes)
                        self.newest = max(self.newest, header["version"])
                        self.cond.notify_all()
                    buckets, t0, nbytes, pending = [], None, 0, {}
                    continue
                buf = torch.empty(sum(header["sizes"]), dtype=torch.uint8, device=self.device)
                _bcast(self.pg, buf, 0)
                nbytes += buf.numel()
                if header.get("delta"):
                    bucket, ok = self._rebuild(header, buf, pending)
                    failed = failed or not ok
                    buckets.append(bucket)
                    continue
                bucket, off = [], 0
                for name, shape, dt, n in zip(header["names"], header["shapes"], header["dtypes"], header["sizes"]):
                    bucket.append((name, buf[off : off + n].view(_DTYPES[dt]).reshape(shape)))
                    off += n
                if "digests" in header:
                    sent = dict(zip(header["names"], header["digests"]))
                    weight_check.compare(sent, {n: weight_check.digest(t) for n, t in bucket}, "the bridge")
                    self.digests.setdefault(header["version"], {}).update(sent)
                buckets.append(bucket)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _rebuild(self, header: dict, buf: torch.Tensor, pending: dict) -> tuple[list, bool]:
        """A delta bucket's tensors from this rank's copy of the previous version; whether every rebuilt tensor has
        the digest the trainer sent. The rebuilt bytes go to ``pending`` (the base once the version is confirmed)."""
        bucket, off, ok = [], 0, True
        fields = zip(*(header[k] for k in ("names", "shapes", "dtypes", "kinds", "sizes", "nbytes", "digests")))
        for name, shape, dt, kind, n, nb, want in fields:
            dtype = _DTYPES[dt]
            size = torch.empty((), dtype=dtype).element_size()
            try:
                new = weight_delta.decode(self.base.get(name), kind, buf[off : off + n].cpu(), nb, size)
            except ValueError:
                new = torch.zeros(nb, dtype=torch.uint8)  # unusable payload: counts as a failed rebuild
            off += n
            ok = ok and weight_check.digest(new) == want
            pending[name] = new
            bucket.append((name, new.to(self.device).view(dtype).reshape(shape)))
        if header.get("verify"):
            self.digests.setdefault(header["version"], {}).update(zip(header["names"], header["digests"]))
        return bucket, ok

    def _check(self) -> None:
        if isinstance(self.error, weight_check.WeightSyncError):
            raise self.error
        if self.error is not None:
            raise PeerLost(
                f"the weight channel from training rank 0 failed ({type(self.error).__name__}: {self.error}); a "
                "training rank has died or lost its connection"
            ) from self.error
        if self.stop_code is not None:
            raise Stopped(self.stop_code)

    def poll(self) -> int:
        """The newest complete version now (no wait). Raises Stopped / PeerLost like ``wait_for``."""
        with self.cond:
            self._check()
            return self.newest

    def wait_for(self, min_version: float, poll_s: float = 0.5) -> int:
        """Wait until a version >= ``min_version`` is complete; returns the newest complete version. Raises Stopped
        when the training ranks ended the run, PeerLost when the channel failed."""
        with self.cond:
            while self.newest < min_version:
                self._check()
                self.cond.wait(poll_s)
            return self.newest

    def take(self, version: int) -> tuple[list, float, int]:
        """(buckets, receive seconds, bytes) of ``version`` and the versions before it not yet taken, which are
        dropped; a version without tensors (a step without an update) gives the newest earlier one's. The digests
        sent with the buckets returned (verified publishes; else empty) are then ``taken_digests``."""
        with self.cond:
            taken = sorted(v for v in self.complete if v <= version)
            parts = [(v, self.complete.pop(v)) for v in taken]
            full = [(v, p) for v, p in parts if p[0]]
            self.taken_digests = self.digests.get(full[-1][0], {}) if full else {}
            for v in [v for v in self.digests if v <= version]:
                del self.digests[v]
            buckets = full[-1][1][0] if full else []
            return buckets, sum(p[1] for _, p in parts), sum(p[2] for _, p in parts)


class BatchReceiver:
    """Training rank 0's thread on the data group: queues what rollout rank 0 sends."""

    def __init__(self, pg, src: int = 1):
        self.pg, self.src = pg, src
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="batch-receiver", daemon=True)

    def start(self) -> BatchReceiver:
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            while True:
                self.queue.put(recv_object(self.pg, self.src))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
            self.queue.put(None)

    def close(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for the thread to end: its recv fails once rollout rank 0 has exited and
        closed the channel. Returns whether it ended."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            return False
        self.pg = None  # the group can be destroyed (Roles.close)
        return True

    def get(self, should_stop: Callable[[], bool] = lambda: False, poll_s: float = 0.5):
        """The next message; raises PeerLost when the channel failed, Stopped(-1) when ``should_stop()``."""
        while True:
            try:
                msg = self.queue.get(timeout=poll_s)
            except queue.Empty:
                if should_stop():
                    raise Stopped(-1) from None
                continue
            if msg is None and self.error is not None:
                raise PeerLost(
                    f"the data channel from rollout rank 0 failed ({type(self.error).__name__}: {self.error}); a "
                    "rollout rank has died or lost its connection"
                ) from self.error
            return msg
