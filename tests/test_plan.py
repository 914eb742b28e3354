"""`mesh3d.plan`: groups, stages and bubbles by hand; the CLI; memory numbers against real runs.

- Unit checks: the 2x2x2 rank groups, the cost-based stage split, the bubble closed forms and the
  in-flight microbatches of GPipe / 1F1B.
- The CLI: a report and exit 0; `--json`; a bad world size prints `error: ...`, exits 2, no
  traceback.
- Real runs, 8 forked ranks at (dp, tp, pp) = (2, 2, 2), one launch, several configs: each rank's
  parameter, gradient and optimizer-state bytes equal make_plan's, exactly.
- Activations: saved-for-backward bytes measured with saved-tensor hooks on 2 ranks (pp=2 under
  four schedules, with and without recompute; tp=2 with sequence parallelism) are within 25% of
  the plan's estimate.
- Context parallelism: the cp groups and the activation terms at cp 2 by hand; real runs on 4
  ranks (cp with tp, sequence parallelism, dp, FSDP, recompute, bf16 autocast, Qwen2 document
  masking): params, grads, optimizer state, the calls and bytes of the cp collectives, and the
  bytes saved for backward equal the plan's, exactly (saved bytes plus what the plan leaves out
  on purpose: CPU SDPA's causal masks, the autocast weight copies it counts as transient).
- Mixture of experts: parameters and saved-bytes terms by hand; the expert-parallel plan by hand
  (groups, slices, all-to-alls, the expert-replica reduction); real runs on 2 ranks (dp, zero1,
  bf16, autocast, pp, tp both modes, cp, ep2 with its recorded routing) exactly.
"""

import copy
import json
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
from dist import run_ranks
from parity import TINY, layout_overrides
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from mesh3d import cli
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.mesh import ParallelDims
from mesh3d.plan import (
    _orders,
    bubble,
    format_plan,
    loss_saved_bytes,
    main,
    make_plan,
    stage_activation_bytes,
)
from mesh3d.plan.activations import moe_routed_bytes
from mesh3d.plan.sizes import _Sizes
from mesh3d.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
CPU_TINY = str(ROOT / "recipes/configs/cpu_tiny.yaml")
PP2 = ["parallelism.pp=2", "model.model_config.num_hidden_layers=4", "tokens.train_steps=2"]


def _cfg(overrides: list[str]):
    return apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides)


def _pp(schedule: str, virtual: int = 1) -> list[str]:
    return [f"mesh3d.pp_schedule={schedule}", f"mesh3d.pp_virtual_stages={virtual}"]


def test_rank_groups_2x2x2_are_parallel_dims():
    plan = make_plan(_cfg(layout_overrides(2, 2, "REDUCE_SCATTER", 0, False) + PP2), 8)
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert plan.groups == {axis: dims.groups(axis) for axis in ("tp", "cp", "pp", "dp")}
    assert plan.groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.groups["cp"] == [[r] for r in range(8)]
    assert plan.groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan.groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [r.coords for r in plan.ranks] == [dims.coords(r) for r in range(8)]


def test_stage_layers():
    # TINY, 4 layers: decoder cost 4*8*8*64 + 3*128*64 = 40960, lm_head 250*64 = 16000, total
    # 179840. pp=2, thresholds 89920 / 179840: decoder 2 (c=122880) crosses the first one and
    # stays on stage 0.
    plan = make_plan(_cfg(layout_overrides(1, 1, "ALL_REDUCE", 0, True) + PP2 + _pp("1f1b")))
    got = [(s.stage, s.pp_rank, s.layers, s.embedding, s.head) for s in plan.stages]
    assert got == [(0, 0, [0, 1, 2], True, False), (1, 1, [3], False, True)]
    # 4 stages, thresholds 44960 / 89920 / 134880: [0, 1], [2], [3], [] (the head); V placement
    ov = PP2 + _pp("zbv_zero_bubble", 2) + ["tokens.batch_accumulation_per_replica=4"]
    plan = make_plan(_cfg(layout_overrides(1, 1, "ALL_REDUCE", 0, True) + ov))
    got = [(s.stage, s.pp_rank, s.layers, s.embedding, s.head) for s in plan.stages]
    assert got == [
        (0, 0, [0, 1], True, False),
        (1, 1, [2], False, False),
        (2, 1, [3], False, False),
        (3, 0, [], False, True),
    ]
    assert [r.stages for r in plan.ranks] == [[0, 3], [1, 2]]


def test_bubble_formulas():
    assert bubble("afab", 2, 1, 2).fraction == pytest.approx(1 / 3)  # (2-1)/(2+2-1)
    assert bubble("1f1b", 4, 1, 8).fraction == pytest.approx(3 / 11)
    assert bubble("interleaved_1f1b", 4, 2, 8).fraction == pytest.approx(3 / 19)  # 3/(16+3)
    assert bubble("looped_bfs", 4, 2, 8).fraction == pytest.approx(3 / 19)
    zb = bubble("interleaved_zero_bubble", 4, 2, 8)
    assert zb.fraction == pytest.approx(3 / 51) and zb.kind == "exact"  # 3/(3*2*8+3), m >= pp
    # torch's ZBV order replayed with F = I = W = 1 (benchmarks/schedules.py): each rank idles
    # pp-1 chunk times (once m >= 3pp/2), not the ideal ZB-V's 0
    for pp, m, want in ((2, 4, 1 / 25), (2, 16, 1 / 97), (4, 8, 3 / 51), (4, 32, 3 / 195),
                        (8, 16, 7 / 103), (8, 64, 7 / 391), (4, 4, 6 / 30)):  # fmt: skip
        zbv = bubble("zbv_zero_bubble", pp, 2, m)
        assert zbv.fraction == pytest.approx(want) and zbv.kind == "exact", (pp, m)
    dv = bubble("dualpipev", 4, 2, 8)  # torch's DualPipeV order, F&B one after the other
    assert dv.fraction == pytest.approx(3 / 51) and dv.kind == "exact"
    assert bubble("1f1b", 1, 1, 8).fraction == 0.0


