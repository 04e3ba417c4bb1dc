"""Weight sync from the trainer's Megatron shards to the rollout engines, after every optimizer step.

The tensors come from the rollout package's weight stream (``megatron_rlvr.rollout.weight_stream``): TP all-gather
and the inverse layouts of the single weight mapping, broadcast from the pipeline stage that owns each tensor, in
byte-bounded buckets, set up in one place (:func:`stream_weights`). Where they go is a sink: this rank's own engine
(:class:`EngineSink`, colocated) or the bridge to the rollout ranks (:class:`BridgeSink`, disaggregated).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator

import torch

from megatron_rlvr.megatron.cpu_shims import native_torch
from megatron_rlvr.models.build import unwrap
from megatron_rlvr.models.lora import lora_container
from megatron_rlvr.rollout import bridge, weight_check
from megatron_rlvr.rollout.engine import RolloutEngine
from megatron_rlvr.rollout.lora_sync import AdapterSync
from megatron_rlvr.rollout.weight_stream import StreamStats, WeightStreamConfig, megatron_weight_stream
from megatron_rlvr.trainer.policy_side import PolicySide

ENGINE_BUCKET_BYTES = 1 << 30
"""Bytes per bucket streamed into a local engine."""
BRIDGE_BUCKET_BYTES = 256 << 20
"""Bytes per weight bucket sent to the rollout ranks (host staging on both sides is about this much)."""


def stream_weights(model, args, pg, bucket_bytes: int, stats: StreamStats, adapters: str = "merged") -> Iterator:
    """Every weight of ``model`` as full HF-named tensors in buckets (collective over TP and PP: every training rank
    iterates it to the end). ``adapters`` (``WeightStreamConfig.adapters``): a LoRA policy's adapters merged into
    their weights (``merged``) or left out, the base weights only (``base``).

    The stream's own work (plan, TP gathers, layout copies) makes no CUDA call when the CPU shims are on (CPU
    tensors, gloo): it runs outside their per-call redirect; the consumer's side runs as before."""
    config = WeightStreamConfig(bucket_bytes=bucket_bytes, adapters=adapters)
    stream = megatron_weight_stream(unwrap(model), args, config=config, stats=stats, pg_collection=pg)
    while True:
        with native_torch():
            bucket = next(stream, None)
        if bucket is None:
            return
        yield bucket


def sync_weights(
    engine: RolloutEngine,
    model,
    args,
    pg,
    adapter_sync: AdapterSync | None = None,
    bucket_bytes=ENGINE_BUCKET_BYTES,
    verify: bool = False,
) -> dict[str, float]:
    """Push the current policy weights into ``engine`` (collective over TP and PP); returns metrics. With
    ``adapter_sync`` (a LoRA policy with ``model.lora.sync: adapter``) the base goes once, then only the adapters.
    ``verify``: read the engine's weights back and compare them with what was sent (:func:`verify_engine`)."""
    if adapter_sync is not None:
        if lora_container(model) is None:
            raise ValueError("adapter sync of a policy without LoRA adapters")

        def base() -> dict[str, float]:
            return sync_weights_merged(engine, model, args, pg, bucket_bytes, verify, adapters="base")

        return adapter_sync.sync(model, pg, base)
    return sync_weights_merged(engine, model, args, pg, bucket_bytes, verify)


def sync_weights_merged(
    engine: RolloutEngine,
    model,
    args,
    pg,
    bucket_bytes=ENGINE_BUCKET_BYTES,
    verify: bool = False,
    adapters: str = "merged",
) -> dict[str, float]:
    """Every weight through the stream; ``adapters``: merged into their weights, or the ``base`` weights only."""
    t0 = time.perf_counter()
    stats = StreamStats()
    sent: dict[str, int] = {}
    stream = stream_weights(model, args, pg, bucket_bytes, stats, adapters)
    n = engine.update_weights(weight_check.record(stream, sent) if verify else stream)
    m = {
        "sync/time_s": time.perf_counter() - t0,
        "sync/tensors": float(n),
        "sync/gbytes": stats.bytes / 1e9,
        "sync/peak_buffer_gbytes": stats.meter.peak_bytes / 1e9,
    }
    if verify:
        m.update(verify_engine(engine, sent))
    return m


def verify_engine(engine: RolloutEngine, sent: dict[str, int]) -> dict[str, float]:
    """Compare the engine's read-back weights with the digests of what was sent (WeightSyncError naming the first
    differing tensor); an engine that cannot read back (vLLM's repacked layouts) is left to the train/inference
    mismatch metrics. ``sync/verified``: 1 when checked. ``sync/verify_s`` includes the sending side's digests."""
    if not engine.supports_weight_digests:
        return {"sync/verified": 0.0}
    t0 = time.perf_counter()
    weight_check.compare(sent, engine.weight_digests(sent), "this rank's engine")
    return {"sync/verified": 1.0, "sync/verify_s": time.perf_counter() - t0}


