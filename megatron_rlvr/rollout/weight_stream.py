"""Stream a Megatron (TP x PP) model's weights as full Hugging-Face-named tensors, in byte-bounded buckets.

Every rank of the world iterates the SAME global sequence of parameters (``WeightMapping.all_params()`` order, i.e.
HF order), so the collectives line up without any per-tensor handshake:

1. plan (once per call): each pipeline stage lists the HF tensors it owns (shapes via ``to_hf`` on meta tensors)
   and the lists are exchanged over the PP group; every HF tensor must be owned by exactly one stage (the last
   stage's copy of a tied embedding is skipped: HF stores it once);
2. on the owning stage, the TP shards are all-gathered into the FULL megatron tensor and ``ResolvedParam.to_hf``
   (the single mapping table, ``megatron_rlvr.models.mapping``) applies the inverse QKV interleave / gate-up split
   and drops the vocabulary padding; nothing here knows a layout;
3. the HF tensors are broadcast from the owning stage to the other stages of the PP group;
   Routed experts (mixture-of-experts models): a local expert's shards are gathered over the EXPERT-TP group, then
   all-gathered over the expert-parallel group, so one plan entry covers that local index on every EP rank (HF
   experts ``j, j + E/ep, ...``) and every rank streams every expert: a vLLM engine at rollout TP needs all of them;
4. tensors are grouped into buckets: a bucket is yielded (a list of ``(hf_name, tensor)``) before the next tensor is
   assembled if that assembly would push the buffered bytes past ``bucket_bytes``.

LoRA policies: the adapters' own A and B are never streamed as tensors; each adapted weight goes out either merged,
W + (alpha/r) B A (``WeightStreamConfig.adapters="merged"``, the default), or as the base W alone (``"base"``, for an
engine that applies the adapters itself). Which weight an adapter adapts comes from the adapters' ownership table
(``models.lora.LoRAAdapters``).

Memory bound. "Buffered bytes" are the bytes of every buffer the stream allocates (gather buffers, layout copies,
PP receive buffers) that are still referenced — by the stream or by the consumer holding a yielded bucket; tensors
that merely alias the trainer's own parameters (TP=1 identity layouts, replicated norms) cost nothing. With ``S`` the
largest tensor and the flush rule above, the peak is at most ``bucket_bytes + S`` provided the consumer drops a
bucket before asking for the next one (both engines do) and ``bucket_bytes`` is at least the largest conversion
scratch (a gathered tensor that ``to_hf`` copies, checked with a ValueError at plan time). ``MemoryMeter`` measures
the real peak through weak references to every buffer and every yielded tensor; tests assert the bound with it.
Staging memory inside the communication library (gloo copies through its own flat buffer) is not counted.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from megatron_rlvr.models.lora import LoRAAdapter, lora_container
from megatron_rlvr.models.mapping import ExpertLayout, ResolvedParam, WeightMapping, layer_offset, mapped_tensors

Bucket = list[tuple[str, torch.Tensor]]

_DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}

# torch >= 2.13 renamed all_gather_into_tensor (deprecated alias kept) to all_gather_single
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class WeightStreamConfig:
    """How the trainer's weights are streamed to the rollout engine."""

    bucket_bytes: int = 1 << 30
    """Most bytes gathered before a bucket is handed to the engine (peak extra memory <= this + largest tensor)."""
    adapters: Literal["merged", "base"] = "merged"
    """LoRA policies: each adapted weight as W + (alpha/r) B A (``merged``: the engine runs the policy as is) or as
    the base W only (``base``: for an engine that loads the adapters separately). No effect without adapters."""

    def __post_init__(self):
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(f"WeightStreamConfig.bucket_bytes must be a positive int, got {self.bucket_bytes!r}")
        if self.adapters not in ("merged", "base"):
            raise ValueError(f"WeightStreamConfig.adapters must be 'merged' or 'base', got {self.adapters!r}")


