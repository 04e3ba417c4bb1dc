"""Let megatron-core run on a CPU-only torch with the gloo backend.

megatron-core is written for CUDA: it calls ``torch.cuda.*`` directly and hard-codes ``device="cuda"`` in its
pipeline schedules, DDP buffers and optimizer. None of that needs a GPU to be *correct*, so on machines without CUDA
(CI, laptops) we redirect those calls to the CPU. Everything here is a no-op when CUDA is available, so GPU runs use
megatron-core unchanged.

``apply_cpu_shims()`` is idempotent and must run before megatron-core builds models, optimizers or schedules (it is
safe to call it before or after ``import megatron.core``); each shim's comment says what breaks without it.
Verified by ``tests/integration/test_cpu_shims.py``: TP=2 == TP=1 logits, PP=2 (1F1B) loss == PP=1 loss, sequence
parallel, Megatron's optimizer (incl. DistributedOptimizer) and dist_checkpointing; the mixture-of-experts shims
(``_patch_moe``) by ``tests/integration/test_models_moe.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_LOCK = threading.Lock()


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _is_cuda_device(device) -> bool:
    """True for anything that names a CUDA device: 'cuda', 'cuda:1', torch.device('cuda'), or a bare index (which
    torch interprets as a CUDA ordinal)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _to_cpu_device(device):
    return torch.device("cpu") if _is_cuda_device(device) else device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch call.

    Why: megatron-core creates tensors with ``device="cuda"`` / ``torch.cuda.current_device()`` and calls
    ``.cuda()`` in ~200 places (schedules, DDP grad buffers, optimizer, clip_grads), and asserts
    ``param.type() == 'torch.cuda.FloatTensor'`` in the optimizer. A function mode catches all of them without
    patching megatron's source. ``Tensor.type()`` reports the CUDA type name so those asserts pass.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                name = func(*args)
                return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
            args = tuple(a.replace("torch.cuda.", "torch.") if isinstance(a, str) else a for a in args)
            if isinstance(kwargs.get("dtype"), str):
                kwargs["dtype"] = kwargs["dtype"].replace("torch.cuda.", "torch.")
            return func(*args, **kwargs)
        if func is torch.Tensor.to:
            args = (args[0],) + tuple(
                _to_cpu_device(a) if isinstance(a, (str, int, torch.device)) else a for a in args[1:]
            )
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for torch.cuda.Stream / Event: CPU ops are synchronous, so waiting and recording are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NullStream()

    def record(self, *a, **k):
        pass

    def synchronize(self, *a, **k):
        pass

    def query(self, *a, **k):
        return True

    def elapsed_time(self, *a, **k):
        return 0.0

    def wait(self, *a, **k):
        pass


_NULL_STREAM = _NullStream()


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # ~80 call sites use torch.cuda.current_device() as a device argument. Return the CPU device itself rather than
    # an index for the mode to map: torch runs a mode's handler with the mode switched off, so everything executed
    # inside an intercepted torch.autograd.backward (megatron's autograd Functions allocate with
    # device=current_device() in backward, e.g. under sequence parallel) sees no mode at all.
    cuda.current_device = lambda: torch.device("cpu")
    cuda.set_device = lambda *a, **k: None
    # CPU work is synchronous: there is nothing to wait for.
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    # DDP and the schedules overlap communication on side streams; on CPU one "stream" is enough.
    cuda.current_stream = lambda *a, **k: _NULL_STREAM
    cuda.default_stream = lambda *a, **k: _NULL_STREAM
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_stream = lambda *a, **k: None
    # nvtx markers (profiling ranges) fail without the CUDA runtime.
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    # The "CUDA" RNG is the CPU default generator: dropout on CPU tensors draws from it, so forking the tracker's
    # states must swap the CPU generator's state (megatron forks it around every attention call).
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly, not via it.)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state


