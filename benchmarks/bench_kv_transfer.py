"""KV page transfer bandwidth per backend (cluster/kv_transfer), with the raw copy as the roofline.

Two Ray actors, a sender (prefill) and a receiver (decode), each own the engine's KVPool shaped
like a real model's: --num-layers layers × K and V × --num-kv-heads × --head-dim --dtype elements
per token, --page-size tokens per page. The pool is token-major (engine/memory/kv_pool.py), so a
page is one contiguous range across all layers and a run of consecutive pages is one region.
The default is Llama-3.1-8B's shape (32 layers, 8 KV heads × 128, bfloat16: 128 KiB per token)
with the engine's page size 1. Each transfer moves SIZE MiB: the src pages lie in runs of
RUN pages (each of --run-pages) at random places of the sender's pool (a radix cache holding
pieces of other prompts), the dst pages are one block (a fresh allocation), so it is one region
per run.

Timing is the sender's: write(src_ready=True, as a prefill replica calls it; --stream-event for the
CUDA-event wait) until its handle is DONE, busy-polled (no event-loop sleeps),
--repeats times after --warmup untimed transfers; the receiver awaits its expects as a replica
would (KVTransferBackend.wait: asyncio, polls backing off to 0.2 ms). For NIXL, a ceiling row too:
NIXL's own call sequence with nothing of ours around it (one region, handle prepared once, re-posted).
The first transfer of each backend (connection or communicator set-up) is reported alone.
The roofline, measured in the same run by the driver: a GPU0 → GPU1 torch copy of SIZE bytes
(CUDA), or a torch copy between two host tensors (CPU). Data is checked after each size.

  python benchmarks/bench_kv_transfer.py                      # GPU: nixl and nccl (needs 2 GPUs)
  python benchmarks/bench_kv_transfer.py --sizes 1,4,16 --repeats 5   # CPU: nixl over host memory

Writes benchmarks/results/kv_transfer_<hardware>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offline import result_path  # noqa: E402

MiB = 1 << 20


class Side:
    """One replica's KV pool and transfer backend (runs as a Ray actor)."""

    def __init__(self, backend: str, name: str, num_pages: int, args: Dict, device: str):
        import torch

        from cluster.kv_transfer import kv_pool_buffers, make_backend
        from engine.memory.kv_pool import KVPool

        if device == "cuda":
            torch.cuda.set_device(0)
        dtype = getattr(torch, args["dtype"])
        self.pool = KVPool(
            num_pages * args["page_size"],
            args["num_layers"],
            args["num_kv_heads"],
            args["head_dim"],
            dtype,
            torch.device(device),
        )
        self.buffers = kv_pool_buffers(self.pool)
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        for buf in self.buffers:
            buf.copy_(torch.rand(buf.shape, generator=gen, device=device, dtype=torch.float32).to(dtype))
        self.page_size = args["page_size"]
        self.backend = make_backend(backend, name, self.buffers, args["page_size"])

    def info(self):
        return self.backend.info()

    def connect(self, info) -> None:
        self.backend.connect(info)

    def _busy_wait(self, handles, timeout_s: float) -> None:
        from cluster.kv_transfer import KVTransferError, KVTransferTimeout, TransferStatus

        deadline = time.monotonic() + timeout_s
        try:
            pending = list(handles)
            while pending:
                for h in list(pending):
                    status = self.backend.poll(h)
                    if status is TransferStatus.FAILED:
                        raise KVTransferError(f"{h.transfer_id}: {h.error}")
                    if status is TransferStatus.DONE:
                        pending.remove(h)
                os.sched_yield()  # let NIXL's progress thread run (it moves the bytes on host memory)
                if time.monotonic() > deadline:
                    raise KVTransferTimeout(f"{len(pending)} transfers not done after {timeout_s} s")
        finally:
            for h in handles:
                self.backend.release(h)

    def write_timed(
        self, peer: str, src: List[int], dst: List[int], tids: List[str], timeout_s: float, src_ready: bool
    ) -> List[float]:
        """Seconds from write() to DONE for each transfer id, one after the other. The page ids become
        int64 arrays first, as a replica holds them (engine.scheduler.handoff)."""
        import numpy as np

        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        times = []
        for tid in tids:
            t0 = time.perf_counter()
            self._busy_wait([self.backend.write(peer, src, dst, tid, src_ready=src_ready)], timeout_s)
            times.append(time.perf_counter() - t0)
        return times

    def receive(self, peer: str, dst: List[int], tids: List[str], timeout_s: float) -> int:
        """Expect every transfer id and await them as a replica would (asyncio, backing-off polls)."""
        import asyncio

        import numpy as np

        dst = np.asarray(dst, dtype=np.int64)
        handles = [self.backend.expect(peer, dst, tid) for tid in tids]

        async def wait_all():
            await asyncio.gather(*(self.backend.wait(h, timeout_s) for h in handles))

        asyncio.run(wait_all())
        return len(tids)

    def raw_nixl_timed(
        self, peer: str, remote_addr: int, remote_device: str, num_pages: int, count: int
    ) -> List[float]:
        """NIXL's own call sequence with nothing of radixserve's around it, the ceiling of the nixl rows:
        pages [1, 1 + num_pages) of this pool into the same pages of the peer's, as ONE region, the
        transfer handle initialized once and re-posted, no notification. Seconds from transfer() to DONE."""
        import numpy as np
        import torch

        agent, buf = self.backend.agent, self.buffers[0]
        page_bytes = self.backend.layout.page_bytes
        mem = "DRAM" if buf.device.type == "cpu" else "VRAM"

        def region(addr: int, device: str) -> Any:
            row = [[addr + page_bytes, num_pages * page_bytes, torch.device(device).index or 0]]
            return agent.get_xfer_descs(np.array(row, dtype=np.int64), mem)

        xfer = agent.initialize_xfer(
            "WRITE", region(buf.data_ptr(), str(buf.device)), region(remote_addr, remote_device), peer, b""
        )
        times = []
        try:
            for _ in range(count):
                t0 = time.perf_counter()
                state = agent.transfer(xfer)
                while state not in ("DONE", "ERR"):
                    state = agent.check_xfer_state(xfer)
                if state == "ERR":
                    raise RuntimeError("NIXL reported an error on the raw WRITE")
                times.append(time.perf_counter() - t0)
        finally:
            agent.release_xfer_handle(xfer)
        return times

    def page_sums(self, pages: List[int]) -> List[float]:
        """Per buffer, the float64 sum of the given pages (a data check across processes)."""
        return [float(b.view(-1, self.page_size, *b.shape[1:])[pages].double().sum()) for b in self.buffers]

    def close(self) -> None:
        self.backend.close()


