"""Collectives per transformer block under tensor parallelism, counted with `CommDebugMode`.

A tiny Llama (2 layers) is split by `llama_tp_plan` on the tp axis (tp=2) of the 3-D mesh, for
both tp modes. One launch measures, per mode: one decoder layer's forward and backward on its own
(input in the layer's local layout: replicated [B, S, h] for ALL_REDUCE, this rank's sequence
shard [B, S/2, h] for REDUCE_SCATTER), the whole model + `loss_parallel` cross-entropy (as
mesh3d/train/step.py runs it), then gradient clipping and one AdamW step. Counts per block
(AR all_reduce, AG all_gather_into_tensor, RS reduce_scatter_tensor):

    mode            pass      measured = Megatron minimum
    ALL_REDUCE      forward   2 AR
    ALL_REDUCE      backward  2 AR
    REDUCE_SCATTER  forward   2 AG + 2 RS
    REDUCE_SCATTER  backward  2 AG + 2 RS

Why the minimum: a block has two sublayers (attention, MLP), each a column-parallel group
(q/k/v; gate/up) followed by a row-parallel linear (o; down); between them everything is local
(attention is per head, SwiGLU per ffn column). Forward, the row-parallel output is a partial sum
over tp that the residual add and the next (nonlinear) norm need whole: one all-reduce per
sublayer, or with sequence parallelism one reduce-scatter back to sequence shards plus one
all-gather of the sequence before the column-parallel group (same volume: AG + RS = AR).
Backward mirrors it: the input gradient of a column-parallel group is a partial sum over tp (each
rank holds some output columns) that needs one all-reduce (one reduce-scatter with sequence
parallelism) per sublayer, and with sequence parallelism the sequence-sharded output gradient is
all-gathered before the row-parallel backward. The forward is minimal in both modes; the sequence
is gathered once per sublayer (`block_input` on self_attn / mlp), not once per projection.

The backward is minimal because attention and MLP receive their input as one local copy of the
full activations whose gradient leaves as `Partial()` (`block_input` in both modes): the q/k/v
(gate/up) input-gradient contributions add up locally and are reduced once per sublayer. Handing each
projection a plain tensor instead costs 5 all-reduces per block (each projection reduces its own
input gradient) — 2.5x the volume with ALL_REDUCE and 5x with REDUCE_SCATTER.

Outside the blocks (whole model): the vocab-parallel embedding sums its partial lookups (1 AR,
or 1 RS straight to sequence shards); with sequence parallelism the final norm's output is
gathered for the column-parallel head (1 AG). The head keeps the logits vocab-sharded (no
gather); the vocab-parallel cross-entropy (`train/loss.py`) all-reduces the max, then the sum of
exponentials and the target logit together (2 AR; `loss_parallel`'s DTensor ops take 3) and
needs none in backward. The
head's input gradient is a partial sum (1 AR, or 1 RS), and with sequence parallelism the
embedding's sequence-sharded output gradient is gathered for its weight gradient (1 AG).

On the CPU at tp=2 (gloo) the blocks' collectives are pair swaps instead (`parallel/pair_collectives.py::swap`: one
send and one receive each way, then the sum, the concatenation or this rank's half of it): a
second pass counts one swap per collective above and checks that outputs, gradients, loss and the
AdamW step keep the same bits. The counts above are taken with the swap turned off.

Norm weights: in ALL_REDUCE mode their gradients are Replicate with no collective (their input
gradients were already all-reduced). With sequence parallelism each rank's gradient covers only
its sequence shard and backward leaves it `Partial(sum)`. Left so, DTensor reduces it wherever it
is read (clipping once, AdamW three times: 4 small all-reduces per norm weight per step);
`reduce_partial_grads` (run by train_step right after backward) reduces them all in one flat
all-reduce, after which clipping needs only the total-norm all-reduce and AdamW none.
"""

import contextlib
import warnings
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from dist import run_ranks
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel

import mesh3d.tp_styles as tp_styles
from mesh3d.mesh import ParallelDims, build_mesh
from mesh3d.models.llama import Llama
from mesh3d.models.llama_spec import init_std as llama_init_std
from mesh3d.models.llama_spec import llama_tp_plan
from mesh3d.parallel import pair_collectives
from mesh3d.parallel.parallelize import materialize, seeded_init
from mesh3d.parallel.tensor import apply_tp, reduce_partial_grads
from mesh3d.tp_styles import local_of
from mesh3d.train.loss import normalized_loss, token_loss_sum
from mesh3d.train.step import clip_grad_norm

