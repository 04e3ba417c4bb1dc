"""Partial rollouts (in-flight weight updates): a generation that spans a weight update continues under the new
weights instead of finishing under the old ones.

Works with any :class:`~megatron_rlvr.rollout.engine.RolloutEngine` without touching its internals: generate in
chunks of ``chunk_tokens`` tokens per sample; between chunks ``between_chunks()`` loads whatever weight version has
arrived (the disaggregated schedule's rollout ranks), then every unfinished sample continues from prompt + its
tokens so far (a re-prefill of that prefix under the new weights, so no KV cache computed by the old weights is
reused). Each token keeps the version that produced it (``Completion.versions``) and its behaviour log-prob from
the engine that produced it, which is what the loss's per-token importance ratios need (decoupled PPO, Hilton et
al. 2022; the same scheme as AReaL's interruptible generation, Fu et al. 2025).

Sampling stays deterministic for a given request seed: chunk 0 is one request with the caller's seed and
``prompt_keys`` (the n samples of a prompt share its prefill; its tokens are those of an unchunked generation's
first chunk). Chunk c >= 1 continues each unfinished sample (prompt i, sample j) as a one-sample request whose seed
derives from (request seed, c) and whose key is the sample's index ``key_i * n + j``: independent of batching and
of which other samples are still running.

Stop strings are checked here on the whole response (a string may span chunks); EOS and stop token ids by the
engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from megatron_rlvr.rollout.engine import (
    Completion,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    prompt_keys_or_default,
    sample_seed,
    validate_prompts,
)

_CHUNK_SEED_SALT = 0x5EED_C4A2
"""Mixed into chunk seeds so that chunk c's seeds never coincide with another request's (step, round) seeds."""


@dataclass
class _Sample:
    prompt: list[int]
    key: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: Completion | None = None


class PartialRolloutEngine(RolloutEngine):
    """Wraps a rollout engine: ``generate`` in chunks of ``chunk_tokens`` tokens with ``between_chunks()`` called
    between them; weights, memory and closing are the wrapped engine's.

    ``version()`` is the weight version the engine holds now; ``between_chunks()`` may load a newer one. It is called
    exactly ``ceil(max_tokens / chunk_tokens) - 1`` times per ``generate`` call, whether samples are still running
    or not, so that ranks that agree on versions with a collective inside it stay in step (and ``generate`` is
    called on every rank, even one without prompts: ``generate_on_every_rank``)."""

    generate_on_every_rank = True

    def __init__(
        self,
        engine: RolloutEngine,
        chunk_tokens: int,
        version: Callable[[], int],
        between_chunks: Callable[[], None],
        tokenizer=None,
    ):
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"PartialRolloutEngine: chunk_tokens must be a positive int, got {chunk_tokens!r}")
        self.engine, self.chunk_tokens, self.tokenizer = engine, chunk_tokens, tokenizer
        self.version, self.between_chunks = version, between_chunks

    @property
    def supports_sleep(self) -> bool:
        return self.engine.supports_sleep

    @property
    def supports_adapters(self) -> bool:
        return self.engine.supports_adapters

    def load_adapter(self, folder: str) -> float:
        return self.engine.load_adapter(folder)

    def update_weights(self, weights: Iterable) -> int:
        return self.engine.update_weights(weights)

    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.engine.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def close(self) -> None:
        self.engine.close()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        prompt_keys: Sequence[int] | None = None,
        images: Sequence[Sequence] | None = None,
    ) -> list[RolloutOutput]:
        if images is not None and any(images):
            raise ValueError("partial rollouts (rollout.partial_rollout_tokens) do not take images")
        if params.stop and self.tokenizer is None:
            raise ValueError("PartialRolloutEngine: SamplingParams.stop (stop strings) needs a tokenizer")
        prompts = validate_prompts(prompts) if len(prompts) else []
        keys = prompt_keys_or_default(prompt_keys, len(prompts))
        base_seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        C, n = self.chunk_tokens, params.n
        samples = [[_Sample(list(p), keys[i] * n + j) for j in range(n)] for i, p in enumerate(prompts)]
        flat = [s for row in samples for s in row]
        # stop strings are checked on the whole response here; the engine sees none (it would only see a chunk)
        chunk_params = replace(params, stop=(), include_stop_str_in_output=False)
        for c in range(math.ceil(params.max_tokens / C)):
            if c > 0:
                self.between_chunks()
            version = self.version()
            if c == 0 and prompts:
                outs = self.engine.generate(
                    prompts, replace(chunk_params, max_tokens=min(C, params.max_tokens), seed=base_seed), keys
                )
                for row, out in zip(samples, outs):
                    for s, comp in zip(row, out.completions):
                        self._extend(s, comp, version, params)
                continue
            running = [s for s in flat if s.done is None]
            if not running:
                continue
            seed = sample_seed(base_seed, _CHUNK_SEED_SALT, c)
            # one request per remaining length, so that no sample is asked for more than it may still generate
            by_left: dict[int, list[_Sample]] = {}
            for s in running:
                by_left.setdefault(min(C, params.max_tokens - len(s.tokens)), []).append(s)
            for left, group in by_left.items():
                p = replace(chunk_params, n=1, max_tokens=left, seed=seed)
                outs = self.engine.generate([s.prompt + s.tokens for s in group], p, [s.key for s in group])
                for s, out in zip(group, outs):
                    self._extend(s, out.completions[0], version, params)
        return [
            RolloutOutput(prompt_token_ids=list(p), completions=[s.done for s in row])
            for p, row in zip(prompts, samples)
        ]

    def _extend(self, s: _Sample, comp: Completion, version: int, params: SamplingParams) -> None:
        """Append one chunk's tokens to sample ``s``; mark it done on EOS / a stop token, a stop string or the
        length limit."""
        start = len(s.tokens)
        s.tokens += list(comp.token_ids)
        s.logprobs += [float(x) for x in comp.logprobs]
        s.versions += [version] * len(comp.token_ids)
        if params.stop:  # the first token whose prefix contains a stop string ends the sample there
            for t in range(start + 1, len(s.tokens) + 1):
                text = self.tokenizer.decode(s.tokens[:t], skip_special_tokens=True)
                hits = [(pos, st) for pos, st in ((text.find(st), st) for st in params.stop) if pos >= 0]
                if hits:
                    pos, st = min(hits)
                    cut = pos + len(st) if params.include_stop_str_in_output else pos
                    del s.tokens[t:], s.logprobs[t:], s.versions[t:]
                    s.done = self._completion(s, "stop", st, text[:cut])
                    return
        if comp.finish_reason == "stop":
            s.done = self._completion(s, "stop", comp.stop_reason)
        elif len(s.tokens) >= params.max_tokens:
            s.done = self._completion(s, "length", None)

    def _completion(self, s: _Sample, reason: str, stop_reason, text: str | None = None) -> Completion:
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(s.tokens, skip_special_tokens=True)
        return Completion(list(s.tokens), list(s.logprobs), reason, stop_reason, text, versions=list(s.versions))
