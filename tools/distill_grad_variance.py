"""Gradient variance of the two reverse-KL distillation estimators (``algorithm.distill.estimator`` ``full`` and
``sampled``, both in ``loss`` mode), measured on the product's own loss function.

    PYTHONPATH=. python tools/distill_grad_variance.py --teacher TEACHER/hf [--student HF_FOLDER] [--config CFG]
        [--batches 32] [--prompts 32] [--n 8] [--seed 0]

What is measured. A student (``--student``: an HF folder, e.g. a run's ``<run_dir>/hf``; default: a random
initialisation of the tiny family, the HF ``Qwen2ForCausalLM`` of ``tiny_hf_config()`` initialised by transformers
with the config's ``initializer_range`` 0.02) and a frozen teacher (``--teacher``, an HF folder; default
``$RLVR_TEACHER``). ``--batches`` times, independently: the student samples ``--n`` responses to each of
``--prompts`` prompts of the tiny copy task ("d=" for the digits in turn, as configs/tiny.yaml's terse 1-digit
``copy`` task; temperature 1, at most ``rollout.max_response_len`` tokens, up to and including the first EOS), one
batch as one step of the tiny preset draws it. For each batch and each estimator the loss that the trainer adds
(``megatron_rlvr.algorithms.distill.distill_loss`` with the config's ``algorithm`` section: its aggregation, coef and
log-ratio clamp; the exact per-token KL from the vocab-parallel ops with one shard, the teacher's log-probs of the
sampled tokens from the same ops, old log-probs = the student's own, so on-policy) is back-propagated to the
student's parameters, giving one flattened gradient g_b per batch. Both estimators see the same batches.

Printed per estimator: ``mean_norm`` = |mean_b g_b|, ``trace_cov`` = sum over parameters of the unbiased sample
variance of g_b (E|g - mean|^2, N-1 in the divisor), and ``rel_var`` = trace_cov / mean_norm^2 (the noise of one
batch's gradient relative to the signal); then ``cos_mean`` = the cosine between the two mean gradients (both
estimators are unbiased for the same gradient, sum_t grad KL_t at the sampled prefixes, so it tends to 1 as the
batches grow), and ``grad_var_sampled_over_full=`` trace_cov(sampled) / trace_cov(full). One process, no tensor
parallelism (the ops' single-shard path), float32, CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from megatron_rlvr.algorithms.aggregation import LossNormalizers  # noqa: E402
from megatron_rlvr.algorithms.distill import distill_loss  # noqa: E402
from megatron_rlvr.config.loader import build_algorithm  # noqa: E402
from megatron_rlvr.families.tiny import tiny_hf_config, tiny_tokenizer  # noqa: E402
from megatron_rlvr.ops import vocab_parallel_token_stats  # noqa: E402


def load_models(student: str | None, teacher: str, seed: int):
    """(student, teacher, tokenizer): HF causal LMs in float32, the teacher frozen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    t_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    for p in t_model.parameters():
        p.requires_grad_(False)
    if student:
        s_model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(student)
    else:
        tok = tiny_tokenizer()
        torch.manual_seed(seed)
        cfg = {k: v for k, v in tiny_hf_config(tok).items() if k not in ("architectures", "model_type", "dtype")}
        s_model = AutoModelForCausalLM.from_config(Qwen2Config(**cfg), dtype=torch.float32)
    if s_model.config.vocab_size != t_model.config.vocab_size:
        raise SystemExit(
            f"--student has vocab_size={s_model.config.vocab_size} but --teacher {t_model.config.vocab_size}"
        )
    return s_model.eval(), t_model, tok


@torch.no_grad()
def sample(model, prompt_BP: torch.Tensor, max_new: int, eos: int, gen: torch.Generator):
    """Ancestral sampling at temperature 1: (ids [B, P + max_new], response mask [B, max_new]; the mask covers the
    tokens up to and including the first EOS)."""
    ids = prompt_BP
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    mask = []
    for _ in range(max_new):
        logits = model(input_ids=ids).logits[:, -1].float()
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(1)
        mask.append(~done)
        nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
        done = done | (nxt == eos)
        ids = torch.cat([ids, nxt[:, None]], 1)
    return ids, torch.stack(mask, 1)


