"""Prompt data for RLVR: jsonl/parquet loaders (problem/answer, DAPO-Math-17k, GSM8K, boxed-solution schemas),
procedural tasks, prompt templates, and a deterministic, DP-sharded, resumable prompt stream.

    cfg = DataConfig(train_files=["gsm8k/train.jsonl"], template="chat")
    loader = build_train_loader(cfg, global_batch_size=128, dp_rank=rank, dp_world=world)
    batch = loader.next_batch()                       # this rank's Examples
    texts = [render(ex, cfg, tokenizer) for ex in batch]
    state = loader.state_dict()                       # save with the checkpoint; load_state_dict() to resume
"""

from megatron_rlvr.data.data_config import DataConfig, build_train_dataset, build_train_loader, render
from megatron_rlvr.data.files import SUPPORTED_EXTENSIONS, PromptDataset, iter_rows, load_dataset, load_examples
from megatron_rlvr.data.procedural import PROCEDURAL_TASKS, ProceduralConfig, generate_examples
from megatron_rlvr.data.records import Example, MalformedRowError
from megatron_rlvr.data.sampler import PromptLoader, PromptSampler, shard_range
from megatron_rlvr.data.schemas import SCHEMAS, answer_to_str, detect_schema
from megatron_rlvr.data.templates import DEFAULT_PROMPT_TEMPLATE, TEMPLATES, prompt_messages, render_prompt

__all__ = [
    "DEFAULT_PROMPT_TEMPLATE",
    "PROCEDURAL_TASKS",
    "SCHEMAS",
    "SUPPORTED_EXTENSIONS",
    "TEMPLATES",
    "DataConfig",
    "Example",
    "MalformedRowError",
    "ProceduralConfig",
    "PromptDataset",
    "PromptLoader",
    "PromptSampler",
    "answer_to_str",
    "build_train_dataset",
    "build_train_loader",
    "detect_schema",
    "generate_examples",
    "iter_rows",
    "load_dataset",
    "load_examples",
    "prompt_messages",
    "render",
    "render_prompt",
    "shard_range",
]
