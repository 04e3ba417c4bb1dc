"""The transformers rollout engine (CPU): every behaviour of the engine interface, checked against independent
references — a full (unpadded, uncached) forward of the same HF model in fp64 for log-probs and greedy tokens,
hand-computed filters, the exact softmax for the sampling distribution, and sequences replayed by hand for EOS,
stop-token, stop-string and length endings."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from megatron_rlvr.rollout.engine import SamplingParams, sample_seed
from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine, filter_logits

V = 96
EOS = 1


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ToyTokenizer:
    """Token k decodes to two letters (aa, ab, ...); the EOS id is special (skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if (t == EOS and skip_special_tokens) else chr(97 + t // 26) + chr(97 + t % 26) for t in ids)


def llama_config(**kw):
    return LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=EOS,
        bos_token_id=0,
        tie_word_embeddings=False,
        **kw,
    )


def qwen2_config(**kw):
    return Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=EOS,
        bos_token_id=0,
        tie_word_embeddings=True,
        **kw,
    )


def make_engine(cfg, seed=0, tokenizer=None, **engine_kw):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Sharpen the random model a little so sampled sequences are not pure noise (and logits span a real range).
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return HFRolloutEngine(model, tokenizer, **engine_kw)


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20]]


def reference_logprobs(model, prompt, completion, temperature):
    """log_softmax(logits / T)[token] from one full fp64 forward of prompt + completion (no padding, no cache)."""
    m64 = model.double() if next(model.parameters()).dtype != torch.float64 else model
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = m64(ids).logits[0].double()
    model.float()
    T = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / T, dim=-1)[len(prompt) - 1 : -1]
    return lp.gather(-1, torch.tensor(completion)[:, None])[:, 0], logits[len(prompt) - 1 : -1]


@pytest.mark.parametrize("cfg_fn", [llama_config, qwen2_config], ids=["llama", "qwen2_tied_bias"])
def test_logprobs_match_full_forward_recomputation(cfg_fn):
    """Batched, left-padded, KV-cached sampling (rows split over chunks of 4) reports log_softmax(logits/T) of
    exactly the model's full-forward logits: max error < 1e-5 in fp32."""
    eng = make_engine(cfg_fn(), config=HFEngineConfig(max_batch_rows=4))
    out = eng.generate(PROMPTS, SamplingParams(n=3, temperature=0.7, max_tokens=12, seed=3, ignore_eos=True))
    assert len(out) == 3 and all(len(o.completions) == 3 for o in out)
    worst = 0.0
    for o, p in zip(out, PROMPTS):
        assert o.prompt_token_ids == p
        for c in o.completions:
            assert len(c.token_ids) == 12 and c.finish_reason == "length"
            ref, _ = reference_logprobs(eng.model, p, c.token_ids, 0.7)
            worst = max(worst, (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item())
    assert worst < 1e-5, worst


def test_greedy_tokens_and_logprobs_follow_the_argmax_of_the_full_forward():
    """temperature=0: every token is the argmax of the full-forward logits and its log-prob is log_softmax(logits)
    (the T = 1 convention)."""
    eng = make_engine(llama_config())
    out = eng.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True))
    for o, p in zip(out, PROMPTS):
        a, b = o.completions
        assert a.token_ids == b.token_ids, "greedy samples of one prompt must agree"
        ref_lp, logits = reference_logprobs(eng.model, p, a.token_ids, 0.0)
        assert a.token_ids == logits.argmax(-1).tolist()
        assert torch.allclose(torch.tensor(a.logprobs, dtype=torch.float64), ref_lp, atol=1e-5)


def test_filter_logits_hand_computed():
    """Top-k keeps the k largest; top-p keeps the smallest prefix reaching mass p, never dropping the argmax."""
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    ninf = float("-inf")
    k2 = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(k2[0, :2]).all() and (k2[0, 2:] == ninf).all()
    # mass above each token: 0, .5, .7, .85, .95 -> p=0.7 keeps the first two (third has exactly 0.7 above it)
    p = filter_logits(logits, top_k=0, top_p=0.7)
    assert torch.isfinite(p[0, :2]).all() and (p[0, 2:] == ninf).all()
    p = filter_logits(logits, top_k=0, top_p=0.71)
    assert torch.isfinite(p[0, :3]).all() and (p[0, 3:] == ninf).all()
    tiny = filter_logits(logits, top_k=0, top_p=0.01)
    assert torch.isfinite(tiny[0, 0]) and (tiny[0, 1:] == ninf).all()
    # unsorted input: the filter follows values, not positions
    perm = torch.tensor([3, 0, 4, 1, 2])
    assert torch.equal(filter_logits(logits[:, perm], 2, 1.0), k2[:, perm])
    assert torch.equal(filter_logits(logits, 0, 1.0), logits)


