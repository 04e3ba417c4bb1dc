"""DataConfig: where prompts come from and how they are rendered, shuffled and sharded."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from megatron_rlvr.data.files import SUPPORTED_EXTENSIONS, PromptDataset, load_dataset
from megatron_rlvr.data.procedural import ProceduralConfig, generate_examples
from megatron_rlvr.data.records import Example
from megatron_rlvr.data.sampler import PromptLoader
from megatron_rlvr.data.schemas import SCHEMAS
from megatron_rlvr.data.templates import DEFAULT_PROMPT_TEMPLATE, TEMPLATES, render_prompt

__all__ = ["DataConfig", "build_train_dataset", "build_train_loader", "render"]


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training data: .jsonl and/or .parquet files, concatenated. Empty: use the procedural task instead."""
    eval_files: list[str] = field(default_factory=list)
    """Benchmark files for periodic evaluation (same formats and schemas)."""
    schema: str = "auto"
    """Row schema: "auto" (detected per file from its first row) or one of "problem_answer", "dapo", "gsm8k",
    "boxed_solution", "code" (test cases for reward.fn=code)."""
    skip_malformed: bool = False
    """False: a malformed row is a ValueError naming file and line. True: skip it and count it."""
    template: str = "chat"
    """Prompt rendering: "chat" (the tokenizer's chat template on the messages) or "plain" (prompt_template only)."""
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    """Text around the problem, with "{problem}" where it goes: the user turn ("chat") or the whole prompt
    ("plain"). Chat-format rows (DAPO) keep their own messages. Use "{problem}" alone for raw prompts."""
    system_prompt: str | None = None
    """Optional system message (chat) or preamble (plain)."""
    shuffle: bool = True
    """Shuffle every epoch with a permutation seeded by (seed, epoch)."""
    seed: int = 1234
    """Shuffling seed."""
    procedural: ProceduralConfig = field(default_factory=ProceduralConfig)
    """The procedural task used when train_files is empty."""

    def __post_init__(self) -> None:
        if isinstance(self.train_files, str):
            self.train_files = [self.train_files]
        if isinstance(self.eval_files, str):
            self.eval_files = [self.eval_files]
        if isinstance(self.procedural, dict):
            known = {f.name for f in dataclasses.fields(ProceduralConfig)}
            unknown = sorted(set(self.procedural) - known)
            if unknown:
                raise ValueError(f"data.procedural: unknown keys {unknown}; known: {sorted(known)}")
            self.procedural = ProceduralConfig(**self.procedural)
        for name in ("train_files", "eval_files"):
            for i, path in enumerate(getattr(self, name)):
                if not isinstance(path, str) or not path:
                    raise ValueError(f"data.{name}[{i}] must be a file path, got {path!r}")
                ext = os.path.splitext(path)[1].lower()
                if ext not in SUPPORTED_EXTENSIONS:
                    raise ValueError(
                        f"data.{name}[{i}] = {path!r}: unsupported file type {ext!r}; "
                        f"use {' or '.join(SUPPORTED_EXTENSIONS)}"
                    )
        if self.schema != "auto" and self.schema not in SCHEMAS:
            raise ValueError(f"data.schema must be 'auto' or one of {sorted(SCHEMAS)}, got {self.schema!r}")
        if self.template not in TEMPLATES:
            raise ValueError(f"data.template must be one of {TEMPLATES}, got {self.template!r}")
        if "{problem}" not in self.prompt_template:
            raise ValueError(f"data.prompt_template must contain '{{problem}}', got {self.prompt_template!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"data.seed must be an int >= 0, got {self.seed!r}")

    def check_files(self) -> None:
        """The data files exist (run by the config loader; ``plan`` may skip it for a cluster's paths)."""
        for name in ("train_files", "eval_files"):
            for i, path in enumerate(getattr(self, name)):
                if not os.path.isfile(path):
                    raise ValueError(f"data.{name}[{i}]: file not found: {path}{cwd_note(path)}")


def cwd_note(path: str) -> str:
    """For a path that was not found: where a relative one was looked for (the working directory, not the config
    file's folder)."""
    if os.path.isabs(os.path.expanduser(path)):
        return ""
    return f" (relative paths are resolved from the working directory {os.getcwd()}, not from the config file)"


def build_train_dataset(cfg: DataConfig) -> PromptDataset:
    """The training examples: the files if any, else the procedural task."""
    if cfg.train_files:
        return load_dataset(cfg.train_files, cfg.schema, cfg.skip_malformed)
    return PromptDataset(generate_examples(cfg.procedural))


def build_train_loader(
    cfg: DataConfig, global_batch_size: int, dp_rank: int = 0, dp_world: int = 1, dataset: PromptDataset | None = None
) -> PromptLoader:
    """A resumable, sharded loader over the training examples (loads them unless ``dataset`` is given)."""
    ds = dataset if dataset is not None else build_train_dataset(cfg)
    return PromptLoader(ds.examples, global_batch_size, dp_rank, dp_world, seed=cfg.seed, shuffle=cfg.shuffle)


def render(example: Example, cfg: DataConfig, tokenizer: Any = None, tools: list[dict] | None = None) -> str:
    """:func:`~megatron_rlvr.data.templates.render_prompt` with the config's template settings (``tools``: tool
    descriptions for the chat template, multi-turn rollouts with tools)."""
    return render_prompt(example, cfg.template, cfg.prompt_template, cfg.system_prompt, tokenizer, tools)
