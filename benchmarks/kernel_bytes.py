"""Bytes that mesh3d's Llama moves through memory outside its matmuls and attention kernels.

    python benchmarks/kernel_bytes.py            # ~4 minutes on 2 cores (torch.compile)
    python benchmarks/kernel_bytes.py --device cuda   # inductor's CUDA kernels (a GPU)

The cost model of `mesh3d plan --search` (docs/plan-search.md, "compute") prices these
memory-bound kernels (norms, RoPE, SiLU x up, residual adds, casts, copies, the loss's
softmax) at the device's memory bandwidth. This script counts them instead of guessing, on
one decoder layer of `mesh3d.models.llama` in bf16 on CPU:
- eager: a `TorchDispatchMode` adds up every aten op's input and output bytes except the
  matmuls, the attention kernel and views (which move nothing), in forward and in forward +
  backward (a GPU runs the same aten ops in eager mode, so the counts carry over);
- `mesh3d.compile`: the blocks `compile_blocks` compiles (attention, MLP and, without tp, the
  norms; `llama_spec.compile_classes`) are compiled one by one and inductor's own count of
  each generated kernel's reads and writes (`GraphLowering.count_bytes`, its non-extern
  nodes) replaces their eager bytes; what stays eager (the residual adds and their gradients,
  the norms under tp) keeps its eager count. Inductor's CPU schedule is counted; its CUDA
  schedule fuses the same pointwise and reduction nodes.
Four layer shapes give each count per token as a·h + b·(q + 2·kv) + c·F (h hidden, q = heads
x head_dim, kv = kv heads x head_dim, F the MLP width) by least squares; the largest relative
residual is printed (the form's fit). The loss (`train.loss.token_loss_sum` on bf16 logits,
eager: mesh3d does not compile it) gives bytes per token per vocabulary entry.
Result: benchmarks/results/local/kernel_bytes.json (`--publish`: benchmarks/results/), the
constants of `mesh3d/plan/kernels.py`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_publish_flag, results_dir  # noqa: E402

from mesh3d.models.llama import DecoderLayer, Rotary  # noqa: E402

FREE = ("view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice",
        "select", "unsqueeze", "squeeze", "as_strided", "detach", "alias", "split", "chunk",
        "unbind", "split_with_sizes", "empty", "zeros", "ones", "arange", "lift_fresh",
        "_to_copy_noop", "is_same_size", "sym_size", "new_empty", "new_zeros",
        "empty_like")  # fmt: skip
PRICED = ("mm", "addmm", "bmm", "_scaled_dot_product")  # matmuls and attention: priced by FLOPs
SHAPES = [(256, 8, 2, 512), (512, 8, 2, 512), (256, 8, 4, 1024), (384, 6, 2, 768)]  # all GQA
TOKENS = 256
DEVICE = torch.device("cpu")  # --device cuda: inductor's CUDA kernels instead


class Bytes(TorchDispatchMode):
    """Sum of input + output bytes of every aten op that is neither free nor priced by FLOPs."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name not in FREE and not name.startswith(PRICED):
            leaves = torch.utils._pytree.tree_leaves((args, kwargs, out))
            self.total += sum(t.nbytes for t in leaves if isinstance(t, torch.Tensor))
        return out


class Inductor(logging.Handler):
    """Inductor's bytes of its generated kernels (not extern matmuls / attention), per graph."""

    def __init__(self):
        super().__init__()
        self.graphs: list[int] = []

    def emit(self, record):
        info = record.args if isinstance(record.args, dict) else None
        if info and "nodes_num_elem" in info:
            self.graphs.append(sum(4 * n for node, n in info["nodes_num_elem"]
                                   if type(node).__name__ != "ExternKernelSchedulerNode"))  # fmt: skip


def llama_layer(h: int, heads: int, kv: int, ffn: int) -> DecoderLayer:
    cfg = SimpleNamespace(hidden_size=h, rms_norm_eps=1e-5, num_key_value_heads=kv,
                          num_attention_heads=heads, intermediate_size=ffn, hidden_act="silu")  # fmt: skip
    dh = h // heads
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh)), interleaved=False)
    return DecoderLayer(cfg, rotary, "sdpa").to(torch.bfloat16)