MODES = ("ALL_REDUCE", "REDUCE_SCATTER")
LAYERS, VOCAB, HIDDEN, B, S = 2, 64, 32, 2, 8
CFG = dict(
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=LAYERS,
    vocab_size=VOCAB,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    rope_interleaved=False,
    tie_word_embeddings=False,
    hidden_act="silu",
)
AR, AG, RS = "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"

# Per decoder layer (see the module docstring for the minimum and the fix).
BLOCK = {
    "ALL_REDUCE": {
        "forward": {AR: 2},  # o_proj, down_proj partial sums
        "backward": {AR: 2},  # input grads of the q/k/v and gate/up groups
    },
    "REDUCE_SCATTER": {
        "forward": {AG: 2, RS: 2},  # gather before q/k/v and gate/up; scatter o, down
        "backward": {AG: 2, RS: 2},  # mirror of the forward
    },
}
# Outside the blocks: embedding, final norm + head, loss.
EDGES = {
    "ALL_REDUCE": {
        "forward": {AR: 1},  # vocab-parallel embedding
        "loss": {AR: 2},  # the max; sum-exp and target logit together
        "backward": {AR: 1},  # lm_head input grad
    },
    "REDUCE_SCATTER": {
        "forward": {RS: 1, AG: 1},  # embedding to sequence shards; gather for lm_head
        "loss": {AR: 2},
        "backward": {RS: 1, AG: 1},  # lm_head input grad; embedding output grad
    },
}
NORMS = 2 * LAYERS + 1  # norm weights with Partial gradients under sequence parallelism
OPTIM = {
    "ALL_REDUCE": {"reduce_partial": {}, "clip": {AR: 1}, "adamw": {}},
    "REDUCE_SCATTER": {
        "reduce_partial": {AR: 1},
        "clip": {AR: 1},
        "adamw": {},
    },
}
# the c10d ops (the blocks' eager collectives, `reduce_partial_grads`) under their functional names
C10D_NAMES = {"allreduce_": AR, "_allgather_base_": AG, "_reduce_scatter_base_": RS}


SWAPS = (
    Counter()
)  # calls of pair_collectives.swap (a CPU pair's send + receive), counted by _measure_all


@contextlib.contextmanager
def _comms():
    """Yields a dict that, on exit, holds {collective name: count} of the block, e.g.
    {"all_reduce": 2}: DTensor's functional collectives and the c10d calls of eager code counted
    alike (c10d_functional prefix dropped), plus "swap": the pair swaps (CommDebugMode does not
    see point-to-point ops)."""
    got: dict[str, int] = {}
    before = SWAPS["n"]
    with CommDebugMode() as mode:
        yield got
    out: Counter = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1]
        out[C10D_NAMES.get(name, name)] += n
    out["swap"] = SWAPS["n"] - before
    got.update({k: n for k, n in out.items() if n})


def _measure(tp_mode: str, rank: int, tp_mesh) -> dict:
    sp = tp_mode == "REDUCE_SCATTER"
    with torch.device("meta"):
        model = Llama(SimpleNamespace(**CFG), attention="sdpa")
    apply_tp(model, tp_mesh, llama_tp_plan(sequence_parallel=sp))
    materialize(
        model, torch.device("cpu"), seeded_init(lambda n: llama_init_std(n, 0.02, LAYERS), 0)
    )
    gen = torch.Generator().manual_seed(0)  # the same inputs on every rank
    out = {}

    # (a) one decoder layer on its own, input in its local layout
    x = torch.randn(B, S, HIDDEN, generator=gen)
    if sp:
        x = x.chunk(tp_mesh.size(), dim=1)[tp_mesh.get_local_rank()]
    x.requires_grad_()
    with _comms() as fwd:
        y = model.layers["0"](x)
    with _comms() as bwd:
        y.sum().backward()
    out["block"] = {"forward": fwd, "backward": bwd}
    out["block_out"] = (type(y).__name__, tuple(y.shape), tuple(x.grad.shape))
    model.zero_grad(set_to_none=True)

    # (b) the whole model + loss, as train_step runs them
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    labels = torch.randint(0, VOCAB, (B, S), generator=gen)
    with _comms() as fwd:
        logits = model(ids)
    with loss_parallel():
        with _comms() as loss_fwd:
            loss = normalized_loss(logits, labels, VOCAB, B * S)
        with _comms() as bwd:
            loss.backward()
    out["model"] = {"forward": fwd, "loss": loss_fwd, "backward": bwd}
    values = [y.detach(), x.grad, loss.detach()]
    values += [p.grad.to_local() for p in model.parameters()]
    out["partial_grads"] = sorted(
        n
        for n, p in model.named_parameters()
        if isinstance(p.grad, DTensor) and any(isinstance(q, Partial) for q in p.grad.placements)
    )

    # (c) the Partial gradients are reduced once, then clipping and the optimizer step
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    with _comms() as partial:
        reduce_partial_grads(params)
    with _comms() as clip:
        clip_grad_norm(params, 1e-3)
    with _comms() as step:
        optimizer.step()
    out["optim"] = {"reduce_partial": partial, "clip": clip, "adamw": step}
    values += [p.to_local() for p in params]
    return out, [v.clone() for v in values]


