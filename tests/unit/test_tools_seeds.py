"""The seed-sweep tool's summary (tools/seeds.py): final reward, first step at 0.9 and collapse after the peak from a
hand-made metrics.jsonl, against values computed by hand; its seed list parsing and its refusal of the overrides it
sets itself."""

import json

import pytest

from megatron_rlvr.rundir.metrics_log import read_metrics
from tools.seeds import format_line, main, parse_seeds, summarize


def _write(path, lines):
    with open(path, "w") as f:
        for rec in lines:
            f.write(rec if isinstance(rec, str) else json.dumps(rec))
            f.write("\n")


def test_summary_of_a_hand_made_metrics_file(tmp_path):
    """Rewards by step 1..13: 0.1 0.5 0.9 0.95 0.8 1.0 1.0 0.6 0.4 0.3 1.0 1.0 1.0 (step 8 logged twice, as a resumed
    run does: the later 0.6 counts; an evaluation record without a reward and a line cut by a crash are skipped).
    final = (0.4 + 0.3 + 1 + 1 + 1) / 5 = 0.74; first step >= 0.9: 3 (exactly 0.9); 5-step moving averages ending at
    steps 5..13: 0.65 0.83 0.93 0.87 0.76 0.66 0.66 0.66 0.74, so the collapse after the peak is 0.93 - 0.66 = 0.27
    (the lowest average after the peak, not the last one)."""
    rewards = [0.1, 0.5, 0.9, 0.95, 0.8, 1.0, 1.0, 0.99, 0.4, 0.3, 1.0, 1.0, 1.0]
    lines = [{"step": i + 1, "reward/mean": r, "loss/total": 0.0} for i, r in enumerate(rewards)]
    lines.insert(9, {"step": 8, "reward/mean": 0.6})  # the resumed run's step 8, logged after step 9
    lines.insert(0, {"step": 0, "eval/avg@4": 0.2})
    lines.append('{"step": 14, "reward/me')
    _write(tmp_path / "metrics.jsonl", lines)
    s = summarize(read_metrics(str(tmp_path / "metrics.jsonl")))
    assert s["steps"] == 13 and s["first_pass"] == 3
    assert s["final"] == pytest.approx(0.74, abs=1e-12)
    assert s["collapse"] == pytest.approx(0.27, abs=1e-12)
    line = format_line(1, s, "runs/x/seed1")
    assert line.startswith("seed=1 final=0.740 pass_0.9=3 collapse=0.270 steps=13")


def test_summary_of_short_rising_and_empty_runs():
    """3 steps (fewer than the window): final = mean of all = 0.3, one moving average, so collapse 0, never 0.9.
    A steady rise has collapse 0 (the lowest average after the peak is the peak). No reward at all: None."""
    s = summarize([{"step": 1, "reward/mean": 0.2}, {"step": 2, "reward/mean": 0.4}, {"step": 3, "reward/mean": 0.3}])
    assert s["final"] == pytest.approx(0.3) and s["collapse"] == 0.0 and s["first_pass"] is None
    s = summarize([{"step": i, "reward/mean": i / 10} for i in range(1, 11)])
    assert s["collapse"] == 0.0 and s["first_pass"] == 9 and s["final"] == pytest.approx(0.8)
    assert summarize([{"step": 1, "eval/avg@4": 0.5}]) is None
    assert format_line(2, None, "d").startswith("seed=2 no reward/mean")


def test_seed_lists_and_reserved_overrides():
    """1-5, 1,4,9 and mixes parse; a repeated or malformed list and the overrides the tool sets are refused with
    one line naming them."""
    assert parse_seeds("1-5") == [1, 2, 3, 4, 5]
    assert parse_seeds("1,4,9") == [1, 4, 9]
    assert parse_seeds("1-3,7") == [1, 2, 3, 7]
    with pytest.raises(SystemExit, match="--seeds"):
        parse_seeds("1,1")
    with pytest.raises(SystemExit, match="--seeds"):
        parse_seeds("a-b")
    with pytest.raises(SystemExit, match="train.seed"):
        main(["configs/tiny.yaml", "train.seed=3"])
    with pytest.raises(SystemExit, match="logging.run_dir"):
        main(["configs/tiny.yaml", "logging.run_dir=/tmp/x"])