def _patch_megatron() -> None:
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:  # megatron-core absent: torch-level shims are still useful for our own code
        return

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # With the CUDA RNG mapped onto the CPU generator, the tracker's "CPU RNG state changed within GPU RNG context"
    # check fires on every forked dropout; it is expected here, so silence exactly that message.
    logger = logging.getLogger(mrandom.__name__)
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage("CPU RNG state changed within GPU RNG context"))

    # WrappedTorchNorm asserts sequence_parallel is off only because TE/Apex norms are the "supported" ones; a torch
    # norm is correct under sequence parallelism as long as its weight grads are all-reduced over TP, which
    # megatron's finalize_model_grads does for params flagged `sequence_parallel` (as FusedLayerNorm flags them).
    from megatron.core.transformer import torch_norm

    wrapped = torch_norm.WrappedTorchNorm
    if not getattr(wrapped, "_rlvr_cpu_patched", False):
        original_new = wrapped.__new__

        def _new(cls, config, *args, **kwargs):
            seq_par = config.sequence_parallel
            config.sequence_parallel = False
            try:
                norm = original_new(cls, config, *args, **kwargs)
            finally:
                config.sequence_parallel = seq_par
            for p in norm.parameters():
                p.sequence_parallel = seq_par
            return norm

        wrapped.__new__ = staticmethod(_new)
        wrapped._rlvr_cpu_patched = True

    _patch_causal_masks()
    _patch_rope_cp_slice()
    _patch_distributed_optimizer_torch_adam()
    _patch_moe()


@functools.lru_cache(maxsize=4)  # [s, s] bools: a micro-batch's layers share one; 4 bound the memory (4 s^2 bytes)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    ones = torch.ones(sq, skv, dtype=torch.bool)
    upper = torch.triu(ones, diagonal=skv - sq - window_size[0])
    return ~torch.tril(upper, diagonal=skv - sq + window_size[1])


def _patch_causal_masks() -> None:
    """megatron's unfused softmax builds its causal mask with ``device="cuda"`` inside the attention forward (a
    new [s, s] mask per layer per call). Build it on the CPU instead, once per micro-batch length: with that, the
    model forward makes no CUDA call and can run outside the redirect (``native_torch``), which saves the handler's
    few microseconds on each of the forward's ~2k torch calls per step. The mask is only read (``masked_fill``)."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    for module in (fused_softmax, transformer_utils):
        if hasattr(module, "get_default_causal_mask"):
            module.get_default_causal_mask = _cpu_causal_mask
        if hasattr(module, "get_sliding_window_causal_mask"):
            module.get_sliding_window_causal_mask = _cpu_sliding_window_mask


def _rope_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """The rotary angles of the positions a context-parallel rank holds, chunks r and 2cp - 1 - r of 2cp along
    ``seq_dim`` (megatron_rlvr.megatron.context_parallel.zigzag_positions), on ``pos_emb``'s own device."""
    if cp_group is None:
        raise ValueError("the rotary embedding of a context-parallel rank needs its cp_group")
    cp, r = cp_group.size(), cp_group.rank()
    chunks = pos_emb.unflatten(seq_dim, (2 * cp, -1))
    picked = chunks.index_select(seq_dim, torch.tensor([r, 2 * cp - 1 - r], device=pos_emb.device))
    return picked.flatten(seq_dim, seq_dim + 1)