class MemoryMeter:
    """Live bytes of the buffers a stream allocated, found through weak references (no allocator hooks).

    A storage is live while any tracked tensor object on it (the buffer itself, or a view the stream yielded) is
    alive. Live bytes only grow at allocations, and every allocation is followed by ``track``, so sampling there
    gives the exact peak as seen from Python."""

    def __init__(self):
        self._storages: dict[tuple, list] = {}  # (device, data_ptr) -> [nbytes, [weakref, ...]]
        self.peak_bytes = 0

    def _purge(self) -> None:
        dead = [k for k, (_, refs) in self._storages.items() if all(r() is None for r in refs)]
        for k in dead:
            del self._storages[k]

    def track(self, *tensors: torch.Tensor) -> None:
        self._purge()  # before adding: a freed address may be reused by the new buffer
        for t in tensors:
            st = t.untyped_storage()
            key = (str(t.device), st.data_ptr())
            entry = self._storages.setdefault(key, [st.nbytes(), []])
            entry[1].append(weakref.ref(t))
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())

    def live_bytes(self) -> int:
        self._purge()
        return sum(n for n, _ in self._storages.values())


@dataclass
class StreamStats:
    """What one stream did (filled while it runs; complete once the generator is exhausted)."""

    tensors: int = 0
    """HF tensors yielded."""
    bytes: int = 0
    """Bytes of the HF tensors yielded."""
    buckets: int = 0
    """Buckets yielded."""
    largest_tensor_bytes: int = 0
    """Largest full tensor (megatron layout, incl. vocab padding) this rank assembled or received."""
    seconds: float = 0.0
    """Wall time spent inside the generator (gathers, layout transforms, broadcasts), excluding the consumer."""
    meter: MemoryMeter = field(default_factory=MemoryMeter)
    """Buffered-bytes meter (``meter.peak_bytes``)."""


@dataclass
class _Entry:
    """One megatron parameter in the global plan."""

    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    dtype: str
    owner: int  # pipeline stage that holds it
    full_bytes: int  # FULL megatron tensor (TP-concatenated, vocab padding included)
    to_hf_copy_bytes: int  # bytes of to_hf outputs that do not alias the full tensor
    local: tuple[ResolvedParam, torch.Tensor] | None = None  # on the owner stage: (resolved, local shard)
    peers: tuple[ResolvedParam, ...] = ()  # a routed expert's parameter: the same local index on every EP rank
    names_per_expert: int = 0  # with peers: HF names of one expert (the entry's names are the peers' in order)
    adapter: LoRAAdapter | None = None  # on the owner stage: the LoRA adapter of this weight (ownership table)


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _local_entries(chunks, offsets, mapping: WeightMapping, tp_size: int, stage: int, experts: ExpertLayout):
    out = []
    for chunk, offset in zip(chunks, offsets):
        lora = lora_container(chunk)
        for name, param in mapped_tensors(chunk):  # the parameters and the buffers HF stores (the router bias)
            if lora is not None and lora.is_adapter_param(param):  # merged into their weights (or sent as a folder)
                continue
            p = mapping.resolve(name, layer_offset=offset, expert_offset=experts.expert_offset(mapping.dims))
            if p.skip_on_export:
                continue
            shard_size = experts.etp_size if p.per_expert else tp_size
            full_shape = list(param.shape)
            if p.tp_dim is not None:
                full_shape[p.tp_dim] *= shard_size
            meta = torch.empty(full_shape, dtype=param.dtype, device="meta")
            hf = p.to_hf(meta, shard_size)
            copy_bytes = sum(
                _nbytes(t.shape, t.dtype) for t in hf.values() if not (t is meta or (t._is_view() and t._base is meta))
            )
            peers: tuple[ResolvedParam, ...] = ()
            names, shapes = p.hf_names, tuple(tuple(hf[n].shape) for n in p.hf_names)
            if p.per_expert and experts.ep_size > 1:
                peers = tuple(
                    mapping.resolve(name, layer_offset=offset, expert_offset=experts.expert_offset(mapping.dims, r))
                    for r in range(experts.ep_size)
                )
                names = tuple(n for q in peers for n in q.hf_names)
                shapes = shapes * experts.ep_size
                copy_bytes *= experts.ep_size
            out.append(
                _Entry(
                    hf_names=names,
                    hf_shapes=shapes,
                    dtype=str(param.dtype),
                    owner=stage,
                    full_bytes=_nbytes(full_shape, param.dtype) * max(1, len(peers)),
                    to_hf_copy_bytes=copy_bytes,
                    local=(p, param),
                    peers=peers,
                    names_per_expert=len(p.hf_names) if peers else 0,
                    adapter=lora.adapter_of(param) if lora is not None else None,
                )
            )
    return out