def check_logprob_probe(metrics: dict[str, float], tol: float, version: int) -> dict[str, float]:
    """The second line of a verified sync where the engine cannot read its weights back (vLLM repacks them): the
    train/inference mismatch of the step that sampled with the synced weights, on its sampled tokens. Mean
    |log p_train - log p_engine| above ``tol`` (``rollout.verify_logprobs_tol``) is a WeightSyncError naming the
    version, the figure and the token count; ``sync/probe_log_ratio``: the figure checked. No recomputed
    log-probs (``rollout.old_logprobs=rollout``, or no sampled token): nothing to compare, ``sync/probed`` 0."""
    err, n = metrics.get("mismatch/log_ratio_abs_mean"), metrics.get("mismatch/tokens", 0)
    if err is None or not n:
        return {"sync/probed": 0.0}
    if not err <= tol:  # NaN fails too
        raise weight_check.WeightSyncError(
            f"log-prob probe after the weight sync of version {version}: engine and trainer log-probs of "
            f"{int(n)} sampled tokens differ by {err:.3g} (mean |log-ratio|; rollout.verify_logprobs_tol={tol:g}): "
            "the engine's weights are not the trainer's (a wrong mapping or layout its loader accepted)"
        )
    return {"sync/probed": 1.0, "sync/probe_log_ratio": float(err)}


class WeightSink(abc.ABC):
    """Where a publish sends the policy's weights."""

    @abc.abstractmethod
    def publish(self, policy: PolicySide, version: int, changed: bool) -> dict[str, float]:
        """Send the policy as ``version``; ``changed``: the weights differ from the version published last (a step
        without an update only announces its version where the sink needs it). Collective over the training ranks;
        returns the sync metrics."""


class EngineSink(WeightSink):
    """This rank's own engine (colocated): wake its weights, stream the policy in when it changed (or when sleep
    dropped the engine's copy), then wake the KV cache, so weights and KV cache are never both allocated during the
    sync."""

    def __init__(self, engine: RolloutEngine, adapter_sync: AdapterSync | None, sleep_level: int, verify: str):
        self.engine, self.adapter_sync, self.sleep_level = engine, adapter_sync, sleep_level
        self.verify = verify
        """``rollout.verify_sync``: which syncs are read back and compared."""
        self.syncs = 0
        self.probe_due = False
        """A verified sync went to an engine that cannot read its weights back: the next step's log-prob probe
        (:func:`check_logprob_probe`) checks it instead."""

    def sleep(self) -> None:
        """While the trainer runs: the engine frees its memory (where its sleep does)."""
        if self.engine.supports_sleep:
            self.engine.sleep(self.sleep_level)

    def publish(self, policy: PolicySide, version: int, changed: bool) -> dict[str, float]:
        e = self.engine
        dropped = e.supports_sleep and self.sleep_level == 2
        if e.supports_sleep and e.is_sleeping:
            e.wake_up(tags=["weights"])
        m = {}
        if changed or dropped:
            check = weight_check.due(self.verify, self.syncs)
            m = sync_weights(e, policy.model, policy.args, policy.dist.pg, self.adapter_sync, verify=check)
            self.probe_due = self.probe_due or (check and not e.supports_weight_digests)
            self.syncs += 1
        if e.supports_sleep and e.is_sleeping:
            e.wake_up()
        return m


class BridgeSink(WeightSink):
    """The rollout ranks (disaggregated): training rank 0 broadcasts the buckets over the bridge's weights group as
    ``version``; a step without an update announces its version with no tensors (admission waits for it)."""

    def __init__(self, weights_group, verify: str, delta: bool = False):
        self.group = weights_group
        """The bridge's group between training rank 0 and the rollout ranks (None on the other training ranks)."""
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.verify = verify
        """``rollout.verify_sync``: which publishes carry per-tensor digests (checked on receipt and in the
        rollout ranks' engines)."""
        self.delta = bridge.DeltaPublisher() if delta and weights_group is not None else None
        """``rollout.weight_delta``: the publisher's state (what the rollout ranks hold), on training rank 0."""
        self.syncs = 0

    def publish(self, policy: PolicySide, version: int, changed: bool) -> dict[str, float]:
        if not changed:
            if self.group is not None:
                bridge.publish_weights(self.group, [], version, device=self.device)
            return {"sync/version": float(version), "sync/gbytes": 0.0}
        t0 = time.perf_counter()
        stats = StreamStats()
        stream = stream_weights(policy.model, policy.args, policy.dist.pg, BRIDGE_BUCKET_BYTES, stats)
        nbytes = ntensors = 0
        if self.group is not None:
            check = weight_check.due(self.verify, self.syncs)
            nbytes, ntensors = bridge.publish_weights(
                self.group, stream, version, self.device, with_digests=check, delta=self.delta
            )
        else:
            for _ in stream:  # the stream's collectives: every training rank takes part
                pass
        self.syncs += 1
        dt = time.perf_counter() - t0
        m = {
            "sync/time_s": dt,
            "sync/tensors": float(ntensors),
            "sync/gbytes": nbytes / 1e9,
            "sync/gbps": nbytes / 1e9 / max(dt, 1e-9),
            "sync/version": float(version),
        }
        if self.delta is not None:
            d = self.delta.last
            m["sync/delta_changed_frac"] = d.changed / max(d.words, 1)
            m["sync/delta_bytes_over_full"] = d.sent_bytes / max(d.full_bytes, 1)
            m["sync/delta_resends"] = float(d.resends)
        return m
