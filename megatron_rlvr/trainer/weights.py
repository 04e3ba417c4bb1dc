"""Weight sync from the trainer's Megatron shards to this rank's rollout engine, after every optimizer step.

The tensors come from the rollout package's weight stream (``megatron_rlvr.rollout.weight_stream``): TP all-gather
and the inverse layouts of the single weight mapping, broadcast from the pipeline stage that owns each tensor, in
byte-bounded buckets. Every rank's engine receives every HF tensor exactly once.
"""

from __future__ import annotations

import time

from megatron_rlvr.megatron.cpu_shims import native_torch


def sync_weights(engine, model, args, pg, bucket_bytes: int = 1 << 30) -> dict[str, float]:
    """Push the current policy weights into ``engine`` (collective over TP and PP); returns metrics. A LoRA policy
    with ``model.lora.sync: adapter`` sends the base once and then only its adapters (rollout.lora_sync)."""
    from megatron_rlvr.models.lora import lora_container

    lora = lora_container(model)
    if lora is not None and lora.cfg.sync == "adapter":
        from megatron_rlvr.rollout.lora_sync import sync_adapter

        return sync_adapter(
            engine, model, args, pg, lambda: sync_weights_merged(engine, model, args, pg, bucket_bytes, adapters="base")
        )
    return sync_weights_merged(engine, model, args, pg, bucket_bytes)


def sync_weights_merged(
    engine, model, args, pg, bucket_bytes: int = 1 << 30, adapters: str = "merged"
) -> dict[str, float]:
    """Every weight through the stream; ``adapters`` (``WeightStreamConfig.adapters``): a LoRA policy's adapters
    merged into their weights (``merged``) or left out, the base weights only (``base``)."""
    from megatron_rlvr.models.build import unwrap
    from megatron_rlvr.rollout.weight_stream import StreamStats, WeightStreamConfig, megatron_weight_stream

    t0 = time.perf_counter()
    stats = StreamStats()
    stream = megatron_weight_stream(
        unwrap(model),
        args,
        config=WeightStreamConfig(bucket_bytes=bucket_bytes, adapters=adapters),
        stats=stats,
        pg_collection=pg,
    )
    n = engine.update_weights(_without_shims(stream))
    return {
        "sync/time_s": time.perf_counter() - t0,
        "sync/tensors": float(n),
        "sync/gbytes": stats.bytes / 1e9,
        "sync/peak_buffer_gbytes": stats.meter.peak_bytes / 1e9,
    }


def _without_shims(stream):
    """The stream's own work (plan, TP gathers, layout copies) makes no CUDA call when the shims are on (CPU
    tensors, gloo): run it outside their per-call redirect. The engine's side runs as before."""
    while True:
        with native_torch():
            bucket = next(stream, None)
        if bucket is None:
            return
        yield bucket
