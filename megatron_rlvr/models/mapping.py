"""THE weight-mapping definition between megatron-core GPTModel parameters and Hugging Face checkpoints.

One table (``RULES``) lists every parameter of a dense GPT decoder (Llama / Qwen2 / Qwen3 families): its megatron name
pattern, the HF name pattern(s) it corresponds to, how it is split over tensor parallelism, and which layout transform
turns the megatron tensor into the HF tensor(s) and back. Loading (``loading.py``), export (``export.py``) and the
weight stream into rollout engines all use this table and nothing else, so there is exactly one place that knows
"QKV is interleaved per query group" or "gate and up are fused into linear_fc1".

API (for a third party holding megatron parameter shards)
----------------------------------------------------------
    dims = ModelDims(...)                      # or models.hf_config.model_dims(hf_config, tp_size=...)
    mapping = WeightMapping(dims)
    for name, shard in model.named_parameters():          # any wrapper prefix ("module.") is ignored
        p = mapping.resolve(name, layer_offset=offset)    # offset = global index of this PP stage's first layer
        p.hf_names        # tuple of HF tensor names, global layer index filled in
        p.tp_dim          # 0 / 1: the dim the TP shards are concatenated along; None: replicated over TP
        p.global_layer    # int for decoder-layer params, None otherwise
        p.skip_on_export  # True for the last stage's copy of a tied embedding (HF stores it once)
        full = gather_tp(shards_from_all_tp_ranks, p.tp_dim)      # torch.cat(shards, dim=tp_dim)
        hf = p.to_hf(full, tp_size)           # {hf_name: tensor}, HF layout, vocab padding removed
        full_again = p.from_hf(hf, tp_size)   # inverse: bit-identical to `full`
        shard_again = split_tp(full_again, p.tp_dim, tp_size)[tp_rank]

"FULL megatron tensor" always means the plain concatenation of the TP shards along ``tp_dim`` (what an all-gather
gives). For every kind except ``gated_fc1`` that equals megatron's logical tensor; for ``linear_fc1`` of a SwiGLU MLP
each TP rank holds ``[gate_r; up_r]``, so the concatenation is ``[gate_0; up_0; gate_1; up_1; ...]`` and the
transform needs ``tp_size`` to undo it (every transform takes ``tp_size`` for that reason).

``read_local_shard(p, reader, tp_rank, tp_size)`` builds ONE rank's shard directly from an HF checkpoint while reading
only the rows/columns that rank owns (``reader(hf_name)`` returns a safetensors ``PySafeSlice`` or anything with
``get_shape()`` and ``[...]`` slicing), which is how ``loading.py`` avoids materialising the full model per rank.

Layouts (megatron-core 0.16, ``SelfAttention.get_query_key_value_tensors``)
----------------------------------------------------------------------------
- QKV: ``linear_qkv.weight`` is ``[ng * (q_per_group + 2) * d, H]``: for each query group g (= KV head g), the
  ``q_per_group`` query heads of that group, then key head g, then value head g. TP splits whole groups.
- SwiGLU: ``linear_fc1.weight`` is ``[2 * F / tp, H]`` per rank = ``[gate rows of rank r; up rows of rank r]``
  (megatron's ``glu`` does ``chunk(2, dim=-1)`` on each rank's local output).
- Vocab: embedding and output layer have ``padded_vocab_size`` rows; rows past the HF ``vocab_size`` are padding
  (zeros when loaded from HF, dropped on export). Logits past ``vocab_size`` are NOT -inf: callers computing
  log-probs over the padded vocabulary must mask them.
- Tied embeddings: HF stores only ``model.embed_tokens.weight``. Megatron with PP > 1 keeps a copy as
  ``output_layer.weight`` on the last stage (synchronised by megatron's embedding group); its rule maps to the same
  HF name with ``skip_on_export=True``.
- Multi-latent attention (DeepSeek): the down projections (``q_a_proj``, ``kv_a_proj_with_mqa``) are whole on every
  TP rank, the up projections (``q_b_proj`` / ``q_proj``, ``kv_b_proj``) split by heads, all in transformers' row
  order; the router's ``e_score_correction_bias`` is megatron's ``router.expert_bias`` buffer (``mapped_tensors``).
- GPT-OSS: the sinks are ``core_attention.softmax_offset`` (split over TP by heads); the experts are stored fused
  over experts with gate and up interleaved (``InterleavedExpertFC1``); the table names one expert's slice
  (``fused_expert_name``), loading reads only that slice (or its MXFP4 blocks, dequantised), and export stacks the
  slices back (``stack_fused_experts``).
- Norm weights: megatron's local (torch) spec names them ``input_layernorm`` / ``pre_mlp_layernorm``; the
  Transformer-Engine spec fuses them into the next linear (``linear_qkv.layer_norm_weight`` /
  ``linear_fc1.layer_norm_weight``). Both names resolve to the same rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

# --------------------------------------------------------------------------------------------------------------------
# Model dimensions the transforms need
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelDims:
    """The shapes of a dense GPT decoder, in HF terms plus megatron's padded vocabulary."""

    num_layers: int
    """Total number of decoder layers (all pipeline stages together)."""
    hidden_size: int
    """Model width H."""
    num_attention_heads: int
    """Number of query heads."""
    num_query_groups: int
    """Number of key/value heads (GQA groups); equals num_attention_heads for MHA."""
    head_dim: int
    """Per-head dimension d (megatron's kv_channels); may differ from hidden_size / num_attention_heads (Qwen3)."""
    ffn_hidden_size: int
    """MLP intermediate size F (per gate/up projection)."""
    vocab_size: int
    """True vocabulary size of the HF checkpoint (rows of embed_tokens / lm_head)."""
    padded_vocab_size: int
    """Rows of megatron's embedding / output layer: vocab_size rounded up to a multiple of the padding multiple."""
    tie_word_embeddings: bool = False
    """HF stores one matrix for input embedding and LM head."""
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    qk_layernorm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    moe_ffn_hidden_size: int = 0
    """Inner width of one routed expert."""
    shared_expert_ffn: int = 0
    """Inner width of the shared expert of each MoE layer (Qwen2-MoE; DeepSeek's shared experts as one); 0: none."""
    shared_expert_gate: bool = True
    """The shared expert has a sigmoid gate and HF names it ``mlp.shared_expert`` (Qwen2-MoE); False: no gate,
    ``mlp.shared_experts`` (DeepSeek)."""
    expert_bias: bool = False
    """Each router has a score-correction bias (DeepSeek-V3's ``e_score_correction_bias``, megatron's
    ``router.expert_bias`` buffer)."""
    gpt_oss: bool = False
    """GPT-OSS's layout: attention sinks (``self_attn.sinks``, megatron's ``core_attention.softmax_offset``), an
    o_proj bias, the router as ``mlp.router`` with a bias, and the experts stored fused over experts
    (``mlp.experts.gate_up_proj`` [E, H, 2F] with gate and up interleaved in the last dim, ``down_proj`` [E, F, H],
    and their biases); the table names one expert's slice ``mlp.experts.{e}.gate_up_proj`` etc.
    (``fused_expert_name``)."""
    mla: bool = False
    """Multi-latent attention (DeepSeek): the five fields below describe it; there is no fused QKV projection."""
    q_lora_rank: int = 0
    """MLA: rank of the query's low-rank projection; 0: a full query projection (``q_proj``)."""
    kv_lora_rank: int = 0
    """MLA: width of the compressed key/value latent."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without RoPE."""
    qk_rope_head_dim: int = 0
    """MLA: per-head RoPE width (queries) and width of the one shared RoPE key."""
    v_head_dim: int = 0
    """MLA: per-head value width."""
    moe_layers: tuple[bool, ...] = ()
    """Per global layer: True for an MoE MLP, False for a dense one (empty: every layer dense)."""
    hf_lm_prefix: str = "model."
    """Prefix of the language model's HF tensors (the table's ``model.``); vision-language checkpoints may nest it
    (Qwen3-VL: ``model.language_model.``)."""
    vision_prefix: str = ""
    """Prefix of the vision tower's HF tensors (``visual.`` / ``model.visual.``); empty: no tower."""
    vision_names: tuple[str, ...] = ()
    """The vision tower's parameter names (relative to the tower); megatron holds them as ``visual.<name>``,
    replicated over TP, and HF as ``<vision_prefix><name>``."""

    def __post_init__(self):
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "ffn_hidden_size",
            "vocab_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelDims.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"ModelDims: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"ModelDims: padded_vocab_size={self.padded_vocab_size} < vocab_size={self.vocab_size}")
        if self.moe_layers and len(self.moe_layers) != self.num_layers:
            raise ValueError(f"ModelDims: moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if any(self.moe_layers) and (self.num_experts <= 0 or self.moe_ffn_hidden_size <= 0):
            raise ValueError("ModelDims: MoE layers need num_experts > 0 and moe_ffn_hidden_size > 0")
        if self.mla and min(self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) <= 0:
            raise ValueError("ModelDims: multi-latent attention needs positive kv_lora_rank and head dims")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` has an MoE MLP."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def queries_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def check_tp(self, tp_size: int) -> None:
        """ValueError unless ``tp_size`` divides everything TP splits."""
        if tp_size <= 0:
            raise ValueError(f"tensor parallel size must be positive, got {tp_size}")
        checks = {
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups (num_key_value_heads)": self.num_query_groups,
            "ffn_hidden_size (intermediate_size)": self.ffn_hidden_size,
            "padded_vocab_size": self.padded_vocab_size,
        }
        if self.shared_expert_ffn:
            checks["shared_expert_intermediate_size"] = self.shared_expert_ffn
        for what, n in checks.items():
            if n % tp_size:
                raise ValueError(f"tensor parallel size {tp_size} does not divide {what}={n}")

    def check_ep(self, ep_size: int, etp_size: int) -> None:
        """ValueError unless expert parallelism ``ep_size`` divides the experts and expert tensor parallelism
        ``etp_size`` divides each expert's inner width."""
        for what, n in (("expert parallel size", ep_size), ("expert tensor parallel size", etp_size)):
            if not isinstance(n, int) or n <= 0:
                raise ValueError(f"{what} must be a positive int, got {n!r}")
        if not self.is_moe:
            if ep_size > 1 or etp_size > 1:
                raise ValueError("expert parallelism needs a mixture-of-experts model")
            return
        if self.num_experts % ep_size:
            raise ValueError(f"expert parallel size {ep_size} does not divide num_experts={self.num_experts}")
        if self.moe_ffn_hidden_size % etp_size:
            raise ValueError(
                f"expert tensor parallel size {etp_size} does not divide "
                f"moe_intermediate_size={self.moe_ffn_hidden_size}"
            )


# --------------------------------------------------------------------------------------------------------------------
# Layout transforms: one small class per kind, selected through the TRANSFORMS registry
# --------------------------------------------------------------------------------------------------------------------


class SliceReader(Protocol):
    """What ``read_local_shard`` needs from a checkpoint tensor: safetensors' ``PySafeSlice`` satisfies it."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, idx: Any) -> torch.Tensor: ...


def _read_range(reader: SliceReader, dim: int, start: int, stop: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a checkpoint tensor; only those bytes are read."""
    if dim == 0:
        return reader[start:stop]
    if dim == 1:
        return reader[:, start:stop]
    raise ValueError(f"unsupported slice dim {dim}")


def _read_all(reader: SliceReader) -> torch.Tensor:
    return reader[:]


class Transform:
    """Layout transform between the FULL megatron tensor (TP shards concatenated along ``tp_dim``) and HF tensors.

    ``to_hf(full, dims, tp_size) -> list[Tensor]`` (ordered like the rule's ``hf`` names),
    ``from_hf(tensors, dims, tp_size) -> Tensor`` (the inverse), and
    ``read_shard(readers, dims, tp_rank, tp_size) -> Tensor`` (one rank's shard, reading only what it owns).
    """

    tp_dim: int | None = None

    def to_hf(self, full: torch.Tensor, dims: ModelDims, tp_size: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def from_hf(self, tensors: Sequence[torch.Tensor], dims: ModelDims, tp_size: int) -> torch.Tensor:
        raise NotImplementedError

    def read_shard(self, readers: Sequence[SliceReader], dims: ModelDims, tp_rank: int, tp_size: int) -> torch.Tensor:
        raise NotImplementedError


class Replicated(Transform):
    """Same tensor on every TP rank and in HF (norm weights)."""

    tp_dim = None

    def to_hf(self, full, dims, tp_size):
        return [full]

    def from_hf(self, tensors, dims, tp_size):
        (t,) = tensors
        return t

    def read_shard(self, readers, dims, tp_rank, tp_size):
        (r,) = readers
        return _read_all(r)


class Split(Transform):
    """Identity layout, split over TP along ``tp_dim`` (0: column-parallel outputs, 1: row-parallel inputs)."""

    def __init__(self, tp_dim: int):
        self.tp_dim = tp_dim

    def to_hf(self, full, dims, tp_size):
        return [full]

    def from_hf(self, tensors, dims, tp_size):
        (t,) = tensors
        return t

    def read_shard(self, readers, dims, tp_rank, tp_size):
        (r,) = readers
        n = r.get_shape()[self.tp_dim]
        if n % tp_size:
            raise ValueError(f"tensor parallel size {tp_size} does not divide dim {self.tp_dim} of size {n}")
        step = n // tp_size
        return _read_range(r, self.tp_dim, tp_rank * step, (tp_rank + 1) * step)


class VocabRows(Transform):
    """Embedding / LM head: megatron has ``padded_vocab_size`` rows split over TP, HF has ``vocab_size`` rows."""

    tp_dim = 0

    def to_hf(self, full, dims, tp_size):
        if full.shape[0] != dims.padded_vocab_size:
            raise ValueError(f"vocab tensor has {full.shape[0]} rows, expected {dims.padded_vocab_size}")
        return [full[: dims.vocab_size]]

    def from_hf(self, tensors, dims, tp_size):
        (t,) = tensors
        if t.shape[0] != dims.vocab_size:
            raise ValueError(f"HF vocab tensor has {t.shape[0]} rows, expected vocab_size={dims.vocab_size}")
        pad = t.new_zeros((dims.padded_vocab_size - dims.vocab_size, *t.shape[1:]))
        return torch.cat([t, pad], dim=0)

    def read_shard(self, readers, dims, tp_rank, tp_size):
        (r,) = readers
        rows = r.get_shape()[0]
        if rows != dims.vocab_size:
            raise ValueError(f"HF vocab tensor has {rows} rows, expected vocab_size={dims.vocab_size}")
        step = dims.padded_vocab_size // tp_size
        start, stop = tp_rank * step, (tp_rank + 1) * step
        real = _read_range(r, 0, min(start, rows), min(stop, rows))
        pad = real.new_zeros((stop - start - real.shape[0], *real.shape[1:]))
        return torch.cat([real, pad], dim=0) if pad.shape[0] else real


class FusedQKV(Transform):
    """``linear_qkv`` (weight or bias) <-> HF ``q_proj``, ``k_proj``, ``v_proj``.

    Megatron rows, per query group g: ``[q heads g*qpg .. (g+1)*qpg-1 | k head g | v head g]``, each head ``d`` rows.
    TP splits whole groups, so the concatenated shards are already the global layout (independent of tp_size).
    """

    tp_dim = 0

    @staticmethod
    def _fuse(q, k, v, ng: int, dims: ModelDims) -> torch.Tensor:
        d, qpg = dims.head_dim, dims.queries_per_group
        rest = q.shape[1:]
        q = q.reshape(ng, qpg * d, *rest)
        k = k.reshape(ng, d, *rest)
        v = v.reshape(ng, d, *rest)
        return torch.cat([q, k, v], dim=1).reshape(ng * (qpg + 2) * d, *rest)

    def to_hf(self, full, dims, tp_size):
        d, qpg, ng = dims.head_dim, dims.queries_per_group, dims.num_query_groups
        if full.shape[0] != ng * (qpg + 2) * d:
            raise ValueError(f"linear_qkv has {full.shape[0]} rows, expected {ng * (qpg + 2) * d}")
        rest = full.shape[1:]
        grouped = full.reshape(ng, (qpg + 2) * d, *rest)
        q, k, v = torch.split(grouped, [qpg * d, d, d], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]

    def from_hf(self, tensors, dims, tp_size):
        q, k, v = tensors
        return self._fuse(q, k, v, dims.num_query_groups, dims)

    def read_shard(self, readers, dims, tp_rank, tp_size):
        rq, rk, rv = readers
        d, qpg = dims.head_dim, dims.queries_per_group
        ng_local = dims.num_query_groups // tp_size
        g0 = tp_rank * ng_local
        q = _read_range(rq, 0, g0 * qpg * d, (g0 + ng_local) * qpg * d)
        k = _read_range(rk, 0, g0 * d, (g0 + ng_local) * d)
        v = _read_range(rv, 0, g0 * d, (g0 + ng_local) * d)
        return self._fuse(q, k, v, ng_local, dims)


class GatedFC1(Transform):
    """SwiGLU ``linear_fc1`` <-> HF ``gate_proj``, ``up_proj``. Each TP rank holds ``[gate_r; up_r]`` (F/tp rows each),
    so the concatenated shards are ``[gate_0; up_0; gate_1; up_1; ...]``. ``ffn_field`` names the ModelDims width F
    (the dense MLP's, a routed expert's, or the shared expert's); for experts "TP" is the expert-TP group."""

    tp_dim = 0

    def __init__(self, ffn_field: str = "ffn_hidden_size"):
        self.ffn_field = ffn_field

    def to_hf(self, full, dims, tp_size):
        f = getattr(dims, self.ffn_field)
        if full.shape[0] != 2 * f:
            raise ValueError(f"linear_fc1 has {full.shape[0]} rows, expected 2 * {self.ffn_field} = {2 * f}")
        rest = full.shape[1:]
        per_rank = full.reshape(tp_size, 2, f // tp_size, *rest)
        gate = per_rank[:, 0].reshape(f, *rest).contiguous()
        up = per_rank[:, 1].reshape(f, *rest).contiguous()
        return [gate, up]

    def from_hf(self, tensors, dims, tp_size):
        gate, up = tensors
        f = getattr(dims, self.ffn_field)
        rest = gate.shape[1:]
        per_rank = torch.stack(
            [gate.reshape(tp_size, f // tp_size, *rest), up.reshape(tp_size, f // tp_size, *rest)], 1
        )
        return per_rank.reshape(2 * f, *rest)

    def read_shard(self, readers, dims, tp_rank, tp_size):
        rg, ru = readers
        step = getattr(dims, self.ffn_field) // tp_size
        gate = _read_range(rg, 0, tp_rank * step, (tp_rank + 1) * step)
        up = _read_range(ru, 0, tp_rank * step, (tp_rank + 1) * step)
        return torch.cat([gate, up], dim=0)


class InterleavedExpertFC1(Transform):
    """GPT-OSS expert ``linear_fc1`` (weight [2F, H] or bias [2F]) <-> one expert's slice of HF ``gate_up_proj``
    ([H, 2F], the transpose) or ``gate_up_proj_bias`` ([2F]), whose gate and up alternate: gate = ``[..., ::2]``,
    up = ``[..., 1::2]``. megatron's GLU chunks each expert-TP rank's output into ``[gate_r; up_r]`` (see
    ``GatedFC1``), so the columns are de-interleaved on the way in. Expert-TP rank r's rows are the contiguous HF
    columns ``2 r F/tp .. 2 (r+1) F/tp``, so a rank reads only those."""

    tp_dim = 0

    def to_hf(self, full, dims, tp_size):
        f = dims.moe_ffn_hidden_size
        if full.shape[0] != 2 * f:
            raise ValueError(f"expert linear_fc1 has {full.shape[0]} rows, expected 2 * moe_ffn_hidden_size = {2 * f}")
        rest = full.shape[1:]
        per_rank = full.reshape(tp_size, 2, f // tp_size, *rest)
        # [tp, F/tp, 2, ...]: gate and up of each inner index side by side
        pairs = per_rank.transpose(1, 2).reshape(2 * f, *rest)
        return [pairs.t().contiguous() if pairs.dim() == 2 else pairs.contiguous()]

    def _deinterleave(self, hf: torch.Tensor, tp_size: int) -> torch.Tensor:
        cols = hf.t() if hf.dim() == 2 else hf  # [2F_local, (H)] in HF's interleaved order
        rest = cols.shape[1:]
        local = cols.shape[0] // 2
        per_rank = cols.reshape(tp_size, local // tp_size, 2, *rest).transpose(1, 2)
        return per_rank.reshape(2 * local, *rest).contiguous()

    def from_hf(self, tensors, dims, tp_size):
        (t,) = tensors
        return self._deinterleave(t, tp_size)

    def read_shard(self, readers, dims, tp_rank, tp_size):
        (r,) = readers
        step = dims.moe_ffn_hidden_size // tp_size
        last = len(r.get_shape()) - 1
        cols = _read_range(r, last, 2 * tp_rank * step, 2 * (tp_rank + 1) * step)
        return self._deinterleave(cols, 1)


class TransposedExpertFC2(Transform):
    """GPT-OSS expert ``linear_fc2.weight`` [H, F] (row-parallel over expert TP) <-> one expert's slice of HF
    ``down_proj`` [F, H] (the transpose)."""

    tp_dim = 1

    def to_hf(self, full, dims, tp_size):
        return [full.t().contiguous()]

    def from_hf(self, tensors, dims, tp_size):
        (t,) = tensors
        return t.t().contiguous()

    def read_shard(self, readers, dims, tp_rank, tp_size):
        (r,) = readers
        step = dims.moe_ffn_hidden_size // tp_size
        return _read_range(r, 0, tp_rank * step, (tp_rank + 1) * step).t().contiguous()


TRANSFORMS: dict[str, Transform] = {
    "replicated": Replicated(),
    "column": Split(0),
    "row": Split(1),
    "vocab": VocabRows(),
    "qkv": FusedQKV(),
    "gated_fc1": GatedFC1(),
    "expert_fc1": GatedFC1("moe_ffn_hidden_size"),
    "shared_fc1": GatedFC1("shared_expert_ffn"),
    "oss_fc1": InterleavedExpertFC1(),
    "oss_fc2": TransposedExpertFC2(),
}
"""Registry of layout kinds used by ``RULES``."""


# --------------------------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One megatron parameter (pattern; ``{layer}`` = decoder layer index) and its HF counterpart(s)."""

    megatron: str
    """Name in megatron-core's local-spec GPTModel (``{layer}`` is the stage-local layer index)."""
    hf: tuple[str, ...]
    """HF tensor name(s); ``{layer}`` is the global layer index. Order matches the transform's tensor order."""
    kind: str
    """Key into TRANSFORMS."""
    aliases: tuple[str, ...] = ()
    """Other megatron names for the same parameter (Transformer-Engine spec)."""
    when: Callable[[ModelDims], bool] = field(default=lambda dims: True)
    """Whether the parameter exists for a model of these dims."""
    skip_on_export: Callable[[ModelDims], bool] = field(default=lambda dims: False)
    """True where HF stores the tensor under another rule (tied LM head)."""
    layers: str = "any"
    """Which decoder layers have the parameter: ``any``, ``dense`` (dense MLP) or ``moe`` (MoE MLP)."""

    @property
    def transform(self) -> Transform:
        return TRANSFORMS[self.kind]

    @property
    def per_expert(self) -> bool:
        """One parameter per routed expert (``{expert}`` in the names): split over the expert-parallel group (whole
        experts) and, inside an expert, over the expert-tensor-parallel group along ``tp_dim``."""
        return "{expert}" in self.megatron


VISION_MODULE = "visual"
"""Attribute of a vision-language GPTModel that holds the HF vision tower (megatron names ``visual.*``)."""

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."

RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule(
        _L + "input_layernorm.weight",
        (_H + "input_layernorm.weight",),
        "replicated",
        aliases=(_L + "self_attention.linear_qkv.layer_norm_weight",),
    ),
    Rule(
        _L + "self_attention.linear_qkv.weight",
        (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
        "qkv",
        when=lambda d: not d.mla,
    ),
    # multi-latent attention (megatron's MLASelfAttention as models/build.py builds it: the down projections whole
    # on every TP rank, the up projections column-parallel by heads). Row layouts are transformers' own:
    # q_b_proj / q_proj per head [nope | rope], kv_a_proj_with_mqa [latent | rope], kv_b_proj per head [nope | v].
    Rule(
        _L + "self_attention.linear_q_down_proj.weight",
        (_H + "self_attn.q_a_proj.weight",),
        "replicated",
        when=lambda d: d.mla and d.q_lora_rank > 0,
    ),
    Rule(
        _L + "self_attention.q_layernorm.weight",
        (_H + "self_attn.q_a_layernorm.weight",),
        "replicated",
        aliases=(_L + "self_attention.linear_q_up_proj.layer_norm_weight",),
        when=lambda d: d.mla and d.q_lora_rank > 0,
    ),
    Rule(
        _L + "self_attention.linear_q_up_proj.weight",
        (_H + "self_attn.q_b_proj.weight",),
        "column",
        when=lambda d: d.mla and d.q_lora_rank > 0,
    ),
    Rule(
        _L + "self_attention.linear_q_proj.weight",
        (_H + "self_attn.q_proj.weight",),
        "column",
        when=lambda d: d.mla and d.q_lora_rank == 0,
    ),
    Rule(
        _L + "self_attention.linear_kv_down_proj.weight",
        (_H + "self_attn.kv_a_proj_with_mqa.weight",),
        "replicated",
        when=lambda d: d.mla,
    ),
    Rule(
        _L + "self_attention.kv_layernorm.weight",
        (_H + "self_attn.kv_a_layernorm.weight",),
        "replicated",
        aliases=(_L + "self_attention.linear_kv_up_proj.layer_norm_weight",),
        when=lambda d: d.mla,
    ),
    Rule(
        _L + "self_attention.linear_kv_up_proj.weight",
        (_H + "self_attn.kv_b_proj.weight",),
        "column",
        when=lambda d: d.mla,
    ),
    Rule(
        _L + "self_attention.linear_qkv.bias",
        (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"),
        "qkv",
        when=lambda d: d.qkv_bias,
    ),
    Rule(
        _L + "self_attention.q_layernorm.weight",
        (_H + "self_attn.q_norm.weight",),
        "replicated",
        when=lambda d: d.qk_layernorm,
    ),
    Rule(
        _L + "self_attention.k_layernorm.weight",
        (_H + "self_attn.k_norm.weight",),
        "replicated",
        when=lambda d: d.qk_layernorm,
    ),
    Rule(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), "row"),
    # GPT-OSS: the o_proj bias (added once after the TP reduction: whole on every rank) and the sinks (per head)
    Rule(
        _L + "self_attention.linear_proj.bias", (_H + "self_attn.o_proj.bias",), "replicated", when=lambda d: d.gpt_oss
    ),
    Rule(
        _L + "self_attention.core_attention.softmax_offset",
        (_H + "self_attn.sinks",),
        "column",
        when=lambda d: d.gpt_oss,
    ),
    Rule(
        _L + "pre_mlp_layernorm.weight",
        (_H + "post_attention_layernorm.weight",),
        "replicated",
        aliases=(_L + "mlp.linear_fc1.layer_norm_weight",),
    ),
    Rule(
        _L + "mlp.linear_fc1.weight",
        (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
        "gated_fc1",
        layers="dense",
    ),
    Rule(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), "row", layers="dense"),
    # mixture of experts: router, routed experts (local index in megatron, global index in HF), shared expert
    Rule(_L + "mlp.router.weight", (_H + "mlp.gate.weight",), "replicated", when=lambda d: not d.gpt_oss, layers="moe"),
    # a buffer in megatron (not trained by gradient), kept in fp32 by both (see FP32_HF_TENSORS)
    Rule(
        _L + "mlp.router.expert_bias",
        (_H + "mlp.gate.e_score_correction_bias",),
        "replicated",
        when=lambda d: d.expert_bias,
        layers="moe",
    ),
    Rule(
        _L + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
        (_H + "mlp.experts.{expert}.gate_proj.weight", _H + "mlp.experts.{expert}.up_proj.weight"),
        "expert_fc1",
        aliases=(_L + "mlp.experts.linear_fc1.weight{expert}",),  # Transformer Engine's grouped GEMM experts
        when=lambda d: not d.gpt_oss,
        layers="moe",
    ),
    Rule(
        _L + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
        (_H + "mlp.experts.{expert}.down_proj.weight",),
        "row",
        aliases=(_L + "mlp.experts.linear_fc2.weight{expert}",),
        when=lambda d: not d.gpt_oss,
        layers="moe",
    ),
    # GPT-OSS: router with a bias; each expert's slice of the fused tensors (see fused_expert_name)
    Rule(_L + "mlp.router.weight", (_H + "mlp.router.weight",), "replicated", when=lambda d: d.gpt_oss, layers="moe"),
    Rule(_L + "mlp.router.bias", (_H + "mlp.router.bias",), "replicated", when=lambda d: d.gpt_oss, layers="moe"),
    Rule(
        _L + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
        (_H + "mlp.experts.{expert}.gate_up_proj",),
        "oss_fc1",
        aliases=(_L + "mlp.experts.linear_fc1.weight{expert}",),
        when=lambda d: d.gpt_oss,
        layers="moe",
    ),
    Rule(
        _L + "mlp.experts.local_experts.{expert}.linear_fc1.bias",
        (_H + "mlp.experts.{expert}.gate_up_proj_bias",),
        "oss_fc1",
        aliases=(_L + "mlp.experts.linear_fc1.bias{expert}",),
        when=lambda d: d.gpt_oss,
        layers="moe",
    ),
    Rule(
        _L + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
        (_H + "mlp.experts.{expert}.down_proj",),
        "oss_fc2",
        aliases=(_L + "mlp.experts.linear_fc2.weight{expert}",),
        when=lambda d: d.gpt_oss,
        layers="moe",
    ),
    Rule(
        _L + "mlp.experts.local_experts.{expert}.linear_fc2.bias",
        (_H + "mlp.experts.{expert}.down_proj_bias",),
        "replicated",
        aliases=(_L + "mlp.experts.linear_fc2.bias{expert}",),
        when=lambda d: d.gpt_oss,
        layers="moe",
    ),
    Rule(
        _L + "mlp.shared_experts.linear_fc1.weight",
        (_H + "mlp.shared_expert.gate_proj.weight", _H + "mlp.shared_expert.up_proj.weight"),
        "shared_fc1",
        when=lambda d: d.shared_expert_ffn > 0 and d.shared_expert_gate,
        layers="moe",
    ),
    Rule(
        _L + "mlp.shared_experts.linear_fc2.weight",
        (_H + "mlp.shared_expert.down_proj.weight",),
        "row",
        when=lambda d: d.shared_expert_ffn > 0 and d.shared_expert_gate,
        layers="moe",
    ),
    Rule(
        _L + "mlp.shared_experts.gate_weight",
        (_H + "mlp.shared_expert_gate.weight",),
        "replicated",
        when=lambda d: d.shared_expert_ffn > 0 and d.shared_expert_gate,
        layers="moe",
    ),
    # DeepSeek: the n_shared_experts shared experts are one MLP of width n_shared_experts * moe_intermediate_size
    Rule(
        _L + "mlp.shared_experts.linear_fc1.weight",
        (_H + "mlp.shared_experts.gate_proj.weight", _H + "mlp.shared_experts.up_proj.weight"),
        "shared_fc1",
        when=lambda d: d.shared_expert_ffn > 0 and not d.shared_expert_gate,
        layers="moe",
    ),
    Rule(
        _L + "mlp.shared_experts.linear_fc2.weight",
        (_H + "mlp.shared_experts.down_proj.weight",),
        "row",
        when=lambda d: d.shared_expert_ffn > 0 and not d.shared_expert_gate,
        layers="moe",
    ),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab", when=lambda d: not d.tie_word_embeddings),
    Rule(
        "output_layer.weight",
        ("model.embed_tokens.weight",),
        "vocab",
        when=lambda d: d.tie_word_embeddings,
        skip_on_export=lambda d: True,
    ),
)
"""Every parameter (and the router's expert-bias buffer) of a Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE /
DeepSeek-V3 GPTModel. Family differences are the ``when`` conditions; which MLP a layer has is ``layers``."""

FP32_HF_TENSORS = ("e_score_correction_bias",)
"""HF tensor names ending so are stored in fp32 whatever the checkpoint's dtype (transformers keeps DeepSeek-V3's
router bias in fp32: a bf16 copy would move which experts are chosen)."""

MAPPED_BUFFERS = ("mlp.router.expert_bias",)
"""Megatron buffers (not parameters) that a checkpoint holds: their names end so."""


def mapped_tensors(model):
    """``(name, tensor)`` of every parameter of ``model`` and the buffers a checkpoint holds (``MAPPED_BUFFERS``):
    what loading, export and the weight stream walk."""
    yield from model.named_parameters()
    for name, buf in model.named_buffers():
        if buf is not None and name.endswith(MAPPED_BUFFERS):
            yield name, buf


def mtp_tensor_names(names, num_layers: int) -> list[str]:
    """The tensors of a checkpoint's multi-token-prediction layers (DeepSeek-V3 and GLM-4.5 store them as decoder layers
    ``num_hidden_layers ..``; ``num_nextn_predict_layers`` of them): not part of the causal LM."""
    out = []
    for n in names:
        m = re.match(r"^model\.layers\.(\d+)\.", n)
        if m and int(m.group(1)) >= num_layers:
            out.append(n)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Resolution of concrete names
# --------------------------------------------------------------------------------------------------------------------


def _compile(pattern: str) -> re.Pattern:
    out = re.escape(pattern).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
    return re.compile("^" + out.replace(re.escape("{expert}"), r"(?P<expert>\d+)") + "$")


_WRAPPER_PREFIX = re.compile(r"^(module\.)+")


def strip_wrappers(name: str) -> str:
    """Drop the ``module.`` prefixes added by Float16Module / DistributedDataParallel."""
    return _WRAPPER_PREFIX.sub("", name)


@dataclass(frozen=True)
class ResolvedParam:
    """One concrete megatron parameter resolved against the table."""

    megatron_name: str
    """Canonical (local-spec, stage-local layer index, no wrapper prefix) megatron name."""
    hf_names: tuple[str, ...]
    """HF tensor names with the global layer index filled in."""
    global_layer: int | None
    """Global decoder layer index, None for embedding / final norm / output layer."""
    rule: Rule
    dims: ModelDims
    expert: int | None = None
    """Global index of the routed expert (local index + the expert-parallel rank's first expert); None otherwise."""

    @property
    def tp_dim(self) -> int | None:
        """Dim along which TP shards are concatenated; None when replicated over TP. For a routed expert's
        parameter the shards are those of the expert-tensor-parallel group (see ``per_expert``)."""
        return self.rule.transform.tp_dim

    @property
    def per_expert(self) -> bool:
        """A routed expert's parameter: its "TP" group is expert-TP, and expert-parallel ranks hold other experts."""
        return self.rule.per_expert

    @property
    def skip_on_export(self) -> bool:
        return self.rule.skip_on_export(self.dims)

    def to_hf(self, full: torch.Tensor, tp_size: int) -> dict[str, torch.Tensor]:
        """FULL megatron tensor (TP shards concatenated along tp_dim) -> {hf_name: tensor}."""
        tensors = self.rule.transform.to_hf(full, self.dims, tp_size)
        return dict(zip(self.hf_names, tensors, strict=True))

    def from_hf(self, hf: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], tp_size: int) -> torch.Tensor:
        """{hf_name: tensor} (or tensors in ``hf_names`` order) -> FULL megatron tensor."""
        tensors = [hf[n] for n in self.hf_names] if isinstance(hf, Mapping) else list(hf)
        return self.rule.transform.from_hf(tensors, self.dims, tp_size)

    def shard(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This TP rank's piece of the FULL megatron tensor."""
        return split_tp(full, self.tp_dim, tp_size)[tp_rank]


class WeightMapping:
    """The table instantiated for one model's dims. See the module docstring for the API."""

    def __init__(self, dims: ModelDims):
        self.dims = dims
        self.rules = tuple(r for r in RULES if r.when(dims))
        self._vision = frozenset(dims.vision_names)
        self._patterns: list[tuple[re.Pattern, Rule]] = []
        for r in self.rules:
            for name in (r.megatron, *r.aliases):
                self._patterns.append((_compile(name), r))

    def resolve(self, megatron_name: str, layer_offset: int = 0, expert_offset: int = 0) -> ResolvedParam:
        """Resolve a megatron parameter name (stage-local layer index; wrapper prefixes allowed).

        ``layer_offset`` is the global index of this pipeline stage's first decoder layer
        (``megatron.core.transformer.transformer_layer.get_transformer_layer_offset``; see ``layer_offset()``).
        ``expert_offset`` is the global index of this expert-parallel rank's first routed expert
        (``ep_rank * num_experts // ep_size``); megatron names local experts 0..num_experts/ep - 1.
        """
        name = strip_wrappers(megatron_name)
        for pat, rule in self._patterns:
            m = pat.match(name)
            if m is None:
                continue
            layer = None
            if "layer" in pat.groupindex:
                layer = int(m.group("layer")) + layer_offset
                if not 0 <= layer < self.dims.num_layers:
                    raise ValueError(
                        f"{megatron_name}: global layer {layer} (local + offset {layer_offset}) is outside "
                        f"0..{self.dims.num_layers - 1}"
                    )
                if rule.layers != "any" and (rule.layers == "moe") != self.dims.is_moe_layer(layer):
                    continue
            expert = local = None
            if "expert" in pat.groupindex:
                local = int(m.group("expert"))
                expert = local + expert_offset
                if not 0 <= expert < self.dims.num_experts:
                    raise ValueError(
                        f"{megatron_name}: global expert {expert} (local + offset {expert_offset}) is outside "
                        f"0..{self.dims.num_experts - 1}"
                    )
            fill = {"layer": m.group("layer") if layer is not None else None, "expert": local}
            canonical = rule.megatron.format(**fill) if layer is not None else rule.megatron
            hf_names = tuple(self._lm_name(h.format(layer=layer, expert=expert)) for h in rule.hf)
            return ResolvedParam(canonical, hf_names, layer, rule, self.dims, expert)
        if name.startswith(VISION_MODULE + ".") and name[len(VISION_MODULE) + 1 :] in self._vision:
            rel = name[len(VISION_MODULE) + 1 :]
            rule = Rule(name, (self.dims.vision_prefix + rel,), "replicated")
            return ResolvedParam(name, rule.hf, None, rule, self.dims)
        raise KeyError(
            f"megatron parameter {megatron_name!r} has no HF mapping (model dims: qkv_bias={self.dims.qkv_bias}, "
            f"qk_layernorm={self.dims.qk_layernorm}, tie_word_embeddings={self.dims.tie_word_embeddings}, "
            f"moe_layers={self.dims.moe_layers})"
        )

    def _lm_name(self, hf_name: str) -> str:
        """The table's HF name (``model.*`` / ``lm_head.*``) under the checkpoint's language-model prefix."""
        if self.dims.hf_lm_prefix != "model." and hf_name.startswith("model."):
            return self.dims.hf_lm_prefix + hf_name[len("model.") :]
        return hf_name

    def hf_names(self) -> list[str]:
        """Every HF tensor name a checkpoint of this model holds (tied LM head counted once)."""
        out: list[str] = []
        for p in self.all_params():
            if not p.skip_on_export:
                out.extend(p.hf_names)
        return out

    def all_params(self) -> list[ResolvedParam]:
        """Every parameter of the unsplit (PP=1) model, with global layer indices."""
        layer_rules = [r for r in self.rules if "{layer}" in r.megatron]
        # tied copy: exists only on a PP>1 last stage, it is not a separate tensor of the model
        other = [r for r in self.rules if "{layer}" not in r.megatron and not r.skip_on_export(self.dims)]
        out = [self.resolve(f"{VISION_MODULE}.{n}") for n in self.dims.vision_names]
        out += [self.resolve(r.megatron) for r in other if r.megatron.startswith("embedding.")]
        for i in range(self.dims.num_layers):  # HF's order: layer by layer
            kind = "moe" if self.dims.is_moe_layer(i) else "dense"
            for r in layer_rules:
                if r.layers not in ("any", kind):
                    continue
                experts = range(self.dims.num_experts) if r.per_expert else [None]
                out.extend(self.resolve(r.megatron.format(layer=i, expert=e)) for e in experts)
        out.extend(self.resolve(r.megatron) for r in other if not r.megatron.startswith("embedding."))
        return out


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------


def gather_tp(shards: Sequence[torch.Tensor], tp_dim: int | None) -> torch.Tensor:
    """FULL megatron tensor from the per-TP-rank shards (in TP rank order). Replicated params: the first shard."""
    if tp_dim is None:
        return shards[0]
    return torch.cat(list(shards), dim=tp_dim)


def split_tp(full: torch.Tensor, tp_dim: int | None, tp_size: int) -> list[torch.Tensor]:
    """Inverse of ``gather_tp``: contiguous per-rank shards (replicated params: the same tensor for every rank)."""
    if tp_dim is None:
        return [full] * tp_size
    if full.shape[tp_dim] % tp_size:
        raise ValueError(f"tensor parallel size {tp_size} does not divide dim {tp_dim} of shape {tuple(full.shape)}")
    return [t.contiguous() for t in torch.chunk(full, tp_size, dim=tp_dim)]


def read_local_shard(
    param: ResolvedParam, reader: Callable[[str], SliceReader], tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This rank's shard of ``param`` read from an HF checkpoint, touching only the rows/columns the rank owns. For a
    routed expert's parameter ``tp_rank`` / ``tp_size`` are the expert-tensor-parallel rank and size."""
    if param.per_expert:
        param.dims.check_ep(1, tp_size)
    else:
        param.dims.check_tp(tp_size)
    readers = [reader(n) for n in param.hf_names]
    return param.rule.transform.read_shard(readers, param.dims, tp_rank, tp_size)


class TensorSlice:
    """Adapts an in-memory tensor to the ``SliceReader`` protocol (tests, in-memory state dicts)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, idx) -> torch.Tensor:
        return self.tensor[idx]


# --------------------------------------------------------------------------------------------------------------------
# Mixture of experts: where a rank's experts are, and transformers 5's fused in-memory expert tensors
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertLayout:
    """This rank's place in the expert-parallel (EP) and expert-tensor-parallel (ETP) groups. EP rank r holds the
    routed experts ``r * E/ep .. (r+1) * E/ep - 1`` (megatron's local indices 0..E/ep-1); ETP splits each expert's
    inner width like TP splits a dense MLP."""

    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    def expert_offset(self, dims: ModelDims, ep_rank: int | None = None) -> int:
        """Global index of the first routed expert of EP rank ``ep_rank`` (default: this rank)."""
        r = self.ep_rank if ep_rank is None else ep_rank
        return r * (dims.num_experts // self.ep_size) if dims.num_experts else 0

    @classmethod
    def of(cls, pg_collection) -> ExpertLayout:
        """From a megatron ProcessGroupCollection (its ``ep`` and ``expt_tp`` groups; size 1 when absent)."""
        ep, etp = getattr(pg_collection, "ep", None), getattr(pg_collection, "expt_tp", None)
        return cls(
            ep_rank=ep.rank() if ep is not None else 0,
            ep_size=ep.size() if ep is not None else 1,
            etp_rank=etp.rank() if etp is not None else 0,
            etp_size=etp.size() if etp is not None else 1,
        )


_PER_EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class _ExpertOfFused:
    """One expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` as a view of transformers 5's fused tensor
    (``gate_up_proj`` [E, 2I, H] with rows [gate; up], ``down_proj`` [E, H, I]), reading only what is sliced."""

    def __init__(self, fused: SliceReader, expert: int, rows: tuple[int, int] | None):
        self.fused, self.expert, self.rows = fused, expert, rows

    def get_shape(self) -> list[int]:
        shape = list(self.fused.get_shape()[1:])
        if self.rows is not None:
            shape[0] = self.rows[1] - self.rows[0]
        return shape

    def __getitem__(self, idx) -> torch.Tensor:
        idx = idx if isinstance(idx, tuple) else (idx,)
        first = idx[0]
        if self.rows is not None:
            start, stop, _ = first.indices(self.rows[1] - self.rows[0])
            first = slice(self.rows[0] + start, self.rows[0] + stop)
        return self.fused[(self.expert, first, *idx[1:])]


_OSS_EXPERT = re.compile(
    r"^(?P<pre>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_up_proj|down_proj)(?P<bias>_bias)?$"
)


def fused_expert_name(name: str) -> tuple[str, int] | None:
    """(checkpoint tensor, expert index) of the table's name for one GPT-OSS expert's slice
    (``model.layers.3.mlp.experts.5.gate_up_proj`` -> (``model.layers.3.mlp.experts.gate_up_proj``, 5)); None for
    any other name. GPT-OSS checkpoints hold each of the four expert tensors once per layer, experts stacked first."""
    m = _OSS_EXPERT.match(name)
    if m is None:
        return None
    return f"{m.group('pre')}.{m.group('proj')}{m.group('bias') or ''}", int(m.group("expert"))


def checkpoint_names(names) -> list[str]:
    """The tensor names a checkpoint holds for the table's ``names`` (``WeightMapping.hf_names()``): GPT-OSS's
    per-expert slices collapse into their fused tensor (first appearance keeps the order); others are unchanged."""
    out: dict[str, None] = {}
    for n in names:
        fused = fused_expert_name(n)
        out[fused[0] if fused else n] = None
    return list(out)


def stack_fused_experts(tensors, num_experts: int, device=None):
    """``(name, tensor)`` stream with GPT-OSS's per-expert slices stacked into their fused checkpoint tensors
    ([E, ...], expert order), each yielded once all ``num_experts`` slices arrived; other tensors pass through.
    Holds copies (on ``device``; None: where they are) of the slices of the fused tensors still incomplete: one
    layer's experts in ``iter_hf_tensors`` order (gpt-oss-120b: 128 x 24.9 M values). The stream must be iterated to
    its end (collective producers)."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors:
        fused = fused_expert_name(name)
        if fused is None:
            yield name, t
            continue
        slices = pending.setdefault(fused[0], {})
        # a copy: the producer may hand out views of parameters or reused buffers
        slices[fused[1]] = t.detach().to(device or t.device, copy=True)
        if len(slices) == num_experts:
            del pending[fused[0]]
            yield fused[0], torch.stack([slices[e] for e in range(num_experts)])
    if pending:
        name, got = next(iter(pending.items()))
        raise RuntimeError(f"{name}: only {len(got)} of {num_experts} experts were produced")


class _ExpertSlice:
    """One expert's slice of a fused GPT-OSS tensor ([E, ...]) as a ``SliceReader`` (reads only what is sliced)."""

    def __init__(self, fused: SliceReader, expert: int):
        self.fused, self.expert = fused, expert

    def get_shape(self) -> list[int]:
        return list(self.fused.get_shape()[1:])

    def __getitem__(self, idx) -> torch.Tensor:
        idx = idx if isinstance(idx, tuple) else (idx,)
        return self.fused[(self.expert, *idx)]


def fused_expert_reader(reader: Callable[[str], SliceReader], names) -> Callable[[str], SliceReader]:
    """``reader`` that also answers hub-style per-expert names (``...mlp.experts.{e}.gate_proj.weight``) from
    transformers 5's fused in-memory layout (``...mlp.experts.gate_up_proj`` / ``down_proj``) when only the fused
    tensors exist (a ``model.state_dict()`` of transformers >= 5; its ``save_pretrained`` writes per-expert names)."""
    names = set(names)

    def read(name: str) -> SliceReader:
        m = _PER_EXPERT.match(name)
        oss = fused_expert_name(name) if name not in names else None
        if oss is not None:  # GPT-OSS: a slice of the fused tensor, or of its MXFP4 blocks dequantised
            fused, e = oss
            if fused not in names and f"{fused}_blocks" in names:
                from megatron_rlvr.models.mxfp4 import Mxfp4Expert

                return Mxfp4Expert(reader(f"{fused}_blocks"), reader(f"{fused}_scales"), e, fused)
            return _ExpertSlice(reader(fused), e)
        if name in names or m is None:
            return reader(name)
        e, proj = int(m.group("expert")), m.group("proj")
        if proj == "down_proj":
            return _ExpertOfFused(reader(m.group("pre") + ".down_proj"), e, None)
        fused = reader(m.group("pre") + ".gate_up_proj")
        inner = fused.get_shape()[1] // 2
        return _ExpertOfFused(fused, e, (0, inner) if proj == "gate_proj" else (inner, 2 * inner))

    return read


def unfuse_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers 5 in-memory state dict with the routed experts under hub-style per-expert names (views).
    GPT-OSS's fused tensors (recognised by their biases, which the other families' experts lack) become the table's
    per-expert slices (``mlp.experts.{e}.gate_up_proj`` = ``gate_up_proj[e]``, ``fused_expert_name``)."""
    out = {}
    for name, t in state.items():
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and f"{name}_bias" in state:
            pre, proj = name.rsplit(".", 1)
            for suffix in ("", "_bias"):
                fused = state[name + suffix]
                out.update({f"{pre}.{e}.{proj}{suffix}": fused[e] for e in range(fused.shape[0])})
        elif name.endswith((".mlp.experts.gate_up_proj_bias", ".mlp.experts.down_proj_bias")):
            if name.removesuffix("_bias") not in state:
                out[name] = t
        elif name.endswith(".mlp.experts.gate_up_proj"):
            pre, inner = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.gate_proj.weight"] = t[e, :inner]
                out[f"{pre}.{e}.up_proj.weight"] = t[e, inner:]
        elif name.endswith(".mlp.experts.down_proj"):
            pre = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def layer_offset(config, pp_rank: int, vp_stage: int | None = None) -> int:
    """Global index of the first decoder layer on pipeline rank ``pp_rank`` (megatron's own rule, incl. uneven PP)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return int(get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank))