def chi_square(counts, probs):
    expected = probs * counts.sum()
    keep = expected > 0
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item(), int(keep.sum()) - 1


def test_sampling_distribution_matches_softmax_and_respects_top_k():
    """The first sampled token of 3000 independent samples follows softmax(logits/T): Pearson chi-square within
    5 standard deviations of its degrees of freedom, while the same counts clearly reject softmax(logits) (T = 1),
    so the check has power. With top_k=3 only the 3 most likely tokens appear, with renormalised probabilities."""
    eng = make_engine(llama_config(), config=HFEngineConfig(max_batch_rows=3000))
    prompt = [7, 8, 9]
    with torch.no_grad():
        logits = eng.model(torch.tensor([prompt])).logits[0, -1].double()
    N, T = 3000, 0.5
    (o,) = eng.generate([prompt], SamplingParams(n=N, temperature=T, max_tokens=1, seed=11, ignore_eos=True))
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in o.completions]), minlength=V).double()
    probs = torch.softmax(logits / T, -1)
    chi2, df = chi_square(counts, probs)
    assert chi2 < df + 5 * math.sqrt(2 * df), (chi2, df)
    chi2_wrong, df_wrong = chi_square(counts, torch.softmax(logits, -1))
    assert chi2_wrong > df_wrong + 10 * math.sqrt(2 * df_wrong), (chi2_wrong, df_wrong)
    # log-prob reported for the sampled token is the full-vocabulary one, not the filtered one
    (o,) = eng.generate([prompt], SamplingParams(n=N, temperature=T, top_k=3, max_tokens=1, seed=5))
    top3 = set(torch.topk(logits, 3).indices.tolist())
    first = [c.token_ids[0] for c in o.completions]
    assert set(first) <= top3
    p3 = probs[list(top3)] / probs[list(top3)].sum()
    emp = torch.tensor([first.count(t) / N for t in top3], dtype=torch.float64)
    assert (emp - p3).abs().max() < 0.04
    lp_full = torch.log(probs)
    for c in o.completions[:20]:
        assert abs(c.logprobs[0] - lp_full[c.token_ids[0]].item()) < 1e-5


def test_seed_determinism_and_batch_independence():
    """Same seed -> identical samples; another seed -> different; a prompt's samples do not depend on which other
    prompts share its batch or on the chunk size (per-sample generators seeded from (seed, prompt, sample))."""
    eng = make_engine(llama_config())
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=42, ignore_eos=True)
    a = eng.generate(PROMPTS, sp)
    b = eng.generate(PROMPTS, sp)
    assert [[c.token_ids for c in o.completions] for o in a] == [[c.token_ids for c in o.completions] for o in b]
    c = eng.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=43, ignore_eos=True))
    assert [x.token_ids for o in a for x in o.completions] != [x.token_ids for o in c for x in o.completions]
    eng.config.max_batch_rows = 1
    solo = eng.generate(PROMPTS, sp)
    assert [[x.token_ids for x in o.completions] for o in solo] == [[x.token_ids for x in o.completions] for o in a]
    assert sample_seed(42, 0, 1) != sample_seed(42, 1, 0)


def test_rows_that_finish_early_leave_the_batch_without_changing_the_others():
    """Rows stop at different steps (a third of the vocabulary are stop tokens), so finished rows leave the decode
    batch while others run on: every row's log-probs still equal the full fp64 forward's, and every prompt's samples
    equal those of a run that decodes one row at a time (max_batch_rows=1, where nothing is ever dropped)."""
    eng = make_engine(llama_config())
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=7, stop_token_ids=tuple(range(2, V, 3)))
    out = eng.generate(PROMPTS, sp)
    lengths = [len(c.token_ids) for o in out for c in o.completions]
    assert min(lengths) < max(lengths) and min(lengths) < 10, lengths  # rows really finished at different steps
    assert any(c.finish_reason == "stop" for o in out for c in o.completions)
    worst = 0.0
    for o, p in zip(out, PROMPTS):
        for c in o.completions:
            ref, _ = reference_logprobs(eng.model, p, c.token_ids, 1.0)
            worst = max(worst, (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item())
    assert worst < 1e-5, worst
    eng.config.max_batch_rows = 1
    solo = eng.generate(PROMPTS, sp)
    assert [[x.token_ids for x in o.completions] for o in solo] == [[x.token_ids for x in o.completions] for o in out]


def _greedy_sequence(eng, prompt, n_tokens):
    (o,) = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True))
    return o.completions[0].token_ids


