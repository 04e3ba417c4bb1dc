"""The checks of tests/unit/test_ops_math.py that take the ``impl`` fixture, through the torch.compile'd kernels of
megatron_rlvr.ops.compiled: the same tests (names, docstrings, tolerances, float64 references), collected here with
``impl="compiled"``. Compiling each kernel variant takes ~10-60 s on a 2-core CPU, too slow for the unit tier; the
eager side stays there."""

from test_ops_math import (  # noqa: F401  the tests themselves, collected again in this module
    impl_fixture,
    test_bad_arguments_raise_clear_errors,
    test_bf16_gradient_of_confident_token_is_rounded_once,
    test_chunked_equals_unchunked,
    test_each_stat_alone_has_exact_gradient,
    test_exact_top2_ties_give_zero_margin,
    test_extreme_logits_stay_finite_and_exact,
    test_fused_all_stats_forward_backward_match_fp64_reference,
    test_gradcheck_fp64,
    test_margin_is_detached,
    test_masked_tokens_get_zero_gradient_and_inputs_are_unchanged,
    test_padded_vocab_does_not_leak,
    test_shift_fallbacks_for_extreme_rows_are_exact,
    test_wrappers_and_leading_dims,
)

impl = impl_fixture("compiled")
