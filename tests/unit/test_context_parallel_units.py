"""Context parallelism in one process: the parallel.cp / cp_comm_type options and the checks that refuse a layout
(one line naming the option), the zig-zag positions against a hand-worked case, the micro-batch split (model inputs
sliced, loss inputs kept whole with this rank's positions in the mask) for unpacked and packed rows, the CPU rotary
slice against megatron's own, and the TransformerConfig the options give. The multi-rank parity of the whole update
is tests/integration/test_context_parallel.py."""

import pytest
import torch

from megatron_rlvr.config import ConfigError, load_run_config
from megatron_rlvr.config.run import check_layout, validate_cross_section
from megatron_rlvr.megatron.context_parallel import gathered_positions, zigzag_positions
from megatron_rlvr.trainer.context_split import split_for_context_parallel
from megatron_rlvr.trainer.microbatch import Sequence, build_microbatch, pack_rows, unpack_values

TINY = ["model.name=tiny", "parallel.tp=1", "rollout.max_prompt_len=8", "rollout.max_response_len=4"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.cp=0"], "parallel.cp must be a positive int"),
        (["parallel.cp_comm_type=ring"], "parallel.cp_comm_type must be one of ('p2p', 'a2a', 'all_gather')"),
    ],
)
def test_bad_options_name_the_option(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [*TINY, *overrides], check_files=False)
    assert message in str(e.value)


def test_layout_checks_refuse_what_cannot_run_in_one_line():
    """World size divisible by tp x cp x pp; no vision-language or MoE model with CP; the longest sequence at least
    2 x cp tokens; a micro-batch budget that holds it padded to a multiple of 2 x cp."""
    cfg = load_run_config(None, [*TINY, "parallel.cp=2", "parallel.tp=2"], check_files=False)
    check_layout(cfg, 4)
    with pytest.raises(ConfigError, match=r"parallel.tp x parallel.cp x parallel.pp = 2 x 2 x 1 = 4 does not divide"):
        check_layout(cfg, 6)
    for name, kind in (("tiny_vl", "vision-language"), ("tiny_moe", "mixture-of-experts")):
        bad = load_run_config(None, [*TINY, f"model.name={name}", "parallel.cp=2"], check_files=False)
        with pytest.raises(ConfigError, match=f"parallel.cp=2: {kind} .* parallel.cp=1"):
            check_layout(bad, 2)
    with pytest.raises(ConfigError, match=r"parallel.cp=8 splits a sequence into 2 x cp = 16 chunks but .* = 12"):
        load_run_config(None, [*TINY, "parallel.cp=8"], check_files=False)
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens=12 .* multiple of 2 x parallel.cp = 8 \(16\)"):
        load_run_config(None, [*TINY, "parallel.cp=4", "train.micro_batch_tokens=12"], check_files=False)
    validate_cross_section(load_run_config(None, [*TINY, "parallel.cp=2"], check_files=False), {})
    a2a = load_run_config(None, [*TINY, "parallel.cp=4", "parallel.cp_comm_type=a2a"], check_files=False)
    with pytest.raises(ConfigError, match=r"cp_comm_type=a2a .* parallel.cp=4 must divide the 2 attention"):
        check_layout(a2a, 4)  # the tiny model has 2 heads
    check_layout(load_run_config(None, [*TINY, "parallel.cp=2", "parallel.cp_comm_type=a2a"], check_files=False), 2)


def test_model_args_carry_the_context_parallel_settings():
    from megatron_rlvr.families.tiny import tiny_hf_config
    from megatron_rlvr.models.hf_config import megatron_model_args

    cfg = megatron_model_args(tiny_hf_config(), cp_size=2, cp_comm_type="a2a").config
    assert (cfg.context_parallel_size, cfg.cp_comm_type) == (2, "a2a")
    assert megatron_model_args(tiny_hf_config()).config.context_parallel_size == 1
    with pytest.raises(ValueError, match="supports dense text models, not mixture-of-experts models"):
        megatron_model_args(tiny_hf_config(name="tiny_moe"), cp_size=2)