def _first_new_position(seq, start):
    for i in range(start, len(seq)):
        if seq[i] not in seq[:i]:
            return i
    pytest.skip("random model repeats itself: no fresh token to stop on")


def test_eos_stop_token_ids_and_length():
    """EOS ends a sample with finish 'stop' (stop_reason None) and is the last token; a stop_token_id does the same
    with stop_reason = that id; ignore_eos runs to max_tokens with finish 'length'."""
    probe = make_engine(llama_config())
    seq = _greedy_sequence(probe, [3, 4], 16)
    k = _first_new_position(seq, 3)
    eng = make_engine(llama_config(), eos_token_ids=[seq[k]])
    (o,) = eng.generate([[3, 4]], SamplingParams(temperature=0.0, max_tokens=16))
    c = o.completions[0]
    assert c.token_ids == seq[: k + 1] and c.finish_reason == "stop" and c.stop_reason is None
    assert len(c.logprobs) == k + 1
    j = _first_new_position(seq, 1)
    (o,) = eng.generate([[3, 4]], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(seq[j],)))
    c = o.completions[0]
    assert c.token_ids == seq[: j + 1] and c.finish_reason == "stop" and c.stop_reason == seq[j]
    (o,) = eng.generate([[3, 4]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    c = o.completions[0]
    assert c.token_ids == seq and c.finish_reason == "length" and c.stop_reason is None
    (o,) = eng.generate([[3, 4]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert o.completions[0].token_ids == seq[:2] and o.completions[0].finish_reason == "length"


def test_stop_strings_span_tokens_and_truncate_text():
    """A stop string that straddles two tokens ends the sample at the token completing it (that token is kept in
    token_ids), the text is cut before it (or after it with include_stop_str_in_output)."""
    tok = ToyTokenizer()
    eng = make_engine(llama_config(), tokenizer=tok)
    seq = _greedy_sequence(eng, [3, 4], 16)
    text = tok.decode(seq)
    # the last letter of token 3 plus the first of token 4, provided it does not occur earlier
    for k in range(3, 15):
        stop = text[2 * k + 1 : 2 * k + 3]
        if text.find(stop) == 2 * k + 1:
            break
    else:
        pytest.skip("no unique straddling stop string in this random sequence")
    (o,) = eng.generate([[3, 4]], SamplingParams(temperature=0.0, max_tokens=16, stop=(stop, "zzzz")))
    c = o.completions[0]
    assert c.token_ids == seq[: k + 2] and c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: 2 * k + 1]
    (o,) = eng.generate(
        [[3, 4]], SamplingParams(temperature=0.0, max_tokens=16, stop=stop, include_stop_str_in_output=True)
    )
    assert o.completions[0].text == text[: 2 * k + 3]
    with pytest.raises(ValueError, match="tokenizer"):
        make_engine(llama_config()).generate([[3]], SamplingParams(stop=("x",)))


def test_n_samples_are_distinct_and_complete():
    eng = make_engine(qwen2_config())
    out = eng.generate([[2, 3, 4]], SamplingParams(n=6, temperature=1.0, max_tokens=10, seed=0, ignore_eos=True))
    seqs = [tuple(c.token_ids) for c in out[0].completions]
    assert len(seqs) == 6 and len(set(seqs)) == 6
    assert all(len(c.logprobs) == len(c.token_ids) == 10 for c in out[0].completions)
    assert all(math.isfinite(x) and x <= 0 for c in out[0].completions for x in c.logprobs)


def test_update_weights_in_place_and_errors():
    """update_weights copies every tensor bit for bit; names must exist, shapes match, each parameter arrive once
    (tied aliases included) and, in strict mode, all of them arrive."""
    src = make_engine(qwen2_config(), seed=1)
    dst = make_engine(qwen2_config(), seed=2)
    sd = {n: p.detach().clone() for n, p in src.model.named_parameters()}  # tied: lm_head is not listed
    assert "lm_head.weight" not in sd
    assert dst.update_weights(list(sd.items())) == len(sd)
    for n, p in dst.named_parameters():
        ref = sd["model.embed_tokens.weight"] if n == "lm_head.weight" else sd[n]
        assert torch.equal(p, ref), n
    sp = SamplingParams(n=2, max_tokens=6, seed=9, ignore_eos=True)
    assert [c.token_ids for c in dst.generate(PROMPTS, sp)[0].completions] == [
        c.token_ids for c in src.generate(PROMPTS, sp)[0].completions
    ]
    # buckets (lists of pairs) are accepted as well
    items = list(sd.items())
    assert dst.update_weights([items[:3], items[3:]]) == len(sd)
    with pytest.raises(ValueError, match="unknown parameter name"):
        dst.update_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        dst.update_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="sent twice"):
        dst.update_weights(
            [("model.embed_tokens.weight", sd["model.embed_tokens.weight"])] * 1
            + [("lm_head.weight", sd["model.embed_tokens.weight"])]
        )
    with pytest.raises(ValueError, match="not sent"):
        dst.update_weights(items[:-1])
    assert dst.update_weights(items[:1], strict=False) == 1


def test_sleep_wake_levels():
    """Level 1 keeps weights (no-op on CPU); level 2 frees them (storage released) and generate refuses until a full
    update_weights; generate and update_weights refuse while asleep; close() makes the engine unusable."""
    eng = make_engine(llama_config())
    sp = SamplingParams(max_tokens=5, seed=1, ignore_eos=True)
    before = eng.generate([[3, 4]], sp)[0].completions[0].token_ids
    sd = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    eng.sleep(1)
    assert eng.is_sleeping
    with pytest.raises(RuntimeError, match="sleeps"):
        eng.generate([[3]], sp)
    eng.wake_up()
    assert eng.generate([[3, 4]], sp)[0].completions[0].token_ids == before
    eng.sleep(2)
    assert all(p.numel() == 0 for p in eng.model.parameters())
    with pytest.raises(RuntimeError, match="sleeps"):
        eng.update_weights(sd.items())
    eng.wake_up()
    with pytest.raises(RuntimeError, match="update_weights"):
        eng.generate([[3]], sp)
    eng.update_weights(sd.items())
    assert eng.generate([[3, 4]], sp)[0].completions[0].token_ids == before
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate([[3]], sp)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(n=0), "n"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=("",)), "stop"),
        (dict(stop_token_ids=(-2,)), "stop_token_ids"),
    ],
)
def test_sampling_params_validation(kw, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


def test_prompt_validation():
    eng = make_engine(llama_config())
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[1, 2], []], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        eng.generate([[V]], SamplingParams())
    with pytest.raises(ValueError, match="flat list"):
        eng.generate([1, 2, 3], SamplingParams())