def roofline(nbytes: int, cuda: bool, repeats: int) -> List[float]:
    """Seconds per copy of `nbytes` GPU0 → GPU1 (CUDA) or host → host."""
    import torch

    if cuda:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    else:
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    times = []
    for i in range(repeats + 2):
        if cuda:
            torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize(1), torch.cuda.synchronize(0)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def page_lists(num_pages: int, run_pages: int, sender_pages: int, seed: int):
    """src: runs of run_pages at random non-overlapping places in [1, sender_pages); dst: 1..num_pages."""
    import numpy as np

    rng = np.random.default_rng(seed)
    slots = (sender_pages - 1) // run_pages
    runs = -(-num_pages // run_pages)
    starts = 1 + rng.choice(slots, size=runs, replace=False) * run_pages
    src = np.concatenate([np.arange(s, s + run_pages) for s in starts])[:num_pages]
    return [int(p) for p in src], list(range(1, num_pages + 1))


def stats(times: List[float], nbytes: int) -> Dict[str, float]:
    best, median = min(times), statistics.median(times)
    return {
        "best_ms": best * 1e3,
        "median_ms": median * 1e3,
        "best_gib_s": nbytes / best / 2**30,
        "median_gib_s": nbytes / median / 2**30,
    }


def bench_backend(name: str, args, cuda: bool, sizes: List[int], run_lengths: List[int], page_mib: float) -> Dict:
    import numpy as np
    import ray

    from cluster.kv_transfer import page_runs

    max_pages = max(sizes) * MiB // int(page_mib * MiB)
    sender_pages = 2 * max_pages + max(run_lengths) + 1
    opts = dict(num_cpus=0, num_gpus=1 if cuda else 0)
    actor = ray.remote(Side)
    shape = dict(
        dtype=args.dtype,
        page_size=args.page_size,
        num_layers=args.num_layers,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
    )
    device = "cuda" if cuda else "cpu"
    sender = actor.options(**opts).remote(name, f"bench-prefill-{name}", sender_pages, shape, device)
    receiver = actor.options(**opts).remote(name, f"bench-decode-{name}", max_pages + 1, shape, device)
    s_info, r_info = ray.get([sender.info.remote(), receiver.info.remote()])
    ray.get([sender.connect.remote(r_info), receiver.connect.remote(s_info)])
    rows, first_ms = [], None
    try:
        for size, run_pages in ((size, run) for size in sizes for run in run_lengths):
            n = size * MiB // int(page_mib * MiB)
            src, dst = page_lists(n, run_pages, sender_pages, args.seed + size)
            count = (1 if first_ms is None else 0) + args.warmup + args.repeats
            tids = [f"{size}-{run_pages}-{i}" for i in range(count)]
            received = receiver.receive.remote(f"bench-prefill-{name}", dst, tids, args.timeout)
            times = ray.get(
                sender.write_timed.remote(f"bench-decode-{name}", src, dst, tids, args.timeout, not args.stream_event)
            )
            ray.get(received)
            if first_ms is None:
                first_ms, times = times[0] * 1e3, times[1:]
            s_sums, r_sums = ray.get([sender.page_sums.remote(src), receiver.page_sums.remote(dst)])
            if s_sums != r_sums:
                raise SystemExit(f"{name} {size} MiB: data on the receiver differs from the sender's")
            regions = len(page_runs(np.array(src), np.array(dst)))  # one buffer: one region per run
            rows.append(
                dict(
                    size_mib=size,
                    run_pages=run_pages,
                    pages=n,
                    regions=regions,
                    **stats(times[args.warmup :], size * MiB),
                )
            )
        raw = []
        if name == "nixl":
            for size in sizes:
                n = size * MiB // int(page_mib * MiB)
                times = ray.get(
                    sender.raw_nixl_timed.remote(
                        r_info.name, r_info.buffer_addrs[0], r_info.layout.device, n, args.warmup + args.repeats
                    )
                )
                raw.append(
                    dict(size_mib=size, run_pages="-", pages=n, regions=1, **stats(times[args.warmup :], size * MiB))
                )
    finally:
        ray.get([sender.close.remote(), receiver.close.remote()])
        ray.kill(sender), ray.kill(receiver)
    return {"first_transfer_ms": first_ms, "sizes": rows, "raw_nixl": raw}


def hardware(cuda: bool) -> Dict[str, str]:
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": str(os.cpu_count())}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or "unknown"
    if cuda:
        info["gpu"] = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=None, help="comma-separated (default: nixl, plus nccl with 2 GPUs)")
    p.add_argument("--sizes", default="1,4,16,64,256", help="transfer sizes in MiB (whole pages)")
    p.add_argument("--repeats", type=int, default=20, help="timed transfers per size")
    p.add_argument("--warmup", type=int, default=3, help="untimed transfers per size")
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=1, help="tokens per page (the engine's default: 1)")
    p.add_argument(
        "--run-pages",
        default="8,64,4096",
        help="comma-separated: src pages lie in runs of this many pages (one case each)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a transfer counts as failed")
    p.add_argument(
        "--stream-event",
        action="store_true",
        help="write(src_ready=False): each write waits for a CUDA event on the current stream (a caller "
        "that cannot vouch that its src pages are computed); default: src_ready=True, as a "
        "prefill replica writes (its first token is on the host)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="host memory even where CUDA is available")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import ray
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit("the GPU benchmark needs 2 GPUs (GPU0 → GPU1); pass --cpu for host memory")
    backends = args.backends.split(",") if args.backends else (["nixl", "nccl"] if cuda else ["nixl"])
    sizes = [int(s) for s in args.sizes.split(",")]
    run_lengths = [int(r) for r in args.run_pages.split(",")]
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    page_mib = 2 * args.num_layers * args.page_size * args.num_kv_heads * args.head_dim * elem / MiB
    if any((size / page_mib) % 1 for size in sizes):
        raise SystemExit(f"a page is {page_mib:g} MiB: every size must be a whole number of pages")

    ray.init(include_dashboard=False, log_to_driver=True, configure_logging=False)
    hw = hardware(cuda)
    copy = {size: stats(roofline(size * MiB, cuda, args.repeats), size * MiB) for size in sizes}
    results = {name: bench_backend(name, args, cuda, sizes, run_lengths, page_mib) for name in backends}
    ray.shutdown()

    label = "GPU0->GPU1 torch copy" if cuda else "host torch copy"
    print(
        f"\n{hw.get('gpu', hw['cpu'])}; token-major KV pool, page {page_mib * 1024:g} KiB "
        f"({args.page_size} token(s) × {args.num_layers} layers × K,V); best / median of {args.repeats}"
    )
    print(
        f"{'backend':<24}{'MiB':>6}{'run':>6}{'regions':>9}{'best ms':>10}{'med ms':>10}{'best GiB/s':>12}"
        f"{'med GiB/s':>11}{'% roofline':>12}"
    )
    for size in sizes:
        c = copy[size]
        print(
            f"{label:<24}{size:>6}{'':>6}{'1':>9}{c['best_ms']:>10.3f}{c['median_ms']:>10.3f}"
            f"{c['best_gib_s']:>12.2f}{c['median_gib_s']:>11.2f}{100.0:>11.0f}%"
        )
        for name, res in results.items():
            rows = [(name, r) for r in res["sizes"] if r["size_mib"] == size]
            rows += [("nixl alone (ceiling)", r) for r in res["raw_nixl"] if r["size_mib"] == size]
            for label_r, r in rows:
                r["pct_of_roofline_best"] = 100 * r["best_gib_s"] / c["best_gib_s"]
                r["pct_of_roofline_median"] = 100 * r["median_gib_s"] / c["median_gib_s"]
                print(
                    f"{label_r:<24}{size:>6}{r['run_pages']:>6}{r['regions']:>9}{r['best_ms']:>10.3f}"
                    f"{r['median_ms']:>10.3f}{r['best_gib_s']:>12.2f}{r['median_gib_s']:>11.2f}"
                    f"{r['pct_of_roofline_best']:>11.0f}%"
                )
    for name, res in results.items():
        print(f"{name}: first transfer {res['first_transfer_ms']:.1f} ms (connection / communicator set-up)")

    out = result_path(args.out, "kv_transfer", hw)
    with open(out, "w") as f:
        json.dump(
            dict(
                benchmark="bench_kv_transfer",
                args=vars(args),
                hardware=hw,
                page_mib=page_mib,
                roofline={"what": label, "sizes": copy},
                backends=results,
                ucx_env={k: v for k, v in os.environ.items() if k.startswith("UCX_")}
                or ("UCX defaults" if cuda else "UCX_TLS=cma,tcp,self (NixlBackend's default for host memory)"),
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            ),
            f,
            indent=2,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
