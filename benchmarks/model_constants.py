"""Does this device reach the rates `mesh3d plan --search`'s step-time model assumes?

    python benchmarks/model_constants.py            # on CUDA if there is one, else this CPU
    python benchmarks/model_constants.py --quick    # small shapes (the CPU test, seconds)

The model (docs/plan-search.md, "Constants") prices a step by kernel class at a profile's rates.
This measures each class on the device, each figure the best of `--repeats` timed runs (CUDA
events on a GPU; other jobs only add time), against the profile the device's name selects
(exactly: H100 80GB HBM3 -> h100-80g, H200 -> h200, A100-SXM4-80GB / 40GB -> a100-80g / 40g;
others, PCIe and NVL parts included, need `--hardware`; on a CPU the measured `cpu` profile
of one rank):
- matmul: the seven linears of a Llama-3-8B layer (h 4096, F 14336, 32 heads, 8 kv heads) on
  `--tokens` tokens, forward and both backward matmuls (6·T·K·N FLOPs a linear): its fraction
  of the peak, against the profile's `efficiency`;
- memory: a triad a = b + s·c (BabelStream's, two reads and a write) over 1 GiB tensors (256
  MiB on a CPU, 64 MiB quick: each past the caches): GB/s,
  against `memory_gbps` x `memory_efficiency`;
- attention: causal SDPA forward + backward at sequence `--seq`, 32 heads of 128, its FLOPs as
  the model counts them (3.5 x 2·q·S per token): the fraction of the peak, against
  `attention_efficiency`; and one ring-attention step's block (`seq` queries against `seq` / 2
  keys, no mask: each step after the first under CP's head-tail balancing), the same way;
- a layer: mesh3d's own Llama decoder layer forward + backward, eager and with `mesh3d.compile`'s
  blocks compiled (`compile_blocks`), against `kernels.compute_seconds` for one layer (matmuls,
  attention and the counted memory-bound bytes, plus `layer_overhead_us`): measured / predicted.
Printed for each: model speed / measured speed (above 1: the model assumes the device faster than
it is). On a GPU, the ratios say
which constant the published-run gaps (benchmarks/docs/plan_search.md) come from.
Result: benchmarks/results/local/model_constants.json (`--publish`: benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_publish_flag, print_header, results_dir  # noqa: E402
from kernel_bytes import llama_layer  # noqa: E402

from mesh3d.config import load_config  # noqa: E402
from mesh3d.models.llama_spec import compile_classes  # noqa: E402
from mesh3d.models.registry import model_shape, spec_of  # noqa: E402
from mesh3d.parallel.compile import compile_blocks  # noqa: E402
from mesh3d.plan.hardware import PROFILES, Hardware, hardware_named  # noqa: E402
from mesh3d.plan.kernels import compute_seconds, work_of  # noqa: E402

CONFIG = str(Path(__file__).resolve().parents[1] / "recipes" / "configs" / "cpu_tiny.yaml")
LLAMA_8B = (4096, 32, 8, 14336)  # hidden, heads, kv heads, MLP width
QUICK = (256, 8, 2, 688)
# the device names torch reports for the parts the profiles describe (others: --hardware)
NAMES = {"NVIDIA H100 80GB HBM3": "h100-80g", "NVIDIA H200": "h200",
         "NVIDIA A100-SXM4-80GB": "a100-80g", "NVIDIA A100-SXM4-40GB": "a100-40g"}  # fmt: skip


def profile_for(device: torch.device, name: str | None) -> Hardware:
    """The profile to compare with: `name`, else the GPU's by its exact name, else this CPU's."""
    if name:
        return hardware_named(name)
    if device.type == "cpu":
        return hardware_named("cpu", 1)
    gpu = torch.cuda.get_device_name(device)
    if gpu not in NAMES:
        print(f"error: no profile for {gpu!r}; give --hardware {{{','.join(PROFILES)}}}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    return PROFILES[NAMES[gpu]]


def best_seconds(fn, device: torch.device, repeats: int) -> float:
    """The least time of `repeats` calls of `fn` after one warm-up call."""
    fn()
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    return best


def linears(h: int, heads: int, kv: int, ffn: int) -> list[tuple[int, int]]:
    """(in, out) of a Llama layer's linears: q, k, v, o, gate, up, down."""
    q, k = h, kv * h // heads
    return [(h, q), (h, k), (h, k), (q, h), (h, ffn), (h, ffn), (ffn, h)]


def matmul_rate(shape, tokens: int, dtype, device, repeats: int) -> float:
    """FLOP/s of the layer's linears, forward and backward (y = xW, dx = dy W^T, dW = x^T dy)."""
    mats = [(torch.randn(tokens, k, dtype=dtype, device=device),
             torch.randn(k, n, dtype=dtype, device=device),
             torch.randn(tokens, n, dtype=dtype, device=device)) for k, n in linears(*shape)]  # fmt: skip

    def run():
        for x, w, dy in mats:
            x @ w, dy @ w.T, x.T @ dy

    flops = sum(6 * tokens * k * n for k, n in linears(*shape))
    return flops / best_seconds(run, device, repeats)


def triad_rate(elements: int, dtype, device, repeats: int) -> float:
    """Bytes/s of a = b + s·c: two tensors read, one written."""
    a, b, c = (torch.rand(elements, dtype=dtype, device=device) for _ in range(3))
    return 3 * a.nbytes / best_seconds(lambda: torch.add(b, c, alpha=0.5, out=a), device, repeats)


