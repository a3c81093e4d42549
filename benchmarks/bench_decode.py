"""Time per decode step of one ModelRunner, against the memory-bandwidth roofline measured in the same run.

For each batch size, `bs` requests with `--context-len` tokens of KV each decode one token per step, over
and over (the same step repeated: same positions, same slots, so every step reads the same bytes). Two
times per batch size:

  step_ms   the engine's whole decode step as the scheduler runs it: ForwardBatch from host lists,
            ModelRunner.run_batch (CUDA-graph replay or eager forward, logits, greedy sampling) and the
            host read-back of the tokens; wall clock, median over --steps steps
  gpu_ms    the device time of the same step without host work between steps (CUDA events around
            --steps back-to-back steps, no read-back)

--engine-tpot adds what a client sees, measured the way the vLLM peer benchmark measures vLLM:
an Engine (scheduler, overlap scheduling, CUDA graphs) generates for one fresh prompt of --tpot-input-len
random tokens, once 1 token and once --tpot-output-len tokens; time per output token = (t[out] - t[1]) /
(out - 1), median of --tpot-trials; its roofline uses the mean context, input + output / 2.

Roofline: a decode step must read every matmul weight once plus each request's KV cache:
    bytes = (layer matmul params + lm_head params) * dtype size + bs * context_len * KV bytes per token
    roofline_ms = bytes / copy bandwidth, the bandwidth of a 4 GiB device-to-device copy (bytes read +
    written) measured first, in this process; fraction = roofline_ms / step_ms.
Weights are dummy (random, real shapes) from a config.json (--config); KV is random.

  python benchmarks/bench_decode.py --config benchmarks/configs/llama-3.1-8b.json \\
      --batch-sizes 1 8 32 128 256 --context-len 256
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offline import result_path  # noqa: E402
from engine.config import EngineConfig  # noqa: E402

ENGINE_DEFAULTS = EngineConfig()
"""The engine's option defaults: a flag left unset measures the engine as users run it."""


