"""The rollout-engine interface shared by the vLLM (GPU) and transformers (CPU / reference) engines.

An engine generates completions for token-id prompts and receives new weights from the trainer as a stream of
(Hugging Face name, full tensor) pairs (see :mod:`megatron_rlvr.rollout.weight_stream`).

Log-prob convention (both engines, and what the trainer recomputes)
--------------------------------------------------------------------
``Completion.logprobs[t]`` is ``log_softmax(logits_t / temperature)[token_t]`` over the FULL (unpadded) vocabulary:
temperature-scaled, but NOT renormalised over the top-k / top-p candidate set, and without penalties. This is
exactly what the trainer computes with ``vocab_parallel_logprobs(logits, ids, temperature=T)``, so
``p_train / p_rollout`` measures only the train/inference numerical mismatch and the weight lag, never a
definition difference. With ``temperature == 0`` (greedy) the log-prob is ``log_softmax(logits)`` (T = 1).

vLLM's default ``logprobs_mode="raw_logprobs"`` ignores the temperature; ``processed_logprobs`` is after
temperature AND top-k/top-p filtering (vllm 0.33.0, ``vllm/v1/sample/ops/topk_topp_sampler.py``). It equals this
convention when top-k and top-p are off, which is the usual RL setting (a top-p rollout is off-policy w.r.t. the
full distribution the trainer optimises). The vLLM engine therefore refuses top-k/top-p unless explicitly allowed.

Images (vision-language policies): ``generate(..., images=...)`` takes one list of PIL RGB images per prompt, and
each prompt holds ONE ``<|image_pad|>`` per image (between ``<|vision_start|>`` and ``<|vision_end|>``), as the chat
template writes it. The engine expands each pad to the image's number of merged patches and returns that expanded
prompt in ``RolloutOutput.prompt_token_ids``: what the model saw, and what the trainer trains on. Engines without
image support raise a clear error when images are given.

Token-id convention (same as vLLM): ``token_ids`` hold every generated token, including the EOS / stop token id
that ended the sample and the token that completed a stop string; ``text`` (when a tokenizer is available) is
truncated before a matched stop string unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

FinishReason = Literal["stop", "length"]


@dataclass
class SamplingParams:
    """How to sample completions (the subset of vLLM's ``SamplingParams`` that RL rollouts need)."""

    n: int = 1
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with cumulative probability >= top_p (1.0 = off)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off, as in vllm 0.33)."""
    max_tokens: int = 256
    """Maximum number of generated tokens per sample; a sample that reaches it ends with finish reason 'length'."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends once the decoded completion contains one (needs a tokenizer)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample (in addition to the model's EOS ids unless ``ignore_eos``)."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS token ids."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string in ``Completion.text`` (token ids always include the completing token)."""
    seed: int | None = None
    """Seed for this request: same seed, prompts and weights -> same samples. None: nondeterministic."""

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be a positive int, got {self.n!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be a positive int, got {self.max_tokens!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be >= 0, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """True when top-k or top-p restricts the sampling distribution."""
        return self.top_k > 0 or self.top_p < 1.0


@dataclass
class Completion:
    """One sampled completion."""

    token_ids: list[int]
    """Generated token ids (including the EOS / stop token that ended it, see the module docstring)."""
    logprobs: list[float]
    """Per generated token: log_softmax(logits / temperature) over the full vocabulary, at the sampled id."""
    finish_reason: FinishReason
    """'stop' (EOS, a stop token id or a stop string) or 'length' (max_tokens reached)."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the sample; None for EOS-free 'length' endings and for EOS."""
    text: str | None = None
    """Decoded completion when the engine has a tokenizer."""
    routes: torch.Tensor | None = None
    """Mixture-of-experts models, when the engine was asked to return routes: [MoE layers, P + R - 1, k] int16, the
    top-k experts the engine's router chose for every token it ran (the prompt's P and every generated token but the
    last, which is never fed back), in layer order; None otherwise (routing replay R3)."""
    route_weights: torch.Tensor | None = None
    """With ``routes``: the gate weights [MoE layers, P + R - 1, k] float32 the engine multiplied those experts'
    outputs by (its router's output, in the order of ``routes``); None otherwise."""
    versions: list[int] | None = None
    """Per generated token: the weight version that produced it (partial rollouts, rollout.partial_rollout_tokens);
    None: all tokens come from the weights the engine held for the whole call."""

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"Completion has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(f"Completion has {len(self.token_ids)} token ids but {len(self.versions)} versions")


@dataclass
class RolloutOutput:
    """All samples of one prompt."""

    prompt_token_ids: list[int]
    """The prompt as the model saw it: with images, each ``<|image_pad|>`` expanded to the image's merged patches."""
    completions: list[Completion] = field(default_factory=list)


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int | None = None) -> list[list[int]]:
    """Check prompt token ids (non-empty lists of ints in [0, vocab_size)) and return them as plain lists."""
    if isinstance(prompts, torch.Tensor) or (len(prompts) > 0 and isinstance(prompts[0], int)):
        raise ValueError("prompts must be a sequence of token-id lists (one per prompt), not a flat list")
    out = []
    for i, p in enumerate(prompts):
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token id")
        lo, hi = min(ids), max(ids)
        if lo < 0 or (vocab_size is not None and hi >= vocab_size):
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): min {lo}, max {hi}")
        out.append(ids)
    return out