def test_zigzag_positions_hand_worked():
    """S = 8, CP = 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (megatron's load balance)."""
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert gathered_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert zigzag_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    with pytest.raises(ValueError, match="sequence length 6 is not a multiple of 2 x cp = 4"):
        zigzag_positions(6, 2, 0)


def _seqs():
    return [
        Sequence(tokens=[1, 2, 3, 4, 5, 6, 7], prompt_len=2, adv=0.5),
        Sequence(tokens=[8, 9, 10], prompt_len=1, adv=-1.0),
        Sequence(tokens=[11, 12, 13, 14], prompt_len=3, adv=2.0),
    ]


@pytest.mark.parametrize("packed", [False, True])
def test_split_keeps_the_loss_layout_and_partitions_the_positions(packed):
    """Every (sequence, position) is held by exactly one of the CP ranks; ``unpack`` of a rank reads, from its
    sliced model output, the value of the global position it maps to; the loss mask is the global mask restricted to
    the held positions; the model inputs are the global ones at the rank's zig-zag positions; a packed row's mask
    keeps all key columns and only the rank's query rows."""
    seqs = _seqs()
    s = 8
    rows = pack_rows([q.length for q in seqs], s) if packed else None
    mb = build_microbatch(seqs, len(rows) if packed else 3, s, pad_id=0, rows=rows)
    b = mb.tokens.shape[0]
    model_out = torch.arange(b * s, dtype=torch.float32).view(b, s) * 10  # a value per global model position
    whole = unpack_values(model_out, mb)  # [n, s]: what the loss reads at CP = 1
    held_total = torch.zeros_like(mb.mask, dtype=torch.long)
    for r in range(2):
        part = split_for_context_parallel(mb, 2, r)
        pos = zigzag_positions(s, 2, r)
        assert torch.equal(part.tokens, mb.tokens[:, pos]) and torch.equal(part.labels, mb.labels[:, pos])
        assert torch.equal(part.position_ids, mb.position_ids[:, pos])
        got = unpack_values(model_out[:, pos], part)
        assert torch.equal(got[part.held], whole[part.held])
        assert torch.equal(part.mask, mb.mask & part.held)
        for key in ("adv", "old_logp", "rollout_logp", "ref_logp", "seq_ids"):
            assert torch.equal(getattr(part, key), getattr(mb, key)), key
        if packed:
            assert part.attention_mask.shape == (b, 1, 4, s)
            assert torch.equal(part.attention_mask, mb.attention_mask[:, :, pos, :])
        else:
            assert part.attention_mask is None
        held_total += part.held.long()
    real = torch.arange(s)[None, :] < torch.tensor([q.length for q in seqs])[:, None]
    assert torch.equal(held_total[real], torch.ones_like(held_total[real]))  # each real position exactly once
    assert int(held_total.max()) == 1


def test_cpu_rotary_slice_picks_the_zigzag_positions():
    """The CPU replacement of megatron's get_pos_emb_on_this_cp_rank (whose index tensor is pinned and moved to
    CUDA) gives the rotary angles of the rank's zig-zag positions, and the three rotary modules that import the
    function by name use it once the CPU shims are on."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    from megatron_rlvr.megatron import cpu_shims

    class Group:
        def __init__(self, rank):
            self._rank = rank

        def size(self):
            return 2

        def rank(self):
            return self._rank

    emb = torch.arange(16, dtype=torch.float32).view(8, 1, 1, 2)  # [s, 1, 1, dim]: angle = its own index
    assert cpu_shims._rope_on_this_cp_rank(emb, 0, Group(0))[:, 0, 0, 0].tolist() == [0, 2, 12, 14]
    for r in range(2):
        assert torch.equal(cpu_shims._rope_on_this_cp_rank(emb, 0, Group(r)), emb[zigzag_positions(8, 2, r)])
    if cpu_shims.apply_cpu_shims():
        for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
            assert module.get_pos_emb_on_this_cp_rank is cpu_shims._rope_on_this_cp_rank, module.__name__
