"""All-reduce latency by size: NCCL against the peer-memory kernels (engine/parallel/allreduce.py).

One process per GPU (--world-size ranks). For each size (bf16 elements of a (rows, hidden) decode tensor),
each method runs --iters all-reduces captured in one CUDA graph (as decode steps run them: no launch cost
per call); the time per call is the graph's replay time / iters, median of --trials replays, rank 0's:

  nccl       dist.all_reduce
  one_shot   PeerAllReduce with the one-shot kernel (copying its input into the peer buffer itself)
  one_shot_staged  the same kernel after a separate copy kernel (torch without the copying variant)
  two_shot   PeerAllReduce with the two-shot kernel

  python benchmarks/bench_allreduce.py --world-size 2
Prints a table; writes JSON (default benchmarks/results/allreduce_tp<N>_<gpu>.json) naming the hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offline import hardware, result_path  # noqa: E402

SIZES_KB = [8, 32, 128, 256, 512, 1024, 2048, 4096, 8192]
METHODS = ("nccl", "one_shot", "one_shot_staged", "two_shot")


def _rank(rank: int, size: int, port: int, args: Dict, queue) -> None:
    import torch
    import torch.distributed as dist

    from engine.parallel import allreduce as ar

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size, device_id=device)
    group = dist.group.WORLD
    peer = ar.PeerAllReduce(group, device, torch.bfloat16)

    def method(name: str):
        if name == "nccl":
            return lambda x: dist.all_reduce(x, group=group)
        threshold = 0 if name == "two_shot" else ar.BUFFER_BYTES
        copy_in_kernel = peer.copy_in_kernel and name == "one_shot"

        def run(x):
            ar.ONE_SHOT_MAX_BYTES = threshold  # this process's choice of kernel (read at each call)
            peer.copy_in_kernel = copy_in_kernel
            return peer(x)

        return run

    rows: List[Dict] = []
    for kb in SIZES_KB:
        x = torch.randn(kb * 1024 // 2, dtype=torch.bfloat16, device=device)
        row: Dict = dict(kb=kb)
        for name in METHODS:
            if name != "nccl" and kb * 1024 > ar.BUFFER_BYTES:
                continue
            fn = method(name)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    fn(x)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args["iters"]):
                    fn(x)
            times = []
            for _ in range(args["trials"]):
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) / args["iters"] * 1e6)
            row[f"{name}_us"] = statistics.median(times)
            del graph
        rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world_size, args.port, vars(args), queue))
        for r in range(args.world_size)
    ]
    for proc in procs:
        proc.start()
    rows = queue.get()
    for proc in procs:
        proc.join()
    hw = hardware()
    print(f"\nall-reduce of bf16, {args.world_size} ranks, {hw.get('gpu')}: microseconds per call (CUDA graph)")
    print(f"{'KiB':>8}" + "".join(f"{m:>17}" for m in METHODS))
    for r in rows:
        cells = "".join(f"{r.get(f'{m}_us', float('nan')):>17.1f}" for m in METHODS)
        print(f"{r['kb']:>8}{cells}")
    out = result_path(args.out, f"allreduce_tp{args.world_size}", hw)
    with open(out, "w") as f:
        json.dump(dict(benchmark="bench_allreduce", args=vars(args), hardware=hw, rows=rows), f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