def build_plan(
    chunks, offsets, mapping: WeightMapping, tp_group, pp_group, experts: ExpertLayout | None = None
) -> list[_Entry]:
    """The global, identically ordered list of parameters on every rank (collective over ``pp_group``)."""
    tp_size, stage = _group_size(tp_group), _group_rank(pp_group)
    local = _local_entries(chunks, offsets, mapping, tp_size, stage, experts or ExpertLayout())
    if _group_size(pp_group) > 1:
        light = [
            (e.hf_names, e.hf_shapes, e.dtype, e.full_bytes, e.to_hf_copy_bytes, e.names_per_expert) for e in local
        ]
        per_stage: list = [None] * _group_size(pp_group)
        dist.all_gather_object(per_stage, light, group=pp_group)
    else:
        per_stage = [None]
    by_key: dict[tuple[str, ...], _Entry] = {e.hf_names: e for e in local}
    seen_twice = []
    for s, entries in enumerate(per_stage):
        if s == stage or entries is None:
            continue
        for names, shapes, dtype, full_bytes, copy_bytes, per in entries:
            if names in by_key:
                seen_twice.append(names[0])
                continue
            by_key[names] = _Entry(names, shapes, dtype, s, full_bytes, copy_bytes, names_per_expert=per)
    if seen_twice:
        raise ValueError(f"weight stream: tensors owned by two pipeline stages, e.g. {seen_twice[:3]}")
    # an entry of a routed expert covers that local index on every EP rank: index it by each expert's names
    by_name: dict[tuple[str, ...], tuple[str, ...]] = {}
    for key, e in by_key.items():
        per = e.names_per_expert or len(key)
        for i in range(0, len(key), per):
            by_name[key[i : i + per]] = key
    plan = []
    for p in mapping.all_params():
        key = by_name.get(p.hf_names)
        if key is None:
            raise ValueError(f"weight stream: no pipeline stage holds {p.hf_names[0]} (is the whole model here?)")
        e = by_key.pop(key, None)
        if e is not None:  # None: emitted with an earlier expert of the same entry
            plan.append(e)
    if by_key:
        raise ValueError(f"weight stream: parameters outside the mapping's model: {sorted(by_key)[:3]}")
    return plan


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""First model chunk -> (key, plan) of its last stream (one pipeline stage only; see ``_plan``)."""


def _plan(chunks, offsets, mapping: WeightMapping, tp_group, pp_group, experts: ExpertLayout) -> list[_Entry]:
    """``build_plan``, reused while the model holds the same parameter objects at the same layout: the plan only
    depends on names, shapes and the mapping, and rebuilding it (a meta ``to_hf`` per tensor) cost more than the
    copies of a small model's sync. With PP > 1 building it is a collective, so every stage builds it every time
    (a cache hit on one stage and a miss on another would desynchronise the ranks)."""
    if _group_size(pp_group) > 1:
        return build_plan(chunks, offsets, mapping, tp_group, pp_group, experts)
    params = tuple(id(p) for c in chunks for p in c.parameters())
    key = (params, tuple(offsets), _group_size(tp_group), repr(mapping.dims), experts)
    hit = _PLANS.get(chunks[0])
    if hit is not None and hit[0] == key:
        return hit[1]
    plan = build_plan(chunks, offsets, mapping, tp_group, pp_group, experts)
    _PLANS[chunks[0]] = (key, plan)  # the plan holds the parameters, so their ids in the key stay theirs
    return plan


class _Assembler:
    """Builds the HF tensors of one plan entry on this rank, tracking every buffer it allocates."""

    def __init__(
        self, tp_group, pp_group, meter: MemoryMeter, device, etp_group=None, ep_group=None, merge_adapters=True
    ):
        self.tp_group, self.pp_group, self.meter, self.device = tp_group, pp_group, meter, device
        self.merge_adapters = merge_adapters
        self.etp_group, self.ep_group = etp_group, ep_group
        self.tp_size = _group_size(tp_group)
        self.stage = _group_rank(pp_group)

    def transient_and_retained(self, e: _Entry) -> tuple[int, int]:
        """(peak bytes while assembling, bytes still held afterwards) for entry ``e`` on this rank."""
        hf_bytes = sum(_nbytes(s, _DTYPES[e.dtype]) for s in e.hf_shapes)
        if e.owner != self.stage:
            return hf_bytes, hf_bytes
        p, param = e.local
        if p.per_expert:  # expert-TP gather, then every EP rank's copy of it, then the HF layout copies
            return e.full_bytes * 2 + e.to_hf_copy_bytes, max(e.to_hf_copy_bytes, hf_bytes)
        merged = e.full_bytes // self.tp_size if self._merges(e) else 0  # LoRA: W + BA is a new shard
        if self.tp_size == 1 or p.tp_dim is None:
            # the full tensor IS the trainer's parameter (or its merged copy): to_hf copies cost memory
            return merged + e.to_hf_copy_bytes, (e.to_hf_copy_bytes or merged)
        gather = merged + e.full_bytes * (2 if p.tp_dim != 0 else 1)  # dim-1 shards need a reorder copy
        retained = e.to_hf_copy_bytes if e.to_hf_copy_bytes else e.full_bytes
        return gather + e.to_hf_copy_bytes, retained

    def _merges(self, e: _Entry) -> bool:
        return self.merge_adapters and e.adapter is not None

    @torch.no_grad()
    def assemble(self, e: _Entry) -> list[torch.Tensor]:
        if e.owner == self.stage:
            tensors = self._owner_tensors(e)
        else:
            tensors = [torch.empty(s, dtype=_DTYPES[e.dtype], device=self.device) for s in e.hf_shapes]
            self.meter.track(*tensors)
        if _group_size(self.pp_group) > 1:
            src = dist.get_global_rank(self.pp_group, e.owner)
            for t in tensors:
                # owner's tensors are contiguous: to_hf copies are, and aliases are row prefixes of contiguous buffers
                dist.broadcast(t, src=src, group=self.pp_group)
        return tensors

    def _expert_tensors(self, e: _Entry) -> list[torch.Tensor]:
        p, param = e.local
        local = param.detach()
        etp = _group_size(self.etp_group)
        full = local if etp == 1 or p.tp_dim is None else self._gather(local, p.tp_dim, self.etp_group, etp)
        if not e.peers:
            fulls, peers = [full], [p]
        else:
            fulls = [torch.empty_like(full) for _ in e.peers]
            self.meter.track(*fulls)
            dist.all_gather(fulls, full.contiguous(), group=self.ep_group)
            peers = list(e.peers)
        del full
        out = []
        for q, t in zip(peers, fulls):
            hf = q.to_hf(t, etp)
            out.extend(hf[n].contiguous() for n in q.hf_names)
        param_storage = local.untyped_storage().data_ptr()
        self.meter.track(*(t for t in out if t.untyped_storage().data_ptr() != param_storage))
        return out

    def _owner_tensors(self, e: _Entry) -> list[torch.Tensor]:
        p, param = e.local
        if p.per_expert:
            return self._expert_tensors(e)
        local = e.adapter.merge(param) if self._merges(e) else param.detach()
        if self.tp_size == 1 or p.tp_dim is None:
            full = local
        else:
            full = self._gather(local, p.tp_dim)
        hf = p.to_hf(full, self.tp_size)
        del full
        out = [hf[n] if hf[n].is_contiguous() else hf[n].contiguous() for n in e.hf_names]
        del hf
        # views of the trainer's own parameter are not buffered memory
        param_storage = param.untyped_storage().data_ptr()
        self.meter.track(*(t for t in out if t.untyped_storage().data_ptr() != param_storage))
        return out

    def _gather(self, local: torch.Tensor, tp_dim: int, group=None, size: int | None = None) -> torch.Tensor:
        local = local.contiguous()  # gloo collectives on non-contiguous tensors are silently wrong
        group = self.tp_group if group is None else group
        tp = self.tp_size if size is None else size
        stacked = torch.empty((tp * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
        self.meter.track(stacked)
        _all_gather_flat(stacked, local, group=group)
        if tp_dim == 0:
            return stacked
        # [tp * rows, cols/tp] -> [rows, tp * cols/tp]: shard r becomes columns [r*c, (r+1)*c)
        full = (
            stacked.view(tp, *local.shape)
            .movedim(0, tp_dim)
            .reshape(*local.shape[:tp_dim], tp * local.shape[tp_dim], *local.shape[tp_dim + 1 :])
        )
        self.meter.track(full)
        del stacked
        return full


def _layer_offsets(chunks: list, pp_group, given: Sequence[int] | None) -> list[int]:
    """Global index of each model chunk's first decoder layer: ``given``, else megatron's rule for this pipeline rank
    and virtual stage."""
    if given is None:
        pp_rank = _group_rank(pp_group)
        given = [
            layer_offset(_unwrap(c).config, pp_rank, vp_stage=i if len(chunks) > 1 else None)
            for i, c in enumerate(chunks)
        ]
    if len(given) != len(chunks):
        raise ValueError(f"layer_offsets has {len(given)} entries for {len(chunks)} model chunks")
    return list(given)


def _check_scratch(plan: list[_Entry], costs: list[tuple[int, int]], bucket_bytes: int) -> None:
    """The largest conversion scratch (transient minus retained bytes of one tensor) must fit in a bucket."""
    scratch = max(((t - r, e.hf_names[0]) for (t, r), e in zip(costs, plan)), default=(0, ""))
    if scratch[0] > bucket_bytes:
        raise ValueError(
            f"WeightStreamConfig.bucket_bytes={bucket_bytes} is smaller than the conversion scratch of "
            f"{scratch[1]} ({scratch[0]} bytes); raise bucket_bytes to at least {scratch[0]}"
        )


def stream_hf_weights(
    model,
    mapping: WeightMapping,
    *,
    tp_group=None,
    pp_group=None,
    layer_offsets: Sequence[int] | None = None,
    config: WeightStreamConfig | None = None,
    stats: StreamStats | None = None,
    etp_group=None,
    ep_group=None,
) -> Iterator[Bucket]:
    """Yield buckets of ``(hf_name, full tensor)`` covering every HF tensor of the model exactly once.

    ``model``: this rank's megatron module or list of virtual-pipeline chunks (wrappers like Float16Module are fine).
    ``tp_group`` / ``pp_group``: the trainer's tensor / pipeline parallel groups (None = size 1). Collective over
    both: every rank of the world must consume the generator to the end. ``layer_offsets``: global index of each
    chunk's first decoder layer (default: megatron's rule for this pipeline rank and virtual stage).
    Tensors are on the parameters' device, in their dtype; they may alias the trainer's parameters (copy, do not
    modify). Drop each bucket before asking for the next (the memory bound relies on it).
    ``etp_group`` / ``ep_group``: the expert-tensor-parallel and expert-parallel groups of a mixture-of-experts model
    (None = size 1); collective over them as well.
    """
    config = config or WeightStreamConfig()
    stats = stats if stats is not None else StreamStats()
    t_start = time.perf_counter()
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    layer_offsets = _layer_offsets(chunks, pp_group, layer_offsets)
    device = next(chunks[0].parameters()).device
    experts = ExpertLayout(
        ep_rank=_group_rank(ep_group),
        ep_size=_group_size(ep_group),
        etp_rank=_group_rank(etp_group),
        etp_size=_group_size(etp_group),
    )
    plan = _plan(chunks, layer_offsets, mapping, tp_group, pp_group, experts)
    asm = _Assembler(
        tp_group,
        pp_group,
        stats.meter,
        device,
        etp_group=etp_group,
        ep_group=ep_group,
        merge_adapters=config.adapters == "merged",
    )
    costs = [asm.transient_and_retained(e) for e in plan]
    _check_scratch(plan, costs, config.bucket_bytes)
    stats.largest_tensor_bytes = max((e.full_bytes for e in plan), default=0)
    stats.seconds += time.perf_counter() - t_start

    bucket: Bucket = []
    held = 0
    for e, (transient, retained) in zip(plan, costs):
        t0 = time.perf_counter()
        if bucket and held + transient > config.bucket_bytes:
            stats.buckets += 1
            stats.seconds += time.perf_counter() - t0
            yield bucket
            t0 = time.perf_counter()
            bucket, held = [], 0  # rebinding drops the stream's reference to the consumed bucket
        tensors = asm.assemble(e)
        for n, t in zip(e.hf_names, tensors):
            bucket.append((n, t))
            stats.tensors += 1
            stats.bytes += t.numel() * t.element_size()
        del tensors
        held += retained
        stats.seconds += time.perf_counter() - t0
    if bucket:
        stats.buckets += 1
        yield bucket
        bucket = []
    stats.meter.track()  # final sample


def megatron_weight_stream(model, args, *, pg_collection, config: WeightStreamConfig | None = None, stats=None):
    """``stream_hf_weights`` over the trainer's process groups (a megatron ProcessGroupCollection: its ``tp`` and
    ``pp`` groups) with the model args' dims (trainer glue)."""
    return stream_hf_weights(
        model,
        WeightMapping(args.dims),
        tp_group=pg_collection.tp,
        pp_group=pg_collection.pp,
        config=config,
        stats=stats,
        etp_group=getattr(pg_collection, "expt_tp", None),
        ep_group=getattr(pg_collection, "ep", None),
    )
