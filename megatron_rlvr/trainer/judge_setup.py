"""Build the reward judge of ``reward.judge`` on the rollout side of an engine leader: a generative judge served by
the transformers rollout engine in the rank's process, or by the transformers or vLLM engine in a judge process of
its own (rollout/judge_process.py), or a scalar reward model, on the rank's device beside the policy's engine. With
``parallel.judge_ranks`` the same judge is built on each judge rank instead, which serves the engine leaders
(:func:`judge_role`, over rollout/judge_ranks.py)."""

from __future__ import annotations

import itertools
import json
import os

import torch

from megatron_rlvr.config import RunConfig
from megatron_rlvr.megatron.roles import Roles
from megatron_rlvr.rewards.judge import GenerativeJudge, ScalarRewardModel
from megatron_rlvr.rewards.judge_config import JudgeConfig
from megatron_rlvr.rewards.reward_config import RewardConfig
from megatron_rlvr.rollout.engine import GenerationStopped, RolloutEngine, SamplingParams
from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine
from megatron_rlvr.rollout.judge_process import JudgeProcess
from megatron_rlvr.rollout.judge_ranks import serve_judge
from megatron_rlvr.rundir.signals import StopSignals
from megatron_rlvr.trainer.run_life import set_cpu_threads

__all__ = ["build_judge", "engine_judge", "judge_role", "process_judge"]


def engine_judge(cfg: JudgeConfig, engine: RolloutEngine, tokenizer, seed: int = 0) -> GenerativeJudge:
    """A generative judge served by ``engine``: one ``generate`` call per step with all its items (one sample
    each, ``max_tokens`` and ``temperature`` from ``cfg``), interrupted between decode steps when the judge's
    ``should_stop`` (its wall-clock limit or a stop request) says so, where the engine is interruptible."""
    calls = itertools.count()

    def generate(prompt_ids: list[list[int]], should_stop) -> list[str] | None:
        # a new seed per call: a sampling judge must not draw the same noise for a prompt index every step
        params = SamplingParams(**_sampling(cfg, seed + next(calls)))
        kw = {"should_stop": should_stop} if engine.interruptible else {}
        try:
            outputs = engine.generate(prompt_ids, params, **kw)
        except GenerationStopped:
            return None
        replies = []
        for out in outputs:
            c = out.completions[0]
            replies.append(c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True))
        return replies

    return GenerativeJudge(cfg, tokenizer, generate, closer=engine.close)


def _sampling(cfg: JudgeConfig, seed: int) -> dict:
    return dict(n=1, temperature=float(cfg.temperature), max_tokens=cfg.max_tokens, seed=seed)


def process_judge(cfg: JudgeConfig, device: torch.device, seed: int = 0) -> GenerativeJudge:
    """A generative judge whose engine (``cfg.engine``) runs in a child process (``JudgeProcess``): one batched
    request per step; past the judge's wall-clock limit the child is killed and restarted, and the batch is scored
    as timed out by ``GenerativeJudge``; a dead or unstartable child makes the batch's items errors."""
    from transformers import AutoTokenizer

    with open(os.path.join(os.path.expanduser(cfg.model), "config.json")) as f:
        hf = json.load(f)
    longest = cfg.max_len + cfg.max_tokens
    positions = hf.get("max_position_embeddings") or hf.get("text_config", {}).get("max_position_embeddings")
    on_cpu = device.type == "cpu"
    spec = dict(
        engine=cfg.engine,
        model=os.path.expanduser(cfg.model),
        dtype="float32" if on_cpu else cfg.dtype,
        device=str(device),
        max_batch_rows=cfg.max_batch_rows,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        seed=seed,
        max_model_len=min(longest, int(positions)) if positions else longest,
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    proc = JudgeProcess(spec, start_timeout_s=cfg.start_timeout_s, max_restarts=cfg.max_restarts)
    calls = itertools.count()

    def generate(prompt_ids: list[list[int]], should_stop) -> list[str] | None:
        # a new seed per call, as engine_judge
        return proc.generate(prompt_ids, _sampling(cfg, seed + next(calls)), should_stop)

    judge = GenerativeJudge(cfg, tokenizer, generate, closer=proc.close)
    judge.process = proc
    return judge


def build_judge(cfg: RewardConfig, device: torch.device, seed: int = 0):
    """The judge of ``cfg.judge`` on ``device`` (None when the reward does not use one)."""
    if not cfg.uses_judge:
        return None
    j = cfg.judge
    on_cpu = device.type == "cpu"
    if j.kind == "scalar":
        return ScalarRewardModel.from_pretrained(j, device=str(device))
    if not j.in_process:
        return process_judge(j, device, seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if on_cpu or j.dtype == "float32" else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(j.model)
    model = AutoModelForCausalLM.from_pretrained(j.model, dtype=dtype)
    engine_cfg = HFEngineConfig(max_batch_rows=j.max_batch_rows, device=str(device))
    engine = HFRolloutEngine(model, tokenizer, config=engine_cfg)
    return engine_judge(j, engine, tokenizer, seed)


def judge_role(cfg: RunConfig, roles: Roles) -> int:
    """A judge rank (``parallel.judge_ranks``): build the judge of ``reward.judge`` on this rank's device, answer the
    engine leaders' requests until each has said stop, then meet every rank at Roles.close; returns 0. Stop signals
    are the training ranks' to act on: a judge rank keeps serving until the scorers stop it. A scorer that dies
    raises PeerLost here (the rank exits with an error and the launcher ends the job)."""
    signals = StopSignals().install()
    set_cpu_threads(cfg, roles.world_size)
    if roles.rollout_ranks:  # the disaggregated roles resolve the policy's source together (a whole-job barrier)
        roles.barrier("model_source")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    judge = build_judge(cfg.reward, device, cfg.train.seed)
    where = f"judge rank {roles.role_rank} (global rank {roles.rank})"
    print(f"megatron-rlvr: {where}: serving reward.judge to {len(roles.scorer_ranks)} engine leader(s)", flush=True)
    try:
        served = serve_judge(judge, roles.judge_links, roles.scorer_ranks)
        print(f"megatron-rlvr: {where}: stopped after {served} requests", flush=True)
    finally:
        signals.uninstall()
        judge.close()
    roles.close(cfg.launch.collective_timeout_s)
    return 0
