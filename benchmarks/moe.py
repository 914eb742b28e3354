"""Mixture-of-experts step throughput against a dense model with the same active parameters.

    python benchmarks/moe.py            # default: 100 + 30 interleaved rounds, ~2 minutes
    python benchmarks/moe.py --quick    # 6 + 4 rounds, for the test (< 60 s)
    python benchmarks/moe.py --ep-only  # only the expert-parallel comparison (~1 minute)

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
same shape, train the MoE model (a) at dp 2 three ways: ep 1 (every rank holds the 8 experts; all
grads summed over dp), ep 2 with all-to-all dispatch and ep 2 with all-gather dispatch
(`mesh3d.parallel.experts.apply_ep`: 4 experts per rank, the tokens dispatched by
`mesh3d.parallel.experts`, `token_dispatcher_type` alltoall or allgather; the non-expert grads
summed over dp, the experts' have no replica at dp 2), interleaved as above, from the same
seed (the two ep2 ways train the same weights on the same batches: the same losses). Reported:
the median ep2 all-to-all / ep1 and ep2 all-gather / ep2 all-to-all step times (per-round
ratios, rank 0's clock, the step ending after the gradient all-reduce) and each ep2 way's
dispatch share: the time inside its collectives (timers around each call, forward and
backward: `torch.distributed.all_to_all_single` for the counts and rows; the flat all-gathers
and reduce-scatters, the token-count check included) over the step's time. On one 2-core host
a collective is a local copy plus waiting for the other rank, so its share is mostly that wait
(the ranks' routing, hence work, differs): a lower bound on nothing across real links.
Raw numbers: `benchmarks/results/local/moe[_ep][_quick].json` (`--publish`:
`benchmarks/results/`).
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

from mesh3d.config.other_families import MoEConfig, Qwen2Config
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


EP_WAYS = {"ep1": (1, "alltoall"), "ep2": (2, "alltoall"), "ep2_allgather": (2, "allgather")}


def _timed_collectives(clock: list[float]) -> list[tuple]:
    """Wrap the ep dispatchers' collectives (module doc) to add their seconds to `clock[0]`;
    returns (module, name, original) to put back."""
    import torch.distributed as dist

    import mesh3d.parallel.experts as experts

    def timed(fn):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            clock[0] += time.perf_counter() - t0
            return out

        return wrapped

    patched = [(dist, "all_to_all_single"), (experts, "all_gather_flat"),
               (experts, "reduce_scatter_flat")]  # fmt: skip
    originals = [(m, n, getattr(m, n)) for m, n in patched]
    for m, n, fn in originals:
        setattr(m, n, timed(fn))
    return originals


def _ep_rank(rank: int, world: int, port: int, rounds: int, queue) -> None:
    """One forked rank of the expert-parallel comparison (module doc): its per-round seconds of
    each way in `EP_WAYS`, and the dispatch collectives' seconds inside each ep2 step."""
    import torch.distributed as dist

    from mesh3d.models.moe import MoE
    from mesh3d.parallel.data import allreduce_gradients
    from mesh3d.parallel.experts import ExpertParallel, apply_ep
    from mesh3d.parallel.parallelize import mark_expert_shards

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    comm = [0.0]
    originals = _timed_collectives(comm)
    ways = {}
    for name, (ep, dispatcher) in EP_WAYS.items():
        model, _ = build(True)
        if ep > 1:
            apply_ep(model, ExpertParallel(group, ep, rank, dispatcher), (MoE,))
            torch.manual_seed(rank)  # the new expert slices: this rank's share
            for pname, p in model.named_parameters():
                if ".experts." in pname:
                    torch.nn.init.normal_(p, std=0.02)
            mark_expert_shards(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
        ways[name] = (model, opt)
    g = torch.Generator().manual_seed(100 + rank)  # each dp rank its own batches
    data = [torch.randint(SHAPE["vocab"], (SHAPE["micro_batch"], SHAPE["seq"] + 1), generator=g)
            for _ in range(rounds)]  # fmt: skip
    out = {"seconds": {n: [] for n in ways}, "loss": {n: [] for n in ways},
           "comm": {n: [] for n in ways if EP_WAYS[n][0] > 1}}  # fmt: skip
    names = list(ways)
    for r, ids in enumerate(data):
        for name in names if r % 2 == 0 else names[::-1]:
            model, opt = ways[name]
            dist.barrier()
            comm[0] = 0.0
            t0 = time.perf_counter()
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            allreduce_gradients(model, group)  # expert slices left out: no replica at dp 2
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            out["seconds"][name].append(time.perf_counter() - t0)
            out["loss"][name].append(float(loss.detach()))
            if name in out["comm"]:
                out["comm"][name].append(comm[0])
    for m, n, fn in originals:
        setattr(m, n, fn)
    dist.destroy_process_group()
    queue.put((rank, out))


def _paired(num: list[float], den: list[float]) -> tuple[float, tuple[float, float]]:
    """Median of the per-round ratios num / den, and its bootstrap 95% interval."""
    ratios = [a / b for a, b in zip(num, den)]
    return statistics.median(ratios), bootstrap_median(ratios)


def expert_parallel(rounds: int, warmup: int) -> dict:
    """ep2 (all-to-all and all-gather) against ep1 at dp 2 on 2 forked ranks (module doc);
    rank 0's times."""
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
    step = {k: v[warmup:] for k, v in results[0]["seconds"].items()}
    comm = {k: v[warmup:] for k, v in results[0]["comm"].items()}
    over_ep1, over_ep1_ci = _paired(step["ep2"], step["ep1"])
    ag, ag_ci = _paired(step["ep2_allgather"], step["ep2"])
    return {
        "rounds": rounds, "warmup": warmup, "ranks": results,
        "step_s_median": {k: statistics.median(v) for k, v in step.items()},
        "ep2_over_ep1_median": over_ep1, "ep2_over_ep1_ci95": over_ep1_ci,
        "allgather_over_alltoall_median": ag, "allgather_over_alltoall_ci95": ag_ci,
        "comm_share_median": {k: _paired(v, step[k])[0] for k, v in comm.items()},
        "comm_s_median": {k: statistics.median(v) for k, v in comm.items()},
    }  # fmt: skip


def ep_table(e: dict, s: dict, tokens: int) -> list[str]:
    """The expert-parallel comparison's lines (`expert_parallel`'s result `e`, shape `s`)."""
    step, share, comm = e["step_s_median"], e["comm_share_median"], e["comm_s_median"]
    lines = [
        f"expert parallelism, 2 ranks, dp 2, 1 thread each, {e['rounds']} rounds "
        f"({e['warmup']} warm-up dropped), {tokens} tokens/step per rank:",
        "",
        "| layout | experts per rank | dispatch | median step s (rank 0) | dispatch share |",
        "|---|---:|---|---:|---:|",
        f"| dp2 ep1 | {s['experts']} | none | {step['ep1']:.3f} | |",
    ]
    for way, label in (("ep2", "all-to-all"), ("ep2_allgather", "all-gather")):
        lines.append(f"| dp2 ep2 | {s['experts'] // 2} | {label} | {step[way]:.3f} | "
                     f"{100 * share[way]:.1f}% ({1000 * comm[way]:.1f} ms) |")  # fmt: skip
    lines += [
        "",
        "ep2 all-to-all / ep1 step time: {:.3f} per-round median, 95% CI [{:.3f}, {:.3f}]".format(
            e["ep2_over_ep1_median"], *e["ep2_over_ep1_ci95"]),
        "ep2 all-gather / all-to-all step time: {:.3f} per-round median, 95% CI [{:.3f}, "
        "{:.3f}]".format(e["allgather_over_alltoall_median"], *e["allgather_over_alltoall_ci95"]),
    ]  # fmt: skip
    return lines


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
    lines += ["", *ep_table(r["expert_parallel"], s, r["tokens_per_step"])]
    return "\n".join(lines)


def single_process(mode: str) -> dict:
    """The one-process part (module doc): MoE grouped, MoE loop and dense, and the profile."""
    rounds, warmup = ROUNDS[mode]
    ways = {"moe": build(True), "moe_loop": build(True, grouped_mm=False), "dense": build(False)}
    params = {k: dict(zip(("total", "active"), param_counts(m))) for k, (m, _) in ways.items()}
    data = batches(rounds + 1)
    runs = interleave(ways, data[:rounds])
    tokens = SHAPE["micro_batch"] * SHAPE["seq"]
    return {
        "rounds": rounds, "warmup": warmup, "params": params, "runs": runs,
        "summary": summarize(runs, tokens, warmup),
        "profile": profile_step(*ways["moe"], data[rounds]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 rounds, for the test")
    ap.add_argument("--ep-only", action="store_true", help="only the expert-parallel comparison")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results[/local]/moe*.json)")
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    mode = "quick" if args.quick else "default"
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__, "cores": os.cpu_count(), "threads": args.threads,
        "mode": mode, "shape": SHAPE, "tokens_per_step": SHAPE["micro_batch"] * SHAPE["seq"],
    }  # fmt: skip
    if not args.ep_only:
        result |= single_process(mode)
    result["expert_parallel"] = expert_parallel(*EP_ROUNDS[mode])
    name = "moe" + "_ep" * args.ep_only + "_quick" * args.quick
    out = args.out or results_dir(args.publish) / f"{name}.json"
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    if args.ep_only:
        print(f"$ {result['command']}  ({result['date']})\ntorch {result['torch']}, "
              f"{result['cores']} cores, fp32\n")  # fmt: skip
        print("\n".join(ep_table(result["expert_parallel"], SHAPE, result["tokens_per_step"])))
    else:
        print(table(result))
    print(f"\nwrote {out}")
    speeds = result.get("summary", {}).get("tokens_per_s_median", {})
    bad = [k for k, v in speeds.items() if not math.isfinite(v)]
    bad += [k for k, v in result["expert_parallel"]["step_s_median"].items() if not v > 0]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
