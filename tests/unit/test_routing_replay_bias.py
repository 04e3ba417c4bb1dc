"""Routing replay with DeepSeek-V3's router (sigmoid scores, an expert bias added for the choice only, renormalised
top-k weights times ``routed_scaling_factor``), through megatron-core's routing function and the project's replay
class (megatron_rlvr/megatron/routing.py), against a hand-computed case of 2 tokens and 4 experts, top-2:

- recording keeps the BIAS-CORRECTED selection (the experts of sigmoid(logits) + bias), not the top-k of the scores;
- replaying routes to the replayed experts with gate weights from the UNBIASED sigmoid scores, renormalised over
  the k and scaled (transformers: ``scores.gather(topk_indices)``, then normalised and scaled);
- the disagreement count compares the replayed set with the router's own bias-corrected choice.
"""

from __future__ import annotations

import math

import torch

LOGITS = [[2.0, 1.0, 0.0, -1.0], [0.0, 0.5, -0.5, 1.0]]
BIAS = [0.0, 0.0, 1.0, 0.0]  # lifts expert 2 into both tokens' choice (its score alone would rank it 3rd / 4th)
SCALE = 2.5


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _weights(token: int, experts: list[int]) -> list[float]:
    """Hand value: sigmoid of the token's logits at ``experts``, over their sum, times the scaling factor."""
    s = [_sig(LOGITS[token][e]) for e in experts]
    return [SCALE * v / sum(s) for v in s]


def _route(replay):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    probs, routing_map = topk_routing_with_score_function(
        torch.tensor(LOGITS),
        2,
        use_pre_softmax=False,
        scaling_factor=SCALE,
        score_function="sigmoid",
        expert_bias=torch.tensor(BIAS),
        router_replay=replay,
    )
    return probs.double(), routing_map


def test_sigmoid_bias_replay_records_the_biased_choice_and_weights_with_unbiased_scores():
    from megatron_rlvr.megatron.routing import _replay_class

    CountingReplay, Action = _replay_class()
    replay = CountingReplay()

    # recording: the biased choice. Token 0: sigmoid + bias = [.88, .73, 1.5, .27] -> {0, 2} (unbiased: {0, 1});
    # token 1: [.5, .62, 1.38, .73] -> {2, 3} (unbiased: {3, 1})
    replay.set_router_replay_action(Action.RECORD)
    probs, routing_map = _route(replay)
    recorded = [sorted(r) for r in replay.get_recorded_indices().tolist()]
    assert recorded == [[0, 2], [2, 3]]
    assert routing_map.tolist() == [[True, False, True, False], [False, False, True, True]]
    expected = torch.zeros(2, 4, dtype=torch.float64)
    for t, experts in enumerate(recorded):
        expected[t, experts] = torch.tensor(_weights(t, experts), dtype=torch.float64)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)

    # replaying other experts: the routing map is the target's, the weights the unbiased scores' at the target
    target = [[1, 3], [0, 1]]
    replay.clear_indices()
    replay.set_target_indices(torch.tensor(target))
    replay.valid = torch.ones(2, dtype=torch.bool)  # real tokens (not padding)
    replay.counted = False
    replay.set_router_replay_action(Action.REPLAY_FORWARD)
    probs, routing_map = _route(replay)
    assert routing_map.tolist() == [[False, True, False, True], [True, True, False, False]]
    expected = torch.zeros(2, 4, dtype=torch.float64)
    for t, experts in enumerate(target):
        expected[t, experts] = torch.tensor(_weights(t, experts), dtype=torch.float64)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)
    assert abs(float(probs[0, 1]) - SCALE * _sig(1.0)) < 1e-6  # sigmoid(1) + sigmoid(-1) = 1: the hand value
    # both tokens' replayed sets differ from their own biased choice in both experts: [tokens, differing, experts/k]
    assert replay.counts["update"].tolist() == [2.0, 2.0, 2.0]