def attention_rate(heads: int, seq: int, dtype, device, repeats: int) -> float:
    """Executed FLOP/s of causal attention forward + backward, as the model counts them."""
    q, k, v = (torch.randn(1, heads, seq, 128, dtype=dtype, device=device, requires_grad=True)
               for _ in range(3))  # fmt: skip
    grad = torch.randn(1, heads, seq, 128, dtype=dtype, device=device)

    def run():
        q.grad = k.grad = v.grad = None  # no accumulation: each run writes fresh gradients
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return 3.5 * 2 * heads * 128 * seq * seq / best_seconds(run, device, repeats)


def block_rate(heads: int, seq: int, dtype, device, repeats: int) -> float:
    """Executed FLOP/s of one ring-attention step's block, forward + backward: `seq` queries
    against `seq` / 2 keys, no mask (what each step after the first runs under context
    parallelism's head-tail balancing: the whole local query against half a peer's keys)."""
    q = torch.randn(1, heads, seq, 128, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(1, heads, seq // 2, 128, dtype=dtype, device=device, requires_grad=True)
            for _ in range(2))  # fmt: skip
    grad = torch.randn(1, heads, seq, 128, dtype=dtype, device=device)

    def run():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v).backward(grad)

    return 3.5 * 4 * heads * 128 * seq * (seq // 2) / best_seconds(run, device, repeats)


def layer_seconds(shape, tokens: int, dtype, device, repeats: int, compiled: bool) -> float:
    """Seconds of one mesh3d Llama decoder layer's forward + backward on `tokens` tokens."""
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": llama_layer(*shape).to(device=device, dtype=dtype)})
    if compiled:
        compile_blocks(holder, compile_classes(tensor_parallel=False))
    layer = holder.layers["0"]
    x = torch.randn(1, tokens, shape[0], dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn_like(x)

    def run():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad)

    return best_seconds(run, device, repeats)


def predicted_layer(shape, tokens: int, hw: Hardware, dtype_name: str, compiled: bool) -> float:
    """The model's seconds for the same layer: `kernels.compute_seconds` of one layer, plus
    the profile's per-layer overhead."""
    h, heads, kv, ffn = shape
    cfg = load_config(CONFIG, [f"model.model_config.hidden_size={h}",
                               f"model.model_config.num_attention_heads={heads}",
                               f"model.model_config.num_key_value_heads={kv}",
                               f"model.model_config.intermediate_size={ffn}",
                               f"model.model_config.max_position_embeddings={tokens}",
                               f"tokens.sequence_length={tokens}"])  # fmt: skip
    size = torch.finfo(getattr(torch, dtype_name)).bits // 8
    w = work_of(spec_of(cfg.model.model_config), model_shape(cfg), tokens, size,
                "compiled" if compiled else "eager")  # fmt: skip
    seconds = compute_seconds(w, hw, dtype_name, tokens, 1, 0, False, 1, False, "none")
    return seconds + hw.layer_overhead_us * 1e-6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes: the CPU test")
    ap.add_argument("--hardware", choices=sorted(PROFILES), help="the profile to compare with")
    ap.add_argument("--tokens", type=int, help="tokens per matmul and layer (8192; quick 256)")
    ap.add_argument("--seq", type=int, help="attention's sequence (8192; quick 256)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs, the best counts")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled layer")
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    head = print_header()
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # the cpu profile is one thread's
    hw = profile_for(device, args.hardware)
    name = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, name)
    small = args.quick or device.type == "cpu"
    shape = QUICK if small else LLAMA_8B
    tokens = args.tokens or (256 if small else 8192)
    seq = args.seq or (256 if small else 8192)
    size = 2**26 if args.quick else 2**28 if device.type == "cpu" else 2**30  # bytes, past caches
    elements = size // (torch.finfo(dtype).bits // 8)
    peak = hw.peak(name)
    rows = {}

    def row(key: str, measured: float, assumed: float, unit: str, time: bool = False) -> None:
        optimism = measured / assumed if time else assumed / measured
        rows[key] = {"measured": measured, "model": assumed, "unit": unit,
                     "model_speed_over_measured": optimism}  # fmt: skip
        print(f"  {key:<20} measured {measured:10.4g} {unit:<8} model {assumed:10.4g}   "
              f"model speed / measured {optimism:5.2f}")  # fmt: skip

    print(f"{device.type} {torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}"
          f" vs profile {hw.name}, {name}, torch {torch.__version__}")  # fmt: skip
    row("matmul fraction", matmul_rate(shape, tokens, dtype, device, args.repeats) / peak,
        hw.efficiency, "of peak")  # fmt: skip
    row("memory GB/s", triad_rate(elements, dtype, device, args.repeats) / 1e9,
        hw.memory_bytes_per_s() / 1e9, "GB/s")  # fmt: skip
    row("attention fraction", attention_rate(shape[1], seq, dtype, device, args.repeats) / peak,
        hw.attention_efficiency, "of peak")  # fmt: skip
    row("ring block fraction", block_rate(shape[1], seq, dtype, device, args.repeats) / peak,
        hw.attention_efficiency, "of peak")  # fmt: skip
    for compiled in (False, True)[: 1 if args.no_compile else 2]:
        key = "layer s, compiled" if compiled else "layer s, eager"
        measured = layer_seconds(shape, tokens, dtype, device, args.repeats, compiled)
        row(key, measured, predicted_layer(shape, tokens, hw, name, compiled), "s", time=True)
    result = head | {"device": str(device), "hardware": hw.name, "dtype": name, "shape": shape,
                     "tokens": tokens, "seq": seq, "rows": rows}  # fmt: skip
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    out = results_dir(args.publish) / "model_constants.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
