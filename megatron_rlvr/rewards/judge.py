"""Model-judged rewards, scored in the rank's own process in one batched call per step.

- :class:`GenerativeJudge`: a causal LM writes a reply to a prompt built from ``reward.judge.template`` (question,
  reference answer, response); :func:`parse_verdict` reads the reply as a reward in [0, 1]. The model is served by a
  rollout engine; this module sees it only as ``generate(prompt_ids, should_stop) -> replies | None`` (the rollout
  package builds that from an engine: ``rollout.judge_engine``), so the rewards package stays below the rollout one.
- :class:`ScalarRewardModel`: an ``AutoModelForSequenceClassification`` checkpoint with one output; the reward is
  ``scale`` x the logit it gives (prompt, response).

Failure path: nothing here raises for a bad item or a broken model. Each item gets an :class:`ItemResult`: a reply
the parser cannot read -> status "unparsed" (reward/n_judge_unparsed), the batch past ``reward.judge.timeout_s`` ->
"timeout" (reward/n_timeout), a judge engine or model that raises -> "error" (reward/n_error); all score 0 and count
towards ``reward.max_error_frac``. Only a stop request (``should_stop``) raises (:class:`ScoringStopped`).
"""

from __future__ import annotations

import math
import re
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Protocol

from megatron_rlvr.rewards.judge_config import JudgeConfig
from megatron_rlvr.rewards.pool import ItemResult, ScoringStopped

__all__ = [
    "GenerativeJudge",
    "Judge",
    "ScalarRewardModel",
    "parse_verdict",
    "question_text",
    "render_judge_input",
]

GenerateFn = Callable[[list[list[int]], Callable[[], bool]], list[str] | None]
"""``generate(prompt_ids, should_stop)``: one reply text per prompt, in order, from ONE engine call; None when the
engine was interrupted because ``should_stop()`` returned True."""


class Judge(Protocol):
    """What the reward manager needs of a judge, wherever it runs: :class:`GenerativeJudge` and
    :class:`ScalarRewardModel` in the rank's process, or the scorer side of a judge on ranks of its own
    (``rollout.judge_ranks.RemoteJudge``)."""

    def score(
        self,
        questions: Sequence[str],
        responses: Sequence[str],
        references: Sequence[str],
        should_stop: Callable[[], bool] | None = None,
    ) -> list[ItemResult]:
        """One result per item, in order; failures are results (status timeout / error / unparsed / nonfinite),
        never exceptions, except ScoringStopped when ``should_stop()`` says so."""
        ...

    def close(self) -> None:
        """Free what the judge holds; idempotent."""
        ...


