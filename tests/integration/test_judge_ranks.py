"""A reward judge on ranks of its own (``parallel.judge_ranks``, rollout/judge_ranks.py) on gloo ranks: the scorer
(rank 0) reaches the judge through ``RemoteJudge`` inside a RewardManager, the judge rank(s) answer with
``serve_judge``, over pair groups as ``megatron.roles`` makes them. Checked against the same judge built in the
scorer's own process on the same items (exact equality: the judge rank runs the same code on the same weights), the
last-token judge's hand-known verdicts, a judge that answers past its wall-clock limit (its items are timeouts, the
next batch is scored, the late reply is dropped), a batch split over two judge ranks (each rank judges its
contiguous share; the results come back in the batch's order), and a judge rank that dies while judging (the scorer
raises PeerLost naming it within seconds)."""

import time

import judge_helpers
import pytest
import torch

from megatron_rlvr.testing.distributed import run_distributed

PLAIN = dict(template="{question}{response}", chat=False)
QUESTIONS = ["1=", "3=", "4=", "9=", "2+5="]
RESPONSES = ["7", "3", "17", "x", "7"]
REFERENCES = ["0"] * 5


@pytest.fixture(scope="module")
def judges(tmp_path_factory):
    root = tmp_path_factory.mktemp("judges")
    return {
        "last7": judge_helpers.save_last_token_judge(root / "g7", "generative"),
        "random_scalar": judge_helpers.save_random_judge(root / "rs", "scalar", seed=4),
    }


def _pairs(scorer: int, judge_ranks: list[int]):
    """This rank's pair groups {scorer, judge rank}, made as megatron.roles makes them (over the job's store)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from megatron_rlvr.megatron.roles import judge_pair_groups

    store = dist.PrefixStore("test/", c10d._get_default_store())
    return judge_pair_groups(store, dist.get_rank(), [scorer], judge_ranks, timedelta(seconds=120))


def _reward_config(jc_kwargs: dict):
    from megatron_rlvr.rewards import RewardConfig
    from megatron_rlvr.rewards.judge_config import JudgeConfig

    return RewardConfig(fn="judge", judge=JudgeConfig(**jc_kwargs), num_workers=0, max_error_frac=1.0)


class _Recording:
    """A judge (rewards.judge.Judge) that records the responses it was asked to score, then asks ``inner``."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def score(self, questions, responses, references, should_stop=None):
        self.seen.append(list(responses))
        return self.inner.score(questions, responses, references, should_stop)

    def close(self):
        self.inner.close()


def _same_scores(configs: list[dict], judge_ranks: list[int]):
    """Rank 0 scores the items through the judge ranks, once per judge config, and in its own process; the judge
    ranks serve each config in turn. Returns (remote, local) results on rank 0, the responses each request carried
    on a judge rank."""
    import torch.distributed as dist

    from megatron_rlvr.rewards import RewardManager
    from megatron_rlvr.rollout.judge_ranks import RemoteJudge, serve_judge
    from megatron_rlvr.trainer.judge_setup import build_judge

    links = _pairs(0, judge_ranks)
    out = []
    for jc in configs:
        rc = _reward_config(jc)
        if dist.get_rank() == 0:
            rm = RewardManager(rc, report=lambda text: None, judge=RemoteJudge(rc.judge, links, judge_ranks))
            with rm:
                remote = rm.score_detailed(RESPONSES, REFERENCES, questions=QUESTIONS)
            local_judge = build_judge(rc, torch.device("cpu"))
            with RewardManager(rc, report=lambda text: None, judge=local_judge) as local_rm:
                local = local_rm.score_detailed(RESPONSES, REFERENCES, questions=QUESTIONS)
            out.append((remote, local))
        elif links:
            judge = _Recording(build_judge(rc, torch.device("cpu")))
            serve_judge(judge, links)
            judge.close()
            out.append(judge.seen)
    return out


def test_a_judge_rank_scores_exactly_as_the_same_judge_in_process(judges):
    """One judge rank serving a scalar reward model (random weights: real-valued rewards), then the generative
    last-token judge: every item's reward and status through the judge rank equals the same judge's in the scorer's
    own process, and the generative one gives the hand-known verdicts (1 exactly for inputs ending in 7)."""
    configs = [
        dict(model=judges["random_scalar"], kind="scalar", scale=3.0, **PLAIN),
        dict(model=judges["last7"], parse="number", max_tokens=1, **PLAIN),
    ]
    results = run_distributed(_same_scores, 2, args=(configs, [1]), timeout=240)
    (scalar_remote, scalar_local), (gen_remote, gen_local) = results[0]
    assert [(r.reward, r.status) for r in scalar_remote] == [(r.reward, r.status) for r in scalar_local]
    assert all(r.status == "ok" for r in scalar_remote) and len({r.reward for r in scalar_remote}) > 2
    assert [(r.reward, r.status) for r in gen_remote] == [(r.reward, r.status) for r in gen_local]
    assert [r.reward for r in gen_remote] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert results[1] == [[RESPONSES], [RESPONSES]]  # one request per batch, the whole batch


