"""Typed settings of model-judged rewards (``reward.judge``) and of weighted reward mixes (``reward.mix``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "DEFAULT_TEMPLATE",
    "JUDGE_ENGINES",
    "JUDGE_KINDS",
    "MODEL_REWARD_FNS",
    "PARSE_MODES",
    "JudgeConfig",
    "MixTerm",
]

JUDGE_KINDS = ("generative", "scalar")
"""``generative``: a causal LM served by a rollout engine writes a verdict that is parsed; ``scalar``: an
``AutoModelForSequenceClassification`` checkpoint (a reward model) maps (prompt, response) to one logit."""

PARSE_MODES = ("verdict", "score", "number")
"""How a generative judge's reply becomes a reward in [0, 1] (``rewards.judge.parse_verdict``)."""

JUDGE_ENGINES = ("hf", "vllm")
"""Engines that serve a generative judge: "hf" (transformers, in the rank's process unless ``isolate``) and "vllm"
(always in a child process of its own: vLLM's state is process-global, so it cannot share the process of the
policy's vLLM engine; rollout/judge_process.py)."""

MODEL_REWARD_FNS = ("judge",)
"""Reward names scored by a model on the rollout side (in the rank's process or its judge process), not by the
reward workers."""

DEFAULT_TEMPLATE = (
    "You are grading a response to a question.\n\n"
    "Question:\n{question}\n\n"
    "{reference_block}"
    "Response:\n{response}\n\n"
    "Is the response's final answer correct? Reason briefly, then end with exactly one line: "
    '"Verdict: correct" or "Verdict: incorrect".'
)
"""The default generative-judge prompt. ``{reference_block}`` is "Reference answer:\\n<ground truth>\\n\\n" when the
example has a ground truth and empty otherwise."""


