"""Hardware profiles for `mesh3d plan --search`: what the cost model (`cost.py`) needs of a GPU and
its links, as data.

Units in the table and in a `--hardware-file` (YAML or JSON, the same keys): peak_tflops per
compute dtype (dense, no sparsity), memory_gib (what the device reports as total), memory_gbps
(HBM bandwidth: the optimizer step streams its state; memory_efficiency the fraction streaming
kernels reach), intra_node_gbps (the bus bandwidth a
ring collective reaches over NVLink within a node: GB/s each GPU sends, as nccl-tests' busbw),
inter_node_gbps (the same of one GPU's network card: a group with k members on each node runs k
rings, one per card, so it gets min(intra, k x inter)), latency_us (the time of a collective too
small for bandwidth to matter: added per collective or send), efficiency (the fraction of the peak large matmuls
reach), float8_efficiency (the same of float8 matmuls, against `peak_tflops["float8"]`),
attention_efficiency (the fraction of the peak a causal flash-attention kernel reaches, its
executed FLOPs counted as FlashAttention counts them), layer_overhead_us (fixed cost per decoder
layer per microbatch, forward and backward together: kernel launches on a GPU, Python dispatch
on a CPU). docs/plan-search.md, "Constants", lists every value with its source.

Sources (dense figures):
- H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet: BF16 989 TFLOPS, FP8 1979 TFLOPS,
  FP32 67 TFLOPS, HBM3 3.35 TB/s, NVLink 900 GB/s (both directions); ConnectX-7 400 Gb/s per GPU
  (DGX H100).
- H100 96GB HBM2e at 500 W (Meta's Grand Teton, where TorchTitan's Llama 3.1 benchmarks ran):
  TorchTitan benchmarks/llama3_h100_202412_torchtitan.md: 2.4 TB/s, 400 Gb/s RDMA per GPU,
  NVLink within the host, 500 W power limit, "peak TFLOPs between SXM and NVL"; the peak here
  is the middle of that bracket: NVIDIA H100 NVL datasheet 1671 BF16 / 3341 FP8 TFLOPS with
  sparsity (835.5 / 1670.5 dense), SXM 989 / 1979 -> 912 / 1825.
- H200 SXM 141GB: NVIDIA H200 datasheet: the H100's compute, HBM3e 4.8 TB/s, NVLink 900 GB/s.
- A100 SXM4 80GB / 40GB: NVIDIA A100 datasheet: BF16 312 TFLOPS, FP32 19.5 TFLOPS, 2.04 / 1.56
  TB/s, NVLink 600 GB/s (both directions); HDR 200 Gb/s per GPU (DGX A100).
FP32 is the plain FP32 rate: torch's default matmul precision does not use TF32.
Links, measured with nccl-tests (S. Bekman, ml-engineering, network/README.md, "Real network
throughput" and "NVLink SHARP"): ring busbw at 16 GiB on 8 GPUs of one node, NVLink 4 (H100,
H200: 450 GB/s one way) all-gather 361.4, reduce-scatter 362.9, all-reduce 367.2 GB/s -> 365;
NVLink 3 (A100: 300 GB/s) all-reduce 234.89 -> 235; the smallest all-reduce (32 KiB) takes 43.8 us
(8x A100) and 40 us (8x H200) -> latency 40 us. Across nodes "expect about 80%" of the card's
rate (same page): 400 Gb/s -> 40 GB/s, 200 Gb/s -> 20 GB/s; a 32-rank all-reduce on 4 nodes of
8x H200 measured 364.65 GB/s busbw, the NVLink figure: 8 rings, one per card, as min(intra,
8 x inter) says.
`efficiency`: what large matmuls sustain, over the peak. H100 and H200: the Maximum Sustainable
Matmul FLOPS (MSMF: the rate a shape holds over a window once the clock has settled at the power
limit, mamf-finder.py; S. Bekman, ml-engineering, compute/accelerator/benchmarks/README.md): BF16
on 8 H200s all computing at once, the slowest GPU (which a synchronous step waits on) 745 of 989
(0.753; the node's median 755; the H100 has the same compute and power limit), FP8 about 1330 of
1979 (0.672). A short burst at the boost clock reaches more (MAMF: 848 BF16 on that H200, 794.5
on an H100 SXM in the older method, 0.803), but a training step runs for seconds at the power
limit. The 500 W H100 gets the same fraction of its own peak: no BF16 rate under a 500 W cap
is published (arXiv:2604.11391 caps an HBM2e H100 from 200 to 700 W, for FP64 DGEMM). A100
SXM: no MSMF is published; MAMF 271.2 of 312 (0.869, ml-engineering MAMF table), an upper
bound for a model's own matmul shapes. `attention_efficiency`: FlashAttention-2 reaches
35% of the H100's peak (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, abstract; its
backward 318 TFLOP/s at head dim 128, 8k: 0.32) and 50-73% of the A100's (Dao 2023,
FlashAttention-2, arXiv:2307.08691, abstract): 0.33 and 0.6 (that range's middle).
`memory_efficiency`: BabelStream's triad (two reads, one write: what an elementwise kernel does)
over the datasheet bandwidth: H100 80GB HBM3 2.97 of 3.35 TB/s (0.887; Azure/AI-benchmarking-guide,
ND_H100_v5 results, "HBM Bandwidth"), used for every H100 and the H200 (no HBM2e or HBM3e H100
part measured with BabelStream was found; the H100 PCIe's HBM2e reaches 1832 of 2039 GB/s in
RRZE-HPC/gpu-benches' gpu-stream triad, 0.90, consistent); A100-SXM4-80GB 1,724.8 of 2,039
GB/s (0.846; ukri-bench/benchmark-BabelStream README, Tursa; Azure's ND_A100_v4 1.70 TB/s,
0.834, agrees); A100-SXM4-40GB 1,377.5 of 1,555 GB/s (0.886; argonne-lcf/ALCFBeginnersGuide,
polaris/02_profiling.md, BabelStream 5.0).

`cpu`: measured on the spot (`measure_cpu`, each figure the best of 5 tries): one thread's fp32
256^3 matmul rate (the peak) and an MLP-shaped forward and backward's rate (its ratio is the
efficiency), a gloo all-reduce's bandwidth and latency among as many processes as ranks (at most 16; the
latency between bursts of compute, so it includes waiting for parked peers), memory bandwidth and the
per-op dispatch cost (x 40 ops per layer); the machine's cores are shared by the ranks
(`cpu_share` = cores / ranks).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path

import yaml

from mesh3d.errors import ConfigError


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: dict[str, float]  # compute dtype -> dense TFLOP/s
    memory_gib: float
    memory_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    latency_us: float
    efficiency: float = 0.6  # of the peak, in large matmuls
    attention_efficiency: float = 0.35  # of the peak, in the attention kernel's executed FLOPs
    float8_efficiency: float = 0.6  # of the float8 peak, in large float8 matmuls
    memory_efficiency: float = 1.0  # of memory_gbps, in streaming kernels (BabelStream's triad)
    layer_overhead_us: float = 0.0
    gpus_per_node: int = 8
    cpu_share: float = 1.0  # the fraction of one core each rank gets (cpu: cores / ranks)
    source: str = field(default="", compare=False)

    def peak(self, dtype: str) -> float:
        """The dense peak FLOP/s of one rank in `dtype` (its share of a core on a CPU)."""
        peak = self.peak_tflops.get(dtype) or self.peak_tflops["float32"]
        return peak * 1e12 * self.cpu_share

    def memory_bytes_per_s(self) -> float:
        """Achievable memory bandwidth of one rank, bytes/s (its share on a CPU)."""
        return self.memory_gbps * 1e9 * self.memory_efficiency * self.cpu_share

    def flops(self, dtype: str) -> float:
        """Achievable matmul FLOP/s of one rank in `dtype`."""
        return self.peak(dtype) * self.efficiency


_H100 = dict(peak_tflops={"bfloat16": 989.0, "float16": 989.0, "float8": 1979.0, "float32": 67.0},
             intra_node_gbps=365, inter_node_gbps=40, latency_us=40, efficiency=0.753,
             float8_efficiency=0.672, attention_efficiency=0.33, memory_efficiency=0.887)  # fmt: skip
_A100 = dict(peak_tflops={"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
             intra_node_gbps=235, inter_node_gbps=20, latency_us=40, efficiency=0.869,
             attention_efficiency=0.6, memory_efficiency=0.846)  # fmt: skip
# between H100 NVL and SXM (dense): TorchTitan's Grand Teton H100s at 500 W
_TETON = {"bfloat16": 912.0, "float16": 912.0, "float8": 1825.0, "float32": 63.5}
PROFILES: dict[str, Hardware] = {
    "h100-80g": Hardware(
        "h100-80g",
        memory_gib=79.6,
        memory_gbps=3350,
        **_H100,
        source="NVIDIA H100 datasheet (SXM5); ml-engineering MSMF; FlashAttention-3",
    ),  # fmt: skip
    "h100-96g-500w": Hardware(
        "h100-96g-500w",
        memory_gib=95.0,
        memory_gbps=2400,
        **(_H100 | {"peak_tflops": _TETON}),
        source="TorchTitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton, 500 W); "
        "NVIDIA H100 NVL and SXM datasheets",
    ),  # fmt: skip
    "h200": Hardware(
        "h200", memory_gib=140.4, memory_gbps=4800, **_H100, source="NVIDIA H200 datasheet"
    ),  # fmt: skip
    "a100-80g": Hardware(
        "a100-80g",
        memory_gib=80.0,
        memory_gbps=2039,
        **_A100,
        source="NVIDIA A100 datasheet; ml-engineering MAMF; FlashAttention-2",
    ),  # fmt: skip
    "a100-40g": Hardware(
        "a100-40g",
        memory_gib=40.0,
        memory_gbps=1555,
        **(_A100 | {"memory_efficiency": 0.886}),
        source="NVIDIA A100 datasheet; ALCF BabelStream",
    ),  # fmt: skip
}
KNOWN = (*PROFILES, "cpu")
OPTIONAL = ("efficiency", "attention_efficiency", "float8_efficiency", "memory_efficiency",
            "layer_overhead_us",
            "gpus_per_node", "cpu_share")  # fmt: skip
_EXAMPLE = "write keys as in docs/plan-search.md, e.g. memory_gib: 80"


def hardware_named(name: str, world_size: int = 1) -> Hardware:
    """A profile by name; `cpu` is measured now for `world_size` ranks on this machine."""
    if name == "cpu":
        return measure_cpu(world_size)
    if name not in PROFILES:
        raise ConfigError(
            f"unknown hardware {name!r}; use one of {', '.join(KNOWN)}, or --hardware-file"
        )
    return PROFILES[name]


def hardware_file(path: str | Path) -> Hardware:
    """A profile from a YAML or JSON file with the dataclass's keys (`name` optional)."""
    where = f"--hardware-file {path}"
    try:
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{where}: cannot read it as YAML/JSON ({first}); {_EXAMPLE}") from e
    keys = {f.name for f in fields(Hardware)}
    needed = keys - {"name", "source", *OPTIONAL}
    if not isinstance(data, dict) or needed - data.keys() or data.keys() - keys:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(
            f"{where}: needs keys {', '.join(sorted(needed))} (optional: name, "
            f"{', '.join(OPTIONAL)}), got {got}"
        )
    for key, value in data.items():
        values = value.values() if key == "peak_tflops" and isinstance(value, dict) else [value]
        if key == "name" or (key == "peak_tflops" and not isinstance(value, dict)):
            ok = key == "name"
        else:
            ok = all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0
                     for v in values)  # fmt: skip
        if ok and key.endswith("efficiency") and value > 1:
            raise ConfigError(
                f"{where}: {key} is {value!r}; it is a fraction (of the peak or of "
                "memory_gbps), 0-1"
            )
        if not ok:
            raise ConfigError(
                f"{where}: {key} is {value!r}; it must be a positive number"
                + (" per dtype, e.g. {bfloat16: 989, float32: 67}" if key == "peak_tflops" else "")
            )
    return Hardware(**({"name": Path(path).stem} | data))


