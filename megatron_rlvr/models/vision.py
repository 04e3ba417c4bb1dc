"""Vision-language policies (Qwen2.5-VL, Qwen3-VL): megatron's GPTModel with multimodal rotary positions for the
language model, and transformers' own vision tower beside it as a plain torch module.

The tower (``visual``) is replicated over tensor-parallel ranks and lives on the first pipeline stage. Its output (one
vector per merged 2x2 patch) replaces the embeddings of the image tokens, in the batch-major order of the images; the
language model then runs on ``decoder_input`` with [3, b, s] M-RoPE position ids (:mod:`megatron_rlvr.models.mrope`).
Its gradient is complete on every TP rank (the column-parallel layers all-reduce the gradient of their input), so a
trainable tower needs only the data-parallel reduction megatron's DDP gives every parameter it holds.

Qwen3-VL adds two pieces megatron-core 0.16.1 does not have: interleaved M-RoPE (:class:`_interleaved_rope_class`)
and DeepStack (Meng et al. 2024, arXiv:2406.04334): features of early vision blocks are added to the hidden states at
the image positions after language layers 0..k-1 (forward hooks on those layers).

Sequence parallelism: the embedding does not scatter (``scatter_embedding_sequence_parallel=False``); the model
scatters ``decoder_input`` and the DeepStack additions itself after the image features are in place.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from megatron_rlvr.families.table import vl_family_of, vl_text_config
from megatron_rlvr.models.mapping import VISION_MODULE
from megatron_rlvr.models.mrope import interleaved_mrope_freqs

VISION_TOWER_CLASSES = {
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"),
}
"""VL kind -> (module, class) of transformers' vision tower."""


@dataclass(frozen=True)
class VisionSpec:
    """What the megatron side needs to know about a vision-language model."""

    kind: str
    """``qwen2_5_vl`` or ``qwen3_vl``."""
    image_token_id: int
    """Id of ``<|image_pad|>``: one per merged patch in the expanded prompt."""
    spatial_merge_size: int
    """Patches merged per side into one language token (2: a 2x2 block)."""
    mrope_section: tuple[int, int, int]
    """Rotary frequencies per axis (temporal, height, width); sums to head_dim / 2."""
    interleaved: bool
    """Interleaved M-RoPE bands (Qwen3-VL)."""
    deepstack_layers: int
    """Number of DeepStack feature maps (added after language layers 0..k-1); 0: none."""
    hf_config: dict = field(repr=False, default_factory=dict)
    """The full HF config (the tower is built from its ``vision_config``)."""


def vision_spec(cfg: dict, where: str = "HF config") -> VisionSpec | None:
    """The VisionSpec of a vision-language HF config dict; None for a text-only one."""
    found = vl_family_of(cfg)
    if found is None:
        return None
    arch, fam = found
    text = vl_text_config(cfg, where)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.get("mrope_section")
    if not isinstance(section, (list, tuple)) or len(section) != 3:
        raise ValueError(f"{where}: {arch} needs text_config.rope_parameters.mrope_section = [t, h, w]")
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    if sum(section) * 2 != head_dim:
        raise ValueError(f"{where}: mrope_section {list(section)} must sum to head_dim / 2 = {head_dim // 2}")
    interleaved = bool(rope.get("mrope_interleaved", fam.interleaved_mrope))
    if interleaved != fam.interleaved_mrope:
        raise ValueError(f"{where}: {arch} with mrope_interleaved={interleaved} is not supported")
    vision = cfg["vision_config"]
    if "image_token_id" not in cfg:
        raise ValueError(f"{where}: {arch} needs image_token_id")
    return VisionSpec(
        kind=fam.kind,
        image_token_id=int(cfg["image_token_id"]),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
        mrope_section=tuple(int(x) for x in section),
        interleaved=interleaved,
        deepstack_layers=len(vision.get("deepstack_visual_indexes") or ()) if fam.deepstack else 0,
        hf_config=dict(cfg),
    )