def test_a_batch_split_over_two_judge_ranks_comes_back_in_order(judges):
    """Two judge ranks serving the same scalar reward model: the scorer sends the first 3 items to judge rank 0
    (global rank 1) and the last 2 to judge rank 1 (global rank 2), and the results, put back in the batch's order,
    equal the in-process judge's on the whole batch."""
    configs = [dict(model=judges["random_scalar"], kind="scalar", scale=3.0, **PLAIN)]
    results = run_distributed(_same_scores, 3, args=(configs, [1, 2]), timeout=240)
    ((remote, local),) = results[0]
    assert [r.status for r in remote] == [r.status for r in local]
    # batches of 3 and 2 against one of 5: the judge's matmuls take other shapes, whose fp32 sums may round otherwise
    # (on AMX CPUs oneDNN picks its kernels by shape: 4e-9 apart measured), so equal to 1e-6 rather than bit for bit;
    # the items' rewards lie far further apart than that, so the order is still checked
    assert [r.reward for r in remote] == pytest.approx([r.reward for r in local], rel=1e-6, abs=1e-6)
    rewards = sorted(r.reward for r in local)
    assert min(b - a for a, b in zip(rewards, rewards[1:])) > 1e-3, rewards
    assert results[1] == [[RESPONSES[:3]]] and results[2] == [[RESPONSES[3:]]]


def _late_judge(folder: str, sleep_s: float, timeout_s: float, margin_s: float):
    """The judge rank's judge sleeps ``sleep_s`` in its first generate call (past the scorer's wait), then answers
    at once; the scorer scores a batch, waits for the late reply to land, scores another."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from megatron_rlvr.rewards import RewardManager
    from megatron_rlvr.rewards.judge import GenerativeJudge
    from megatron_rlvr.rollout.judge_ranks import RemoteJudge, serve_judge

    links = _pairs(0, [1])
    rc = _reward_config(dict(model=folder, parse="number", max_tokens=1, timeout_s=timeout_s, **PLAIN))
    if dist.get_rank() == 1:
        calls = []

        def generate(prompt_ids, should_stop):
            calls.append(len(prompt_ids))
            if len(calls) == 1:
                time.sleep(sleep_s)  # not interruptible: the reply comes late
            return ["1", "0", "0.25"][: len(prompt_ids)]

        serve_judge(GenerativeJudge(rc.judge, AutoTokenizer.from_pretrained(folder), generate), links)
        return calls
    remote = RemoteJudge(rc.judge, links, [1], margin_s=margin_s)
    with RewardManager(rc, report=lambda text: None, judge=remote) as rm:
        t0 = time.monotonic()
        first, first_stats = rm.score(RESPONSES[:3], REFERENCES[:3], questions=QUESTIONS[:3])
        waited = time.monotonic() - t0
        time.sleep(sleep_s + 1.0)  # the late reply lands meanwhile
        second, second_stats = rm.score(RESPONSES[:3], REFERENCES[:3], questions=QUESTIONS[:3])
        late = remote.late_replies
    return first, first_stats["reward/n_timeout"], waited, second, second_stats["reward/n_timeout"], late


def test_a_judge_rank_past_the_limit_counts_timeouts_and_the_next_batch_is_scored(judges):
    """The judge rank's first answer comes 3 s late (timeout_s 0.3 s + margin 0.3 s): the scorer gives up after
    about 0.6 s, the 3 items score 0 and count as reward/n_timeout, and nothing raises. The next batch gets the
    judge's replies ("1", "0", "0.25" -> 1, 0, 0.25); the late reply is recognised by its request id and dropped."""
    results = run_distributed(_late_judge, 2, args=(judges["last7"], 3.0, 0.3, 0.3), timeout=240)
    first, n_timeout, waited, second, n_timeout2, late = results[0]
    assert first == [0.0, 0.0, 0.0] and n_timeout == 3
    assert 0.55 < waited < 2.5
    assert second == [1.0, 0.0, 0.25] and n_timeout2 == 0
    assert late == 1
    assert results[1] == [3, 3]


def _dead_judge(report: str):
    """The judge rank exits (status 3) once it has the request; the scorer writes what its score call raised, and
    how long it took, to ``report``."""
    import os

    import torch.distributed as dist

    from megatron_rlvr.rewards.judge_config import JudgeConfig
    from megatron_rlvr.rollout.bridge import recv_object
    from megatron_rlvr.rollout.judge_ranks import RemoteJudge

    links = _pairs(0, [1])
    if dist.get_rank() == 1:
        recv_object(links[0], 0)  # the request arrives; the rank dies while judging it
        os._exit(3)
    remote = RemoteJudge(JudgeConfig(model="unused", timeout_s=60.0), links, [1])
    t0 = time.monotonic()
    try:
        remote.score(QUESTIONS, RESPONSES, REFERENCES)
        what = "no error"
    except Exception as e:  # noqa: BLE001 - the test reads it
        what = f"{type(e).__name__}: {e}"
    with open(report, "w") as f:
        f.write(f"{time.monotonic() - t0:.3f}\n{what}")


def test_a_dead_judge_rank_ends_the_scorer_with_a_line_naming_it(tmp_path):
    """A judge rank whose process exits while judging: the scorer's score call raises PeerLost naming the judge rank
    (judge rank 0, global rank 1) within seconds, not after the judge's 60 s limit: the scorer's rank exits and the
    job ends, as for a dead rollout rank."""
    from megatron_rlvr.testing.distributed import DistributedError

    report = tmp_path / "scorer.txt"
    with pytest.raises(DistributedError, match="died without reporting"):
        run_distributed(_dead_judge, 2, args=(str(report),), timeout=120)
    took, what = report.read_text().split("\n", 1)
    assert what.startswith("PeerLost: the channel to judge rank 0 (global rank 1) failed"), what
    assert float(took) < 20.0
