"""Mixture-of-experts step throughput against a dense model with the same active parameters.

    python benchmarks/moe.py            # default: 100 + 30 interleaved rounds, ~2 minutes
    python benchmarks/moe.py --quick    # 6 + 4 rounds, for the test (< 60 s)

One process, CPU, fp32, one intra-op thread by default (`--threads`; benchmarks/throughput.py
says why). Two Qwen2 models (`mesh3d.models.qwen2.Qwen2`, SDPA) of the same shape, hidden 256,
4 layers, 8 heads (4 kv), vocab 2048, seq 256, micro batch 2 (512 tokens a step), no shared
expert on either side:
  (a) MoE: every layer's MLP is `models/moe.py`'s block, 8 experts of F = 384, top 2, the
      load-balancing loss on (coefficient 0.01);
  (a') the same MoE model with the experts run by a loop over experts instead of two grouped
      GEMMs (`torch._grouped_mm`; `Experts.grouped_mm = False`), to measure what grouping buys;
  (b) dense: a SwiGLU MLP of 2F = 768 in every layer.
A token runs through the same parameters in both (2 experts of F = one MLP of 2F), except the
MoE router (E·h per layer): active(a) = total(b) + layers·E·h, and total(a) = active(a) +
layers·(E - k)·3·h·F. Each step: forward, cross-entropy, backward, clip to 1.0, AdamW (torch's,
not fused), zero_grad; both from the same seed and on the same batches (random ids).

Timing: round r runs step r of (a), (a') and (b), in an order that reverses every round; the
first `warmup` rounds are dropped. Reported: median tokens/s of each, MoE / dense as the ratio
of the medians and as the median of the per-round ratios with a 95% bootstrap interval, and
grouped / loop the same way.

Where the MoE step goes: one more MoE step under torch.profiler (CPU, input shapes recorded),
its ops' self times put in classes: expert matmuls (mm/addmm/matmul with an F or 2F dim, forward
and backward), router (mm with an E dim, softmax, topk and their backwards, the aux loss's
scatter_add), dispatch (the gathers, index_add, nonzero, bincount, `==`, index backward's
index_put, the zeros the output starts from), expert weight slices (select of expert e's weights
and its backward, which writes a [E, h, F]-sized zero gradient per expert run, and the adds that
accumulate them), the optimizer (clip and AdamW: over every expert's weights) and the rest
(attention, norms, embedding, lm_head, loss). The shares
are of the profiled step's total self time; profiling slows small ops more than big ones, so
they are indicative.

Expert parallelism: 2 forked ranks (gloo, one thread each), each with its own batches of the
same shape, train the MoE model (a) at dp 2 twice: ep 1 (every rank holds the 8 experts; all
grads summed over dp) and ep 2 (`mesh3d.parallel.parallelize.apply_ep`: 4 experts per rank, the
tokens dispatched by `mesh3d.parallel.experts`' all-to-alls; the non-expert grads summed over
dp, the experts' have no replica at dp 2), interleaved as above, from the same seed. Reported:
the median ep2 / ep1 step time (per-round ratio, rank 0's clock, the step ending after the
gradient all-reduce) and the all-to-all share of the ep2 step: the time inside
`torch.distributed.all_to_all_single` (the counts exchange and the row all-to-alls, forward
and backward; timers around each call) over the step's time. On one 2-core host the
all-to-all is a local copy plus waiting for the other rank, so its share is mostly that wait
(the ranks' routing, hence work, differs): a lower bound on nothing across real links.
Raw numbers: `benchmarks/results/local/moe[_quick].json` (`--publish`: `benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from _results import add_publish_flag, results_dir  # benchmarks/ is on sys.path when a script runs
from throughput import bootstrap_median

from mesh3d.config.schema import MoEConfig, Qwen2Config
from mesh3d.models.moe import Experts
from mesh3d.models.qwen2 import Qwen2

SHAPE = dict(hidden=256, layers=4, heads=8, kv_heads=4, vocab=2048, seq=256, micro_batch=2,
             experts=8, top_k=2, expert_ffn=384)  # fmt: skip
# mode -> (interleaved rounds, warm-up rounds dropped)
ROUNDS = {"default": (100, 5), "quick": (6, 1)}
EP_ROUNDS = {"default": (30, 3), "quick": (4, 1)}  # the ep1 / ep2 rounds, warm-up dropped


def model_config(moe: bool, s: dict = SHAPE) -> Qwen2Config:
    """Qwen2 of `s`: MoE in every layer (E experts of F, top k), or dense with an MLP of k·F."""
    k, f = s["top_k"], s["expert_ffn"]
    experts = MoEConfig(num_experts=s["experts"], top_k=k, moe_intermediate_size=f,
                        shared_expert_intermediate_size=0, enable_shared_expert=False,
                        router_aux_loss_coef=0.01, layers=[-1])  # fmt: skip
    return Qwen2Config(
        hidden_size=s["hidden"], intermediate_size=k * f, num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], num_hidden_layers=s["layers"], vocab_size=s["vocab"],
        max_position_embeddings=s["seq"], tie_word_embeddings=False, attention_bias=False,
        moe_config=experts if moe else None,
    )  # fmt: skip


def param_counts(model: torch.nn.Module, s: dict = SHAPE) -> tuple[int, int]:
    """(total, active per token): active leaves out the E - k experts a token does not run."""
    total = sum(p.numel() for p in model.parameters())
    idle = sum(
        p.numel() * (s["experts"] - s["top_k"]) // s["experts"]
        for name, p in model.named_parameters()
        if ".mlp.experts." in name
    )
    return total, total - idle


def build(moe: bool, seed: int = 0, grouped_mm: bool = True):
    torch.manual_seed(seed)
    model = Qwen2(model_config(moe), attention="sdpa")
    for m in model.modules():
        if isinstance(m, Experts):
            m.grouped_mm = grouped_mm
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    return model, opt


def batches(n: int, s: dict = SHAPE) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(s["vocab"], (s["micro_batch"], s["seq"] + 1), generator=g)
            for _ in range(n)]  # fmt: skip


def train_step(model, opt, ids: torch.Tensor) -> float:
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    with torch.profiler.record_function("optimizer"):  # a label for `profile_step`
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def interleave(ways: dict, data: list[torch.Tensor]) -> dict[str, dict]:
    """Per way, each round's seconds and loss; the order alternates every round."""
    out = {name: {"seconds": [], "loss": []} for name in ways}
    names = list(ways)
    for r, ids in enumerate(data):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            loss = train_step(*ways[name], ids)
            out[name]["seconds"].append(time.perf_counter() - t0)
            out[name]["loss"].append(loss)
    return out


