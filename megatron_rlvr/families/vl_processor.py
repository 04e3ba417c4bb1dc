"""The Qwen-VL processors (tokenizer + chat template + image processor) on machines without torchvision.

transformers 5.19 cannot construct ``Qwen2_5_VLProcessor`` or ``Qwen3VLProcessor`` without torchvision, not even
with ``video_processor=None``: every processor attribute is type-checked, ``video_processor`` against a class that
exists only with torchvision, and ``from_pretrained`` fails with "Can't load video processor". torchvision has no
CPU build for our torch here (the PyPI wheel links the CUDA libtorch). Processor attributes are read from the
``__init__`` signature, so an image-only subclass without a ``video_processor`` argument constructs, loads and
saves like the original for images. With torchvision installed (GPU machines) the original classes are used.
"""

from __future__ import annotations

import functools
import os

VL_ARCHITECTURES = {
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
}
"""HF architecture name -> VL kind."""


def has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # an installed CUDA-only wheel raises on import, not only ImportError
        return False
    return True


def processor_class(kind: str):
    """The processor class of VL kind ``kind`` (``qwen2_5_vl`` or ``qwen3_vl``): transformers' own with
    torchvision, else its image-only subclass."""
    from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor

    classes = {"qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}
    if kind not in classes:
        raise ValueError(f"VL processor kind must be one of {tuple(classes)}, got {kind!r}")
    cls = classes[kind]
    return cls if has_torchvision() else _image_only(cls)


@functools.cache
def _image_only(cls):
    from transformers.processing_utils import ProcessorMixin

    class ImageOnly(cls):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # the attributes the parent's __init__ would set from the tokenizer (Qwen3-VL also reads the
            # vision start/end tokens)
            self.image_token = "<|image_pad|>"
            self.video_token = "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    ImageOnly.__name__ = cls.__name__
    ImageOnly.__qualname__ = cls.__qualname__
    return ImageOnly


def vl_processor(kind: str, image_processor, tokenizer, chat_template: str | None = None):
    """A processor of VL kind ``kind`` from its parts (chat template: the tokenizer's by default)."""
    return processor_class(kind)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=chat_template if chat_template is not None else tokenizer.chat_template,
    )


def load_vl_processor(path: str | os.PathLike, kind: str | None = None):
    """The processor saved in the HF folder ``path`` (kind from its config.json's architecture when not given)."""
    import json

    from transformers import AutoImageProcessor, AutoTokenizer

    path = os.fspath(path)
    if kind is None:
        cfg_file = os.path.join(path, "config.json")
        with open(cfg_file) as f:
            arch = (json.load(f).get("architectures") or [None])[0]
        if arch not in VL_ARCHITECTURES:
            raise ValueError(
                f"{cfg_file}: architectures[0] = {arch!r} is not a vision-language model {tuple(VL_ARCHITECTURES)}"
            )
        kind = VL_ARCHITECTURES[arch]
    tok = AutoTokenizer.from_pretrained(path)
    return vl_processor(kind, AutoImageProcessor.from_pretrained(path), tok)