def _local_of_against_to_local(tp_mesh) -> list:
    """Per (placement, gradient placement): `local_of`'s gradient, accumulated over two
    backwards as microbatches do, against `to_local`'s; (which function read the weight,
    gradient placements, strides, equal values)."""
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(8, 6, generator=gen)
    rows = []
    for placement, grad_placement in [(Shard(0), None), (Shard(1), None), (Replicate(), None),
                                      (Replicate(), Replicate()), (Replicate(), Partial())]:  # fmt: skip
        grads = []
        for read in ("local_of", "to_local"):
            p = torch.nn.Parameter(distribute_tensor(full, tp_mesh, [placement]))
            for _ in range(2):
                w = (
                    local_of(p, grad_placement)
                    if read == "local_of"
                    else p.to_local(
                        grad_placements=None if grad_placement is None else [grad_placement]
                    )
                )
                (w.pow(3) + w.sin()).sum().backward()
            grads.append(p.grad)
            if read == "local_of":
                fn = type(w.grad_fn).__name__
        a, b = grads
        rows.append((str(placement), str(grad_placement), fn, a.placements == b.placements,
                     a.stride() == b.stride(), bool(torch.equal(a.to_local(), b.to_local()))))  # fmt: skip
    return rows


def _cross_entropy_against_full(tp_mesh) -> list:
    """`token_loss_sum` of vocab-sharded logits (even and uneven shards, vocabulary padding,
    ignored labels) against `F.cross_entropy` of the full logits: (loss difference, largest
    gradient difference, whether the loss came back a plain tensor)."""
    gen = torch.Generator().manual_seed(2)
    rows = []
    for width, vocab in ((10, 10), (10, 7), (9, 9), (9, 8)):
        full = torch.randn(2, 5, width, generator=gen) * 3
        labels = torch.randint(0, vocab, (2, 5), generator=gen)
        labels[0, 1] = labels[1, 4] = -100
        dt = distribute_tensor(full, tp_mesh, [Shard(2)]).requires_grad_()
        with loss_parallel():
            loss = token_loss_sum(dt, labels, vocab)
            loss.backward()
        ref_logits = full.clone().requires_grad_()
        ref = F.cross_entropy(ref_logits[..., :vocab].reshape(-1, vocab), labels.reshape(-1),
                              reduction="sum", ignore_index=-100)  # fmt: skip
        ref.backward()
        got = dt.grad.full_tensor()
        rows.append((float((loss - ref).abs()), float((got - ref_logits.grad).abs().max()),
                     not isinstance(loss, DTensor)))  # fmt: skip
    return rows


def _measure_all(rank: int, world: int) -> dict:
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # CommDebugMode's
    mesh = build_mesh(ParallelDims(dp=1, tp=world, pp=1), "cpu")
    # the blocks' collectives as c10d collectives (what they are on GPUs and for tp > 2) ...
    swap, choose = pair_collectives.swap, tp_styles.choose_collectives
    tp_styles.choose_collectives = lambda group, device_type: choose(group, "cuda")  # c10d's
    try:
        measured = {m: _measure(m, rank, mesh["tp"]) for m in MODES}
    finally:
        tp_styles.choose_collectives = choose
    out = {m: counts for m, (counts, _) in measured.items()}

    # ... and as a CPU pair runs them: swapped, with the same bits
    def counted_swap(*args):
        SWAPS["n"] += 1
        return swap(*args)

    pair_collectives.swap = counted_swap
    try:
        for m in MODES:
            counts, values = _measure(m, rank, mesh["tp"])
            reference = measured[m][1]
            same = len(values) == len(reference) and all(map(torch.equal, values, reference))
            out[f"{m} swapped"] = {**counts, "same values": same}
    finally:
        pair_collectives.swap = swap
    out["local_of"] = _local_of_against_to_local(mesh["tp"])
    out["cross_entropy"] = _cross_entropy_against_full(mesh["tp"])
    return out


