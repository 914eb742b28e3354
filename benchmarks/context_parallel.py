"""Context parallelism on CPU: activation memory per rank, the longest sequence under a memory
cap, and the step time of cp 2 against cp 1 on the same cores.

    python benchmarks/context_parallel.py           # ~4 min here: memory at seq 4096, cap at 2048, steps at 4096
    python benchmarks/context_parallel.py --quick   # < 1 min: seq 512, for tests/launch/test_bench_context_parallel.py

Model: Llama, hidden 256, ffn 688, 8 query / 2 kv heads (GQA), 2 layers, vocab 1024 (untied),
fp32, one sample per microbatch, one microbatch per step. Ranks are forked gloo processes.

1. Memory: on each rank of cp = 1, 2, 4 (`parallelism.context_parallel_size`), the bytes autograd
   saves for backward in one microbatch's forward and loss (`saved_tensors_hooks`; each storage
   counted once with its full size, parameters left out), on the run's own first batch after
   `prepare_batches` (which cuts each cp rank's tokens). Beside it: this script's analytic
   estimate (`analytic_saved`, derived from what is saved; it splits the bytes into the per-token
   part, the gathered K/V and the causal mask SDPA gets on CPU) and `mesh3d.plan`'s number
   where the plan accepts the cp config.
2. Longest sequence under a cap: the cap is cp 1's measured bytes at `--cap-seq`; for each cp a
   search over sequence lengths that are multiples of 2·cp (doubling, then bisection) measures
   the saved bytes of one forward at each length (the maximum over the cp ranks) and keeps the
   longest that is <= the cap. Measured bytes, not a real out-of-memory.
3. Step time: a full training step (`mesh3d.train.run.Run.step`: forward, backward, gradient
   all-reduce over cp, clipping, AdamW) of cp 1 on one process with 2 intra-op threads and of
   cp 2 on two processes with 1 thread each (the same 2 cores), plus cp 1 on one thread as a
   reference for what the second thread gives. The runs live side by side; semaphores let one
   step run at a time, the order rotating every round (warm-up steps left out). Reported:
   median step time of each, cp2 / cp1 and cp1 / cp1_1thread as the ratio of the medians and
   the median of the per-round ratios with a bootstrap 95% interval.

Results go to `benchmarks/results/local/context_parallel[_quick].json` (`--publish`:
`benchmarks/results/`; `--out` wins over both).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import multiprocessing
import os
import queue
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import _rank_main, keep_freed_memory, launch  # noqa: E402
from _results import add_publish_flag, results_dir  # noqa: E402
from throughput import bootstrap_median  # noqa: E402

from mesh3d.config import apply_overrides, config_from_dict  # noqa: E402
from mesh3d.data.dummy import DummyTokens, microbatches  # noqa: E402
from mesh3d.train.run import Run  # noqa: E402
from mesh3d.train.step import prepare_batches  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
CPS = (1, 2, 4)
SHAPE = dict(h=256, ffn=688, heads=8, kv_heads=2, layers=2, vocab=1024)
BASE = dict(
    general=dict(project="cp-bench", run="cp-bench", seed=11),
    logging=dict(log_level="warning", log_level_replica="warning"),
    model=dict(
        dtype="float32",
        init_method=dict(std=0.02),
        make_vocab_size_divisible_by=1,
        model_config=dict(
            hidden_size=SHAPE["h"],
            intermediate_size=SHAPE["ffn"],
            num_attention_heads=SHAPE["heads"],
            num_key_value_heads=SHAPE["kv_heads"],
            num_hidden_layers=SHAPE["layers"],
            max_position_embeddings=1 << 16,
            vocab_size=SHAPE["vocab"],
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            is_llama_config=True,
        ),
    ),
    optimizer=dict(
        zero_stage=0,
        weight_decay=0.01,
        clip_grad=1.0,
        accumulate_grad_in_fp32=False,
        learning_rate_scheduler=dict(
            learning_rate=1e-3,
            lr_warmup_steps=1,
            lr_warmup_style="constant",
            lr_decay_style="cosine",
            min_decay_lr=1e-4,
        ),
        optimizer_factory=dict(
            name="adamW", adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, torch_adam_is_fused=True
        ),
    ),
    parallelism=dict(dp=1, tp=1, pp=1),
    tokens=dict(
        sequence_length=1024, train_steps=100, micro_batch_size=1, batch_accumulation_per_replica=1
    ),
    data_stages=[dict(name="s", start_training_step=1, data=dict(dataset=None, seed=3))],
    mesh3d=dict(device="cpu"),
)
MODES = {  # seq of the memory table, cap length, seq of the timed steps, rounds, warm-up steps
    "default": dict(mem_seq=4096, cap_seq=2048, time_seq=4096, rounds=12, warmup=2),
    "quick": dict(mem_seq=512, cap_seq=512, time_seq=512, rounds=4, warmup=1),
}


def make_config(seq: int, cp: int, steps: int = 100):
    overrides = [f"tokens.sequence_length={seq}", f"parallelism.context_parallel_size={cp}",
                 f"tokens.train_steps={steps}"]  # fmt: skip
    return apply_overrides(config_from_dict(copy.deepcopy(BASE)), overrides)


# --- 1 and 2: saved bytes -----------------------------------------------------------------------


def analytic_saved(seq: int, cp: int, rank: int, b: int = 1) -> dict[str, int]:
    """Bytes one fp32 microbatch's forward + loss saves on cp rank `rank`, by part.

    Derived from the tensors the saved-tensor hook sees (this script's estimate, not
    mesh3d.plan's). T = b·S/cp local tokens, c = S/(2·cp) tokens per chunk, 4-byte values:
    - per token (all / cp): per layer two RMSNorms T·(8h + 4), the q/k/v and gate/up inputs
      2·4·T·h, q and the attention output 2·4·T·h (under cp the two chunks' SDPA outputs are
      separate from the o_proj input: + 4·T·h), the logsumexp 4·T·nq, RoPE cos/sin 16·dh·S/cp
      (times b under cp, where each sample has its positions), the MLP 16·T·ffn; once: token ids
      8·T, the final norm, the lm_head input 4·T·h, the fp32 log-softmax 4·T·V, labels 8·T + 4;
    - gathered K/V: 2·4·b·S·nkv·dh per layer, the full sequence on every cp rank;
    - mask: a query chunk whose keys are not square (all but rank 0's head chunk) gets an
      additive (c, end) mask on CPU, which SDPA saves for backward; one per chunk shape, shared
      by every layer: 4·c·end per chunk (rank r: ends (r+1)·c and (2·cp - r)·c). On CUDA the
      lower-right causal bias runs in the flash / memory-efficient kernels without a mask: 0.
    """
    h, ffn, nq, nkv, layers, vocab = (SHAPE[k] for k in ("h", "ffn", "heads", "kv_heads",
                                                          "layers", "vocab"))  # fmt: skip
    dh, t = h // nq, b * seq // cp
    norm = t * (8 * h + 4)
    layer = 2 * norm + 16 * t * h + 4 * t * nq + 16 * dh * (seq // cp) * (b if cp > 1 else 1)
    layer += 16 * t * ffn + (4 * t * h if cp > 1 else 0)
    per_token = layers * layer + 8 * t + norm + 4 * t * h + 4 * t * vocab + 8 * t + 4
    kv = layers * 2 * 4 * b * seq * nkv * dh
    mask = 0
    if cp > 1:
        c = seq // (2 * cp)
        ends = [e for e in ((rank + 1) * c, (2 * cp - rank) * c) if e != c]
        mask = sum(4 * c * e for e in ends)
    return dict(per_token=per_token, kv=kv, mask=mask, total=per_token + kv + mask)


def plan_saved(seq: int, cp: int) -> tuple[list[int] | None, str]:
    """mesh3d.plan's saved-activation bytes per rank for this config, or None and why not."""
    try:
        from mesh3d.plan import make_plan

        plan = make_plan(make_config(seq, cp), cp)
    except Exception as e:  # the plan may not know cp (yet)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    if len(plan.ranks) != cp:
        return None, f"the plan has {len(plan.ranks)} ranks for world {cp}"
    return [r.saved_activation_bytes for r in plan.ranks], ""


def saved_bytes(model, loss_fn, microbatch: tuple) -> int:
    """Bytes of the distinct storages autograd saves in forward + loss (parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    inputs, labels, *positions = microbatch
    kwargs = {"positions": positions[0]} if positions else {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(inputs, **kwargs)
        loss = loss_fn(logits, labels)
    del logits, loss  # every saved tensor was alive until here: no storage address was reused
    return sum(seen.values())


def memory_rank(rank: int, world: int, mem_seq: int, cap_seq: int, cap: int | None) -> dict:
    """One cp rank: saved bytes at `mem_seq` (the run's first batch), then the longest
    sequence whose saved bytes (max over the cp ranks) fit `cap` (cp 1: cap = its own bytes at
    `cap_seq`)."""
    run = Run.prepare(make_config(mem_seq, world))
    model, loss_fn, layout = run.parts.modules[0], run.parts.loss_fn, run.layout

    def measure(batches: list[tuple]) -> tuple[int, int]:
        mine = saved_bytes(model, loss_fn, prepare_batches(batches, layout, None, run.device)[0][0])
        gc.collect()
        most = torch.tensor([mine])
        if world > 1:
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return mine, int(most)

    def synthetic(seq: int) -> list[tuple]:  # the run's own kind of batch, at any length
        return microbatches(DummyTokens(SHAPE["vocab"], seq, seed=5), 1, 1, 0, 1, 1)

    t0 = time.perf_counter()
    at_mem, at_mem_max = measure(run.data.batches(1, 0, 1, 1))
    if cap is None:
        cap = measure(synthetic(cap_seq))[1]
    unit, probes = 2 * world, []

    def fits(n: int) -> bool:
        probes.append((n * unit, measure(synthetic(n * unit))[1]))
        return probes[-1][1] <= cap

    n = max(1, cap_seq // unit)
    if fits(n):
        lo, hi = n, None
        while hi is None:
            lo, hi = (2 * lo, None) if fits(2 * lo) else (lo, 2 * lo)
    else:
        lo, hi = 0, n
        while lo == 0 and hi > 1:
            lo, hi = (hi // 2, hi) if fits(hi // 2) else (0, hi // 2)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return dict(rank=rank, saved=at_mem, saved_max=at_mem_max, cap=cap, longest=lo * unit,
                probes=sorted(probes), seconds=time.perf_counter() - t0)  # fmt: skip


# --- 3: step time, cp 1 and cp 2 side by side --------------------------------------------------


def timing_rank(
    rank: int, world: int, me: str, cfg, turns: list[str], sems: dict, sizes: dict
) -> dict:
    """Train one step each time group `me` has the turn; rank 0 times it and hands the turn
    on by releasing the next group's semaphore once per rank of that group."""
    run = Run.prepare(cfg)
    times, step = [], 0
    for k, who in enumerate(turns):
        if who != me:
            continue
        if not sems[me].acquire(timeout=600):
            raise RuntimeError(f"{me} rank {rank}: no turn for 600 s")
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step += 1
        loss = run.step(step).loss
        if world > 1:
            dist.barrier()
        times.append(time.perf_counter() - t0)
        if rank == 0 and k + 1 < len(turns):
            for _ in range(sizes[turns[k + 1]]):
                sems[turns[k + 1]].release()
    return dict(rank=rank, threads=torch.get_num_threads(), times=times, last_loss=loss)


def _threads(n: int):
    def setup() -> None:
        keep_freed_memory()
        torch.set_num_threads(n)

    return setup


def launch_side_by_side(groups: dict[str, tuple], turns: list[str], timeout: float) -> dict:
    """Start every group's ranks at once (`groups`: name -> (world, threads, cfg)), each its
    own gloo process group; give `turns[0]` the first turn; rank 0's result of each group."""
    ctx = multiprocessing.get_context("fork")
    sizes = {name: g[0] for name, g in groups.items()}
    sems = {name: ctx.Semaphore(0) for name in groups}
    procs, queues, results = [], {}, {}
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="mesh3d-cp-bench-") as tmp:
        try:
            for name, (world, threads, cfg) in groups.items():
                os.makedirs(f"{tmp}/{name}")
                queues[name] = q = ctx.Queue()
                args = (name, cfg, turns, sems, sizes)
                for r in range(world):
                    procs.append(ctx.Process(target=_rank_main, args=(
                        r, world, f"{tmp}/{name}", "gloo", _threads(threads), q, timing_rank, args
                    )))  # fmt: skip
                    procs[-1].start()
            for _ in range(sizes[turns[0]]):
                sems[turns[0]].release()
            for name, q in queues.items():
                got = 0
                while got < sizes[name]:
                    try:
                        rank, status, value = q.get(timeout=1)
                    except queue.Empty:
                        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                        if dead or time.monotonic() > deadline:
                            raise RuntimeError(f"ranks died ({dead}) or timed out") from None
                        continue
                    if status != "ok":
                        raise RuntimeError(f"{name} rank {rank} failed:\n{value}")
                    got += 1
                    if rank == 0:
                        results[name] = value
            return results
        finally:
            for p in procs:
                p.join(5 if len(results) == len(groups) else 0)
                if p.is_alive():
                    p.kill()


GROUPS = {  # name: (ranks, intra-op threads per rank, cp)
    "cp1": (1, 2, 1),  # the same 2 cores as cp2
    "cp2": (2, 1, 2),
    "cp1_1thread": (1, 1, 1),  # reference: what the second thread gives cp 1
}


def step_times(seq: int, rounds: int, warmup: int) -> dict:
    """Steps of every group in GROUPS, side by side; the order rotates every round."""
    names = list(GROUPS)
    turns = names * warmup
    for k in range(rounds):
        turns += names[k % len(names) :] + names[: k % len(names)]
    steps = warmup + rounds + 1
    groups = {n: (w, t, make_config(seq, cp, steps)) for n, (w, t, cp) in GROUPS.items()}
    res = launch_side_by_side(groups, turns, timeout=1800)
    times = {n: res[n]["times"][warmup:] for n in names}
    out = dict(seq=seq, rounds=rounds, warmup=warmup,
               threads={n: res[n]["threads"] for n in names}, step_s=times,
               median_s={n: statistics.median(t) for n, t in times.items()},
               last_loss={n: res[n]["last_loss"] for n in names}, ratios={})  # fmt: skip
    for num, den in (("cp2", "cp1"), ("cp1", "cp1_1thread")):
        per_round = [a / b for a, b in zip(times[num], times[den])]
        low, high = bootstrap_median(per_round)
        out["ratios"][f"{num}/{den}"] = dict(
            of_medians=out["median_s"][num] / out["median_s"][den],
            per_round=per_round, per_round_median=statistics.median(per_round),
            per_round_ci95=[low, high],
        )  # fmt: skip
    return out


# --- report ------------------------------------------------------------------------------------


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def mib(x: float) -> str:
    return f"{x / MiB:.2f}"


def memory_table(mem: dict, seq: int) -> str:
    head = ["cp", "tokens per rank", "measured rank 0", "max over ranks", "/ cp 1",
            "analytic rank 0 (per token + K/V + mask)", "analytic / measured", "mesh3d.plan rank 0"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = mem[1]["ranks"][0]["saved"]
    for cp, m in mem.items():
        r0, a = m["ranks"][0], m["analytic"][0]
        plan = mib(m["plan"][0]) if m["plan"] else "n/a"
        cells = [cp, seq // cp, mib(r0["saved"]), mib(r0["saved_max"]), f"{r0['saved'] / base:.3f}",
                 f"{mib(a['total'])} ({mib(a['per_token'])} + {mib(a['kv'])} + {mib(a['mask'])})",
                 f"{a['total'] / r0['saved']:.4f}", plan]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def cap_table(mem: dict) -> str:
    head = ["cp", "longest seq <= cap", "/ cp 1", "its saved MiB (max rank)", "next length tried",
            "forwards measured", "analytic longest"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = mem[1]["ranks"][0]["longest"]
    for cp, m in mem.items():
        r0 = m["ranks"][0]
        at = dict(r0["probes"])
        over = [s for s, b in r0["probes"] if b > r0["cap"]]
        cells = [cp, r0["longest"], f"{r0['longest'] / base:.2f}", mib(at.get(r0["longest"], 0)),
                 min(over) if over else "-", len(r0["probes"]), m["analytic_longest"]]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def analytic_longest(cap: int, cp: int, limit: int = 1 << 20) -> int:
    """The longest multiple of 2·cp whose analytic bytes (max over ranks) are <= cap."""
    unit, best, n = 2 * cp, 0, 1
    while n * unit <= limit:
        if max(analytic_saved(n * unit, cp, r)["total"] for r in range(cp)) > cap:
            break
        best, n = n * unit, n + 1
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for the test (< 1 min)")
    ap.add_argument("--mem-seq", type=int, help="sequence length of the memory table")
    ap.add_argument("--cap-seq", type=int, help="the cap is cp 1's saved bytes at this length")
    ap.add_argument("--time-seq", type=int, help="sequence length of the timed steps")
    ap.add_argument("--rounds", type=int, help="timed rounds (one cp 1 and one cp 2 step each)")
    ap.add_argument("--out", type=Path, help="JSON path (default: see --publish)")
    add_publish_flag(ap)
    a = ap.parse_args(argv)
    mode = "quick" if a.quick else "default"
    s = dict(MODES[mode])
    s.update({k: getattr(a, k) for k in ("mem_seq", "cap_seq", "time_seq", "rounds")
              if getattr(a, k) is not None})  # fmt: skip
    for key in ("mem_seq", "cap_seq", "time_seq"):
        if s[key] % (2 * max(CPS)):
            ap.error(f"--{key.replace('_', '-')} must be a multiple of {2 * max(CPS)}")
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    t_all = time.time()
    print(f"command: python {shlex.join(['benchmarks/context_parallel.py', *sys.argv[1:]])}")
    print(f"torch {torch.__version__} | cores {os.cpu_count()} | {now} | load {load()}")
    print(
        f"model: Llama h{SHAPE['h']} ffn {SHAPE['ffn']} {SHAPE['heads']}/{SHAPE['kv_heads']} heads "
        f"{SHAPE['layers']} layers vocab {SHAPE['vocab']}, fp32, 1 sample per microbatch\n",
        flush=True,
    )
    mem, cap = {}, None
    for cp in CPS:
        t0 = time.time()
        ranks = launch(cp, memory_rank, s["mem_seq"], s["cap_seq"], cap, timeout=1200)
        cap = ranks[0]["cap"]
        plan, why = plan_saved(s["mem_seq"], cp)
        mem[cp] = dict(ranks=ranks, plan=plan, plan_note=why, seconds=time.time() - t0,
                       analytic=[analytic_saved(s["mem_seq"], cp, r) for r in range(cp)],
                       analytic_longest=analytic_longest(cap, cp))  # fmt: skip
        print(f"  memory cp {cp}: {mem[cp]['seconds']:.1f}s", file=sys.stderr, flush=True)
    t0 = time.time()
    timing = step_times(s["time_seq"], s["rounds"], s["warmup"])
    timing["seconds"] = time.time() - t0

    print(
        f"1. Saved for backward, one microbatch's forward + loss, seq {s['mem_seq']} (MiB per rank)\n"
    )
    print(memory_table(mem, s["mem_seq"]))
    notes = {cp: m["plan_note"] for cp, m in mem.items() if m["plan_note"]}
    if notes:
        print("\nmesh3d.plan n/a: " + "; ".join(f"cp {cp}: {n}" for cp, n in notes.items()))
    print(f"\n2. Longest sequence under a cap of {mib(cap)} MiB per rank (cp 1's saved bytes at "
          f"seq {s['cap_seq']}), multiples of 2·cp\n")  # fmt: skip
    print(cap_table(mem))
    t = timing
    th = t["threads"]
    print(f"\n3. Step time at seq {t['seq']} (forward, backward, gradient all-reduce, AdamW): "
          f"cp 1 on 1 process x {th['cp1']} threads, cp 2 on 2 processes x {th['cp2']} thread "
          f"each (the same 2 cores), and cp 1 on 1 process x {th['cp1_1thread']} thread as a "
          f"reference; {t['rounds']} rounds, order rotating, first {t['warmup']} steps of each "
          "left out\n")  # fmt: skip
    print("| run | ranks x threads | median ms |\n|---|---|---|")
    for n, (w, threads, _) in GROUPS.items():
        print(f"| {n} | {w} x {threads} | {t['median_s'][n] * 1e3:.0f} |")
    print()
    for key, r in t["ratios"].items():
        low, high = r["per_round_ci95"]
        print(f"{key}: ratio of medians {r['of_medians']:.3f}; per-round median "
              f"{r['per_round_median']:.3f} [95% CI {low:.3f}, {high:.3f}]")  # fmt: skip
    name = "context_parallel_quick.json" if a.quick else "context_parallel.json"
    out = a.out or results_dir(a.publish) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(command=sys.argv, torch=torch.__version__, cores=os.cpu_count(), date=now,
                  mode=mode, settings=s, shape=SHAPE, cap_bytes=cap,
                  memory={str(cp): m for cp, m in mem.items()}, timing=timing)  # fmt: skip
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ntotal {time.time() - t_all:.1f}s; load average at the end {load()}; wrote "
          f"{os.path.relpath(out)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
