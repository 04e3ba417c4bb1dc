"""Megatron's kernel fusions: which ones the installed stack supports, detected once at start-up.

megatron-core's fusions need CUDA and, for some, a fused-kernel package:

- ``bias_activation_fusion`` (SwiGLU, megatron's jit/compile-fused function) and ``bias_dropout_fusion``
  (bias-dropout-add): torch on CUDA only.
- ``masked_softmax_fusion`` (FusedScaleMaskSoftmax of the local attention): the ``scaled_*masked_softmax_cuda``
  extension modules (NVIDIA Apex / megatron's fused kernels). Under the Transformer-Engine layer spec attention is
  TE's own fused attention and the flag is moot.
- ``apply_rope_fusion``: Transformer Engine's fused RoPE.
- ``gradient_accumulation_fusion`` (weight-gradient GEMM accumulating straight into megatron DDP's fp32
  ``main_grad``): Transformer Engine's linear layers, or Apex's ``fused_weight_gradient_mlp_cuda``.
- ``persist_layer_norm`` (Apex's persistent LayerNorm kernel): LayerNorm only; every model family here uses
  RMSNorm (TE's or torch's norm, which refuses the flag), so it stays off and the header says so.

NVIDIA Apex is what NGC containers ship; the PyPI package named ``apex`` is an unrelated project, so Apex is detected
by its CUDA extension modules, never by the name alone. On CPU every fusion is off (they would fail or be slower).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from functools import lru_cache

FUSION_FLAGS = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
    "persist_layer_norm",
)
"""The TransformerConfig fields this module decides (models/hf_config.py sets them from ``flags``)."""


@dataclass(frozen=True)
class FusionSupport:
    """What the running process can fuse."""

    cuda: bool
    """A CUDA device is usable."""
    transformer_engine: str | None
    """Transformer Engine's version when ``transformer_engine.pytorch`` imports (None otherwise)."""
    apex: bool
    """NVIDIA Apex with its CUDA extension ``fused_weight_gradient_mlp_cuda``."""
    softmax_kernels: bool = False
    """The ``scaled_upper_triang_masked_softmax_cuda`` / ``scaled_masked_softmax_cuda`` extension modules."""

    def flags(self) -> dict[str, bool]:
        """TransformerConfig fusion fields: on exactly where the stack has the kernel."""
        te, apex, cuda = self.transformer_engine is not None and self.cuda, self.apex and self.cuda, self.cuda
        return {
            "bias_activation_fusion": cuda,
            "bias_dropout_fusion": cuda,
            "masked_softmax_fusion": self.softmax_kernels and cuda,
            "apply_rope_fusion": te,
            "gradient_accumulation_fusion": te or apex,
            "persist_layer_norm": False,  # LayerNorm only (all families here are RMSNorm)
        }

    @property
    def grouped_gemm(self) -> bool:
        """MoE experts as one grouped GEMM (Transformer Engine's ``TEGroupedMLP``); CPU runs megatron's
        ``SequentialMLP`` (one GEMM per local expert)."""
        return self.transformer_engine is not None and self.cuda

    def describe(self) -> str:
        """One line for the run header, e.g. ``fusions: TE 2.8 + Apex: bias_activation, ...`` or ``fusions: off``."""
        on = [k.removesuffix("_fusion") for k, v in self.flags().items() if v]
        if not on:
            return "fusions: off (CPU)" if not self.cuda else "fusions: off"
        stack = [f"TE {self.transformer_engine}"] if self.transformer_engine else []
        stack += ["Apex"] if self.apex else []
        return f"fusions: {' + '.join(stack) or 'torch'}: {', '.join(on)}"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _te_version() -> str | None:
    if not _has_module("transformer_engine"):
        return None
    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # a TE wheel without its CUDA libraries raises at import: treat as absent
        return None
    return str(getattr(te, "__version__", "unknown"))


def _nvidia_apex() -> bool:
    # NVIDIA Apex's compiled extensions; the unrelated PyPI "apex" has none of them.
    return _has_module("fused_weight_gradient_mlp_cuda") and _has_module("apex.transformer")


@lru_cache(maxsize=1)
def detect() -> FusionSupport:
    """The fusion support of this process (cached: detected once at start-up)."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        return FusionSupport(cuda=False, transformer_engine=None, apex=False)
    softmax = _has_module("scaled_upper_triang_masked_softmax_cuda") and _has_module("scaled_masked_softmax_cuda")
    return FusionSupport(cuda=True, transformer_engine=_te_version(), apex=_nvidia_apex(), softmax_kernels=softmax)


def fusion_flags(enabled: bool | None = None) -> dict[str, bool]:
    """TransformerConfig fusion fields: ``None`` what :func:`detect` supports, ``False`` all off, ``True`` the
    detected ones too (there is nothing to force: an unsupported fusion fails at model build)."""
    if enabled is False:
        return {k: False for k in FUSION_FLAGS}
    return detect().flags()