def build_vision_tower(spec: VisionSpec, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' vision tower of ``spec`` with transformers' random init (weights are loaded afterwards)."""
    import importlib

    from transformers import AutoConfig

    module, name = VISION_TOWER_CLASSES[spec.kind]
    cls = getattr(importlib.import_module(module), name)
    cfg = {k: v for k, v in spec.hf_config.items() if k not in ("model_type", "transformers_version", "_name_or_path")}
    vision_config = AutoConfig.for_model(spec.kind, **cfg).vision_config
    return cls._from_config(vision_config).to(dtype)


def vision_param_names(spec: VisionSpec) -> tuple[str, ...]:
    """The tower's parameter names, in its own order (built on the meta device: no memory)."""
    with torch.device("meta"):
        tower = build_vision_tower(spec)
    return tuple(n for n, _ in tower.named_parameters())


def image_features(tower, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor):
    """(features [n_image_tokens, H], DeepStack features: list of [n_image_tokens, H]) of the images of a batch,
    in the order of ``image_grid_thw``."""
    dtype = next(tower.parameters()).dtype
    out = tower(pixel_values.to(dtype), grid_thw=image_grid_thw)
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def scatter_image_features(embeds_sbh: torch.Tensor, features: torch.Tensor, image_mask_bs: torch.Tensor):
    """[s, b, H] embeddings with the image tokens' rows replaced by ``features`` [n, H], which are in batch-major
    order: the mask is indexed [b, s] (indexing megatron's [s, b] layout would mix the images of a batch)."""
    if int(image_mask_bs.sum()) != features.shape[0]:
        raise ValueError(
            f"the batch has {int(image_mask_bs.sum())} image tokens but its images give {features.shape[0]} features"
        )
    bsh = embeds_sbh.transpose(0, 1)
    out = bsh.masked_scatter(image_mask_bs[..., None].to(bsh.device), features.to(bsh.dtype))
    return out.transpose(0, 1).contiguous()


@functools.cache
def _interleaved_rope_class():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
        """Qwen3-VL's interleaved M-RoPE in megatron's layout: [3, b, s] positions -> [s, b, 1, d] angles."""

        def forward(self, position_ids, mrope_section, cp_group=None):
            if self.seq_len_interpolation_factor is not None or self.rotary_interleaved:
                raise ValueError("interleaved M-RoPE supports neither position interpolation nor interleaved pairs")
            if cp_group is not None and cp_group.size() > 1 or self.cp_group is not None and self.cp_group.size() > 1:
                raise ValueError("interleaved M-RoPE does not support context parallelism")
            freqs = position_ids[..., None].float().to(self.inv_freq.device) * self.inv_freq  # [3, b, s, d/2]
            f = interleaved_mrope_freqs(freqs, mrope_section)
            return torch.cat((f, f), dim=-1)[..., None, :].transpose(0, 1).contiguous()

    return InterleavedMultimodalRotaryEmbedding


def _deepstack_hook(model, i: int):
    """Forward hook of language layer ``i``: adds ``model._deepstack[i]`` (the i-th DeepStack feature map of the
    current micro-batch, if any) to the layer's output. The additions stay set until the next forward: activation
    recomputation re-runs the layers (and this hook) in the backward pass of the same micro-batch."""

    def hook(module, inputs, output):
        if i >= len(model._deepstack):
            return output
        if isinstance(output, tuple):
            return (output[0] + model._deepstack[i].to(output[0].dtype), *output[1:])
        return output + model._deepstack[i].to(output.dtype)

    return hook


def _add_images(model, embeds_sbh, pixel_values, image_grid_thw, image_mask_bs):
    """The text embeddings ``embeds_sbh`` [s, b, H] with the vision tower's features of ``pixel_values`` in the
    image tokens' rows, and the DeepStack feature maps laid out the same way (sequence-parallel scattered)."""
    if image_grid_thw is None or image_mask_bs is None:
        raise ValueError("pixel_values need image_grid_thw and image_mask")
    feats, deep = image_features(getattr(model, VISION_MODULE), pixel_values, image_grid_thw)
    out_sbh = scatter_image_features(embeds_sbh, feats, image_mask_bs)
    zeros = torch.zeros_like(out_sbh)
    deepstack = [
        model._sp_scatter(scatter_image_features(zeros, f, image_mask_bs))
        for f in deep[: model.vision_spec.deepstack_layers]
    ]
    return out_sbh, deepstack


@functools.cache
def vl_gpt_model_class():
    """The GPTModel subclass of vision-language policies (a class factory: megatron is imported on first use)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    class VLGPTModel(GPTModel):
        """GPTModel (``position_embedding_type="mrope"``) + the HF vision tower as ``visual`` on the first stage.

        ``forward(input_ids, position_ids, attention_mask, ..., pixel_values=, image_grid_thw=, image_mask=)``:
        ``position_ids`` [3, b, s] (or [b, s] for text only: the same position on every axis), ``pixel_values``
        [n_patches, C * t * p * p] and ``image_grid_thw`` [n_images, 3] as the processor gives them for the images
        of the batch in batch-major order, ``image_mask`` [b, s] bool: the image tokens (taken from the prompts:
        a policy may sample the image token itself)."""

        def __init__(self, *, vision: VisionSpec, **gpt_kwargs):
            gpt_kwargs.update(position_embedding_type="mrope", scatter_embedding_sequence_parallel=False)
            super().__init__(**gpt_kwargs)
            self.vision_spec = vision
            if self.pre_process:
                setattr(self, VISION_MODULE, build_vision_tower(vision, self.config.params_dtype))
            if vision.interleaved:
                self.rotary_pos_emb = _interleaved_rope_class()(
                    kv_channels=self.config.kv_channels,
                    rotary_percent=1.0,
                    rotary_base=gpt_kwargs.get("rotary_base", 10000),
                    cp_group=self.pg_collection.cp,
                )
            self._deepstack: list[torch.Tensor] = []
            if vision.deepstack_layers:
                if not self.pre_process or len(self.decoder.layers) < vision.deepstack_layers:
                    raise ValueError(
                        f"DeepStack adds vision features after the first {vision.deepstack_layers} language layers: "
                        "they must be on the first pipeline stage"
                    )
                for i in range(vision.deepstack_layers):
                    self.decoder.layers[i].register_forward_hook(_deepstack_hook(self, i))

        def forward(
            self,
            input_ids,
            position_ids,
            attention_mask,
            decoder_input=None,
            *args,
            pixel_values=None,
            image_grid_thw=None,
            image_mask=None,
            **kwargs,
        ):
            if position_ids is not None and position_ids.dim() == 2:
                position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
            self._deepstack = []
            if self.pre_process and decoder_input is None:
                decoder_input = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, H], not scattered
                if pixel_values is not None:
                    decoder_input, self._deepstack = _add_images(
                        self, decoder_input, pixel_values, image_grid_thw, image_mask
                    )
                decoder_input = self._sp_scatter(decoder_input)
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)

        def _sp_scatter(self, x_sbh):
            if not self.config.sequence_parallel:
                return x_sbh
            return tensor_parallel.scatter_to_sequence_parallel_region(x_sbh, group=self.pg_collection.tp)

    return VLGPTModel