@pytest.fixture(scope="module")
def measured() -> dict:
    results = run_ranks(2, _measure_all, timeout=60)
    assert results[0] == results[1], "every tp rank issues the same collectives"
    print(f"\ncollectives (tp=2): {results[0]}")
    return results[0]


@pytest.mark.parametrize("tp_mode", MODES)
def test_block_collectives(measured, tp_mode):
    got = measured[tp_mode]
    assert got["block"] == BLOCK[tp_mode]
    local_s = S // 2 if tp_mode == "REDUCE_SCATTER" else S
    # the layer maps its local layout to the same local layout, as plain tensors
    assert got["block_out"] == ("Tensor", (B, local_s, HIDDEN), (B, local_s, HIDDEN))


@pytest.mark.parametrize("tp_mode", MODES)
def test_model_collectives_are_blocks_plus_edges(measured, tp_mode):
    got, block, edges = measured[tp_mode]["model"], BLOCK[tp_mode], EDGES[tp_mode]
    for phase in ("forward", "backward"):
        expected = Counter(edges[phase])
        for _ in range(LAYERS):
            expected.update(block[phase])
        assert got[phase] == dict(expected), phase
    assert got["loss"] == edges["loss"]


@pytest.mark.parametrize("tp_mode", MODES)
def test_norm_weight_grads_reduced_once(measured, tp_mode):
    got = measured[tp_mode]
    norms = [
        f"layers.{i}.{n}.weight"
        for i in range(LAYERS)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    expected = sorted([*norms, "norm.weight"]) if tp_mode == "REDUCE_SCATTER" else []
    assert got["partial_grads"] == expected
    assert len(expected) in (0, NORMS)
    assert got["optim"] == OPTIM[tp_mode]


@pytest.mark.parametrize("tp_mode", MODES)
def test_cpu_pairs_swap_instead_with_the_same_bits(measured, tp_mode):
    """At tp=2 on the CPU each of a block's collectives (all-reduce, all-gather, reduce-scatter)
    is one swap between the two ranks (`parallel/pair_collectives.py::swap`: one send and one receive each way), and
    so are the embedding's and the head's (`LocalEmbedding`, `LocalHead`); the layer and model
    outputs, input and weight gradients, loss and the AdamW step that follows equal the
    collectives' bit for bit. The loss's and the optimizer's collectives stay."""
    got, collectives = measured[f"{tp_mode} swapped"], measured[tp_mode]
    assert got["same values"]
    for phase in ("forward", "backward"):
        assert got["block"][phase] == {"swap": sum(BLOCK[tp_mode][phase].values())}, phase
        edges = sum(EDGES[tp_mode][phase].values())  # the embedding's and the head's
        swaps = LAYERS * sum(BLOCK[tp_mode][phase].values()) + edges
        assert got["model"][phase] == {"swap": swaps}, phase
    assert got["model"]["loss"] == collectives["model"]["loss"]
    assert got["optim"] == collectives["optim"]


def test_local_of_is_to_local_with_a_cheaper_backward(measured):
    """`tp_styles.local_of` reads a weight as `to_local` does and gives it the same gradient
    (placements, strides, values, accumulated over two backwards); it takes its own autograd
    function only where the gradient keeps the weight's placements, `to_local` elsewhere."""
    rows = measured["local_of"]
    assert [r[2] for r in rows] == ["_LocalOfBackward"] * 4 + ["_ToTorchTensorBackward"]
    for placement, grad_placement, _fn, *same in rows:
        assert same == [True, True, True], (placement, grad_placement, same)


def test_vocab_parallel_cross_entropy_equals_the_full_one(measured):
    """The plain-tensor vocab-parallel cross-entropy of `train/loss.py` (2 all-reduces) gives
    the loss and logit gradients of `F.cross_entropy` on the gathered logits, with even and
    uneven vocabulary shards, padding columns and ignored labels."""
    for loss_diff, grad_diff, plain in measured["cross_entropy"]:
        assert plain
        assert loss_diff < 1e-5 and grad_diff < 1e-6, (loss_diff, grad_diff)
