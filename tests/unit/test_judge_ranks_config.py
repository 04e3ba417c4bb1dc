"""``parallel.judge_ranks``: the option's checks (one line naming it), which ranks get the judge role
(megatron/roles.py: the LAST judge_ranks ranks, outside the training ranks), who scores, and how a batch is split
over the judge ranks (rollout/judge_ranks.py)."""

import pytest

from megatron_rlvr.config import ConfigError, ParallelConfig, check_layout, load_run_config
from megatron_rlvr.megatron.roles import JUDGE, ROLLOUT, TRAIN, Roles
from megatron_rlvr.rollout.judge_ranks import split_even

JUDGED = ["reward.fn=judge", "reward.judge.model=/ckpt/judge", "parallel.tp=1"]


@pytest.mark.parametrize("bad", [-1, "1", True, 1.0])
def test_judge_ranks_must_be_a_non_negative_int(bad):
    """Anything but an int >= 0 is refused, naming the option and the value."""
    with pytest.raises(ValueError, match=r"^parallel.judge_ranks must be an int >= 0, got "):
        ParallelConfig(judge_ranks=bad)


def test_judge_ranks_need_a_judged_reward():
    """judge_ranks with a rule reward is refused at load, naming the option and the reward."""
    with pytest.raises(ConfigError, match=r"parallel.judge_ranks=1 needs a reward that uses a judge.*'exact_stop'"):
        load_run_config("configs/tiny.yaml", ["parallel.judge_ranks=1"])


@pytest.mark.parametrize(
    "extra, world, ok",
    [
        ([], 1, False),  # the judge rank would take the only rank
        ([], 2, True),  # 1 training + 1 judge
        ([], 3, True),  # 2 training + 1 judge
        (["parallel.rollout_ranks=1"], 2, False),  # 1 rollout + 1 judge: no training rank
        (["parallel.rollout_ranks=1", "parallel.judge_ranks=2"], 4, True),  # 1 + 1 + 2
        (["parallel.tp=2"], 2, False),  # 1 training rank left: tp=2 does not divide it
        (["parallel.tp=2"], 3, True),  # 2 training ranks at tp=2 + 1 judge
    ],
)
def test_the_world_holds_training_rollout_and_judge_ranks(extra, world, ok):
    """check_layout counts the judge ranks out of the world before the training layout: a world without a training
    rank besides the rollout and judge ranks is refused naming judge_ranks; what is left must fit tp x cp x pp."""
    cfg = load_run_config("configs/tiny.yaml", ["parallel.judge_ranks=1", *JUDGED, *extra], check_files=False)
    if ok:
        check_layout(cfg, world)
        return
    with pytest.raises(ConfigError, match=r"parallel\.(judge_ranks|tp)"):
        check_layout(cfg, world)


def test_the_last_ranks_are_the_judge_ranks_and_the_engine_leaders_score():
    """World 7 = 3 training + 2 rollout (one engine of rollout_tp=2) + 2 judge ranks: roles by position, role ranks
    counted from each role's first rank, one scorer (the engine's first rank, 3); colocated (no rollout ranks) with
    rollout_tp=2: the scorers are training ranks 0 and 2."""
    roles = [Roles(rank=r, world_size=7, rollout_ranks=2, judge_ranks=2, rollout_tp=2) for r in range(7)]
    assert [x.role for x in roles] == [TRAIN] * 3 + [ROLLOUT] * 2 + [JUDGE] * 2
    assert [x.role_rank for x in roles] == [0, 1, 2, 0, 1, 0, 1]
    assert [x.role_size for x in roles] == [3, 3, 3, 2, 2, 2, 2]
    assert roles[0].scorer_ranks == [3] and roles[0].judge_global_ranks == [5, 6]
    colocated = Roles(rank=0, world_size=5, rollout_ranks=0, judge_ranks=1, rollout_tp=2)
    assert colocated.train_ranks == 4 and colocated.scorer_ranks == [0, 2] and colocated.judge_global_ranks == [4]


@pytest.mark.parametrize(
    "n, parts, expected",
    [(5, 2, [(0, 3), (3, 5)]), (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]), (1, 3, [(0, 1), (1, 1), (1, 1)])],
)
def test_a_batch_splits_into_contiguous_near_equal_shares(n, parts, expected):
    """split_even: contiguous shares covering the batch in order, sizes differing by at most one (hand-listed)."""
    assert split_even(n, parts) == expected