def device_time_ms(fn: Callable[[], object], iters: int, warmup: int, device) -> float:
    """Device time of one `fn()` in ms: `warmup` calls, then CUDA events around `iters` back-to-back calls
    (when the host enqueues slower than the device runs, this is the host's time)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / iters


def copy_bandwidth(device, nbytes: int = 4 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = device_time_ms(functools.partial(dst.copy_, src), iters, 3, device) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def model_bytes(cfg: Dict, dtype_bytes: int) -> Dict[str, int]:
    """Matmul weight bytes a decode step reads (all layers + lm_head) and KV bytes per token."""
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    hq = cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads", hq)
    d = cfg.get("head_dim") or h // hq
    per_layer = h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * cfg["intermediate_size"]
    return {
        "weight_bytes": (L * per_layer + cfg["vocab_size"] * h) * dtype_bytes,
        "kv_bytes_per_token": 2 * L * hkv * d * dtype_bytes,
    }


class DecodeBench:
    """A ModelRunner with `max_bs` requests of `context_len` cached tokens (random KV)."""

    def __init__(
        self,
        model_dir: str,
        max_bs: int,
        context_len: int,
        backend: str,
        disable_cuda_graph: bool,
        dtype: str,
        **options,
    ):
        import torch

        from engine.config import EngineConfig
        from engine.models.source import resolve_model
        from engine.runner.model_runner import ModelRunner

        self.context_len = context_len
        config = EngineConfig(
            model=model_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=dtype,
            max_running_requests=max_bs,
            max_total_tokens=max_bs * (context_len + 1) + 64,
            attention_backend=backend,
            disable_cuda_graph=disable_cuda_graph,
            context_length=max(context_len + 64, 2048),
            **options,
        )
        self.runner = runner = ModelRunner(config, resolve_model(model_dir))
        self.device = runner.device
        self.rows, self.slots = [], []
        for _ in range(max_bs):
            row = runner.req_to_token_pool.alloc()
            slots = runner.allocator.alloc_pages(context_len + 1)  # page size 1: page ids are slots
            runner.req_to_token_pool.write(row, 0, slots)
            self.rows.append(row)
            self.slots.append(slots)
        gen = torch.Generator(device=self.device).manual_seed(0)
        for buf in runner.kv_pool.k_buffers + runner.kv_pool.v_buffers:
            buf.normal_(0.0, 1.0, generator=gen)
        self.vocab = runner.vocab_size

    def step_fn(self, bs: int):
        """A closure running one decode step of the first `bs` requests; returns host token ids."""
        import torch

        from engine.forward_batch import ForwardBatch, ForwardMode

        ctx = self.context_len
        runner = self.runner
        gen = torch.Generator().manual_seed(bs)
        input_ids = torch.randint(100, self.vocab, (bs,), generator=gen).tolist()
        out_loc = torch.stack([s[ctx] for s in self.slots[:bs]])

        class _Req:  # what run_batch reads of a request when sampling greedily
            def __init__(self):
                from engine.sampling_params import SamplingParams

                self.sampling_params = SamplingParams(temperature=0.0, max_new_tokens=1 << 20, ignore_eos=True)
                self.seed, self.output_ids, self.origin_input_ids, self.grammar = 0, [], [], None

        reqs = [_Req() for _ in range(bs)]

        class _Batch:
            def __init__(self):
                self.forward_batch = ForwardBatch.build(
                    ForwardMode.DECODE,
                    input_ids,
                    [ctx] * bs,
                    out_loc,
                    self_rows[:bs],
                    [ctx + 1] * bs,
                    [ctx] * bs,
                    runner.device,
                )
                self.sampled_reqs = reqs
                self.reqs = reqs

        self_rows = self.rows

        def step():
            return runner.run_batch(_Batch()).next_token_ids

        return step

    def gpu_time_ms(self, bs: int, steps: int) -> float:
        """Device time of one step (forward + logits + argmax), back-to-back steps timed with CUDA events."""
        import torch

        from engine.forward_batch import ForwardBatch, ForwardMode

        ctx, runner = self.context_len, self.runner
        fb = ForwardBatch.build(
            ForwardMode.DECODE,
            [1000] * bs,
            [ctx] * bs,
            torch.stack([s[ctx] for s in self.slots[:bs]]),
            self.rows[:bs],
            [ctx + 1] * bs,
            [ctx] * bs,
            runner.device,
        )
        fb.attn_backend = runner.backend_for(fb)

        def once():
            if runner.graph_runner is not None and runner.graph_runner.can_run(fb):
                logits = runner.graph_runner.replay(fb)
            else:
                logits = runner.model.compute_logits(runner.forward_hidden(fb))
            return logits.argmax(dim=-1)

        with torch.inference_mode():
            return device_time_ms(once, steps, 3, self.device)


def engine_tpot(model_dir: str, args, options: Dict) -> Dict:
    """Batch-1 time per output token of a whole Engine, as peer_vllm_bench measures vLLM's (see the docstring)."""
    import random

    from engine import Engine

    n_in, n_out = args.tpot_input_len, args.tpot_output_len
    rng = random.Random(0)
    kwargs = dict(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph,
        max_running_requests=8,
        max_total_tokens=16384,
        context_length=2048,
        **options,
    )
    with Engine(**kwargs) as engine:
        vocab = engine.runner.vocab_size

        def timed(max_new: int) -> float:
            prompt = [rng.randrange(100, vocab) for _ in range(n_in)]  # fresh: no prefix-cache hit
            start = time.perf_counter()
            out = engine.generate(prompt, dict(temperature=0.0, max_new_tokens=max_new, ignore_eos=True))
            elapsed = time.perf_counter() - start
            assert out.completion_tokens == max_new
            return elapsed

        timed(n_out)  # warm-up
        first = statistics.median(timed(1) for _ in range(args.tpot_trials))
        full = statistics.median(timed(n_out) for _ in range(args.tpot_trials))
        backend = engine.runner.attn_backend_name
    return dict(
        input_len=n_in,
        output_len=n_out,
        trials=args.tpot_trials,
        first_token_s=first,
        total_s=full,
        tpot_ms=(full - first) / (n_out - 1) * 1e3,
        attention_backend=backend,
    )


