"""Multi-turn rollouts: token-in / token-out trajectories through an environment (docs/agentic.md).

A trajectory is one id sequence ``prompt + action 1 + observation 1 + ... + action K``. Every turn the engine
continues from the exact ids so far (nothing is decoded and re-encoded: the trainer trains on the ids the engine
sampled), the environment answers the action with observation ids, which are appended. Each response token carries a
loss mask (1: sampled by the policy, 0: observation / template) and, for sampled tokens, the engine's log-prob (0.0
at observation tokens, where it is never read).

All trajectories of a share advance together: one ``generate`` call per turn over every trajectory still running
(the first turn samples ``n`` per prompt, later turns one continuation per trajectory), so the engine batches them.
Each (trajectory, turn) has its own seed key, so samples do not depend on how prompts are split over engines.

Limits, each counted when it ends a trajectory:
- ``max_turns`` assistant turns (``cut_max_turns``: the last turn's calls run and are counted, but their
  observation is not appended);
- ``budget`` response tokens in all (rollout.max_response_len, observations included): a turn is asked for at most
  the tokens left, and an observation that does not fit ends the trajectory with finish reason 'length'
  (``cut_budget``);
- ``max_turn_tokens`` per turn: a turn cut there ends the trajectory with finish reason 'length'
  (``cut_turn_tokens``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron_rlvr.agentic.environment import Action, Environment, Episode, ToolCallRecord
from megatron_rlvr.data.records import Example
from megatron_rlvr.rollout.engine import Completion, RolloutEngine, SamplingParams, sample_seed

CUTS = ("max_turns", "budget", "turn_tokens")
"""Why a trajectory was ended by a limit (``Trajectory.cut``)."""


@dataclass(frozen=True)
class MultiTurn:
    """The environment and the limits of multi-turn rollouts (built from the ``agent`` section)."""

    environment: Environment
    max_turns: int
    """Most assistant turns per trajectory."""
    budget: int
    """Most response tokens per trajectory, observations included (rollout.max_response_len)."""
    max_turn_tokens: int
    """Most tokens per assistant turn."""

    stop: tuple[str, ...] = ()
    """Extra stop strings of an assistant turn (the environment's that are not one token)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop token ids of an assistant turn (the environment's stop strings that are one token each: exact on
    every engine, and no detokenizer needed)."""

    @classmethod
    def build(cls, environment: Environment, tokenizer, max_turns: int, budget: int, max_turn_tokens: int):
        """Split the environment's stop strings into single tokens and the rest."""
        strings, ids = [], []
        for s in environment.stop:
            toks = tokenizer(s, add_special_tokens=False)["input_ids"]
            (ids.append(toks[0]) if len(toks) == 1 else strings.append(s))
        return cls(environment, max_turns, budget, max_turn_tokens, tuple(strings), tuple(ids))


@dataclass
class Trajectory:
    """One sample: its response ids after the prompt, with a loss mask and the engine's log-probs."""

    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """Per response token: 1 sampled by the policy (carries loss), 0 observation."""
    logprobs: list[float] = field(default_factory=list)
    """Per response token: the engine's log-prob (0.0 at observation tokens)."""
    finish_reason: str = "stop"
    """The last turn's (or 'length' when the budget cut an observation)."""
    final_text: str = ""
    """The last assistant turn's text: what the reward scores."""
    turns: int = 0
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    reward_terms: dict[str, float] = field(default_factory=dict)
    cut: str = ""
    """Which limit ended it ('' when the episode ended by itself)."""
    routes: object = None
    """The last turn's engine routes (they cover the whole trajectory: its prompt was everything before it)."""

    def add_action(self, c: Completion) -> None:
        self.response_ids += c.token_ids
        self.loss_mask += [1] * len(c.token_ids)
        self.logprobs += [float(x) for x in c.logprobs]
        self.finish_reason = c.finish_reason
        self.turns += 1
        if c.routes is not None:
            self.routes = c.routes

    def add_observation(self, ids: Sequence[int]) -> None:
        self.response_ids += list(ids)
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)


@dataclass
class _Running:
    prompt: list[int]
    traj: Trajectory
    episode: Episode
    key: int


def roll_out(
    engine: RolloutEngine,
    multi: MultiTurn,
    examples: Sequence[Example],
    prompts: Sequence[list[int]],
    params: SamplingParams,
    prompt_keys: Sequence[int],
    decode: Callable[[list[int]], str],
    generate_kw: dict | None = None,
) -> list[list[Trajectory]]:
    """``params.n`` trajectories per prompt (one list per prompt, in order). ``decode``: ids -> text (for the
    environment's parsing and the reward; never re-encoded). ``generate_kw``: passed to every ``generate`` call
    (``should_stop``)."""
    kw = dict(generate_kw or {})
    n = params.n
    out: list[list[Trajectory]] = [[] for _ in prompts]
    running: list[_Running] = []
    for i, (ex, p, key) in enumerate(zip(examples, prompts, prompt_keys)):
        for j in range(n):
            t = Trajectory()
            out[i].append(t)
            running.append(_Running(list(p), t, multi.environment.start(ex), key * n + j))
    turn = 0
    try:
        while running:
            if turn == 0:
                first = _turn(params, multi, max_tokens=min(multi.max_turn_tokens, multi.budget))
                results = engine.generate(prompts, first, prompt_keys=list(prompt_keys), **kw)
                completions = [c for r in results for c in r.completions]
            else:
                completions = _continue(engine, multi, running, params, turn, kw)
            running = [r for r, c in zip(running, completions) if _after_action(multi, r, c, decode)]
            turn += 1
    finally:
        for r in running:
            r.episode.close()
    return out


