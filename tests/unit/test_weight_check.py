"""Verified weight syncs (megatron_rlvr.rollout.weight_check), in process: the digest, the comparison's message, the
transformers engine's read-back, and the bridge's per-tensor check on receipt. Without verification (the code before
``rollout.verify_sync``) each corruption below went unnoticed: the engine generated from weights nobody sent."""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_rlvr.rollout import bridge
from megatron_rlvr.rollout.weight_check import WeightSyncError, compare, digest, due, record


def test_digest_is_the_crc32_of_the_bytes_and_sees_one_changed_or_swapped_value():
    x = torch.randn(64, 33)
    assert digest(x) == zlib.crc32(x.numpy().tobytes())  # independent reference: the bytes themselves
    assert digest(x) == digest(x.clone()) == digest(x.t().contiguous().t())  # layout-free: contiguous bytes
    y = x.clone()
    y[5, 7] = torch.nextafter(y[5, 7], torch.tensor(float("inf")))  # one ulp
    z = x.clone().reshape(-1)
    z[[0, 1]] = z[[1, 0]]
    assert digest(y) != digest(x) and digest(z.reshape(64, 33)) != digest(x)
    b = x.bfloat16()
    assert digest(b) == zlib.crc32(b.view(torch.uint8).numpy().tobytes())
    raw = torch.arange(40, dtype=torch.uint8)
    assert digest(raw[3:19]) == zlib.crc32(bytes(range(3, 19)))  # a misaligned slice of a received byte buffer


def test_compare_names_the_first_differing_or_missing_tensor_in_stream_order():
    sent = {"a": 1, "b": 2, "c": 3}
    compare(sent, {"c": 3, "b": 2, "a": 1, "extra": 9}, "x")
    with pytest.raises(WeightSyncError, match=r"x: b has digest 0x00000005, the trainer sent 0x00000002"):
        compare(sent, {"a": 1, "b": 5, "c": 4}, "x")
    with pytest.raises(WeightSyncError, match=r"y: c is missing"):
        compare(sent, {"a": 1, "b": 2}, "y")


def test_due_every_first_off():
    assert [due("every", n) for n in range(3)] == [True, True, True]
    assert [due("first", n) for n in range(3)] == [True, False, False]
    assert [due("never", n) for n in range(3)] == [False, False, False]


def _tiny_engine():
    from megatron_rlvr.families.tiny import tiny_hf_config
    from megatron_rlvr.models.hf_config import hf_config_object
    from megatron_rlvr.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine.from_config(hf_config_object(tiny_hf_config()), None, dtype=torch.float32)


def test_the_transformers_engine_reads_back_what_it_was_sent_and_a_corrupted_copy_is_named(monkeypatch):
    from megatron_rlvr.trainer.weights import verify_engine

    engine = _tiny_engine()
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(p.shape, generator=g) for n, p in engine.named_parameters()}
    sent: dict[str, int] = {}
    engine.update_weights(record([list(state.items())], sent))
    assert sent == {n: digest(t) for n, t in state.items()}  # recorded as the stream went by
    assert verify_engine(engine, sent)["sync/verified"] == 1.0
    target = sorted(state)[3]
    real = type(engine)._load_pairs

    def corrupting(pairs, params, received):
        n = real(pairs, params, received)
        with torch.no_grad():
            for name, _ in pairs:
                if name == target:
                    params[name].view(-1)[-1] += 0.5  # what a wrong offset or layout would leave behind
        return n

    monkeypatch.setattr(engine, "_load_pairs", corrupting)
    sent.clear()
    engine.update_weights(record([list(state.items())], sent))
    with pytest.raises(WeightSyncError, match=rf"this rank's engine: {target} has digest"):
        verify_engine(engine, sent)
    engine.close()


class _Wire:
    """A fake process group pair: what the publisher broadcasts is queued and replayed to the receiver, and the
    ``corrupt`` hook may change a replayed tensor (a fault in transit)."""

    def __init__(self, corrupt=None):
        self.queue: list[torch.Tensor] = []
        self.calls = 0
        self.corrupt = corrupt

    def group(self, rank: int):
        wire = self

        class Done:
            def wait(self):
                return True

        class PG:
            def rank(self):
                return rank

            def broadcast(self, tensors, opts):
                t = tensors[0]
                if rank == 0:
                    wire.queue.append(t.clone())
                else:
                    t.copy_(wire.queue.pop(0))
                    wire.calls += 1
                    if wire.corrupt is not None:
                        wire.corrupt(wire.calls, t)
                return Done()

        return PG()


def _publish_and_receive(wire: _Wire, with_digests: bool):
    tensors = [("w.a", torch.randn(5, 3)), ("w.b", torch.randn(8)), ("w.c", torch.randn(2, 2).bfloat16())]
    bridge.publish_weights(wire.group(0), [tensors[:2], tensors[2:]], 3, with_digests=with_digests)
    bridge.publish_stop(wire.group(0), 0)
    receiver = bridge.WeightReceiver(wire.group(1)).start()
    receiver.thread.join(10)
    return receiver, tensors


def test_the_bridge_checks_each_tensor_on_receipt_and_names_the_corrupted_one():
    def flip(call, t):  # per bucket: header size, header payload, data; the first bucket's data is call 3
        if call == 3:
            t[5 * 3 * 4 + 4] ^= 1  # a bit of w.b's second value (w.a's 15 floats come first)

    receiver, _ = _publish_and_receive(_Wire(flip), with_digests=True)
    with pytest.raises(WeightSyncError, match=r"the bridge: w\.b has digest"):
        receiver.wait_for(3)
    receiver, _ = _publish_and_receive(_Wire(flip), with_digests=False)  # unverified: the flip goes through
    with pytest.raises(bridge.Stopped):
        receiver.wait_for(4)
    assert receiver.newest == 3


def test_an_intact_verified_publish_hands_its_digests_to_the_rollout_rank():
    receiver, tensors = _publish_and_receive(_Wire(), with_digests=True)
    assert receiver.newest == 3
    buckets, _, _ = receiver.take(3)
    got = {n: t for b in buckets for n, t in b}
    assert all(torch.equal(got[n], t) for n, t in tensors)
    assert receiver.taken_digests == {n: digest(t) for n, t in tensors}


def test_the_log_prob_probe_stops_above_its_tolerance_and_needs_recomputed_log_probs():
    """``check_logprob_probe`` (the second line where the engine cannot read its weights back): below the tolerance
    it passes and logs the figure; above it (or NaN) it is a WeightSyncError naming the version, the figure, the
    token count and the option; without recomputed log-probs (no ``mismatch/*``) nothing is probed."""
    from megatron_rlvr.trainer.weights import check_logprob_probe

    ok = check_logprob_probe({"mismatch/log_ratio_abs_mean": 2e-7, "mismatch/tokens": 40.0}, 0.1, 3)
    assert ok == {"sync/probed": 1.0, "sync/probe_log_ratio": 2e-7}
    for bad in (0.75, float("nan")):
        want = r"version 3: .* 40 sampled tokens differ by .*rollout.verify_logprobs_tol=0.1"
        with pytest.raises(WeightSyncError, match=want):
            check_logprob_probe({"mismatch/log_ratio_abs_mean": bad, "mismatch/tokens": 40.0}, 0.1, 3)
    assert check_logprob_probe({"loss/policy": 0.1}, 0.1, 3) == {"sync/probed": 0.0}
    with pytest.raises(ValueError, match="rollout.verify_logprobs_tol must be a finite number > 0"):
        from megatron_rlvr.config.sections import RolloutConfig

        RolloutConfig(verify_logprobs_tol=0.0)