_VERDICT = re.compile(r"verdict\s*[:=]\s*\**\s*(correct|incorrect)\b", re.IGNORECASE)
_SCORE = re.compile(r"score\s*[:=]\s*\**\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_verdict(reply: str, mode: str) -> float | None:
    """The reward a judge's ``reply`` gives, or None when it cannot be read.

    ``verdict``: the LAST "Verdict: correct" (1.0) or "Verdict: incorrect" (0.0), case-insensitive (a judge that
    reasons first may quote the format before its own answer). ``score``: the last "Score: x" with x in [0, 1].
    ``number``: the whole reply, stripped, is a number in [0, 1]."""
    if mode == "verdict":
        found = _VERDICT.findall(reply)
        return None if not found else (1.0 if found[-1].lower() == "correct" else 0.0)
    if mode == "score":
        found = _SCORE.findall(reply)
        value = float(found[-1]) if found else None
    elif mode == "number":
        text = reply.strip()
        value = float(text) if _NUMBER.fullmatch(text) else None
    else:
        raise ValueError(f"unknown judge parse mode {mode!r}")
    if value is None or not (0.0 <= value <= 1.0):
        return None
    return value


def question_text(prompt) -> str:
    """The question an example asks: its prompt text, or for chat-format prompts the last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else ""


def render_judge_input(template: str, question: str, response: str, reference: str) -> str:
    """``template`` with its placeholders filled (``JudgeConfig.template``)."""
    block = f"Reference answer:\n{reference}\n\n" if reference.strip() else ""
    return template.format(question=question, response=response, reference=reference, reference_block=block)


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _engine_failure(e: BaseException, what: str) -> ItemResult:
    detail = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-12))[-4000:]
    return ItemResult(0.0, "error", f"{what} failed: {type(e).__name__}: {e}"[:1000], detail)


def _timeout(cfg: JudgeConfig, what: str) -> ItemResult:
    return ItemResult(0.0, "timeout", f"{what} ran past reward.judge.timeout_s={cfg.timeout_s:g} s")


class GenerativeJudge:
    """A generative judge: templates -> judge prompts -> one batched generate -> parsed rewards."""

    def __init__(
        self,
        cfg: JudgeConfig,
        tokenizer,
        generate: GenerateFn,
        clock: Callable[[], float] = time.monotonic,
        closer: Callable[[], None] | None = None,
    ):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.generate = generate
        self.clock = clock
        self._closer = closer
        self.last_replies: list[str | None] = []
        """The replies of the last batch (None where an item got none), for inspection."""
        self.process = None
        """The judge process serving ``generate`` when the engine runs in one (``rollout.judge_process``), for
        inspection; None for an in-process engine."""

    def close(self) -> None:
        """Free the engine behind ``generate`` (when one was given to close); idempotent."""
        closer, self._closer = self._closer, None
        if closer is not None:
            closer()

    def prompt_ids(self, question: str, response: str, reference: str) -> list[int]:
        """The judge's input token ids for one item."""
        text = render_judge_input(self.cfg.template, question, response, reference)
        if self.cfg.chat and _has_chat_template(self.tokenizer):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(text)["input_ids"])

    def score(
        self,
        questions: Sequence[str],
        responses: Sequence[str],
        references: Sequence[str],
        should_stop: Callable[[], bool] | None = None,
    ) -> list[ItemResult]:
        """One result per item, in order; all items in one generate call."""
        n = len(responses)
        results: list[ItemResult | None] = [None] * n
        self.last_replies = [None] * n
        batch, where = [], []
        for i, (q, r, ref) in enumerate(zip(questions, responses, references)):
            try:
                ids = self.prompt_ids(q, r, ref)
            except Exception as e:  # a template or tokenizer failure on this item's text
                results[i] = _engine_failure(e, "building the judge's input")
                continue
            if not ids or len(ids) > self.cfg.max_len:
                results[i] = ItemResult(
                    0.0, "error", f"judge input of {len(ids)} tokens (reward.judge.max_len={self.cfg.max_len})"
                )
                continue
            batch.append(ids)
            where.append(i)
        if batch:
            deadline = self.clock() + self.cfg.timeout_s
            user_stop = should_stop or (lambda: False)

            def stop() -> bool:
                return self.clock() > deadline or user_stop()

            try:
                replies = self.generate(batch, stop)
                failure = None
            except Exception as e:  # an unreachable or crashing judge engine: every item of the call fails
                replies, failure = None, _engine_failure(e, "the judge engine")
            if replies is None and failure is None and user_stop():
                raise ScoringStopped("scoring stopped: a stop was requested")
            if failure is None and (replies is None or self.clock() > deadline):
                failure = _timeout(self.cfg, "the judge")
            if failure is None and len(replies) != len(batch):
                failure = ItemResult(0.0, "error", f"the judge engine gave {len(replies)} replies for {len(batch)}")
            for k, i in enumerate(where):
                if failure is not None:
                    results[i] = failure
                    continue
                reply = replies[k]
                self.last_replies[i] = reply
                value = parse_verdict(reply, self.cfg.parse)
                if value is None:
                    why = f"judge reply not readable as reward.judge.parse={self.cfg.parse}: {reply!r:.300}"
                    results[i] = ItemResult(0.0, "unparsed", why)
                else:
                    results[i] = ItemResult(value, "ok")
        return results  # type: ignore[return-value]


