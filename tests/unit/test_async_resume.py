"""What the disaggregated schedule saves with a checkpoint so a resume repeats the run (in process, no ranks):

1. Training rank 0's inbox hands out the saved batches before the received ones, in step order, and at a save of
   step s returns exactly the batches of steps s + 1 .. s + k (waiting for those not yet received), none at the last
   step or at k = 0; a batch that skips a step is refused naming both steps.
2. The batches in flight survive the checkpoint file round trip with their multi-turn fields; a file that does not
   hold the count the trainer state records is refused.
"""

import pytest
import torch

from megatron_rlvr.data import Example
from megatron_rlvr.rollout.groups import Group
from megatron_rlvr.rundir.checkpointer import IN_FLIGHT_FILE, read_in_flight, write_in_flight
from megatron_rlvr.trainer.batch import RolloutBatch
from megatron_rlvr.trainer.disaggregated import Inbox


class Arrivals:
    """A BatchReceiver stand-in: hands out the given messages in order and records how many were taken."""

    def __init__(self, steps):
        self.messages = [{"step": s} for s in steps]
        self.taken = 0

    def get(self):
        self.taken += 1
        return self.messages[self.taken - 1]


def test_inbox_saves_exactly_the_next_k_batches_and_trains_them_first():
    inbox = Inbox([{"step": 3, "saved": True}], k=2, last_step=7)  # resumed at step 2 with step 3 saved (k = 2)
    inbox.receiver = Arrivals([4, 5, 6, 7])
    assert inbox.take(3) == {"step": 3, "saved": True} and inbox.receiver.taken == 0
    assert [m["step"] for m in inbox.in_flight(3)] == [4, 5]  # a save of step 3 waits for 4 and 5 ...
    assert inbox.receiver.taken == 2  # ... and for nothing more
    assert inbox.take(4) == {"step": 4} and inbox.receiver.taken == 2
    assert [m["step"] for m in inbox.in_flight(5)] == [6, 7] and inbox.take(5) == {"step": 5}
    assert inbox.in_flight(7) is None  # the last step: nothing in flight
    assert Inbox([], k=0, last_step=7).in_flight(3) is None  # k = 0: nothing in flight (and no receiver asked)
    assert Inbox([], k=1, last_step=7).in_flight(3) is None  # not training rank 0: no receiver


def test_inbox_refuses_a_batch_that_skips_a_step():
    inbox = Inbox([], k=1, last_step=7)
    inbox.receiver = Arrivals([1, 3])
    assert inbox.take(1) == {"step": 1}
    with pytest.raises(RuntimeError, match=r"batch of step 3, expected step 2"):
        inbox.take(2)


def test_in_flight_batches_round_trip_with_their_multi_turn_fields(tmp_path):
    group = Group(
        Example(prompt="1+1=", answer="2", source="t", id="x"),
        [5, 6],
        [[7, 8, 9], [10]],
        logprobs=[[-0.5, -0.25, -1.0], [-2.0]],
        rewards=[1.0, 0.0],
        versions=[3, 3],
        loss_masks=[[1, 0, 1], [1]],
        turns=[2, 1],
        cuts=["", "max_turns"],
    )
    batch = RolloutBatch(groups=[group], kept=[0], rewards=torch.tensor([1.0, 0.0]), policy_version=3)
    messages = [{"step": 5, "batch": batch, "loader": {"position": 40}, "metrics": {"rollout/rounds": 1.0}}]
    write_in_flight(str(tmp_path), messages)
    (back,) = read_in_flight(str(tmp_path), {"in_flight": 1})
    g = back["batch"].groups[0]
    assert (g.prompt_ids, g.response_ids, g.logprobs, g.versions) == ([5, 6], [[7, 8, 9], [10]], group.logprobs, [3, 3])
    assert (g.loss_masks, g.turns, g.cuts, g.example.answer) == ([[1, 0, 1], [1]], [2, 1], ["", "max_turns"], "2")
    assert torch.equal(back["batch"].rewards, torch.tensor([1.0, 0.0])) and back["batch"].kept == [0]
    assert back["loader"] == {"position": 40} and back["metrics"] == {"rollout/rounds": 1.0}
    assert read_in_flight(str(tmp_path), {"step": 4}) == []  # a checkpoint without batches in flight
    with pytest.raises(ValueError, match=rf"{IN_FLIGHT_FILE} holds 1 batches, its trainer state says 2"):
        read_in_flight(str(tmp_path), {"in_flight": 2})
    with pytest.raises(FileNotFoundError):
        read_in_flight(str(tmp_path / "elsewhere"), {"in_flight": 1})