def validate_images(images, prompts: Sequence[Sequence[int]], image_token_id: int | None) -> list[list] | None:
    """Check ``images`` (None, or one list of PIL images per prompt) against the prompts: each prompt must hold
    exactly one ``image_token_id`` per image (unexpanded, as the chat template writes it), so a prompt with an image
    token but no image is refused too (the model would embed a placeholder). Returns the lists, or None when no
    prompt has an image."""
    if images is None:
        images = [[] for _ in prompts]
    else:
        images = [list(ims) for ims in images]
        if len(images) != len(prompts):
            raise ValueError(f"images has {len(images)} entries for {len(prompts)} prompts (one list per prompt)")
    if image_token_id is None:
        if any(images):
            raise ValueError("images were given, but this model has no image token (image_token_id): not a VL model")
        return None
    for i, (ids, ims) in enumerate(zip(prompts, images)):
        for j, im in enumerate(ims):
            if not (hasattr(im, "mode") and hasattr(im, "size")):
                raise ValueError(f"images[{i}][{j}] is a {type(im).__name__}, not a PIL image")
        pads = sum(1 for t in ids if t == image_token_id)
        if pads != len(ims):
            hint = ""
            if not ims:
                hint = " (an image placeholder without its image: pass the prompt's images)"
            elif pads > len(ims):
                hint = " (already expanded? pass one pad per image, as the chat template writes it)"
            raise ValueError(f"prompt {i} holds {pads} image tokens (id {image_token_id}) for {len(ims)} images{hint}")
    return images if any(images) else None


def prompt_keys_or_default(prompt_keys, n_prompts: int) -> list[int]:
    """Validated per-prompt seed keys (default 0..n-1)."""
    if prompt_keys is None:
        return list(range(n_prompts))
    keys = [int(k) for k in prompt_keys]
    if len(keys) != n_prompts:
        raise ValueError(f"prompt_keys has {len(keys)} entries for {n_prompts} prompts")
    if any(k < 0 for k in keys):
        raise ValueError("prompt_keys must be non-negative integers")
    return keys


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A per-sample seed derived from the request seed: samples are independent of batch composition and order.

    splitmix64-style mixing so neighbouring (prompt, sample) pairs get unrelated generator streams."""
    x = (seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + sample_index * 0x94D049BB133111EB) & (
        (1 << 64) - 1
    )
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    return x & ((1 << 63) - 1)


class GenerationStopped(Exception):
    """``generate`` returned nothing because its ``should_stop()`` returned True (a stop signal)."""


class RolloutEngine(abc.ABC):
    """Generation plus in-place weight updates. Implementations: HFRolloutEngine (CPU, reference), VLLMRolloutEngine.

    Life cycle in colocated RL: ``wake_up()`` -> ``update_weights(stream)`` -> ``generate(...)`` -> ``sleep()`` while
    the trainer runs -> ... -> ``close()``.

    What the trainer may ask of an engine beyond that is declared here, and each implementation states its own value:
    the trainer reads these attributes, it never probes for methods.
    """

    supports_sleep: bool = False
    """``sleep`` frees accelerator memory, so the trainer puts the engine to sleep while it trains (and a level-2
    sleep drops the weights: the next sync must bring all of them). False: sleep/wake are never called by the
    trainer."""
    generate_on_every_rank: bool = False
    """``generate`` runs collectives (e.g. weight agreement between the chunks of partial rollouts): every rank
    calls it, even one whose share of the prompts is empty."""
    supports_adapters: bool = False
    """``load_adapter`` serves a PEFT adapter folder on top of the loaded base weights (LoRA adapter sync)."""
    interruptible: bool = False
    """``generate`` takes ``should_stop`` (a callable) and, when it returns True between decode steps, abandons the
    batch with GenerationStopped: a stop signal does not wait for a long generation."""
    supports_weight_digests: bool = False
    """``weight_digests`` reads back the tensors it holds under their HF names (a verified weight sync compares them
    with what the trainer sent). False where the engine repacks what it loads (vLLM's fused layouts)."""

    @abc.abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        prompt_keys: Sequence[int] | None = None,
        images: Sequence[Sequence] | None = None,
    ) -> list[RolloutOutput]:
        """Sample ``params.n`` completions for each prompt (token ids); one RolloutOutput per prompt, in order.

        ``prompt_keys``: one integer per prompt (default: its position) from which, with ``params.seed``, the
        prompt's sampling seed is derived; passing global prompt indices makes samples independent of how prompts
        are split across engines (``rollout.groups`` does). ``images``: None, or one list of PIL images per prompt
        (see the module docstring: one ``<|image_pad|>`` per image in the prompt; the output's prompt is
        expanded)."""

    @abc.abstractmethod
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load full Hugging-Face-named tensors in place (consumed lazily, one tensor/bucket at a time). Every engine
        parameter must be received exactly once per call; returns the number of tensors loaded."""

    @abc.abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Release accelerator memory while the trainer runs. Level 1 keeps the weights (offloaded), level 2 drops
        them (the next ``update_weights`` must bring all of them). ``generate`` raises while asleep."""

    @abc.abstractmethod
    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Retake the memory released by ``sleep``: all of it, or only ``tags`` (``weights``, ``kv_cache``) where the
        engine holds them apart (wake the weights, update them, then the KV cache)."""

    def weight_digests(self, names: Iterable[str]) -> dict[str, int]:
        """The digest (``rollout.weight_check.digest``) of the tensor held under each HF name, read back from the
        engine's parameters. Only engines with ``supports_weight_digests``."""
        raise NotImplementedError(f"{type(self).__name__} cannot read back its weights (supports_weight_digests)")

    def load_adapter(self, folder: str) -> float:
        """Serve the PEFT adapter in ``folder`` from now on (reloaded in place when one is served already); returns
        the seconds it took. Only engines with ``supports_adapters``."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve LoRA adapters (supports_adapters is False)")

    @abc.abstractmethod
    def close(self) -> None:
        """Free everything; the engine cannot be used afterwards."""

    @property
    @abc.abstractmethod
    def is_sleeping(self) -> bool: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