def test_microbatches_in_flight():
    ov = ["parallelism.pp=4", "model.model_config.num_hidden_layers=8"]
    ov += ["tokens.batch_accumulation_per_replica=8", "tokens.micro_batch_size=1"]
    one_f_one_b = make_plan(_cfg(ov + _pp("1f1b")))
    assert [r.microbatches_in_flight for r in one_f_one_b.ranks] == [4, 3, 2, 1]  # min(pp-r, m)
    gpipe = make_plan(_cfg(ov + _pp("afab")))
    assert [r.microbatches_in_flight for r in gpipe.ranks] == [8] * 4


def test_cli_report_and_user_error():
    good = [sys.executable, "-m", "mesh3d.plan", CPU_TINY, "parallelism.tp=2", "--world-size", "2"]
    bad = good[:-1] + ["3"]  # dp * tp * pp = 2
    procs = [  # both at once: most of each run is importing torch
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for c in (good, bad)
    ]
    (out, err), (bad_out, bad_err) = (p.communicate(timeout=120) for p in procs)
    assert procs[0].returncode == 0, err
    for heading in ("1. Rank groups", "2. Pipeline stages", "3. Memory per rank", "5. Pipeline"):
        assert heading in out
    assert "tp: [0, 1]" in out
    assert procs[1].returncode == 2
    assert bad_err.startswith("error: ") and "world size is 3" in bad_err
    assert "Traceback" not in bad_err + bad_out


def test_json_output(capsys):
    main([CPU_TINY, "--json", "parallelism.pp=2", "parallelism.dp=2"])
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 4 and len(data["ranks"]) == 4
    assert data["groups"]["pp"] == [[0, 2], [1, 3]]
    assert {"param_bytes", "grad_bytes", "optimizer_bytes", "comm"} <= data["ranks"][0].keys()


def test_cli_dispatches_plan_and_refuses_unknown_commands(capsys):
    cli.main(["plan", CPU_TINY, "--json"])
    assert json.loads(capsys.readouterr().out)["world_size"] == 1
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plam", CPU_TINY])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: unknown command 'plam'")


# --- real runs: memory held on each rank ------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors)