def demonstrate(multi: MultiTurn, example: Example, tokenizer, decode: Callable[[list[int]], str]) -> Trajectory | None:
    """The environment's demonstration for ``example`` (``Environment.demonstration``) as a trajectory, or None when
    it has none. Each demonstrated turn is tokenized on its own (the last one ended by the tokenizer's EOS) and goes
    through the same step as a sampled turn (:func:`_after_action`): the environment's episode answers it, its
    observation ids are appended with loss mask 0, its limits apply. So ids, loss mask, reward terms and tool calls
    are exactly those of a sampled trajectory with the same text. The log-probs are 0.0 placeholders: no engine
    sampled these tokens (the trainer computes their behaviour log-probs). ValueError when the demonstration does not
    end its episode at its last turn (within the limits)."""
    turns = multi.environment.demonstration(example)
    if turns is None:
        return None
    r = _Running([], Trajectory(), multi.environment.start(example), 0)
    running = True
    try:
        for k, text in enumerate(turns):
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if k == len(turns) - 1:
                ids.append(tokenizer.eos_token_id)
            running = _after_action(multi, r, Completion(ids, [0.0] * len(ids), "stop"), decode)
            if not running and k < len(turns) - 1:
                break
    finally:
        if running:
            r.episode.close()
    t = r.traj
    if running or t.turns != len(turns) or t.cut:
        raise ValueError(
            f"agent.guidance: the environment's demonstration for example {example.id!r} ({len(turns)} turns) ended "
            f"after turn {t.turns} (limit: {t.cut or 'none'}); it must end its episode exactly at its last turn"
        )
    return t


def _turn(params: SamplingParams, multi: MultiTurn, **kw) -> SamplingParams:
    """The sampling parameters of one assistant turn: the run's, with the environment's stops added."""
    return dataclasses.replace(
        params,
        stop=tuple(dict.fromkeys(params.stop + multi.stop)),
        stop_token_ids=tuple(dict.fromkeys(params.stop_token_ids + multi.stop_token_ids)),
        **kw,
    )


def _continue(engine, multi: MultiTurn, running: list[_Running], params: SamplingParams, turn: int, kw) -> list:
    """One more turn for every running trajectory, each from its exact ids so far and with the tokens it has left.
    Trajectories are grouped by that limit (one generate call per distinct limit, usually one)."""
    by_limit: dict[int, list[int]] = {}
    for k, r in enumerate(running):
        left = multi.budget - len(r.traj.response_ids)
        by_limit.setdefault(min(multi.max_turn_tokens, left), []).append(k)
    completions: list = [None] * len(running)
    seed = None if params.seed is None else sample_seed(params.seed, turn, 0x7475726E)  # "turn"
    for limit, idx in by_limit.items():
        p = _turn(params, multi, n=1, max_tokens=limit, seed=seed)
        res = engine.generate(
            [running[k].prompt + running[k].traj.response_ids for k in idx],
            p,
            prompt_keys=[running[k].key for k in idx],
            **kw,
        )
        for k, r in zip(idx, res):
            completions[k] = r.completions[0]
    return completions


def _after_action(multi: MultiTurn, r: _Running, c: Completion, decode) -> bool:
    """Record the action and the environment's answer; whether the trajectory runs on."""
    t = r.traj
    t.add_action(c)
    text = decode(list(c.token_ids))
    t.final_text = text
    if c.finish_reason == "length":
        t.cut = "turn_tokens" if len(t.response_ids) < multi.budget else "budget"
        return _end(r)
    obs = r.episode.step(Action(tuple(c.token_ids), text, c.finish_reason))
    t.tool_calls += obs.tool_calls
    for k, v in obs.reward_terms.items():
        t.reward_terms[k] = t.reward_terms.get(k, 0.0) + float(v)
    if obs.done:
        return _end(r)
    if t.turns >= multi.max_turns:  # still acting after its last turn: its observation is not appended
        t.cut = "max_turns"
        return _end(r)
    if len(t.response_ids) + len(obs.token_ids) >= multi.budget:  # no room for the observation and another turn
        t.cut, t.finish_reason = "budget", "length"
        return _end(r)
    t.add_observation(obs.token_ids)
    return True


def _end(r: _Running) -> bool:
    r.episode.close()
    return False