@dataclass
class JudgeConfig:
    """A reward model or a generative judge, scored on the rollout side (each engine leader holds one)."""

    model: str = ""
    """Folder of a Hugging Face checkpoint (config.json, safetensors weights and its tokenizer files)."""

    kind: str = "generative"
    """"generative": a causal LM writes a reply that ``parse`` reads (served by ``engine``); "scalar": an
    AutoModelForSequenceClassification reward model whose single logit (times ``scale``) is the reward."""

    template: str = DEFAULT_TEMPLATE
    """The judge's input with placeholders {question} (the example's prompt text; chat prompts: the last user
    message), {response}, {reference} (the ground truth, may be empty) and {reference_block} (the reference in a
    labelled paragraph, or nothing when there is none). Generative judges then get the judge tokenizer's chat
    template around it when ``chat`` is on; scalar ones see exactly this text (use ``chat`` for a chat-trained
    reward model: question as the user turn, response as the assistant turn, and the template is not used)."""

    chat: bool = True
    """Wrap the input in the judge tokenizer's chat template when it has one (generative: the rendered template as
    the user turn plus the generation prompt; scalar: user = question, assistant = response). Off: raw text."""

    parse: str = "verdict"
    """Generative judges: "verdict" (the last "Verdict: correct" -> 1.0 or "Verdict: incorrect" -> 0.0), "score"
    (the last "Score: x" with x a number in [0, 1]) or "number" (the whole reply is a number in [0, 1], e.g. "1").
    A reply it cannot read scores 0 and is counted in reward/n_judge_unparsed."""

    max_tokens: int = 512
    """Generative judges: most tokens of a reply (a reply cut there is read as it is, usually unparsed)."""

    temperature: float = 0.0
    """Generative judges: sampling temperature of the reply; 0 is greedy."""

    max_len: int = 4096
    """Most tokens of a judge's input; a longer input is cut from the left of the response (the question and the
    end of the response stay) for scalar models, and is counted as an error for generative ones."""

    scale: float = 1.0
    """Scalar reward models: the reward is ``scale * logit`` (its raw scale is the model's own)."""

    timeout_s: float = 300.0
    """Wall-clock limit of one step's judging in seconds (one batched call). Past it the engine is interrupted
    (in-process transformers engine: between decode steps; a judge process: killed and restarted for the next
    step) and every item of the batch scores 0 in reward/n_timeout."""

    engine: str = "hf"
    """Generative judges: "hf", the transformers engine on the rank's device (CUDA when there is one), beside the
    policy's engine, or "vllm", a vLLM engine in a child process of the rank (always isolated, see ``isolate``).
    Either way its weights stay on the device for the whole run (it is not put to sleep while the policy trains);
    the transformers engine's KV cache lives only during the judging call, vLLM's for the whole run."""

    isolate: bool = False
    """Generative judges: run the judge's engine in a child process of the rollout rank, driven over a socket
    (rollout/judge_process.py): batched requests, killed and restarted past ``timeout_s``, restarted when it dies,
    killed at the run's end. Always on for ``engine=vllm``; for "hf" it keeps a crashing or hanging judge out of
    the rank's process."""

    gpu_memory_utilization: float = 0.2
    """``engine=vllm`` on CUDA: the fraction of the GPU's memory the judge's vLLM engine takes for its weights and
    KV cache (the policy's engine and the trainer share the rest: keep the sum of the shares below 1). Unused on
    CPU, where vLLM sizes the KV cache from the judge's lengths."""

    start_timeout_s: float = 600.0
    """A judge process that is not ready this many seconds after it was started counts as failed (and is
    restarted, see ``max_restarts``)."""

    max_restarts: int = 3
    """A judge process that fails this many times in a row (dies, cannot load its model, is not ready within
    ``start_timeout_s``) is given up: the judge is unreachable for the rest of the run and every later item scores 0
    in reward/n_error (the run goes on until ``reward.max_error_frac`` stops it). Kills at the wall-clock limit do
    not count: they are timeouts, not failures."""

    dtype: str = "bfloat16"
    """Weights' dtype on CUDA ("bfloat16" or "float32"); on CPU the judge runs in float32."""

    max_batch_rows: int = 64
    """Most rows decoded (generative, transformers engine) or scored (scalar) at once; a step's items are all
    handed over in one call and split into chunks of this size inside it."""

    @property
    def in_process(self) -> bool:
        """The generative judge's engine runs in the rank's own process (not in a judge process)."""
        return self.engine == "hf" and not self.isolate

    def check_files(self) -> None:
        """The checkpoint folder exists (checked where the run starts, not where a config is only planned)."""
        if not os.path.isfile(os.path.join(os.path.expanduser(self.model), "config.json")):
            raise ValueError(f"reward.judge.model={self.model!r} is not a checkpoint folder (no config.json)")

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("reward.judge.model must name a Hugging Face checkpoint folder")
        if self.kind not in JUDGE_KINDS:
            raise ValueError(f"reward.judge.kind must be one of {JUDGE_KINDS}, got {self.kind!r}")
        if self.parse not in PARSE_MODES:
            raise ValueError(f"reward.judge.parse must be one of {PARSE_MODES}, got {self.parse!r}")
        if self.engine not in JUDGE_ENGINES:
            raise ValueError(f"reward.judge.engine must be one of {JUDGE_ENGINES}, got {self.engine!r}")
        if not isinstance(self.isolate, bool):
            raise ValueError(f"reward.judge.isolate must be true or false, got {self.isolate!r}")
        if self.kind == "scalar" and (self.engine != "hf" or self.isolate):
            raise ValueError(
                "reward.judge.engine and reward.judge.isolate apply to generative judges; a scalar reward model runs "
                "in the rank's process (leave them at engine=hf, isolate=false)"
            )
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 < g < 1.0:
            raise ValueError(f"reward.judge.gpu_memory_utilization must be a number in (0, 1), got {g!r}")
        if not isinstance(self.start_timeout_s, (int, float)) or not self.start_timeout_s > 0:
            raise ValueError(f"reward.judge.start_timeout_s must be a number > 0, got {self.start_timeout_s!r}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"reward.judge.dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        if not isinstance(self.template, str) or "{response}" not in self.template:
            raise ValueError("reward.judge.template must contain the {response} placeholder")
        try:
            self.template.format(question="", response="", reference="", reference_block="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"reward.judge.template: bad placeholder {e} (known: {{question}}, {{response}}, {{reference}}, "
                "{reference_block}; write {{ and }} for literal braces)"
            ) from None
        for name in ("max_tokens", "max_len", "max_batch_rows", "max_restarts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"reward.judge.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"reward.judge.temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"reward.judge.timeout_s must be a number > 0, got {self.timeout_s!r}")
        if not isinstance(self.scale, (int, float)) or not self.scale == self.scale or abs(self.scale) == float("inf"):
            raise ValueError(f"reward.judge.scale must be a finite number, got {self.scale!r}")


@dataclass
class MixTerm:
    """One term of ``reward.mix``: a reward and its weight."""

    fn: str = ""
    """A built-in rule reward ("exact_stop", "math", ...), a user function's dotted path, or "judge" (the
    ``reward.judge`` model)."""

    weight: float = 1.0
    """The term's weight: the reward is the sum of weight x term over the terms."""

    def __post_init__(self) -> None:
        if not isinstance(self.fn, str) or not self.fn.strip():
            raise ValueError(f"reward.mix: every term needs fn (a reward name), got {self.fn!r}")
        if self.fn == "mix":
            raise ValueError("reward.mix: a term cannot be 'mix' itself")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w != w or abs(w) == float("inf"):
            raise ValueError(f"reward.mix: term {self.fn!r} needs a finite number as weight, got {w!r}")