def test_moe_routes_are_the_routers_top_k_of_a_full_forward():
    """``return_routes`` on a Qwen3-MoE (routing replay R3): for every row (left-padded, KV-cached, chunked, rows that
    end early leave the batch) the engine's routes [layers, P + R - 1, k] are, per token and layer, the top-k experts
    of the router logits transformers returns (``output_router_logits``) from one full uncached forward of prompt +
    response minus its last token, and its gate weights (``route_weights``) are the softmax of those logits at the
    routes (renormalised over the k with ``norm_topk_prob``, checked both ways), recomputed here in fp64. Without the
    option no routes are kept; a dense model refuses it."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
        max_position_embeddings=128, eos_token_id=EOS, bos_token_id=0, tie_word_embeddings=False, mlp_only_layers=[1],
    )  # fmt: skip
    for norm in (False, True):
        cfg.norm_topk_prob = norm
        _check_engine_routes(make_engine(cfg, seed=4, config=HFEngineConfig(max_batch_rows=4, return_routes=True)), cfg)
    plain = make_engine(cfg, seed=4).generate(PROMPTS[:1], SamplingParams(n=1, max_tokens=2, seed=5))
    assert plain[0].completions[0].routes is None and plain[0].completions[0].route_weights is None
    with pytest.raises(ValueError, match="return_routes: the model has no mixture-of-experts router"):
        make_engine(llama_config(), config=HFEngineConfig(return_routes=True))


def _check_engine_routes(eng, cfg) -> None:
    """The checks of the test above on one engine built from ``cfg``."""
    with torch.no_grad():
        for name, p in eng.model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(8.0)  # sharp routing: ties between experts never decide a test
    out = eng.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5))
    lengths = set()
    for o, p in zip(out, PROMPTS):
        for c in o.completions:
            lengths.add(len(c.token_ids))
            ids = torch.tensor([p + c.token_ids[:-1]])
            with torch.no_grad():
                ref = eng.model(ids, output_router_logits=True).router_logits  # one [T, E] per MoE layer
            assert len(ref) == 2  # layer 1 is dense
            assert c.routes.dtype == torch.int16 and tuple(c.routes.shape) == (2, ids.shape[1], 2)
            assert c.route_weights.dtype == torch.float32 and c.route_weights.shape == c.routes.shape
            for layer, logits in enumerate(ref):
                expected = logits.topk(2, -1).indices.sort(-1).values
                assert torch.equal(c.routes[layer].long().sort(-1).values, expected), (layer, p, c.token_ids)
                at = logits.double().softmax(-1).gather(1, c.routes[layer].long())
                want = at / at.sum(-1, keepdim=True) if cfg.norm_topk_prob else at
                torch.testing.assert_close(c.route_weights[layer], want.float())
    assert len(lengths) > 1  # some rows stopped at EOS before others


def test_deepseek_v3_routes_are_the_biased_choice_and_weights_the_unbiased_scores():
    """``return_routes`` on a DeepSeek-V3 (sigmoid router, random ``e_score_correction_bias``, 2 groups of which 1
    is used, routed_scaling_factor 2.5): per token and MoE layer the engine's routes are the top-k of
    sigmoid(logits) + bias within the best group (a group scored by its two best biased scores), and its gate
    weights the UNBIASED sigmoid scores at the routes, renormalised and scaled, recomputed here in fp64 from the
    router inputs of one full uncached forward. The bias decides: without it the choice differs for many tokens."""
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=128, eos_token_id=EOS, bos_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    eng = make_engine(cfg, seed=4, config=HFEngineConfig(max_batch_rows=4, return_routes=True))
    g = torch.Generator().manual_seed(9)
    routers = [m for m in eng.model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
    with torch.no_grad():
        for r in routers:
            r.weight.normal_(0.0, 1.0, generator=g)
            r.e_score_correction_bias.copy_(0.5 * torch.randn(8, generator=g))
    out = eng.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=5))
    differs = compared = 0
    for o, p in zip(out, PROMPTS):
        for c in o.completions:
            ids = torch.tensor([p + c.token_ids[:-1]])
            inputs = []
            hooks = [
                r.register_forward_pre_hook(lambda m, a, inputs=inputs: inputs.append(a[0].reshape(-1, 32)))
                for r in routers
            ]
            with torch.no_grad():
                eng.model(ids)
            for h in hooks:
                h.remove()
            assert c.routes.dtype == torch.int16 and tuple(c.routes.shape) == (2, ids.shape[1], 2)
            for layer, (x, r) in enumerate(zip(inputs, routers)):
                scores = torch.sigmoid(x.double() @ r.weight.double().t())  # [T, 8]
                choice = scores + r.e_score_correction_bias.double()
                group = choice.view(-1, 2, 4).topk(2, -1).values.sum(-1).argmax(-1)  # [T]: the best group
                keep = torch.arange(8).view(1, 8) // 4 == group.view(-1, 1)
                routes = choice.masked_fill(~keep, -math.inf).topk(2, -1).indices
                assert torch.equal(c.routes[layer].long().sort(-1).values, routes.sort(-1).values), (layer, p)
                at = scores.gather(1, c.routes[layer].long())
                want = 2.5 * at / at.sum(-1, keepdim=True)  # float32 engine values
                torch.testing.assert_close(c.route_weights[layer].double(), want, rtol=1e-6, atol=1e-6)
                unbiased = scores.masked_fill(~keep, -math.inf).topk(2, -1).indices.sort(-1).values
                differs += int((unbiased != routes.sort(-1).values).any(-1).sum())
                compared += routes.shape[0]
    assert differs > 0.1 * compared


def test_should_stop_interrupts_generation_between_decode_steps():
    """A stop signal during generation waited for the whole batch (minutes for long responses). ``should_stop`` is
    asked before every decode step: True on its 4th call ends generate with GenerationStopped after 3 decode steps
    (not max_tokens=64), and a later generate with the same seed gives the samples of an uninterrupted engine."""
    from megatron_rlvr.rollout.engine import GenerationStopped

    eng = make_engine(llama_config())
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=64, seed=3, ignore_eos=True)
    calls = []
    with pytest.raises(GenerationStopped):
        eng.generate(PROMPTS, sp, should_stop=lambda: calls.append(1) or len(calls) > 3)
    assert len(calls) == 4
    again = eng.generate(PROMPTS, sp, should_stop=lambda: False)
    fresh = make_engine(llama_config()).generate(PROMPTS, sp)
    tokens = [[c.token_ids for c in o.completions] for o in again]
    assert tokens == [[c.token_ids for c in o.completions] for o in fresh]