def _eager(module, h: int) -> tuple[int, int]:
    """(forward, forward + backward) bytes of `module` on one fresh bf16 input."""
    module.zero_grad(set_to_none=True)  # a first backward: no accumulation into .grad
    x = torch.randn(1, TOKENS, h, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    with Bytes() as fwd:
        y = module(x)
    grad = torch.randn_like(y)  # made outside the count: the layer's own ops only
    with Bytes() as bwd:
        y.backward(grad)
    return fwd.total, fwd.total + bwd.total


def _compiled(module, h: int, handler: Inductor) -> tuple[int, int]:
    """(forward, forward + backward) bytes of inductor's kernels for `module`, compiled."""
    module.zero_grad(set_to_none=True)
    x = torch.randn(1, TOKENS, h, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    torch._dynamo.reset()
    handler.graphs.clear()
    y = torch.compile(module)(x)
    fwd = sum(handler.graphs)
    y.backward(torch.randn_like(y))
    return fwd, sum(handler.graphs)


def layer_bytes(shape: tuple[int, int, int, int], handler: Inductor) -> dict[str, float]:
    """Bytes per token of one decoder layer: eager, compiled (norms too: tp 1) and compiled
    under tp (attention and MLP only), each forward and forward + backward."""
    layer, h = llama_layer(*shape).to(DEVICE), shape[0]
    whole = _eager(layer, h)
    blocks = {"attention": layer.self_attn, "mlp": layer.mlp, "norm": layer.input_layernorm}
    eager = {k: _eager(m, h) for k, m in blocks.items()}
    compiled = {k: _compiled(m, h, handler) for k, m in blocks.items()}
    out = {}
    for i, part in enumerate(("fwd", "all")):
        saved = {k: eager[k][i] - compiled[k][i] for k in blocks}  # what compiling a block saves
        out[f"eager_{part}"] = whole[i] / TOKENS
        out[f"compiled_{part}"] = (whole[i] - saved["attention"] - saved["mlp"]
                                   - 2 * saved["norm"]) / TOKENS  # fmt: skip
        out[f"compiled_tp_{part}"] = (whole[i] - saved["attention"] - saved["mlp"]) / TOKENS
    return out


def loss_bytes(vocab: int) -> float:
    """Bytes per token per vocabulary entry of the loss on bf16 logits, forward + backward."""
    from mesh3d.train.loss import token_loss_sum

    logits = torch.randn(1, TOKENS, vocab, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, vocab, (1, TOKENS), device=DEVICE)
    with Bytes() as count:
        token_loss_sum(logits, labels, vocab).backward()
    return count.total / TOKENS / vocab


def fit(rows: list[list[int]], got: list[float]) -> tuple[list[float], float]:
    """Least-squares (a, b, c) and the largest relative residual."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(got, dtype=torch.float64)
    coef = torch.linalg.lstsq(a, b[:, None]).solution[:, 0]
    worst = ((a @ coef - b).abs() / b).max().item()
    return coef.tolist(), worst


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu (the published counts) or cuda")
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    DEVICE = torch.device(args.device)
    torch.manual_seed(0)
    torch._inductor.config.force_disable_caches = True  # a cached graph logs no count
    handler = Inductor()
    torch._logging.set_logs(inductor_metrics=True)
    log = logging.getLogger("torch._inductor.compile_fx")
    log.addHandler(handler)
    log.propagate = False  # the graphs' metrics go to the handler only, not the console
    got = [layer_bytes(s, handler) for s in SHAPES]
    rows = [[h, h + 2 * kv * h // heads, f] for h, heads, kv, f in SHAPES]
    result = {"torch": torch.__version__, "device": args.device, "shapes": SHAPES, "tokens": TOKENS, "per_token": got,
              "layer": {}, "loss_per_token_vocab": loss_bytes(4096)}  # fmt: skip
    for key in got[0]:
        (a, b, c), worst = fit(rows, [g[key] for g in got])
        result["layer"][key] = {"h": a, "q_plus_2kv": b, "ffn": c, "max_residual": worst}
        print(f"{key:<16} {a:7.1f}·h + {b:6.1f}·(q + 2kv) + {c:6.1f}·F bytes per token "
              f"(largest residual {worst:.1%})")  # fmt: skip
    print(f"loss: {result['loss_per_token_vocab']:.1f} bytes per token per vocabulary entry")
    suffix = "" if DEVICE.type == "cpu" else f"_{DEVICE.type}"
    out = results_dir(args.publish) / f"kernel_bytes{suffix}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