def _held(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    """Inside a rank: train each config; local bytes of params, grads (at the last optimizer
    step, before zero_grad) and optimizer state (after it)."""
    out = []
    for overrides in runs:
        grads: dict[str, int] = {}

        def before_step(opt, args, kwargs, grads=grads):
            ps = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            grads["bytes"] = _nbytes([p.grad for p in ps])

        handle = register_optimizer_step_pre_hook(before_step)
        try:
            res = train(_cfg(overrides), keep_model=True)
        finally:
            handle.remove()
        params = list(res.model.parameters())
        state = [t for s in res.optimizer.state.values() for t in s.values()]
        elements = sum(_local(p).numel() for p in params)
        out.append(
            dict(
                elements=elements,
                params=_nbytes(params),
                grads=grads["bytes"],
                optim=_nbytes(state),
            )
        )
    return out


RUNS_2X2X2 = {  # label -> overrides; TINY with 4 layers, 2 steps, global batch 8
    "zero0 untied RS 1f1b": layout_overrides(2, 2, "REDUCE_SCATTER", 0, False) + _pp("1f1b"),
    "zero1 untied AR afab": layout_overrides(2, 2, "ALL_REDUCE", 1, False) + _pp("afab"),
    "zero0 tied AR zbv": layout_overrides(2, 2, "ALL_REDUCE", 0, True, microbatches=4)
    + _pp("zbv_zero_bubble", 2),
    "full_shard tied RS interleaved": layout_overrides(2, 2, "REDUCE_SCATTER", 1, True)
    + _pp("interleaved_1f1b", 2)
    + ["mesh3d.full_shard=true"],
}


def test_plan_memory_equals_a_real_2x2x2_run():
    runs = [ov + PP2 for ov in RUNS_2X2X2.values()]
    measured = run_ranks(8, _held, runs, timeout=240)
    for i, (label, overrides) in enumerate(RUNS_2X2X2.items()):
        plan = make_plan(_cfg(overrides + PP2), 8)
        for rank, rp in enumerate(plan.ranks):
            got = measured[rank][i]
            want = dict(
                elements=rp.param_elements,
                params=rp.param_bytes,
                grads=rp.grad_bytes,
                optim=rp.optimizer_bytes,
            )
            assert got == want, f"{label}, rank {rank}: measured {got}, planned {want}"


# --- real runs: activations saved for backward ------------------------------------------------


class _Held:
    """What the pack hook hands autograd: the tensor, and a weakref target that dies when the
    graph releases it (after the backward that used it)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedBytes:
    """Peak of the bytes saved for backward that are alive at once.

    How it is measured: a `saved_tensors_hooks` pack hook sees every tensor autograd saves (in
    checkpointed layers, only the layer inputs: recomputation has its own hooks). Each is
    unwrapped to its plain storages (DTensor local tensors, async collective results). A storage
    counts once, by pointer, while any saved tensor uses it, with its full `nbytes`; it stops
    counting when autograd drops the last packed handle that uses it (a weakref finalizer).
    Parameters and views of them are left out (their storages, and those of the module's
    children, are collected by a global forward pre-hook before a module runs), so what remains
    are activations.
    """

    def __init__(self):
        self.live: dict[int, list[int]] = {}  # storage pointer -> [handles, nbytes]
        self.params: set[int] = set()
        self.current = self.peak = 0

    def note_params(self, module: nn.Module, args) -> None:
        # recursively: a module can use a child's parameters without calling it (the MoE block
        # slices its stacked experts, and applies its router weight with F.linear)
        for p in module.parameters():
            self.params.update(s.data_ptr() for s in self._storages(p))

    @staticmethod
    def _storages(t: torch.Tensor):
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    yield from SavedBytes._storages(inner)
        else:
            yield t.untyped_storage()

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter):
            return t
        held = _Held(t.detach())  # no grad_fn: a saved output would hold its own node (a cycle)
        for storage in self._storages(t):
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in self.params:
                continue
            entry = self.live.setdefault(key, [0, storage.nbytes()])
            if entry[0] == 0:
                self.current += entry[1]
                self.peak = max(self.peak, self.current)
            entry[0] += 1
            weakref.finalize(held, self._release, key)
        return held

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


def _saved_peaks(rank: int, world: int, runs: list[list[str]]) -> list[int]:
    peaks = []
    for overrides in runs:
        meter = SavedBytes()
        hook = nn.modules.module.register_module_forward_pre_hook(meter.note_params)
        try:
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                train(_cfg(overrides))
        finally:
            hook.remove()
        peaks.append(meter.peak)
    return peaks


ONE_STEP = ["tokens.train_steps=1", "tokens.micro_batch_size=2"]
PP2_M4 = PP2[:2] + ONE_STEP + ["tokens.batch_accumulation_per_replica=4"]
RUNS_ACTIVATIONS = {  # on 2 ranks
    "pp2 1f1b m4": PP2_M4 + _pp("1f1b"),
    "pp2 afab m4": PP2_M4 + _pp("afab"),
    "pp2 interleaved_1f1b m4": PP2_M4 + _pp("interleaved_1f1b", 2),
    "pp2 zbv m4": PP2_M4 + _pp("zbv_zero_bubble", 2),
    "pp2 1f1b m4 recompute": PP2_M4 + _pp("1f1b") + ["parallelism.recompute_layer=true"],
    "tp2 sequence parallel": ONE_STEP
    + [
        "parallelism.tp=2",
        "parallelism.tp_mode=REDUCE_SCATTER",
        "tokens.batch_accumulation_per_replica=2",
    ],
}


def test_activation_estimate_matches_saved_tensors():
    measured = run_ranks(2, _saved_peaks, list(RUNS_ACTIVATIONS.values()), timeout=120)
    report, bad = [], []
    for i, (label, overrides) in enumerate(RUNS_ACTIVATIONS.items()):
        plan = make_plan(_cfg(overrides), 2)
        for rank, rp in enumerate(plan.ranks):
            got, want = measured[rank][i], rp.saved_activation_bytes
            diff = got / want - 1
            report.append(f"{label} rank {rank}: measured {got}, planned {want} ({diff:+.2%})")
            if abs(diff) > 0.25:
                bad.append(report[-1])
    print("\n" + "\n".join(report))
    assert not bad, "\n".join(bad)


def test_split_backward_frees_the_loss_at_input_backward():
    # torch's stage_backward_input detaches the loss, so I (not W) frees what the loss saved;
    # with ZB at pp=2, m=2 rank 1's peak is the second F3, after I3 freed the first's loss
    # (benchmarks/schedules.py meters it: 36.2 MB, not the 39.0 MB of freeing it all at W)
    m2 = ["tokens.batch_accumulation_per_replica=2"]
    cfg = _cfg(PP2[:2] + ONE_STEP + m2 + _pp("interleaved_zero_bubble", 2))
    plan = make_plan(cfg, 2)
    ops = ["F1", "F1", "F3", "I3", "F3", "I3", "W3", "I1", "W3", "I1", "W1", "W1"]
    z = types.SimpleNamespace(pp=2, v=2, m=2, schedule="interleaved_zero_bubble")
    assert [f"{k}{s}" for k, s in _orders(z)[0][1]] == ops
    saved = {s.stage: s.saved_per_microbatch for s in plan.stages}
    want = 2 * saved[1] + 2 * saved[3] - loss_saved_bytes(cfg)
    assert plan.ranks[1].saved_activation_bytes == want


def test_format_plan_lists_every_rank():
    plan = make_plan(_cfg(layout_overrides(2, 2, "REDUCE_SCATTER", 0, True) + PP2 + _pp("1f1b")), 8)
    text = format_plan(plan)
    assert "  0-3    0 " in text and "  4-7    1 " in text  # memory rows: one per pp stage
    assert "ranks 0-3 send" in text and "ranks 4-7 send" in text
    assert "Pipeline bubble: 33.3%" in text  # (2-1)/(2+2-1), 2 microbatches


# --- context parallelism -----------------------------------------------------------------------


def _cp(n: int, *more: str) -> list[str]:
    return [f"parallelism.context_parallel_size={n}", *ONE_STEP, *more]


def test_cp_groups_and_activations_by_hand():
    plan = make_plan(_cfg(_cp(2, *PP2[:2], "parallelism.tp=2")), 8)
    dims = ParallelDims(dp=1, tp=2, pp=2, cp=2)
    assert plan.dims == {"pp": 2, "dp": 1, "cp": 2, "tp": 2} and plan.world_size == 8
    assert plan.groups == {axis: dims.groups(axis) for axis in ("tp", "cp", "pp", "dp")}
    assert plan.groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # mesh.py's picture
    assert [r.coords for r in plan.ranks] == [dims.coords(r) for r in range(8)]
    # one layer, fp32, TINY: b 2, s 16, h 64, F 128, 8 heads of 8, 4 kv heads
    one, cp = _cfg(ONE_STEP), _cfg(_cp(2))
    layer = [stage_activation_bytes(c, 1, False, False)[0] for c in (one, cp)]
    kv = 2 * 2 * 16 * 4 * 8 * 4  # k and v of the whole sequence: the same at cp 2
    attn_out = 2 * 8 * 64 * 4  # under cp the chunks' outputs are concatenated: once more
    rope = [16 * 16 * 8, 16 * 2 * 8 * 8]  # cos/sin of positions 0..s-1, then [b, s/cp] ones
    assert layer[1] == (layer[0] - kv - rope[0]) // 2 + kv + attn_out + rope[1]  # rest: s/cp
    held = [stage_activation_bytes(c, 2, True, True)[1] for c in (one, cp)]
    assert held[1] * 2 == held[0]  # the logits: s/cp tokens
    assert loss_saved_bytes(cp) == (loss_saved_bytes(one) - 4) // 2 + 4


def test_cp_communication_by_hand():
    # TINY at cp 2, dp 2, 2 layers, 4 microbatches of 2 x 16 tokens, recompute
    cfg = _cfg(_cp(2, "parallelism.dp=2", "parallelism.recompute_layer=true"))
    rp = make_plan(cfg, 4).ranks[0]
    comm = {(c.axis, c.collective): c for c in rp.comm}
    kv = 2 * 16 * 4 * 8 * 4  # the whole sequence's k (or v): b, s, 4 kv heads of 8, fp32
    gather, scatter = comm["cp", "all_gather"], comm["cp", "reduce_scatter"]
    assert (gather.count, gather.bytes_each) == (2 * 2 * 4 * 2, kv)  # k and v, recompute again
    assert (scatter.count, scatter.bytes_each) == (2 * 2 * 4, kv)
    assert gather.sent_bytes == 32 * kv // 2  # a ring of 2 ranks sends half of each
    grads = comm["dp", "all_reduce"]  # over the 4 ranks of dp x cp, which hold the same params
    assert grads.what.endswith("over dp x cp") and grads.bytes_each == rp.grad_bytes
    assert grads.sent_bytes == round(rp.grad_bytes * 2 * 3 / 4)
    assert [c.axis for c in rp.comm] == ["cp", "cp", "dp"]  # no tp, no pp


def _qwen_docs(overrides: list[str]):
    """TINY as Qwen2 with document masking (random tokens over 16 ids hold many EOS)."""
    d = copy.deepcopy(TINY)
    mc = d["model"]["model_config"]
    mc.pop("is_llama_config")
    mc.update(is_qwen2_config=True, _use_doc_masking=True, vocab_size=16, eos_token_id=3)
    d["mesh3d"]["dummy_data"] = "random"
    return apply_overrides(config_from_dict(d), overrides)


def _cp_measured(rank: int, world: int, runs: list) -> list[dict]:
    """Inside a rank: train each config once; the peak of the bytes saved for backward, the
    local bytes of params, grads and optimizer state (as `_held`), and per cp collective kind
    its calls and bytes (all-gather output, reduce-scatter input: the plan's payloads)."""
    import mesh3d.parallel.context as context

    out = []
    for cfg in runs:
        meter, grads, cp = SavedBytes(), {}, {}

        def count(fn, kind, cp=cp):
            def wrapped(out, inp, group=None):
                full = out if kind == "all_gather" else inp
                key = f"{kind} {full.dtype}"
                calls, nbytes = cp.get(key, (0, 0))
                cp[key] = (calls + 1, nbytes + full.numel() * full.element_size())
                return fn(out, inp, group=group)

            return wrapped

        def before_step(opt, args, kwargs, grads=grads):
            ps = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            grads["bytes"] = _nbytes([p.grad for p in ps])

        flat = context.all_gather_flat, context.reduce_scatter_flat
        context.all_gather_flat = count(flat[0], "all_gather")
        context.reduce_scatter_flat = count(flat[1], "reduce_scatter")
        handles = [
            register_optimizer_step_pre_hook(before_step),
            nn.modules.module.register_module_forward_pre_hook(meter.note_params),
        ]
        try:
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                res = train(cfg, keep_model=True)
        finally:
            context.all_gather_flat, context.reduce_scatter_flat = flat
            for h in handles:
                h.remove()
        params = list(res.model.parameters())
        state = [t for s in res.optimizer.state.values() for t in s.values()]
        out.append(dict(saved=meter.peak, elements=sum(_local(p).numel() for p in params),
                        params=_nbytes(params), grads=grads["bytes"], optim=_nbytes(state),
                        cp=cp))  # fmt: skip
    return out


def _cpu_causal_masks(cfg, cp_rank: int, itemsize: int) -> int:
    """Bytes the plan leaves out: SDPA on CPU saves the lower-right causal mask of each query
    chunk whose keys outnumber its queries (every chunk but the first) as a [c, keys] tensor
    in the compute dtype (`itemsize` bytes), one per chunk shape shared by every layer; none
    under recompute."""
    if cfg.parallelism.recompute_layer:
        return 0
    cp = cfg.parallelism.context_parallel_size
    c = cfg.tokens.sequence_length // (2 * cp)
    return sum(c * (k + 1) * c for k in (cp_rank, 2 * cp - 1 - cp_rank) if k > 0) * itemsize


RUNS_CP = {  # on 4 ranks; label -> config
    "cp2 tp2 sequence parallel": _cfg(
        _cp(2, "parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER")
    ),
    "cp2 dp2 zero1": _cfg(_cp(2, "parallelism.dp=2", "optimizer.zero_stage=1")),
    "cp4 zero1 tied": _cfg(
        _cp(4, "optimizer.zero_stage=1", "model.model_config.tie_word_embeddings=true")
    ),
    "cp2 tp2 recompute": _cfg(_cp(2, "parallelism.tp=2", "parallelism.recompute_layer=true")),
    "cp2 dp2 bf16 autocast": _cfg(_cp(2, "parallelism.dp=2", "model.dtype=bfloat16")),
    "cp2 dp2 qwen2 documents": _qwen_docs(_cp(2, "parallelism.dp=2")),
    "cp2 pp2 zero1 1f1b": _cfg(_cp(2, *PP2[:2], "optimizer.zero_stage=1", *_pp("1f1b"))),
}


def test_plan_equals_real_cp_runs():
    """Params, grads, optimizer state and the cp collectives exactly; the bytes saved for
    backward exactly once the CPU-only causal masks are added, and the autocast weight copies,
    which autograd saves but the plan counts as transient (Llama without a pipeline: Qwen2's
    attention biases and document masks are not in the estimate, and a pipeline run keeps a few
    more bytes per microbatch than it counts, as without cp)."""
    measured = run_ranks(4, _cp_measured, list(RUNS_CP.values()), timeout=240)
    for i, (label, cfg) in enumerate(RUNS_CP.items()):
        plan = make_plan(cfg, 4)
        for rank, rp in enumerate(plan.ranks):
            got = measured[rank][i]
            want = dict(elements=rp.param_elements, params=rp.param_bytes,
                        grads=rp.grad_bytes, optim=rp.optimizer_bytes)  # fmt: skip
            assert {k: got[k] for k in want} == want, f"{label}, rank {rank}"
            compute, want_cp = getattr(torch, plan.compute_dtype), {}
            for c in rp.comm:
                if c.axis == "cp":  # k, v in the compute dtype; document positions int64
                    dtype = torch.int64 if c.what.startswith("positions") else compute
                    want_cp[f"{c.collective} {dtype}"] = (c.count, c.count * c.bytes_each)
            assert got["cp"] == want_cp, f"{label}, rank {rank}"
            if "qwen2" not in label and plan.dims["pp"] == 1:
                extra = _cpu_causal_masks(cfg, rp.coords["cp"], compute.itemsize)
                extra += rp.transient.get("autocast_weight_copies", 0)
                want = rp.saved_activation_bytes + extra
                assert got["saved"] == want, f"{label}, rank {rank}"


# --- mixture of experts ------------------------------------------------------------------------


def _moe_cfg(overrides: list[str], base: dict | None = None):
    from test_moe import MOE  # 3 layers, MoE in 0 and 2: 4 experts, top 2, F 32, shared 48

    return apply_overrides(config_from_dict(copy.deepcopy(base or MOE)), overrides)


def test_moe_parameters_total_and_active_by_hand():
    plan = make_plan(_moe_cfg([]))
    h, f, v, dense_ffn, kv = 64, 32, plan.padded_vocab, 128, 4 * 8
    attn = h * h + 2 * h * kv + h * h + 2 * h  # q, k, v, o; the two norms
    router, experts, shared = 4 * h, 4 * 3 * h * f, 3 * h * 48 + h
    dense, moe = attn + 3 * h * dense_ffn, attn + router + experts + shared
    total = 2 * v * h + h + dense + 2 * moe  # untied embedding and lm_head, final norm
    assert plan.total_params == total and plan.ranks[0].param_elements == total
    assert plan.active_params == total - 2 * (4 - 2) * 3 * h * f  # 2 of 4 experts idle
    text = format_plan(plan)
    assert "top 2 of 4 experts of 32, a shared expert of 48 in layers 0,2" in text
    assert f"{plan.active_params:,} parameters active per token of {total:,}" in text
    assert "no expert parallelism" in text
    assert "mixture of experts" not in format_plan(make_plan(_cfg([])))


def test_moe_activation_terms_by_hand():
    # MOE, one microbatch of 2 x 16: T 32, h 64, E 4, k 2, F 32, G 48, fp32
    cfg = _moe_cfg(ONE_STEP)
    dense, moe = (stage_activation_bytes(cfg, [i], False, False)[0] for i in (1, 0))
    t, h = 32, 64
    mlp = t * h * 4 + 4 * t * 128 * 4  # a dense MLP's input and intermediates
    router = t * h * 4 + 4 * t * 4 + 8 * t * 2 + 4 * 2 * 4
    routed = 2 * t * (16 + 4 * 32 * 4 + h * 12 + 4) + 4 * 4  # + the grouped GEMMs' int32 offsets
    shared = t * (4 * 48 * 4 + h * 4 + 4)
    assert moe - dense == router + routed + shared - mlp
    assert stage_activation_bytes(cfg, 3, False, False)[0] == 2 * moe + dense


def test_expert_parallel_plan_by_hand():
    # MOE at dp 4, ep 2, one microbatch of 2 x 16 (T 32), h 64, E 4, k 2, F 32, 2 MoE layers
    cfg = _moe_cfg(["parallelism.dp=4", "parallelism.expert_parallel_size=2", *ONE_STEP])
    plan, whole = make_plan(cfg, 4), make_plan(_moe_cfg(["parallelism.dp=4", *ONE_STEP]), 4)
    assert plan.groups["ep"] == [[0, 1], [2, 3]]
    assert plan.groups["expert_replicas"] == [[0, 2], [1, 3]]
    experts = 2 * 4 * 3 * 64 * 32  # both MoE layers' stacked experts, all 4
    rp = plan.ranks[1]
    assert rp.param_elements == whole.ranks[1].param_elements - experts // 2
    assert plan.total_params == whole.total_params
    comm = {c.what: c for c in rp.comm}
    rows = 2 * 32 * 64 * 4  # k·T rows of h, fp32
    counts, there = comm["expert counts (fwd)"], comm["routed rows, results back (fwd)"]
    n = 2 * plan.microbatches  # MoE layers x microbatches
    assert (counts.collective, counts.count, counts.bytes_each) == ("all_to_all", n, 8 * 4)
    assert (there.count, there.bytes_each, there.sent_bytes) == (2 * n, rows, 2 * n * rows // 2)
    assert comm["their grads (bwd)"].count == 2 * n
    dp, rep = comm["grads, one flat buffer"], comm["expert grads over their replicas (dp/ep = 2)"]
    assert dp.bytes_each == (rp.param_elements - experts // 2) * 4
    assert (rep.axis, rep.bytes_each, rep.sent_bytes) == ("dp", experts // 2 * 4, experts // 2 * 4)
    text = format_plan(plan)
    assert "ep: [0, 1] [2, 3]" in text and "expert replicas: [0, 2] [1, 3]" in text
    assert "balanced routing assumed" in text and "no expert parallelism" not in text
    # dp 2, ep 2: no replica to sum the expert grads over
    two = make_plan(_moe_cfg(["parallelism.dp=2", "parallelism.expert_parallel_size=2"]), 2)
    assert not any("replicas" in c.what for c in two.ranks[0].comm)
    # the all-gather dispatcher: every rank's T tokens, whatever the routing
    ag = make_plan(_moe_cfg(["parallelism.dp=4", "parallelism.expert_parallel_size=2", *ONE_STEP,
                             f"{MOE_KEY}.token_dispatcher_type=allgather"]), 4)  # fmt: skip
    got = {c.what: (c.collective, c.count, c.bytes_each) for c in ag.ranks[1].comm
           if c.axis == "ep"}  # fmt: skip
    tokens = 2 * 32  # ep·T
    assert got == {
        "token counts (fwd)": ("all_gather", n, 8 * 2),
        "chosen experts (fwd)": ("all_gather", n, 8 * 2 * tokens),
        "tokens and weights (fwd)": ("all_gather", n, tokens * (64 + 2) * 4),
        "results (fwd)": ("reduce_scatter", n, tokens * 64 * 4),
        "result grads (bwd)": ("all_gather", n, tokens * 64 * 4),
        "token and weight grads (bwd)": ("reduce_scatter", n, tokens * (64 + 2) * 4),
        "expert grad norm (fp64 squares)": ("all_reduce", 1, 8),
    }, got
    # per MoE block it saves k·T·(h·e_p + 16 - 8·ep) bytes fewer than all-to-all (balanced);
    # the peak holds one microbatch's 2 MoE layers
    fewer = 2 * 2 * 32 * (64 * 4 + 16 - 8 * 2)
    assert rp.saved_activation_bytes - ag.ranks[1].saved_activation_bytes == fewer
    assert "expert parallelism 2 (allgather)" in format_plan(ag)


def _moe_measured(rank: int, world: int, runs: list) -> list[dict]:
    """`_cp_measured` without the cp counters, plus the routed rows per microbatch and layer,
    and under expert parallelism, per run: the rows each dispatch received (R), and per dtype
    the calls and send-buffer bytes of `all_to_all_single` (counts int64, rows float)."""
    import torch.distributed as dist

    import mesh3d.parallel.experts as experts
    from mesh3d.models.moe import MoE

    routed: list[set[int]] = [set() for _ in runs]
    received: list[list[int]] = [[] for _ in runs]
    ran: list[list[int]] = [[] for _ in runs]
    a2a: list[dict] = [{} for _ in runs]
    flat: list[dict] = [{} for _ in runs]
    run = [0]

    def count_rows(module, args, output):
        with torch.no_grad():  # nothing saved: the meter must not see it
            _, _, experts_ = module.route(args[0])
        routed[run[0]].add(experts_.numel())

    def all_to_all(x, send, recv, group, fn=experts.all_to_all):
        calls = received[run[0]]
        calls.append(sum(recv))
        return fn(x, send, recv, group)

    def all_to_all_single(out, inp, *args, fn=dist.all_to_all_single, **kwargs):
        key = str(inp.dtype)
        calls, nbytes = a2a[run[0]].get(key, (0, 0))
        a2a[run[0]][key] = (calls + 1, nbytes + inp.numel() * inp.element_size())
        return fn(out, inp, *args, **kwargs)

    def gather_and_reduce(experts_fn, *args, fn=experts.gather_and_reduce):
        def counted(rows, counts):
            ran[run[0]].append(len(rows))
            return experts_fn(rows, counts)

        return fn(counted, *args)

    def flat_collective(kind, fn):
        def wrapped(out, inp, group=None):
            full = out if kind == "all_gather" else inp
            key = f"{kind} {full.dtype}"
            calls, nbytes = flat[run[0]].get(key, (0, 0))
            flat[run[0]][key] = (calls + 1, nbytes + full.numel() * full.element_size())
            return fn(out, inp, group=group)

        return wrapped

    hook = nn.modules.module.register_module_forward_hook(
        lambda m, a, o: count_rows(m, a, o) if isinstance(m, MoE) else None
    )
    names = ("all_to_all", "gather_and_reduce", "all_gather_flat", "reduce_scatter_flat")
    patched = [getattr(experts, n) for n in names] + [dist.all_to_all_single]
    experts.all_to_all, experts.gather_and_reduce = all_to_all, gather_and_reduce
    experts.all_gather_flat = flat_collective("all_gather", patched[2])
    experts.reduce_scatter_flat = flat_collective("reduce_scatter", patched[3])
    dist.all_to_all_single = all_to_all_single
    out = []
    try:
        for i, cfg in enumerate(runs):
            run[0] = i
            out += _cp_measured(rank, world, [cfg])
    finally:
        hook.remove()
        for n, fn in zip(names, patched):
            setattr(experts, n, fn)
        dist.all_to_all_single = patched[-1]
    for o, rows, rows_ran, calls, flats, k in zip(out, received, ran, a2a, flat, routed):
        o["routed"] = k
        # all-to-all: dispatch, then results back (whose recv is what was sent); all-gather:
        # the rows the local experts ran
        o["received"] = rows[::2] or rows_ran
        o["a2a"], o["flat"] = calls, flats
    return out


MOE_KEY = "model.model_config.moe_config"
ALLGATHER = f"{MOE_KEY}.token_dispatcher_type=allgather"
RUNS_MOE = {  # on 2 ranks; label -> (config overrides, base)
    "moe dp2 zero0": ["parallelism.dp=2", *ONE_STEP],
    "moe dp2 zero1 tied": ["parallelism.dp=2", "optimizer.zero_stage=1", *ONE_STEP,
                           "model.model_config.tie_word_embeddings=true"],
    "moe dp2 bf16 autocast": ["parallelism.dp=2", "model.dtype=bfloat16", *ONE_STEP],
    "moe dp2 bf16 params": ["parallelism.dp=2", "model.dtype=bfloat16", *ONE_STEP,
                            "optimizer.accumulate_grad_in_fp32=false"],
    "moe pp2 1f1b": ["parallelism.pp=2", *ONE_STEP, "tokens.batch_accumulation_per_replica=4",
                     *_pp("1f1b")],
    "dense pp2 1f1b": ["parallelism.pp=2", *ONE_STEP, "tokens.batch_accumulation_per_replica=4",
                       *_pp("1f1b"), "model.model_config.moe_config=null"],
    "moe dp2 ep2": ["parallelism.dp=2", "parallelism.expert_parallel_size=2", *ONE_STEP,
                    "tokens.batch_accumulation_per_replica=2"],
    "moe dp2 ep2 bf16 autocast": ["parallelism.dp=2", "parallelism.expert_parallel_size=2",
                                  "model.dtype=bfloat16", *ONE_STEP],
    "moe dp2 ep2 bf16 params": ["parallelism.dp=2", "parallelism.expert_parallel_size=2",
                                "model.dtype=bfloat16", "optimizer.accumulate_grad_in_fp32=false",
                                *ONE_STEP],
    "moe dp2 ep2 allgather": ["parallelism.dp=2", "parallelism.expert_parallel_size=2",
                              *ONE_STEP, "tokens.batch_accumulation_per_replica=2", ALLGATHER],
    "moe dp2 ep2 allgather bf16 autocast": ["parallelism.dp=2", "parallelism.expert_parallel_size=2",
                                            "model.dtype=bfloat16", *ONE_STEP, ALLGATHER],
    "moe dp2 ep2 allgather bf16 params": ["parallelism.dp=2", "parallelism.expert_parallel_size=2",
                                          "model.dtype=bfloat16", *ONE_STEP, ALLGATHER,
                                          "optimizer.accumulate_grad_in_fp32=false"],
    "moe tp2 sequence parallel": ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER",
                                  *ONE_STEP],
    "moe tp2 all-reduce": ["parallelism.tp=2", "parallelism.tp_mode=ALL_REDUCE", *ONE_STEP],
    "moe cp2": _cp(2),
}  # fmt: skip


def test_plan_equals_real_moe_runs():
    """Params, grads and optimizer state exactly (router, stacked experts, shared expert, dense
    MLPs elsewhere). The bytes saved for backward exactly without a pipeline in fp32 and bf16
    params: the experts' rows add up to k·T whatever the routing (checked: every microbatch of
    every MoE layer routed k·T rows), and every saved tensor is linear in them. Under autocast,
    plus the cached weight casts the plan counts as transient, exactly too (every expert got
    tokens: the plan's bound is met). With a pipeline, the MoE run misses exactly what the same
    dense run misses (the few bytes per microbatch a schedule keeps that the plan leaves out).
    Under tp (both modes) and cp the block runs on the rank's tokens: exact too (cp plus CPU
    SDPA's causal masks). Under expert parallelism the plan assumes balanced routing: the run's
    recorded received rows replace it (`_ep_checks`), then the saved bytes and the all-to-all
    calls and bytes are exact (fp32, bf16 params, bf16 autocast); the same with the all-gather
    dispatcher, whose collectives are exact without the recorded rows."""
    cfgs = [_moe_cfg(ov) for ov in RUNS_MOE.values()]
    measured = run_ranks(2, _moe_measured, cfgs, timeout=300)
    off = {}
    for i, (label, cfg) in enumerate(zip(RUNS_MOE, cfgs)):
        plan, z = make_plan(cfg, 2), _Sizes.of(cfg)
        for rank, rp in enumerate(plan.ranks):
            got = measured[rank][i]
            if z.moe_layers:  # k·T in every MoE forward (T: the tokens the block runs on)
                assert got["routed"] == {z.top_k * z.local_tokens}, (label, got["routed"])
            want = dict(elements=rp.param_elements, params=rp.param_bytes,
                        grads=rp.grad_bytes, optim=rp.optimizer_bytes)  # fmt: skip
            assert {k: got[k] for k in want} == want, f"{label}, rank {rank}"
            saved = rp.saved_activation_bytes + rp.transient.get("autocast_weight_copies", 0)
            if z.cp > 1:
                saved += _cpu_causal_masks(cfg, rp.coords["cp"], z.e_c)
            saved += _ep_checks(z, rp, got, label)
            if plan.dims["pp"] == 1:
                assert got["saved"] == saved, f"{label}, rank {rank}"
            else:
                off.setdefault(rank, []).append(got["saved"] - saved)
    assert all(len(set(d)) == 1 for d in off.values()), off  # moe and dense pp2 miss the same


def _ep_checks(z, rp, got: dict, label: str) -> int:
    """Under expert parallelism: the dispatch collectives' calls and bytes against the plan's:
    all-to-all with the recorded received rows R in place of the balanced k·T (a rank sends
    k·T rows and R results back in forward, the grads of both in backward), all-gather exactly
    (its sizes do not depend on the routing); returns what the plan's saved bytes lack for the
    recorded R (rows received, or run by the local experts under all-gather; the largest over
    the step's microbatches, as the peak is)."""
    if z.ep == 1:
        assert not got["a2a"] and not got["flat"], label
        return 0
    rows, per_mb = got["received"], len(z.moe_layers)
    assert len(rows) == z.m * per_mb, label
    comm = {c.what: c for c in rp.comm if c.axis == "ep"}
    float_dtype = str(getattr(torch, {4: "float32", 2: "bfloat16"}[z.e_p]))
    if z.dispatcher == "allgather":  # exact whatever the routing
        assert not got["a2a"], label
        planned = {}
        for c in comm.values():
            if c.collective == "all_reduce":
                continue
            ints = c.what.startswith(("token counts", "chosen experts"))
            key = f"{c.collective} {'torch.int64' if ints else float_dtype}"
            calls, nbytes = planned.get(key, (0, 0))
            planned[key] = (calls + c.count, nbytes + c.count * c.bytes_each)
        assert got["flat"] == planned, (label, got["flat"], planned)
    else:
        assert not got["flat"], label
        _a2a_checks(z, comm, got, rows, label, float_dtype)
    base = moe_routed_bytes(z)
    return max(
        sum(moe_routed_bytes(z, r) - base for r in rows[j : j + per_mb])
        for j in range(0, len(rows), per_mb)
    )


def _a2a_checks(z, comm: dict, got: dict, rows: list[int], label: str, float_dtype: str) -> None:
    """The all-to-all calls and bytes against the plan's, with the recorded received rows."""
    kt = z.top_k * z.local_tokens
    counts, sent = comm["expert counts (fwd)"], comm["routed rows, results back (fwd)"]
    grads = comm["their grads (bwd)"]
    assert got["a2a"]["torch.int64"] == (counts.count, counts.count * 8 * z.experts), label
    planned = (sent.count + grads.count) * sent.bytes_each
    skew = 2 * sum(r - kt for r in rows) * z.h * z.e_p  # the R-row halves, routing-dependent
    assert got["a2a"][float_dtype] == (sent.count + grads.count, planned + skew), label
