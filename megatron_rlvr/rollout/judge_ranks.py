"""A reward judge on ranks of its own (``parallel.judge_ranks``): the scorer side's :class:`RemoteJudge` and the
judge rank's :func:`serve_judge`, talking point to point over one gloo group per (scorer, judge rank) pair.

A pair group has two ranks: the scorer (an engine leader, whoever scores a step's rewards) is group rank 0, the judge
rank group rank 1. Messages are pickled dataclasses sent with ``bridge.send_object``:

- scorer -> judge rank: :class:`JudgeRequest` (a request id and the items: questions, responses, references), or
  :class:`JudgeStop` at the end of the run;
- judge rank -> scorer: :class:`JudgeReply` (the request id and one ``ItemResult`` per item, in order), or
  :class:`JudgeStopped` to acknowledge a stop (the last message on the pair: no receive is left posted on it).

Each side has one receiving thread per pair, always posted (like ``bridge.BatchReceiver``), so a send never waits on
the other side's main loop. With several judge ranks the scorer splits a batch into contiguous near-equal chunks, one
per judge rank, and puts the replies back in order.

Timeouts: a chunk whose reply does not arrive within ``reward.judge.timeout_s`` + ``margin_s`` scores its items 0 in
``reward/n_timeout`` and the step goes on; the late reply is recognised by its request id and dropped when it comes.
The judge itself bounds its work by ``timeout_s`` (``rewards.judge``), so a judge rank is never more than about one
timeout behind.

Death: a judge rank that exits closes its sockets; the scorer's receiving thread (or its next send) fails and
:meth:`RemoteJudge.score` raises ``bridge.PeerLost`` naming the judge rank, which ends the scorer's rank and the job,
as a lost rollout rank does. A judge rank whose scorer dies ends the same way (:func:`serve_judge` raises PeerLost).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_rlvr.rewards.judge import Judge
from megatron_rlvr.rewards.judge_config import JudgeConfig
from megatron_rlvr.rewards.pool import ItemResult, ScoringStopped
from megatron_rlvr.rollout.bridge import PeerLost, recv_object, send_object

__all__ = [
    "JudgeItems",
    "JudgeReply",
    "JudgeRequest",
    "JudgeStop",
    "JudgeStopped",
    "RemoteJudge",
    "serve_judge",
    "split_even",
]

SCORER, JUDGE = 0, 1
"""Group ranks of the two ends of a pair group."""

REPLY_MARGIN_S = 30.0
"""Seconds a scorer waits for a reply beyond ``reward.judge.timeout_s`` (pickling, the transfer, a judge rank still
finishing the previous request) before it counts the items as timed out."""

POLL_S = 0.05
"""How often a waiting scorer checks ``should_stop``."""


@dataclass
class JudgeItems:
    """The items of one request, index-aligned."""

    questions: list[str]
    responses: list[str]
    references: list[str]

    def __len__(self) -> int:
        return len(self.responses)

    def part(self, lo: int, hi: int) -> JudgeItems:
        return JudgeItems(self.questions[lo:hi], self.responses[lo:hi], self.references[lo:hi])


@dataclass
class JudgeRequest:
    request_id: int
    """Increasing per scorer: tells a late reply from the awaited one."""
    items: JudgeItems


@dataclass
class JudgeReply:
    request_id: int
    results: list[ItemResult]
    """One per item of the request, in its order."""


@dataclass
class JudgeStop:
    """The scorer is done: the judge rank acknowledges (JudgeStopped) and stops listening on this pair."""


@dataclass
class JudgeStopped:
    """The judge rank's last message on a pair."""


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [lo, hi) ranges covering range(n), sizes differing by at most one (the first ones
    larger)."""
    base, extra = divmod(n, parts)
    bounds, lo = [], 0
    for k in range(parts):
        hi = lo + base + (k < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class _Listener:
    """One thread per pair, posted on a receive: puts (link index, message) into a shared queue, or (index,
    exception) when the pair fails; ends after ``last`` (the pair's final message type)."""

    def __init__(self, links: Sequence, src: int, last: type, out: queue.Queue, name: str):
        self.threads = [
            threading.Thread(target=self._run, args=(k, pg, src, last, out), name=f"{name}-{k}", daemon=True)
            for k, pg in enumerate(links)
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def _run(k: int, pg, src: int, last: type, out: queue.Queue) -> None:
        try:
            while True:
                msg = recv_object(pg, src)
                out.put((k, msg))
                if isinstance(msg, last):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            out.put((k, e))

    def join(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s`` in all) for every thread; whether all ended."""
        end = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)


class RemoteJudge:
    """The scorer side's judge when the judge runs on judge ranks: the :class:`~megatron_rlvr.rewards.judge.Judge`
    interface (``score``, ``close``) over one pair group per judge rank (``links[k]``: this scorer and judge rank k,
    global rank ``judge_ranks[k]`` for messages)."""

    def __init__(
        self,
        cfg: JudgeConfig,
        links: Sequence,
        judge_ranks: Sequence[int] | None = None,
        margin_s: float = REPLY_MARGIN_S,
        stop_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not links:
            raise ValueError("RemoteJudge needs at least one judge rank")
        self.cfg = cfg
        self.links = list(links)
        self.judge_ranks = list(judge_ranks) if judge_ranks is not None else list(range(len(self.links)))
        self.margin_s = float(margin_s)
        self.stop_timeout_s = float(stop_timeout_s)
        self.clock = clock
        self._ids = itertools.count(1)
        self._inbox: queue.Queue = queue.Queue()
        self._listener = _Listener(self.links, JUDGE, JudgeStopped, self._inbox, "judge-replies")
        self._closed = False
        self.late_replies = 0
        """Replies that arrived after their request had been given up (dropped)."""

    def _lost(self, k: int, e: BaseException) -> PeerLost:
        first = (str(e).strip().splitlines() or [""])[0]
        return PeerLost(
            f"the channel to judge rank {k} (global rank {self.judge_ranks[k]}) failed ({type(e).__name__}: "
            f"{first}); the judge rank has died or lost its connection"
        )

    def score(
        self,
        questions: Sequence[str],
        responses: Sequence[str],
        references: Sequence[str],
        should_stop: Callable[[], bool] | None = None,
    ) -> list[ItemResult]:
        """One result per item, in order: the batch split over the judge ranks, one request each."""
        if self._closed:
            raise RuntimeError("the remote judge is closed")
        items = JudgeItems(list(questions), list(responses), list(references))
        n = len(items)
        results: list[ItemResult | None] = [None] * n
        if n == 0:
            return []
        waiting: dict[int, tuple[int, int, int]] = {}  # link -> (request id, lo, hi)
        for k, (lo, hi) in enumerate(split_even(n, len(self.links))):
            if hi == lo:
                continue
            rid = next(self._ids)
            try:
                send_object(self.links[k], JudgeRequest(rid, items.part(lo, hi)), JUDGE)
            except RuntimeError as e:
                raise self._lost(k, e) from e
            waiting[k] = (rid, lo, hi)
        deadline = self.clock() + self.cfg.timeout_s + self.margin_s
        while waiting:
            if should_stop is not None and should_stop():
                raise ScoringStopped("scoring stopped: a stop was requested")
            left = deadline - self.clock()
            if left <= 0:
                break
            try:
                k, msg = self._inbox.get(timeout=min(POLL_S, left))
            except queue.Empty:
                continue
            if isinstance(msg, BaseException):
                raise self._lost(k, msg) from msg
            if not isinstance(msg, JudgeReply) or k not in waiting or msg.request_id != waiting[k][0]:
                self.late_replies += 1
                continue
            _, lo, hi = waiting.pop(k)
            if len(msg.results) != hi - lo:
                why = f"judge rank {k} gave {len(msg.results)} results for {hi - lo} items"
                results[lo:hi] = [ItemResult(0.0, "error", why)] * (hi - lo)
            else:
                results[lo:hi] = msg.results
        for k, (_, lo, hi) in waiting.items():
            why = (
                f"judge rank {k} did not reply within reward.judge.timeout_s={self.cfg.timeout_s:g} s "
                f"+ {self.margin_s:g} s"
            )
            results[lo:hi] = [ItemResult(0.0, "timeout", why)] * (hi - lo)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Tell every judge rank this scorer is done and wait (at most ``stop_timeout_s``) for their
        acknowledgements, so no receive is left posted on the pairs; idempotent. A judge rank already gone is
        skipped."""
        if self._closed:
            return
        self._closed = True
        for pg in self.links:
            try:
                send_object(pg, JudgeStop(), JUDGE)
            except RuntimeError:
                pass  # that judge rank is gone: its listener has failed or will
        self._listener.join(self.stop_timeout_s)
        self.links = []


def serve_judge(judge: Judge, links: Sequence, scorer_ranks: Sequence[int] | None = None) -> int:
    """A judge rank's loop: answer every scorer's requests (``links[k]``: the pair group with scorer k) in arrival
    order until each has sent JudgeStop; returns the number of requests served. Raises PeerLost naming the scorer
    when a pair fails (its rank died)."""
    names = list(scorer_ranks) if scorer_ranks is not None else list(range(len(links)))
    inbox: queue.Queue = queue.Queue()
    listener = _Listener(links, SCORER, JudgeStop, inbox, "judge-requests")
    open_links, served = set(range(len(links))), 0
    while open_links:
        k, msg = inbox.get()
        if isinstance(msg, BaseException):
            first = (str(msg).strip().splitlines() or [""])[0]
            raise PeerLost(
                f"the channel from scorer {k} (global rank {names[k]}) to this judge rank failed "
                f"({type(msg).__name__}: {first}); the scorer's rank has died or lost its connection"
            ) from msg
        if isinstance(msg, JudgeStop):
            send_object(links[k], JudgeStopped(), SCORER)
            open_links.discard(k)
            continue
        it = msg.items
        results = judge.score(it.questions, it.responses, it.references)
        send_object(links[k], JudgeReply(msg.request_id, results), SCORER)
        served += 1
    listener.join(5.0)
    return served