def _patch_rope_cp_slice() -> None:
    """megatron's ``get_pos_emb_on_this_cp_rank`` (context parallelism) builds its chunk index with
    ``pin_memory=True`` and ``.cuda()``; the model forward runs outside the CUDA -> CPU redirect (``native_torch``),
    where that raises "pin_memory=True requires a CUDA or other accelerator backend". The rotary modules import the
    function by name, so each gets the CPU version."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = _rope_on_this_cp_rank


def _patch_distributed_optimizer_torch_adam() -> None:
    """Two bugs of DistributedOptimizer on torch.optim.Adam (no Apex/TE fused Adam, i.e. every CPU run) when it
    loads a checkpoint; torch's Adam keeps a per-parameter ``"step"`` tensor, the fused Adams keep it per group:

    1. ``load_state_dict`` puts ONE step tensor object into every parameter's state; torch's Adam increments each
       parameter's step in place, so after the first resumed step they read 1 + (#params seen so far) and the bias
       correction of almost every parameter is wrong. Give each parameter its own copy.
    2. Loading the 'fully_reshardable' format, ``_set_main_param_and_optimizer_states`` copies EVERY state key from
       the checkpoint's per-parameter tensors, which hold only param / exp_avg / exp_avg_sq: ``KeyError: 'step'``.
       Copy the keys the checkpoint has and leave the already-restored step alone.
    """
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if getattr(cls, "_rlvr_cpu_patched", False):
        return
    original = cls._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    original_load = cls.load_state_dict

    def load_state_dict(self, state_dict):
        out = original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        return out

    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    cls.load_state_dict = load_state_dict
    cls._rlvr_cpu_patched = True


# ---------------------------------------------------------------------------------------------------------------
# Mixture of experts (megatron-core 0.16.1 MoE layer, SequentialMLP experts, allgather / alltoall dispatchers)
# ---------------------------------------------------------------------------------------------------------------

_MOE_SHIMS: dict[str, list[tuple[object, str, object]]] = {}
"""Shim name -> [(module, attribute, the original value or _MISSING)], so a test can suspend one shim."""
_MISSING = object()


def _set(shim: str, module, attr: str, value) -> None:
    _MOE_SHIMS.setdefault(shim, []).append((module, attr, getattr(module, attr, _MISSING)))
    setattr(module, attr, value)


def _patch_moe() -> None:
    """Three shims, each verified by a test in tests/integration/test_models_moe.py that fails with it suspended:

    - ``te_names``: moe_utils imports ``te_general_gemm`` and the ``fused_*`` MoE kernels inside ``try/except
      ImportError`` and never defines them when Transformer Engine is absent; the router's GEMM then tests
      ``te_general_gemm is not None`` and raises NameError on every forward. Define them as None (the unfused path).
    - ``host_split_sizes``: the alltoall dispatcher moves its split sizes "to host numpy" with
      ``maybe_move_tensor_to_cpu(as_numpy=True)``, which converts CUDA tensors only; CPU tensors reach
      ``all_to_all_single`` as tensors and it raises TypeError. Return numpy for CPU tensors too.
    - ``uneven_gloo_gather``: gloo's ``all_gather`` refuses chunks of different sizes (the alltoall dispatcher's
      gather over expert-TP with EP > 1 and expert TP > 1). Pad every chunk to the largest, gather evenly, trim.
    """
    if _MOE_SHIMS:
        return
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    te_names = (
        "te_general_gemm",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_topk_with_score_function",
        "fused_unpermute",
    )
    for name in te_names:
        if not hasattr(moe_utils, name):
            _set("te_names", moe_utils, name, None)
    _MOE_SHIMS.setdefault("te_names", [])

    original_move = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _set("host_split_sizes", moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    _set("host_split_sizes", token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)

    original_gather = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        uneven = output_split_sizes is not None and len(set(output_split_sizes)) > 1
        if not uneven or group.size() == 1 or torch.distributed.get_backend(group) != "gloo":
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        most = max(output_split_sizes)
        padded = input_.new_zeros((most, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((most * group.size(), *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[i * most : i * most + n] for i, n in enumerate(output_split_sizes)])

    _set("uneven_gloo_gather", mappings, "_gather_along_first_dim", _gather_along_first_dim)


MOE_SHIM_NAMES = ("te_names", "host_split_sizes", "uneven_gloo_gather")
"""The MoE shims (see ``_patch_moe``)."""


@contextlib.contextmanager
def suspend_moe_shim(name: str):
    """Undo one MoE shim inside the block (tests show what fails without it)."""
    if name not in MOE_SHIM_NAMES:
        raise ValueError(f"unknown MoE shim {name!r}; known: {MOE_SHIM_NAMES}")
    entries = _MOE_SHIMS.get(name, [])
    patched = [(m, a, getattr(m, a)) for m, a, _ in entries]
    for module, attr, original in entries:
        if original is _MISSING:
            delattr(module, attr)
        else:
            setattr(module, attr, original)
    try:
        yield
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


_MODE: _CudaToCpuMode | None = None


@contextlib.contextmanager
def native_torch():
    """Suspend the CUDA -> CPU redirect inside code that makes no CUDA calls (the hot loops of a step: the
    transformers rollout engine, the model forward, the loss). Under the mode every torch call goes through a Python
    handler (a few microseconds each; ~10k calls in an RL step of a small model). A no-op without the shims."""
    if _MODE is None:
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


def apply_cpu_shims() -> bool:
    """Apply every shim when CUDA is unavailable. Returns True if shims are active. Idempotent, process-wide."""
    global _APPLIED, _MODE
    if cuda_available():
        return False
    with _LOCK:
        if _APPLIED:
            return True
        _patch_torch_cuda()
        _patch_megatron()
        _MODE = _CudaToCpuMode()
        _MODE.__enter__()  # global for the life of the process (the mode stack is inherited by autograd threads)
        _APPLIED = True
    return True