# ------------------------------------------------------------------------- cpu, measured


def _best(fn, repeats: int = 5) -> float:
    """The least time of `repeats` runs on one thread: a shared machine's other jobs only add."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return min(fn() for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)


def _matmul_flops(n: int = 256, count: int = 20) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)

    def once():
        start = time.perf_counter()
        for _ in range(count):
            a @ b
        return time.perf_counter() - start

    return 2 * n**3 * count / _best(once)


def _mlp_flops(tokens: int = 256, h: int = 256, f: int = 688, count: int = 5) -> float:
    """FLOP/s of an MLP-shaped forward and backward (what a layer's matmuls achieve with their
    elementwise work and autograd around them)."""
    import torch

    x = torch.randn(tokens, h)
    w1 = torch.randn(h, f, requires_grad=True)
    w2 = torch.randn(f, h, requires_grad=True)

    def once():
        start = time.perf_counter()
        for _ in range(count):
            torch.nn.functional.silu(x @ w1).matmul(w2).sum().backward()
        return time.perf_counter() - start

    return 3 * 2 * 2 * tokens * h * f * count / _best(once)


def _op_seconds(count: int = 2000) -> float:
    """Dispatch cost of one small autograd op, forward and backward."""
    import torch

    x = torch.randn(4, 8, requires_grad=True)

    def once():
        start = time.perf_counter()
        for _ in range(count // 4):
            (x * 2 + 1).relu().sum().backward()
        return time.perf_counter() - start

    return _best(once) / count


def _memory_gbps() -> float:
    import torch

    a = torch.empty(2**23)  # 32 MiB
    b = torch.empty_like(a)

    def once():
        start = time.perf_counter()
        for _ in range(5):
            b.copy_(a)
        return time.perf_counter() - start

    return 5 * 2 * a.numel() * 4 / _best(once) / 1e9


def _gloo_rank(rank: int, n: int, store: str, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, n), rank=rank, world_size=n,
                            timeout=timedelta(seconds=60))  # fmt: skip
    small, big = torch.zeros(1), torch.zeros(2**20)  # 4 MiB
    dist.all_reduce(big)
    lat = per = float("inf")
    for _ in range(5):  # the best of 5: other jobs only add
        t = time.perf_counter()
        for _ in range(10):
            dist.all_reduce(small)
        lat = min(lat, (time.perf_counter() - t) / 10)
        t = time.perf_counter()
        dist.all_reduce(big)
        per = min(per, time.perf_counter() - t)
    per -= lat
    # a collective between bursts of compute, as in a step: with more processes than cores, it
    # waits for the peers the scheduler has parked; that wait counts as its latency
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    times = []
    for sync in (False, True, False, True):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(20):
            for _ in range(10):
                a @ b
            if sync:
                dist.all_reduce(small)
        times.append(time.perf_counter() - t)
    loaded = max(lat, (times[1] + times[3] - times[0] - times[2]) / 40)
    if rank == 0:  # a ring all-reduce: each rank sends 2(n-1)/n of the payload
        q.put((loaded, 2 * (n - 1) / n * big.numel() * 4 / max(per, 1e-9)))
    dist.destroy_process_group()


def _gloo(n: int) -> tuple[float, float]:
    """(latency s, bytes/s one rank sends) of an `n`-process gloo all-reduce: as many processes
    as the run will have, so a machine with fewer cores than ranks shows what that costs."""
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_gloo_rank, args=(r, n, f"{tmp}/store", q)) for r in range(n)]
        for p in procs:
            p.start()
        lat, bw = q.get(timeout=120)
        for p in procs:
            p.join(30)
    return lat, bw


def measure_cpu(world_size: int) -> Hardware:
    """This machine, now: ranks run one thread each and share its cores."""
    lat, bw = _gloo(max(2, min(world_size, 16)))
    flops = _matmul_flops()
    efficiency = min(1.0, _mlp_flops() / flops)
    cores = os.cpu_count() or 1
    ops_per_layer = 40  # a Llama layer's autograd ops, forward and backward (order of magnitude)
    return Hardware(
        "cpu", peak_tflops={"float32": flops / 1e12}, memory_gib=os.sysconf("SC_PHYS_PAGES")
        * os.sysconf("SC_PAGE_SIZE") / 2**30 / max(1, world_size), memory_gbps=_memory_gbps(), intra_node_gbps=bw / 1e9,
        inter_node_gbps=bw / 1e9, latency_us=lat * 1e6, efficiency=efficiency,
        attention_efficiency=efficiency,
        layer_overhead_us=ops_per_layer * _op_seconds() * 1e6, gpus_per_node=world_size,
        cpu_share=min(1.0, cores / max(1, world_size)),
        source=f"measured: 1-thread fp32 matmul 256^3, MLP fwd+bwd, gloo all-reduce 4 MiB / 4 B, {cores} cores",
    )  # fmt: skip