def profile(bench: DecodeBench, bs: int, steps: int = 20) -> None:
    """torch.profiler over `steps` engine decode steps: GPU kernel time by kernel, and the host calls."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step = bench.step_fn(bs)
    with torch.inference_mode():
        for _ in range(3):
            step()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
    graphs = bench.runner.graph_runner
    if graphs is not None and graphs.can_run_bs(bs):
        # host time of the replay's parts (no sync): attention planning, graph launch
        fb = graphs.batches[graphs.padded_size(bs)]
        times = {"init_forward_metadata_replay": [], "graph_launch": []}
        for _ in range(20) if torch.is_inference_mode_enabled() else ():
            t0 = time.perf_counter()
            fb.attn_backend.init_forward_metadata_replay(fb)
            t1 = time.perf_counter()
            graphs.graphs[graphs.padded_size(bs)].replay()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            times["init_forward_metadata_replay"].append((t1 - t0) * 1e6)
            times["graph_launch"].append((t2 - t1) * 1e6)
        print(
            "host time per decode step (median us): "
            + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in times.items())
        )
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    print(f"\nprofile of {steps} decode steps at batch size {bs} (by GPU time):\n{table}")
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)
    print(f"\nprofile of {steps} decode steps at batch size {bs} (by host time):\n{table}")


PRODUCTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
"""The decode step's products by the name of their Linear (lm_head: the logits, tied or not)."""


def override_gemv_products(products: List[str]) -> Dict[str, int]:
    """Keep the named products (PRODUCTS) on the GEMV kernels at one row only: their products of 2..gemv_max_rows
    rows go to cuBLAS (cuBLASLt up to cublaslt_max_rows), the rest of the step as the engine runs it. Patches
    the runner's `set_gemv`, so it must run before the engine is built (it captures its CUDA graphs then).
    Returns the number of modules changed per product, filled in when the engine is built."""
    import engine.runner.model_runner as runner_module

    unknown = sorted(set(products) - set(PRODUCTS))
    if unknown:
        raise ValueError(f"--cublas-products: unknown {unknown}; choose from {list(PRODUCTS)}")
    changed = {name: 0 for name in products}
    set_gemv = runner_module.set_gemv

    def patched(model, max_rows: int) -> None:
        set_gemv(model, max_rows)
        for qualified, module in model.named_modules():
            name = "lm_head" if qualified == "" else qualified.rsplit(".", 1)[-1]  # the root's gemv_rows: logits
            if name in changed and hasattr(module, "gemv_rows"):
                module.gemv_rows = min(module.gemv_rows, 1)
                changed[name] += 1

    runner_module.set_gemv = patched
    return changed


