"""The ranks' heartbeats and the timeout message they complete: a collective that timed out names the rank that
stopped and the step it last reported, from the records the ranks' threads keep current in the run directory."""

import json
import os
import time

from megatron_rlvr.rundir import heartbeat


def _record(folder, rank, role, step, age_s, every_s=1.0, now=1000.0):
    os.makedirs(folder, exist_ok=True)
    rec = {"rank": rank, "role": role, "step": step, "time": now - age_s, "every_s": every_s, "pid": 100 + rank}
    rec["host"] = "node1"
    with open(os.path.join(folder, f"rank_{rank:05d}.json"), "w") as f:
        json.dump(rec, f)


def test_the_note_names_the_ranks_that_stopped_beating_with_their_step(tmp_path):
    """Hand-made records at now = 1000 s, one beat a second: a record older than three beats is a stopped rank,
    named with its role, pid, host, step and silence; current records (a rank blocked in a collective keeps beating)
    name nobody; no records say nothing."""
    folder = tmp_path / heartbeat.HEARTBEAT_DIR
    _record(folder, 0, "training", 7, age_s=0.5)
    _record(folder, 1, "training", 7, age_s=2.0)
    _record(folder, 2, "rollout", 8, age_s=0.2)
    records = heartbeat.read_heartbeats(str(tmp_path))
    assert [r["rank"] for r in records] == [0, 1, 2]
    assert heartbeat.stalled_note(records, now=1000.0).startswith("; every rank's heartbeat is current")
    _record(folder, 1, "training", 6, age_s=41.2)
    note = heartbeat.stalled_note(heartbeat.read_heartbeats(str(tmp_path)), now=1000.0)
    assert note == "; stopped: rank 1 (training, pid 101 on node1) at step 6, silent for 41 s", note
    assert heartbeat.stalled_note([], now=1000.0) == ""
    (folder / "rank_00003.json").write_text("{not json")  # a record caught mid-write elsewhere is skipped
    assert len(heartbeat.read_heartbeats(str(tmp_path))) == 3


def test_a_rank_beats_while_it_runs_and_leaves_no_record_when_it_ends(tmp_path, monkeypatch):
    """A started heartbeat rewrites its record with the step it is on (read through the step function) every
    interval; stopping removes the record and the empty folder. A one-process job starts none."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    step = [5]
    beat = heartbeat.start(str(tmp_path), "training", timeout_s=10.0, step=lambda: step[0])
    try:
        assert beat.every_s == 1.0
        first = heartbeat.read_heartbeats(str(tmp_path))
        assert [(r["rank"], r["role"], r["step"]) for r in first] == [(3, "training", 5)]
        step[0] = 6
        deadline = time.time() + 10
        while heartbeat.read_heartbeats(str(tmp_path))[0]["step"] != 6 and time.time() < deadline:
            time.sleep(0.2)
        again = heartbeat.read_heartbeats(str(tmp_path))[0]
        assert again["step"] == 6 and again["time"] > first[0]["time"]
    finally:
        heartbeat.stop()
    assert not (tmp_path / heartbeat.HEARTBEAT_DIR).exists()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert heartbeat.start(str(tmp_path), "training", timeout_s=10.0) is None


def test_a_collective_timeout_names_the_stopped_rank_and_its_step_in_one_line(tmp_path, monkeypatch, capsys):
    """The CLI's line for a timed-out collective said only that "another rank is hung or stopped"; with the run's
    heartbeats it names the rank that stopped and its last step. The rollout data channel's own message (PeerLost,
    which carries gloo's "Timed out") was replaced by that generic one; it is kept, with the same note."""
    from megatron_rlvr.commands import cli
    from megatron_rlvr.megatron import parallel
    from megatron_rlvr.rollout.bridge import PeerLost

    monkeypatch.setattr(parallel, "_COLLECTIVE_TIMEOUT_S", 10.0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    now = time.time()
    beat = heartbeat.start(str(tmp_path), "training", timeout_s=10.0, step=lambda: 5)
    try:
        _record(tmp_path / heartbeat.HEARTBEAT_DIR, 1, "rollout", 6, age_s=12.0, now=now)
        gloo = "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation to complete"
        cli._report("train", RuntimeError(gloo))
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert "a collective waited longer than launch.collective_timeout_s=10 s" in err[0], err
        assert "; stopped: rank 1 (rollout, pid 101 on node1) at step 6, silent for 12 s" in err[0], err
        lost = PeerLost(f"the data channel from rollout rank 0 failed (RuntimeError: {gloo}); a rollout rank has died")
        cli._report("train", lost)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "PeerLost: the data channel from rollout rank 0 failed" in err[0], err
        assert "a collective waited" not in err[0] and "; stopped: rank 1 (rollout" in err[0], err
    finally:
        heartbeat.stop()
    assert beat is not None


def test_a_weight_publish_to_a_stopped_rollout_rank_names_the_weight_channel():
    """Training rank 0's weight publish to a rollout rank that stopped ends in gloo's send timeout, which the CLI read
    as any collective's ("a collective waited longer than ..."); it now names the weight channel and the role behind
    it, as the receiving sides do (PeerLost). A send of the second bucket times out here."""
    import pytest
    import torch

    from megatron_rlvr.rollout import bridge

    class StoppedPeer:  # a weights group whose rollout rank stopped: sends complete until the buffers are full
        sent = 0

        def rank(self):
            return 0

        def broadcast(self, tensors, opts):
            self.sent += 1
            if self.sent > 4:  # three sends a bucket (the header's size, the header, the tensors)
                raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 10000ms for send")
            return type("Work", (), {"wait": lambda self: True})()

    buckets = [[(f"w{i}", torch.ones(2))] for i in range(3)]
    with pytest.raises(bridge.PeerLost) as e:
        bridge.publish_weights(StoppedPeer(), buckets, version=3)
    msg = str(e.value)
    assert msg.startswith("the weight channel to the rollout ranks failed (RuntimeError: [gloo/"), msg
    assert "Timed out" in msg and "a rollout rank has died, stopped or lost its connection" in msg
