"""Where a run's model comes from (an HF folder, a GGUF file, an HF config for a random init, or a built-in tiny
model) and what the rollout side needs of it besides weights: the tokenizer and, for vision-language policies, the
image processor. Torch-free of Megatron: a rank that only rolls out resolves its model here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_rlvr.config import ModelConfig
from megatron_rlvr.families import gguf
from megatron_rlvr.families.table import vl_family_of
from megatron_rlvr.families.tiny import tiny_hf_config, tiny_tokenizer_for
from megatron_rlvr.families.tiny_vl import tiny_image_processor, tiny_vl_tokenizer
from megatron_rlvr.families.vl_processor import load_vl_processor
from megatron_rlvr.models.hf_config import load_hf_config


@dataclass
class ModelSource:
    """Where the model comes from, resolved once per run."""

    hf_config: dict
    """HF config of the policy."""
    weights_dir: str | None
    """HF folder with the start weights; None: random init (tiny, or model.hf_config)."""
    tokenizer_dir: str | None
    """Tokenizer folder; None for the built-in tiny tokenizer."""
    is_tiny: bool
    """A built-in tiny model (random init with its own vision-tower scale, built-in tokenizer)."""
    trust_remote_code: bool = False
    """Run the tokenizer folder's own code (``model.trust_remote_code``)."""


def resolve_model_source(cfg: ModelConfig) -> ModelSource:
    """HF config, weights folder and tokenizer folder of the configured model (converts a GGUF file once, cached);
    ``model.rope_scaling`` is laid over the HF config, so the trainer, the engines and the export all see it."""
    source = _resolve_model_source(cfg)
    if cfg.rope_scaling is not None:
        source.hf_config = cfg.rope_scaling.apply(source.hf_config)
    return source


def _resolve_model_source(cfg: ModelConfig) -> ModelSource:
    if cfg.is_tiny:
        return ModelSource(tiny_hf_config(name=cfg.name), None, cfg.tokenizer, True)
    remote = cfg.trust_remote_code
    if cfg.gguf:
        path = gguf.smollm2_gguf_path() if cfg.gguf == "smollm2" else cfg.gguf
        folder = gguf.cached_hf_folder(path)
        return ModelSource(load_hf_config(folder), folder, cfg.tokenizer or folder, False, remote)
    if cfg.hf_path:
        return ModelSource(load_hf_config(cfg.hf_path), cfg.hf_path, cfg.tokenizer or cfg.hf_path, False, remote)
    return ModelSource(load_hf_config(cfg.hf_config), None, cfg.tokenizer, False, remote)


def resolve_on_node(cfg: ModelConfig, local_rank: int, barrier: Callable[[], None]) -> ModelSource:
    """:func:`resolve_model_source` on every rank, local rank 0 first: a GGUF model is converted (and cached) once
    per node, not by every rank at once. ``barrier()`` waits for every rank of the job."""
    if local_rank == 0:
        source = resolve_model_source(cfg)
    barrier()
    if local_rank != 0:
        source = resolve_model_source(cfg)
    return source


def vl_kind(source: ModelSource) -> str | None:
    """``qwen2_5_vl`` / ``qwen3_vl`` for a vision-language policy, None for a text-only one."""
    found = vl_family_of(source.hf_config)
    return None if found is None else found[1].kind


def load_tokenizer(source: ModelSource):
    """The policy's tokenizer: the configured folder's, else the built-in tiny (or tiny VL) one."""
    if source.tokenizer_dir is None:
        if vl_kind(source) is not None:
            return tiny_vl_tokenizer()
        return tiny_tokenizer_for(source.hf_config)
    from transformers import AutoTokenizer  # transformers' import is seconds: only for a tokenizer folder

    return AutoTokenizer.from_pretrained(source.tokenizer_dir, trust_remote_code=source.trust_remote_code)


def load_image_processor(source: ModelSource):
    """The image processor of a vision-language policy (the model folder's, else the tiny models' built-in one);
    None for a text-only policy. It turns an example's images into the tower's ``pixel_values`` and patch grids, for
    the trainer and the transformers engine alike."""
    kind = vl_kind(source)
    if kind is None:
        return None
    folder = source.weights_dir or source.tokenizer_dir
    if folder is None:
        return tiny_image_processor(kind)
    return load_vl_processor(folder, kind).image_processor
