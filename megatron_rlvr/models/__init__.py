"""Megatron GPT policy models from Hugging Face checkpoints: config translation (hf_config), model building (build),
the single weight-mapping table (mapping), sliced HF loading (loading), HF export (export) and resharding training
checkpoints (checkpointing)."""