class ScalarRewardModel:
    """A sequence-classification reward model: reward = ``scale`` x its logit for the (prompt, response) text.

    Rows are right-padded (real tokens keep their positions; causal attention never sees the padding) and the model
    pools its own way: with ``pad_token_id`` in its config, at the last token that is not a pad (the padded row then
    gives what the unpadded one gives); without one, at the last token, and a row that ends in the id used for
    padding is scored alone, unpadded."""

    def __init__(self, cfg: JudgeConfig, model, tokenizer, device=None, clock: Callable[[], float] = time.monotonic):
        import torch

        self.cfg = cfg
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = device if device is not None else next(model.parameters()).device
        self.clock = clock
        self._torch = torch
        n_out = int(getattr(model.config, "num_labels", 1))
        if n_out != 1:
            raise ValueError(f"reward.judge.kind=scalar needs a model with one output (num_labels=1), got {n_out}")
        self._own_pad = model.config.pad_token_id
        pad = self._own_pad
        for cand in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None), 0):
            if pad is None and cand is not None:
                pad = cand
        self.pad_id = int(pad)

    @classmethod
    def from_pretrained(cls, cfg: JudgeConfig, device: str = "cpu") -> ScalarRewardModel:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        dtype = torch.float32 if str(device) == "cpu" or cfg.dtype == "float32" else torch.bfloat16
        model = AutoModelForSequenceClassification.from_pretrained(cfg.model, dtype=dtype).to(device)
        return cls(cfg, model, AutoTokenizer.from_pretrained(cfg.model), device)

    def close(self) -> None:
        """Drop the model (frees its device memory once nothing else holds it)."""
        self.model = None

    def input_ids(self, question: str, response: str, reference: str) -> list[int]:
        """The model's input for one item (its last ``max_len`` tokens)."""
        tok = self.tokenizer
        if self.cfg.chat and _has_chat_template(tok):
            msgs = [{"role": "user", "content": question}, {"role": "assistant", "content": response}]
            ids = list(tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"])
        else:
            ids = list(tok(render_judge_input(self.cfg.template, question, response, reference))["input_ids"])
        return ids[-self.cfg.max_len :]

    def _forward(self, rows: list[list[int]]) -> list[float]:
        torch = self._torch
        L = max(len(r) for r in rows)
        ids_BL = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        mask_BL = torch.zeros((len(rows), L), dtype=torch.long)
        for b, r in enumerate(rows):
            ids_BL[b, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask_BL[b, : len(r)] = 1
        cfg = self.model.config
        cfg.pad_token_id = self.pad_id if len(rows) > 1 or self._own_pad is not None else None
        try:
            with torch.no_grad():
                out = self.model(input_ids=ids_BL.to(self.device), attention_mask=mask_BL.to(self.device))
        finally:
            cfg.pad_token_id = self._own_pad
        return [float(x) * self.cfg.scale for x in out.logits.float().reshape(len(rows)).tolist()]

    def score(
        self,
        questions: Sequence[str],
        responses: Sequence[str],
        references: Sequence[str],
        should_stop: Callable[[], bool] | None = None,
    ) -> list[ItemResult]:
        """One result per item, in order, scored in chunks of ``max_batch_rows``; items left when
        ``reward.judge.timeout_s`` has passed get "timeout"."""
        n = len(responses)
        results: list[ItemResult | None] = [None] * n
        rows: list[tuple[int, list[int]]] = []
        for i, (q, r, ref) in enumerate(zip(questions, responses, references)):
            try:
                ids = self.input_ids(q, r, ref)
            except Exception as e:
                results[i] = _engine_failure(e, "building the reward model's input")
                continue
            if not ids:
                results[i] = ItemResult(0.0, "error", "the reward model's input is empty")
                continue
            rows.append((i, ids))
        solo = self._own_pad is None
        groups = [[x] for x in rows if solo and x[1][-1] == self.pad_id]
        batched = [x for x in rows if not (solo and x[1][-1] == self.pad_id)]
        size = self.cfg.max_batch_rows
        groups += [batched[k : k + size] for k in range(0, len(batched), size)]
        deadline = self.clock() + self.cfg.timeout_s
        for chunk in groups:
            if should_stop is not None and should_stop():
                raise ScoringStopped("scoring stopped: a stop was requested")
            if self.clock() > deadline:
                for i, _ in chunk:
                    results[i] = _timeout(self.cfg, "the reward model")
                continue
            try:
                values = self._forward([ids for _, ids in chunk])
            except Exception as e:
                failure = _engine_failure(e, "the reward model")
                for i, _ in chunk:
                    results[i] = failure
                continue
            for (i, _), v in zip(chunk, values):
                if math.isfinite(v):
                    results[i] = ItemResult(v, "ok")
                else:
                    results[i] = ItemResult(0.0, "nonfinite", f"the reward model gave {v}")
        return results  # type: ignore[return-value]