def override_rows_tiles(
    prefetch: Optional[int], sweep_paths: Optional[List[str]], prefetch_shapes: Optional[List[str]] = None
) -> Dict[str, Dict]:
    """Make kernels.triton.gemv pick other tiles for the rows kernel (2..MAX_ROWS rows), to time candidates in
    whole decode steps: each shape that a `bench_gemv.py --sweep` JSON of `sweep_paths` timed takes that
    sweep's fastest tile with PDL on; then, with `prefetch`, every tile (of the "NxK" weights in
    `prefetch_shapes` if given) loads that many weight tiles ahead.
    Must run before the engine captures its CUDA graphs. Returns the tiles taken by (N, K)."""
    from kernels.triton import gemv as gemv_module

    swept: Dict[tuple, object] = {}
    for path in sweep_paths or []:
        with open(path) as f:
            data = json.load(f)
        for row in data["results"]:
            grid = [g for g in data.get("sweeps", {}).get(f"{row['name']}_m{row['m']}", []) if g.get("pdl", True)]
            if row["m"] > 1 and grid:
                best = min(grid, key=lambda g: g["us"])
                fields = {name: best[name] for name in gemv_module.RowsConfig._fields if name in best}
                swept[(row["n"], row["k"])] = gemv_module.RowsConfig(**fields)
    default = gemv_module.pick_rows_config
    taken: Dict[str, Dict] = {}

    def pick(n: int, k: int, dtype):
        config = swept.get((n, k)) or default(n, k, dtype)
        if prefetch is not None and (prefetch_shapes is None or f"{n}x{k}" in prefetch_shapes):
            config = config._replace(prefetch=prefetch)
        taken[f"{n}x{k}"] = config._asdict()
        return config

    gemv_module.pick_rows_config = pick
    return taken


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "llama-3.1-8b.json")
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    p.add_argument(
        "--context-len",
        type=int,
        default=256,
        help="KV tokens per request (256: the mean context of vLLM's batch-1 run, 128 in + 256 out)",
    )
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--disable-gemv", action="store_true", help="EngineConfig.disable_gemv: cuBLAS for every matmul")
    p.add_argument(
        "--gemv-max-rows",
        type=int,
        default=ENGINE_DEFAULTS.gemv_max_rows,
        help="EngineConfig.gemv_max_rows (default: the engine's): 1 = GEMV kernel for batch 1 only",
    )
    p.add_argument(
        "--cublaslt-max-rows",
        type=int,
        default=ENGINE_DEFAULTS.cublaslt_max_rows,
        help="EngineConfig.cublaslt_max_rows (default: the engine's): 0 = torch's default BLAS path for every GEMM",
    )
    p.add_argument(
        "--triton-decode-max-bs",
        type=int,
        default=ENGINE_DEFAULTS.triton_decode_max_bs,
        help="EngineConfig.triton_decode_max_bs (default: the engine's): with FlashInfer, Triton decode attention "
        "up to this batch (0: never)",
    )
    p.add_argument(
        "--disable-pdl", action="store_true", help="EngineConfig.disable_pdl: no programmatic dependent launch"
    )
    p.add_argument(
        "--gemv-rows-prefetch",
        type=int,
        choices=(1, 2),
        default=None,
        help="the GEMV rows kernel loads this many weight tiles ahead in every tile (default: each tile's own)",
    )
    p.add_argument(
        "--gemv-rows-prefetch-shapes",
        nargs="+",
        default=None,
        help='with --gemv-rows-prefetch: only these weights, as "NxK" (e.g. 6144x4096 for qkv); default all',
    )
    p.add_argument(
        "--gemv-tiles",
        nargs="+",
        default=None,
        help="bench_gemv.py --sweep JSONs: the rows kernel takes each swept shape's fastest tile (PDL on)",
    )
    p.add_argument(
        "--cublas-products",
        nargs="+",
        default=None,
        metavar="PRODUCT",
        help=f"these products ({' '.join(PRODUCTS)}) keep the GEMV kernels at one row only; from 2 rows cuBLAS "
        "runs them (to time a per-product choice in whole decode steps)",
    )
    p.add_argument(
        "--engine-tpot",
        action="store_true",
        help="also measure an Engine's batch-1 time per output token (as the vLLM peer measures it)",
    )
    p.add_argument("--tpot-input-len", type=int, default=128)
    p.add_argument("--tpot-output-len", type=int, default=256)
    p.add_argument("--tpot-trials", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/decode_<model>_<gpu>.json)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print the top GPU kernels and host time of one step at the smallest batch size",
    )
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_decode needs a CUDA device")
    from bench_offline import hardware

    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    rows_tiles = None
    if args.gemv_rows_prefetch is not None or args.gemv_tiles:
        rows_tiles = override_rows_tiles(args.gemv_rows_prefetch, args.gemv_tiles, args.gemv_rows_prefetch_shapes)
    cublas_products = override_gemv_products(args.cublas_products) if args.cublas_products else None
    with open(args.config) as f:
        cfg = json.load(f)
    folder = tempfile.mkdtemp(prefix="bench-decode-")
    shutil.copy(args.config, os.path.join(folder, "config.json"))
    dtype_bytes = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    sizes = model_bytes(cfg, dtype_bytes)
    options = dict(
        disable_gemv=args.disable_gemv,
        gemv_max_rows=args.gemv_max_rows,
        cublaslt_max_rows=args.cublaslt_max_rows,
        disable_pdl=args.disable_pdl,
        triton_decode_max_bs=args.triton_decode_max_bs,
    )
    start = time.perf_counter()
    bench = DecodeBench(
        folder,
        max(args.batch_sizes),
        args.context_len,
        args.attention_backend,
        args.disable_cuda_graph,
        args.dtype,
        **options,
    )
    startup = time.perf_counter() - start
    rows: List[Dict] = []
    with torch.inference_mode():
        for bs in args.batch_sizes:
            step = bench.step_fn(bs)
            for _ in range(5):
                step()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e3)
            step_ms = statistics.median(times)
            gpu_ms = bench.gpu_time_ms(bs, args.steps)
            nbytes = sizes["weight_bytes"] + bs * args.context_len * sizes["kv_bytes_per_token"]
            roof_ms = nbytes / bandwidth * 1e3
            rows.append(
                dict(
                    batch_size=bs,
                    step_ms=step_ms,
                    gpu_ms=gpu_ms,
                    bytes_per_step=nbytes,
                    roofline_ms=roof_ms,
                    fraction_of_roofline=roof_ms / step_ms,
                    gpu_fraction_of_roofline=roof_ms / gpu_ms,
                    tokens_per_s=bs / step_ms * 1e3,
                    pdl=not args.disable_pdl and bench.runner.decode_uses_pdl(bs),
                )
            )
    if args.profile:
        with torch.inference_mode():
            profile(bench, min(args.batch_sizes))
    hw = hardware()
    runner = bench.runner
    backend_name, graphs_on = runner.attn_backend_name, runner.graph_runner is not None
    tpot = None
    if args.engine_tpot:
        import gc

        del bench, runner  # free the bench runner's weights and pool before the engine loads its own
        gc.collect()
        torch.cuda.empty_cache()
        tpot = engine_tpot(folder, args, options)
        avg_ctx = tpot["input_len"] + tpot["output_len"] / 2
        tpot["bytes_per_step"] = sizes["weight_bytes"] + avg_ctx * sizes["kv_bytes_per_token"]
        tpot["roofline_ms"] = tpot["bytes_per_step"] / bandwidth * 1e3
        tpot["fraction_of_roofline"] = tpot["roofline_ms"] / tpot["tpot_ms"]
    print(
        f"\ndecode, {os.path.basename(args.config)} dummy {args.dtype}, context {args.context_len}; "
        f"{hw.get('gpu')}; attention {backend_name} (Triton decode up to batch {args.triton_decode_max_bs}), "
        f"CUDA graphs {'on' if graphs_on else 'off'}, GEMV "
        f"{'off' if args.disable_gemv else f'up to {args.gemv_max_rows} rows'}, "
        f"PDL {'off' if args.disable_pdl else 'in the steps of the GEMV kernels (column pdl)'}; copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s"
    )
    if rows_tiles is not None:
        print(f"rows kernel tiles (--gemv-rows-prefetch / --gemv-tiles): {rows_tiles}")
    if cublas_products is not None:
        print(f"cuBLAS from 2 rows (--cublas-products), modules changed: {cublas_products}")
    cols = [
        "batch_size",
        "step_ms",
        "gpu_ms",
        "roofline_ms",
        "fraction_of_roofline",
        "gpu_fraction_of_roofline",
        "tokens_per_s",
        "pdl",
    ]
    print("".join(f"{c:>26}" for c in cols))
    for r in rows:
        print("".join(f"{r[c]:>26.3f}" if isinstance(r[c], float) else f"{r[c]:>26}" for c in cols))
    if tpot is not None:
        print(
            f"engine, batch 1, {tpot['input_len']} in + {tpot['output_len']} out: time per output token "
            f"{tpot['tpot_ms']:.3f} ms = {tpot['fraction_of_roofline']:.1%} of the roofline "
            f"({tpot['roofline_ms']:.3f} ms); first token {tpot['first_token_s'] * 1e3:.1f} ms"
        )
    model = os.path.splitext(os.path.basename(args.config))[0]
    out = result_path(args.out, f"decode_{model}", hw)
    with open(out, "w") as f:
        json.dump(
            dict(
                benchmark="bench_decode",
                args=vars(args),
                hardware=hw,
                model=model,
                **sizes,
                copy_gb_per_s=bandwidth / 1e9,
                attention_backend=backend_name,
                triton_decode_max_bs=args.triton_decode_max_bs,
                cuda_graphs=graphs_on,
                gemv=not args.disable_gemv,
                gemv_max_rows=0 if args.disable_gemv else args.gemv_max_rows,
                cublaslt_max_rows=args.cublaslt_max_rows,
                pdl=not args.disable_pdl,
                gemv_rows_tiles=rows_tiles,
                cublas_products=cublas_products,
                startup_s=startup,
                results=rows,
                engine_tpot=tpot,
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            ),
            f,
            indent=2,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