_DISPATCH = {"aten::index", "aten::index_add", "aten::index_add_", "aten::nonzero",
             "aten::bincount", "aten::eq", "aten::index_put_", "aten::_index_put_impl_",
             "aten::index_select", "aten::zeros", "aten::zero_", "aten::new_zeros",
             "aten::unbind", "aten::item", "aten::_local_scalar_dense", "aten::sort",
             "aten::argsort", "aten::cumsum", "aten::split_with_sizes"}  # fmt: skip
_ROUTER = {"aten::softmax", "aten::_softmax", "aten::_softmax_backward_data", "aten::topk",
           "aten::scatter_add_", "aten::scatter", "aten::scatter_"}  # fmt: skip
_SLICES = {"aten::select", "aten::select_backward"}
_MATMUL = {"aten::mm", "aten::addmm", "aten::matmul", "aten::bmm", "aten::_grouped_mm"}


def _dims(shapes) -> set[int]:
    return {d for shape in shapes or [] if isinstance(shape, list) for d in shape}


def classify(name: str, shapes, s: dict = SHAPE) -> str:
    """The class of one op of the MoE step (module doc)."""
    f, e = s["expert_ffn"], s["experts"]
    if name in _MATMUL:
        dims = _dims(shapes)
        if dims & {f, 2 * f}:
            return "expert matmuls"
        return "router" if e in dims else "rest"
    if name in _ROUTER:
        return "router"
    if name in _DISPATCH:
        return "dispatch"
    if name in _SLICES:
        return "expert weight slices"
    if name == "aten::add_" and {e, s["hidden"], 2 * f} <= _dims(shapes):
        return "expert weight slices"  # accumulating a select_backward's [E, h, 2F] grad
    if name == "aten::add_" and {e, f, s["hidden"]} <= _dims(shapes):
        return "expert weight slices"
    return "rest"


