"""Where the train/inference log-prob mismatch of an MoE policy comes from under routing replay R3: one process,
the trainer (megatron, TP = EP = 1) and the transformers engine holding the same weights (streamed from the trainer
as in a run), the engine samples, and the trainer's behaviour log-probs of the sampled response tokens are computed

    plain    without replay (the trainer's own routes, recorded),
    r3       replaying the engine's routes (``train.routing_replay=r3``),
    r3+w     replaying the engine's routes AND its gate weights (``train.routing_replay_weights=true``),

each against the engine's own log-probs; beside them the engine against itself: one uncached forward of the whole
sequence through the transformers model (the same weights and routes up to near-ties, other matmul shapes than the
cached prefill + decode that sampled it).

Tokens are split by whether an MoE route where the engine differs from the trainer's own reaches the token's
log-prob (at the position that predicts it, or before it in a layer that attention follows), and the engine's
returned routes are checked against the top-k of its own router logits of the same forward and of one uncached
forward (order, bf16 ties, position alignment). Prints one table per dtype.

    PYTHONPATH=$PWD .venv/bin/python tools/replay_mismatch.py --dtype bfloat16 float32 [--weights HF_FOLDER]

``--weights``: an exported HF folder of the tiny MoE model (``checkpoint.export_hf``) instead of the random init
(seed ``--seed``); ``--task``: prompts of the tiny copy task ("<digits>=") instead of random tokens; ``--prompts``
x ``--n`` samples of ``--max-tokens`` tokens each (EOS ignored); ``--threads``: torch threads per process (1
steadies the figures on a loaded machine). The numbers of docs/moe.md ("What routing replay removes in bf16") come
from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.append(REPO)


def _rank(dtype: str, seed: int, weights, prompts_n: int, n: int, max_tokens: int, threads: int, task: bool):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rlvr.algorithms import AlgorithmConfig
    from megatron_rlvr.config import ModelConfig, ParallelConfig, TrainConfig
    from megatron_rlvr.megatron.policy import build_model, model_args_for
    from megatron_rlvr.megatron.routing import RoutingReplay
    from megatron_rlvr.models.build import unwrap
    from megatron_rlvr.models.export import iter_hf_tensors
    from megatron_rlvr.models.hf_config import hf_config_object
    from megatron_rlvr.models.source import load_tokenizer, resolve_model_source
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine
    from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig
    from megatron_rlvr.trainer.microbatch import Sequence
    from megatron_rlvr.trainer.token_loss import StatsSpec
    from megatron_rlvr.trainer.update import UpdateSettings, compute_logprobs

    torch.set_num_threads(threads)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    mcfg = ModelConfig(name="tiny_moe", dtype=dtype)
    source = resolve_model_source(mcfg)
    if weights:
        source = dataclasses.replace(source, weights_dir=weights, is_tiny=False)
    args = model_args_for(source, mcfg, ParallelConfig(), TrainConfig())
    model = build_model(args, source, seed=seed, pg=pg)
    model.eval()
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    engine = HFRolloutEngine.from_config(
        hf_config_object(source.hf_config), dtype=dt, config=HFEngineConfig(return_routes=True), eos_token_ids=[]
    )
    engine.update_weights([(name, t.detach().clone()) for name, t in iter_hf_tensors(model, args, pg_collection=pg)])

    # the engine's routers: their logits of each forward, to check the returned routes against
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hf_routers = [m for m in engine.model.modules() if type(m).__name__.endswith("TopKRouter")]
    hooks = [r.register_forward_hook(lambda mod, i, o: seen.append((o[0].detach().float(), o[2].detach())))
             for r in hf_routers]  # fmt: skip
    order_bad = ties = checked = own_bad = 0

    g = torch.Generator().manual_seed(seed)
    vocab = int(source.hf_config["vocab_size"])
    if task:  # the tiny preset's copy task: "<digits>=" (the built-in character tokenizer)
        tok = load_tokenizer(resolve_model_source(ModelConfig(name="tiny_moe")))
        prompts = [tok.encode("".join(str(int(d)) for d in torch.randint(0, 10, (int(torch.randint(1, 4, (1,),
                   generator=g)),), generator=g)) + "=") for _ in range(prompts_n)]  # fmt: skip
    else:
        prompts = [torch.randint(3, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(prompts_n)]  # fmt: skip
    seqs = []
    for p in prompts:  # one prompt per generate call: its forwards' router logits are this prompt's rows only
        seen.clear()
        sp = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)
        out = engine.generate([p], sp)
        k = out[0].completions[0].routes.shape[-1]
        for logits, idx in seen:  # [rows * positions, E] per router call, and the experts it returned
            top = logits.topk(k, -1).indices.sort(-1).values
            own_bad += int((top != idx.long().sort(-1).values).any(-1).sum())
            vals = logits.sort(-1, descending=True).values
            ties += int((vals[:, k - 1] == vals[:, k]).sum())  # the k-th and (k+1)-th logits equal: a tie decides
            checked += logits.shape[0]
        for c in out[0].completions:
            seqs.append(Sequence(tokens=p + c.token_ids, prompt_len=len(p), rollout_logprobs=c.logprobs,
                                 engine_routes=c.routes, engine_route_weights=c.route_weights))  # fmt: skip
    for h in hooks:
        h.remove()
    # the returned routes against the top-k of the engine's router logits in one full uncached forward of the same
    # tokens (alignment), and that forward's own log-probs: the engine against itself with other shapes
    uncached = {}
    for i, q in enumerate(seqs):
        with torch.no_grad():
            o = engine.model(torch.tensor([q.tokens[:-1]]), output_router_logits=True)
        lp = torch.log_softmax(o.logits[0].float(), -1)[q.prompt_len - 1 :]
        uncached[i] = lp.gather(1, torch.tensor(q.tokens[q.prompt_len :])[:, None])[:, 0]
        for layer, logits in enumerate(o.router_logits):
            k = q.engine_routes.shape[-1]
            same = logits.float().topk(k, -1).indices.sort(-1).values == q.engine_routes[layer].long().sort(-1).values
            order_bad += int((~same.all(-1)).sum())

    rr = RoutingReplay(model, pg.tp, "r3")
    ctx = UpdateSettings(
        algo=AlgorithmConfig(), spec=StatsSpec(pg.tp, vocab, 1.0, 4096), pg=pg, device=torch.device("cpu"),
        pad_id=0, micro_batch_tokens=None, seq_multiple=1, n_per_group=n, num_mini_batches=1, ppo_epochs=1,
        correction=MismatchCorrectionConfig(), skip_nonfinite=True, routing=rr,
    )  # fmt: skip
    ids = list(range(len(seqs)))
    eroutes = {i: rr.engine_routes(seqs[i]) for i in ids}
    eweights = {i: rr.engine_weights(seqs[i]) for i in ids}
    own: dict[int, torch.Tensor] = {}
    rr.mode = "r2"  # a recording forward: the trainer's own routes
    lp_plain, _, _ = compute_logprobs(ctx, model, seqs, ids, routes=own)
    rr.mode = "r3"
    lp_r3, _, _ = compute_logprobs(ctx, model, seqs, ids, routes=eroutes)
    lp_w, _, _ = compute_logprobs(ctx, model, seqs, ids, routes=eroutes, route_weights=eweights)

    # the trainer's own gate weights at the engine's routes (r3 forward), against the engine's
    routers = [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]
    probs: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda mod, i, o: probs.append(o[0].detach().float())) for r in routers]
    gate_err = []
    for i in ids:
        probs.clear()
        compute_logprobs(ctx, model, seqs, [i], routes=eroutes)
        L = seqs[i].length
        for layer, pr in enumerate(probs):  # [s * b, E], b = 1
            mine = pr[: L - 1].gather(1, eroutes[i][layer, :-1].long())
            gate_err.append((mine - seqs[i].engine_route_weights[layer].float()).abs().flatten())
    for h in hooks:
        h.remove()

    # a route at (MoE layer l, position j) reaches the log-prob predicted at position t when j == t, or j < t and
    # an attention layer follows layer l (the last layer's MoE output at j feeds position j only)
    n_layers = int(source.hf_config["num_hidden_layers"])
    last_is_moe = routers[-1].layer_number == n_layers  # megatron's layer numbers are 1-based
    rows = []
    for i in ids:
        q = seqs[i]
        R = q.length - q.prompt_len
        diff_lp = (own[i][:, :-1].long().sort(-1).values != q.engine_routes.long().sort(-1).values).any(-1)  # [l, p]
        differ = diff_lp.any(0)
        deep = diff_lp[:-1] if last_is_moe else diff_lp
        ctx_differ = differ | deep.any(0).long().cummax(0).values.bool()  # [length - 1]: reaches this position
        eng = torch.tensor(q.rollout_logprobs)
        rows.append(torch.stack([
            ctx_differ[q.prompt_len - 1 :].float(), differ[q.prompt_len - 1 :].float(),
            lp_plain[i] - eng, lp_r3[i] - eng, lp_w[i] - eng, uncached[i] - eng,
        ]))  # fmt: skip
        assert rows[-1].shape[1] == R
    table = torch.cat(rows, 1)
    return {
        "table": table,
        "gate_err": torch.cat(gate_err),
        "ties": ties,
        "router_rows": checked,
        "alignment_bad": order_bad,
        "own_bad": own_bad,
        "disagree_pairs": sum(
            int((own[i][:, :-1].long().sort(-1).values != seqs[i].engine_routes.long().sort(-1).values).any(-1).sum())
            for i in ids
        ),  # fmt: skip
        "positions": sum(q.length - 1 for q in seqs),
        "tokens": table.shape[1],
        "layers": rr.num_moe_layers,
    }


def _summary(name: str, res: dict) -> None:
    t = res["table"].double()
    ctx_d = t[0].bool()
    print(f"\n{name}: {res['tokens']} response tokens, {res['positions']} positions run by the engine")
    print(
        f"  engine router rows {res['router_rows']}: returned experts != top-k of the same forward's router logits: "
        f"{res['own_bad']}; k-th / (k+1)-th logit ties: {res['ties']}; returned routes != top-k of one uncached "
        f"forward (alignment; sampled positions): {res['alignment_bad']}"
    )
    print(
        f"  (position, MoE layer) pairs whose engine route differs from the trainer's own: {res['disagree_pairs']} "
        f"of {res['positions'] * res['layers']}"
    )
    ge = res["gate_err"].double()
    print(f"  gate weights |trainer - engine| at the engine's routes: mean {ge.mean():.2e}, max {ge.max():.2e}")
    print(f"  {'|log r| mean / max':<34}{'n':>6}  {'plain':>20}  {'r3':>20}  {'r3+w':>20}  {'engine uncached':>20}")
    for label, m in (
        ("all", torch.ones_like(ctx_d)),
        ("(a) a differing route reaches it", ctx_d),
        ("    ... at the predicting position", t[1].bool()),
        ("(b) identical routing", ~ctx_d),
    ):
        cells = []
        for j in (2, 3, 4, 5):
            x = t[j][m].abs()
            cells.append(f"{x.mean():.2e} / {x.max():.2e}" if x.numel() else "-")
        print(f"  {label:<34}{int(m.sum()):>6}  " + "  ".join(f"{c:>20}" for c in cells))
    for j, lab in ((2, "plain"), (3, "r3"), (4, "r3+w"), (5, "engine uncached")):
        total = float(t[j].abs().sum())
        share = f"{float(t[j][ctx_d].abs().sum()) / total:.2f}" if total > 0 else "-"
        print(f"  share of sum |log r| from (a), {lab}: {share};"
              f" mean ratio {float(t[j].exp().mean()):.4f}")  # fmt: skip


def main(argv=None) -> None:
    from megatron_rlvr.testing.distributed import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--weights", default=None, help="exported HF folder of the tiny MoE model")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--task", action="store_true", help="prompts of the tiny copy task instead of random tokens")
    a = ap.parse_args(argv)
    for dtype in a.dtype:
        res = run_distributed(
            _rank, 1, args=(dtype, a.seed, a.weights, a.prompts, a.n, a.max_tokens, a.threads, a.task), timeout=900
        )[0]
        _summary(f"{dtype}, {'weights ' + a.weights if a.weights else f'random init seed {a.seed}'}", res)


if __name__ == "__main__":
    main()