def estimator_grads(s_model, t_model, ids_BL, mask_BT, algo, P: int) -> dict[str, torch.Tensor]:
    """Flattened student gradient of ``distill_loss`` for each estimator on one batch."""
    B, T = mask_BT.shape
    labels_BT = ids_BL[:, P:]
    with torch.no_grad():
        t_logits = t_model(input_ids=ids_BL[:, :-1]).logits[:, P - 1 :].float()
        t_lp_BT = vocab_parallel_token_stats(t_logits, token_ids_T=labels_BT, want=("logprob",))["logprob"]
    norms = LossNormalizers(num_tokens=float(mask_BT.sum()), num_seqs=float(B))
    params = [p for p in s_model.parameters() if p.requires_grad]
    out = {}
    for est in ("full", "sampled"):
        cfg = type(algo.distill)(**{**vars(algo.distill), "estimator": est, "mode": "loss", "reward_weight": 0.0})
        s_logits = s_model(input_ids=ids_BL[:, :-1]).logits[:, P - 1 :].float()
        st = vocab_parallel_token_stats(
            s_logits, token_ids_T=labels_BT, other_logits_TV=t_logits, want=("logprob", "kl")
        )
        logp = st["logprob"]
        loss, _ = distill_loss(
            cfg,
            algo.aggregation,
            norms,
            mask_BT,
            logp,
            logp.detach(),
            t_lp_BT,
            st["kl"] if est == "full" else None,
            algo.policy_loss.log_ratio_clamp,
        )
        grads = torch.autograd.grad(loss, params)
        out[est] = torch.cat([g.reshape(-1) for g in grads]).double()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", default=os.environ.get("RLVR_TEACHER"), help="teacher HF folder")
    ap.add_argument("--student", default=None, help="student HF folder (default: a random tiny initialisation)")
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "tiny_distill.yaml"))
    ap.add_argument("--batches", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not args.teacher or not os.path.isfile(os.path.join(args.teacher, "config.json")):
        ap.error(f"--teacher={args.teacher!r} is not an HF folder (train one: megatron-rlvr train configs/tiny.yaml)")
    if args.batches < 2:
        ap.error("--batches must be >= 2 (a variance needs two gradients)")
    with open(args.config) as f:
        raw = yaml.safe_load(f)
    section = dict(raw.get("algorithm") or {})
    # the config's teacher may be a ${RLVR_TEACHER:-...} interpolation: this tool's teacher is --teacher
    section["distill"] = {**(section.get("distill") or {}), "teacher": args.teacher}
    algo = build_algorithm(section)
    max_new = int(raw.get("rollout", {}).get("max_response_len", 4))
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    s_model, t_model, tok = load_models(args.student, args.teacher, args.seed)
    prompts = [tok(f"{i % 10}=", add_special_tokens=False)["input_ids"] for i in range(args.prompts)]
    prompt_BP = torch.tensor([p for p in prompts for _ in range(args.n)], dtype=torch.long)
    P = prompt_BP.shape[1]
    gen = torch.Generator().manual_seed(args.seed + 1)
    grads: dict[str, list[torch.Tensor]] = {"full": [], "sampled": []}
    kls = []
    for _ in range(args.batches):
        ids, mask = sample(s_model, prompt_BP, max_new, tok.eos_token_id, gen)
        for k, g in estimator_grads(s_model, t_model, ids, mask, algo, P).items():
            grads[k].append(g)
        with torch.no_grad():
            s_l = s_model(input_ids=ids[:, :-1]).logits[:, P - 1 :].float()
            t_l = t_model(input_ids=ids[:, :-1]).logits[:, P - 1 :].float()
            kl = vocab_parallel_token_stats(s_l, other_logits_TV=t_l, want=("kl",))["kl"]
            kls.append(float(kl[mask].mean()))
    stats = {}
    for k, gs in grads.items():
        G = torch.stack(gs)
        mean = G.mean(0)
        trace_cov = float(((G - mean) ** 2).sum(1).sum() / (G.shape[0] - 1))
        stats[k] = (mean, trace_cov)
        norm = float(mean.norm())
        print(f"{k}: mean_norm={norm:.4g} trace_cov={trace_cov:.4g} rel_var={trace_cov / norm**2:.4g}")
    cos = float(torch.nn.functional.cosine_similarity(stats["full"][0], stats["sampled"][0], dim=0))
    print(
        f"student={args.student or 'random-init'} kl_per_token={sum(kls) / len(kls):.4g} batches={args.batches} "
        f"samples_per_batch={prompt_BP.shape[0]}"
    )
    print(f"cos_mean={cos:.4f} grad_var_sampled_over_full={stats['sampled'][1] / stats['full'][1]:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