def profile_step(model, opt, ids: torch.Tensor) -> dict[str, float]:
    """Share of the step's total self CPU time per class (module doc)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        train_step(model, opt, ids)
    times: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        parent, in_optimizer = ev, False
        while parent is not None and not in_optimizer:
            in_optimizer, parent = parent.name == "optimizer", parent.cpu_parent
        kind = "optimizer (clip, AdamW)" if in_optimizer else classify(ev.name, ev.input_shapes)
        times[kind] += ev.self_cpu_time_total
    total = sum(times.values())
    order = ("expert matmuls", "router", "dispatch", "expert weight slices",
             "optimizer (clip, AdamW)", "rest")  # fmt: skip
    return {k: times.get(k, 0.0) / total for k in order}


def summarize(runs: dict[str, dict], tokens: int, warmup: int) -> dict:
    tps = {k: [tokens / t for t in v["seconds"][warmup:]] for k, v in runs.items()}
    per_round = [m / d for m, d in zip(tps["moe"], tps["dense"])]
    grouped = [m / d for m, d in zip(tps["moe"], tps["moe_loop"])]
    return {
        "tokens_per_s_median": {k: statistics.median(v) for k, v in tps.items()},
        "ratio_of_medians": statistics.median(tps["moe"]) / statistics.median(tps["dense"]),
        "ratio_paired_median": statistics.median(per_round),
        "ratio_paired_ci95": bootstrap_median(per_round),
        "grouped_over_loop_median": statistics.median(grouped),
        "grouped_over_loop_ci95": bootstrap_median(grouped),
    }


def _ep_rank(rank: int, world: int, port: int, rounds: int, queue) -> None:
    """One forked rank of the expert-parallel comparison (module doc): its per-round seconds of
    ep1 and ep2, and the all-to-all seconds inside each ep2 step."""
    import torch.distributed as dist

    from mesh3d.parallel.data import allreduce_gradients
    from mesh3d.parallel.experts import ExpertParallel
    from mesh3d.parallel.parallelize import apply_ep, mark_expert_shards

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    a2a = [0.0]
    plain = dist.all_to_all_single

    def timed(*args, **kwargs):  # every all-to-all of the ep2 step: counts, rows, their grads
        t0 = time.perf_counter()
        out = plain(*args, **kwargs)
        a2a[0] += time.perf_counter() - t0
        return out

    dist.all_to_all_single = timed
    ways = {}
    for ep in (1, 2):
        model, _ = build(True)
        if ep > 1:
            apply_ep(model, ExpertParallel(group, ep, rank))
            torch.manual_seed(rank)  # the new expert slices: this rank's share
            for name, p in model.named_parameters():
                if ".experts." in name:
                    torch.nn.init.normal_(p, std=0.02)
            mark_expert_shards(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
        ways[f"ep{ep}"] = (model, opt)
    g = torch.Generator().manual_seed(100 + rank)  # each dp rank its own batches
    data = [torch.randint(SHAPE["vocab"], (SHAPE["micro_batch"], SHAPE["seq"] + 1), generator=g)
            for _ in range(rounds)]  # fmt: skip
    out = {"ep1": [], "ep2": [], "a2a": [], "loss": {"ep1": [], "ep2": []}}
    names = list(ways)
    for r, ids in enumerate(data):
        for name in names if r % 2 == 0 else names[::-1]:
            model, opt = ways[name]
            dist.barrier()
            a2a[0] = 0.0
            t0 = time.perf_counter()
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            allreduce_gradients(model, group)  # expert slices left out: no replica at dp 2
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            out[name].append(time.perf_counter() - t0)
            out["loss"][name].append(float(loss.detach()))
            if name == "ep2":
                out["a2a"].append(a2a[0])
    dist.all_to_all_single = plain
    dist.destroy_process_group()
    queue.put((rank, out))


def expert_parallel(rounds: int, warmup: int) -> dict:
    """ep2 against ep1 at dp 2 on 2 forked ranks (module doc); rank 0's times."""
    import multiprocessing
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ep_rank, args=(r, 2, port, rounds, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    if any(proc.exitcode != 0 for proc in procs):
        raise RuntimeError(f"an ep rank failed: exit codes {[p.exitcode for p in procs]}")
    r0 = results[0]
    ep1, ep2, a2a = (r0[k][warmup:] for k in ("ep1", "ep2", "a2a"))
    ratios = [b / a for a, b in zip(ep1, ep2)]
    share = [c / b for b, c in zip(ep2, a2a)]
    return {
        "rounds": rounds, "warmup": warmup, "ranks": results,
        "step_s_median": {"ep1": statistics.median(ep1), "ep2": statistics.median(ep2)},
        "ep2_over_ep1_median": statistics.median(ratios),
        "ep2_over_ep1_ci95": bootstrap_median(ratios),
        "a2a_share_median": statistics.median(share),
        "a2a_s_median": statistics.median(a2a),
    }  # fmt: skip


def table(r: dict) -> str:
    s, p, t = r["shape"], r["params"], r["summary"]
    lo, hi = t["ratio_paired_ci95"]
    lines = [
        f"$ {r['command']}  ({r['date']})",
        f"torch {r['torch']}, {r['cores']} cores, {r['threads']} thread(s), fp32, "
        f"{r['rounds']} rounds ({r['warmup']} warm-up dropped), {r['tokens_per_step']} tokens/step",
        f"shape: hidden {s['hidden']}, {s['layers']} layers, seq {s['seq']}, micro batch "
        f"{s['micro_batch']}; MoE {s['experts']} experts of {s['expert_ffn']}, top {s['top_k']}"
        f"; dense FFN {s['top_k'] * s['expert_ffn']}; no shared expert",
        "",
        "| model | params | active / token | median tokens/s |",
        "|---|---:|---:|---:|",
    ]
    for k in ("moe", "moe_loop", "dense"):
        lines.append(f"| {k} | {p[k]['total']:,} | {p[k]['active']:,} | "
                     f"{t['tokens_per_s_median'][k]:,.0f} |")  # fmt: skip
    lines += [
        "",
        f"MoE / dense tokens/s: {t['ratio_of_medians']:.3f} (ratio of medians), "
        f"{t['ratio_paired_median']:.3f} per-round median, 95% CI [{lo:.3f}, {hi:.3f}]",
        "MoE grouped GEMM / expert loop tokens/s: {:.3f} per-round median, 95% CI [{:.3f}, "
        "{:.3f}]".format(t["grouped_over_loop_median"], *t["grouped_over_loop_ci95"]),
        "",
        "| share of one MoE step (torch.profiler, self CPU time) | % |",
        "|---|---:|",
        *(f"| {k} | {100 * v:.1f} |" for k, v in r["profile"].items()),
    ]
    e = r["expert_parallel"]
    lo, hi = e["ep2_over_ep1_ci95"]
    lines += [
        "",
        f"expert parallelism, 2 ranks, dp 2, 1 thread each, {e['rounds']} rounds "
        f"({e['warmup']} warm-up dropped), {r['tokens_per_step']} tokens/step per rank:",
        "",
        "| layout | experts per rank | median step s (rank 0) |",
        "|---|---:|---:|",
        f"| dp2 ep1 | {s['experts']} | {e['step_s_median']['ep1']:.3f} |",
        f"| dp2 ep2 | {s['experts'] // 2} | {e['step_s_median']['ep2']:.3f} |",
        "",
        f"ep2 / ep1 step time: {e['ep2_over_ep1_median']:.3f} per-round median, 95% CI "
        f"[{lo:.3f}, {hi:.3f}]; all-to-all share of the ep2 step: "
        f"{100 * e['a2a_share_median']:.1f}% ({1000 * e['a2a_s_median']:.1f} ms, median)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 rounds, for the test")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results[/local]/moe*.json)")
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    mode = "quick" if args.quick else "default"
    rounds, warmup = ROUNDS[mode]
    ways = {"moe": build(True), "moe_loop": build(True, grouped_mm=False), "dense": build(False)}
    params = {k: dict(zip(("total", "active"), param_counts(m))) for k, (m, _) in ways.items()}
    data = batches(rounds + 1)
    runs = interleave(ways, data[:rounds])
    tokens = SHAPE["micro_batch"] * SHAPE["seq"]
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__, "cores": os.cpu_count(), "threads": args.threads,
        "mode": mode, "rounds": rounds, "warmup": warmup, "shape": SHAPE,
        "tokens_per_step": tokens, "params": params, "runs": runs,
        "summary": summarize(runs, tokens, warmup),
        "profile": profile_step(*ways["moe"], data[rounds]),
        "expert_parallel": expert_parallel(*EP_ROUNDS[mode]),
    }  # fmt: skip
    out = args.out or results_dir(args.publish) / f"moe{'_quick' if args.quick else ''}.json"
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(table(result))
    print(f"\nwrote {out}")
    bad = [k for k, v in result["summary"]["tokens_per_s_median"].items() if not math.isfinite(v)]
    bad += [k for k, v in result["expert_parallel"]["step_s_median"].items() if not v > 0]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
