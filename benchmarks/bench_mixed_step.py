"""Time of one prefill or mixed step of a ModelRunner, on the device and on the host, beside the decode step.

A server's steps are of three kinds: decode steps (every running request decodes one token; CUDA graphs),
prefill steps (prompt tokens only) and mixed steps (prompt tokens plus one decode token of each running
request, `enable_mixed_chunk`). Prefill and mixed steps run eagerly: the host launches every kernel of
every layer. This script measures, for each combination of --decodes D (requests with --context-len
cached tokens, one token each) and --prefill P (prompt tokens, cut into prompts of --prompt-len with no
cached prefix), one step of the engine's own code:

  gpu_ms    CUDA events around --steps back-to-back steps: the device time when the host keeps ahead;
            when the host is slower, the device waits and this is the host's time instead
  host_ms   the host's time to enqueue one step after the device is idle (attention plan, forward and
            logits launched, no wait): when host_ms >= the device time, the step is bound by the host
  wall_ms   the step as the scheduler runs it: ForwardBatch from host lists, the step, tokens on the host
  host_speed  the host CPU's speed before and after the row and the hypervisor's steal meanwhile
            (host_probe.py): a row measured while a virtual CPU ran slow shows it there

Prefill and mixed steps of up to --piecewise-cuda-graph-max-tokens replay piecewise CUDA graphs
(`enable_piecewise_cuda_graph`, the engine's default); --no-piecewise-cuda-graph measures them all eager.
--profile D:P prints where one step's time goes (kernels on the device, Python functions on the host).
P = 0 rows are the decode step the engine runs (a CUDA graph up to its largest captured batch): the
baseline each mixed row adds its prompt tokens to. Weights are dummy (random, real shapes) from a
config.json (--config); KV is random.

  python benchmarks/bench_mixed_step.py --decodes 0 64 256 --prefill 0 64 256 512 1024 2048 8192
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_probe  # noqa: E402
from bench_decode import ENGINE_DEFAULTS, device_time_ms  # noqa: E402
from bench_offline import hardware, result_path  # noqa: E402


class MixedStepBench:
    """A ModelRunner with `max_decodes` requests of `context_len` cached tokens (random KV) and room for
    `max_prefill` prompt tokens in prompts of `prompt_len`."""

    def __init__(
        self,
        model_dir: str,
        max_decodes: int,
        context_len: int,
        max_prefill: int,
        prompt_len: int,
        dtype: str = "bfloat16",
        piecewise: bool = True,
        piecewise_max_tokens: int = 512,
        disable_pdl: bool = False,
    ):
        import torch

        from engine.config import EngineConfig
        from engine.models.source import resolve_model
        from engine.runner.model_runner import ModelRunner

        self.context_len, self.prompt_len = context_len, prompt_len
        prompts = -(-max_prefill // prompt_len)
        config = EngineConfig(
            model=model_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=dtype,
            max_running_requests=max(1, max_decodes + prompts),
            max_total_tokens=max_decodes * (context_len + 1) + prompts * prompt_len + 64,
            context_length=max(context_len + 64, prompt_len, 2048),
            enable_piecewise_cuda_graph=piecewise,
            piecewise_cuda_graph_max_tokens=piecewise_max_tokens,
            disable_pdl=disable_pdl,
        )
        self.runner = runner = ModelRunner(config, resolve_model(model_dir))
        self.decoding = [self._request(context_len + 1) for _ in range(max_decodes)]
        self.prompts = [self._request(prompt_len) for _ in range(prompts)]
        gen = torch.Generator(device=runner.device).manual_seed(0)
        for buf in runner.kv_pool.k_buffers + runner.kv_pool.v_buffers:
            buf.normal_(0.0, 1.0, generator=gen)

    def _request(self, tokens: int):
        """(req_to_token row, its slots) of a request owning `tokens` KV slots (page size 1: page ids are slots)."""
        row = self.runner.req_to_token_pool.alloc()
        slots = self.runner.allocator.alloc_pages(tokens)
        self.runner.req_to_token_pool.write(row, 0, slots)
        return row, slots

    def batch(self, decodes: int, prefill: int):
        """The ForwardBatch of one step: `decodes` decode tokens first (as the scheduler orders a mixed
        batch), then `prefill` prompt tokens; DECODE mode when there are no prompt tokens."""
        import torch

        from engine.forward_batch import ForwardBatch, ForwardMode

        ctx, vocab = self.context_len, self.runner.vocab_size
        ids, pos, rows, seq, pre, locs = [], [], [], [], [], []
        for i, (row, slots) in enumerate(self.decoding[:decodes]):
            ids.append((1000 + i) % vocab)
            pos.append(ctx)
            rows.append(row)
            seq.append(ctx + 1)
            pre.append(ctx)
            locs.append(slots[ctx : ctx + 1])
        left = prefill
        for row, slots in self.prompts:
            if left <= 0:
                break
            n = min(self.prompt_len, left)
            ids += [(2000 + 7 * k) % vocab for k in range(n)]
            pos += list(range(n))
            rows.append(row)
            seq.append(n)
            pre.append(0)
            locs.append(slots[:n])
            left -= n
        mode = ForwardMode.EXTEND if prefill else ForwardMode.DECODE
        fb = ForwardBatch.build(mode, ids, pos, torch.cat(locs), rows, seq, pre, self.runner.device)
        fb.attn_backend = self.runner.backend_for(fb)
        return fb

    def launch(self, fb):
        """Queue one step of `fb` as ModelRunner._launch runs it (decode graph replay, piecewise graphs or an
        eager forward; logits of each request's last token; greedy); returns the device tokens without
        waiting."""
        runner = self.runner
        if runner.graph_runner is not None and runner.graph_runner.can_run(fb):
            return runner.graph_runner.replay(fb).argmax(dim=-1)
        return runner.model.compute_logits(runner.forward_hidden(fb)[fb.last_token_rows]).argmax(dim=-1)

    def measure(self, decodes: int, prefill: int, steps: int) -> Dict:
        import torch

        device = self.runner.device
        start = host_probe.snapshot()
        fb = self.batch(decodes, prefill)
        gpu_ms = device_time_ms(lambda: self.launch(fb), steps, 5, device)
        host, wall = [], []
        for _ in range(steps):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            self.launch(fb)
            host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            self.launch(self.batch(decodes, prefill)).cpu()
            wall.append((time.perf_counter() - t0) * 1e3)
        runner = self.runner
        graph = runner.graph_runner is not None and runner.graph_runner.can_run(fb)
        piecewise = not graph and runner.piecewise_runner is not None and runner.piecewise_runner.can_run(fb)
        return dict(
            decodes=decodes,
            prefill=prefill,
            tokens=decodes + prefill,
            cuda_graph="decode" if graph else "piecewise" if piecewise else None,
            gpu_ms=gpu_ms,
            host_ms=statistics.median(host),
            wall_ms=statistics.median(wall),
            host_bound=statistics.median(host) >= 0.9 * gpu_ms,
            host_speed=host_probe.between(start, host_probe.snapshot()),
        )


def profile(bench: MixedStepBench, decodes: int, prefill: int, steps: int = 5) -> None:
    """Where one step's time goes: torch.profiler's kernels by device time over `steps` steps, then cProfile's
    Python functions by own host time over `steps` enqueues (device idle before each, as host_ms)."""
    import cProfile
    import io
    import pstats

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = bench.runner.device
    fb = bench.batch(decodes, prefill)
    for _ in range(3):
        bench.launch(fb)
    torch.cuda.synchronize(device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            bench.launch(fb)
        torch.cuda.synchronize(device)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70)
    print(f"\nkernels of {steps} steps, {decodes} decodes + {prefill} prompt tokens (by device time):\n{table}")
    prof_host = cProfile.Profile()
    for _ in range(steps):
        torch.cuda.synchronize(device)
        prof_host.enable()
        bench.launch(fb)
        prof_host.disable()
    torch.cuda.synchronize(device)
    out = io.StringIO()
    pstats.Stats(prof_host, stream=out).sort_stats("tottime").print_stats(25)
    print(f"host functions of {steps} enqueues, {decodes} decodes + {prefill} prompt tokens (by own time):")
    print(out.getvalue(), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "llama-3.1-8b.json")
    )
    p.add_argument("--decodes", type=int, nargs="+", default=[0, 64, 256])
    p.add_argument("--prefill", type=int, nargs="+", default=[0, 64, 128, 256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--context-len", type=int, default=1152, help="cached tokens of each decoding request")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens are cut into prompts this long")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--piecewise-cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=ENGINE_DEFAULTS.enable_piecewise_cuda_graph,
        help="EngineConfig.enable_piecewise_cuda_graph (default: the engine's): prefill and mixed steps of up to "
        "piecewise_cuda_graph_max_tokens replay piecewise CUDA graphs; --no-piecewise-cuda-graph: all eager",
    )
    p.add_argument(
        "--piecewise-cuda-graph-max-tokens",
        type=int,
        default=ENGINE_DEFAULTS.piecewise_cuda_graph_max_tokens,
        help="EngineConfig.piecewise_cuda_graph_max_tokens (default: the engine's): the largest piecewise step",
    )
    p.add_argument(
        "--profile",
        nargs="*",
        default=[],
        metavar="D:P",
        help="after the table, profile the step of D decodes and P prompt tokens: kernels by device time "
        "(torch.profiler; with PDL on a kernel's time includes its wait for the one before) and Python "
        "functions by host time (cProfile)",
    )
    p.add_argument(
        "--disable-pdl", action="store_true", help="EngineConfig.disable_pdl: no programmatic dependent launch"
    )
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/mixed-step_<model>_<gpu>.json)")
    args = p.parse_args()

    profiles = []
    for spec in args.profile:
        try:
            d, n = (int(x) for x in spec.split(":"))
        except ValueError:
            p.error(f"--profile takes D:P pairs of integers, got {spec!r}")
        if not (0 <= d <= max(args.decodes) and 0 <= n <= max(args.prefill) and d + n > 0):
            p.error(f"--profile {spec}: D and P must fit the largest --decodes and --prefill, not both 0")
        profiles.append((d, n))

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_mixed_step needs a CUDA device")
    folder = tempfile.mkdtemp(prefix="bench-mixed-")
    shutil.copy(args.config, os.path.join(folder, "config.json"))
    bench = MixedStepBench(
        folder,
        max(args.decodes),
        args.context_len,
        max(args.prefill),
        args.prompt_len,
        piecewise=args.piecewise_cuda_graph,
        piecewise_max_tokens=args.piecewise_cuda_graph_max_tokens,
        disable_pdl=args.disable_pdl,
    )
    rows: List[Dict] = []
    with torch.inference_mode():
        for d in args.decodes:
            for n in args.prefill:
                if d or n:
                    rows.append(bench.measure(d, n, args.steps))
                    print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    with torch.inference_mode():
        for d, n in profiles:
            profile(bench, d, n)
    hw = hardware()
    model = os.path.splitext(os.path.basename(args.config))[0]
    print(f"\nprefill and mixed steps, {model} dummy bf16, decode context {args.context_len}; {hw.get('gpu')}")
    print(
        f"{'decodes':>8} {'prefill':>8} {'graph':>9} {'gpu ms':>9} {'host ms':>9} {'wall ms':>9}  bound "
        f"  probe us (before / after), steal"
    )
    for r in rows:
        speed = r["host_speed"]
        steal = "-" if speed["steal_pct"] is None else f"{speed['steal_pct']:.1f}%"
        print(
            f"{r['decodes']:>8} {r['prefill']:>8} {r['cuda_graph'] or 'no':>9} {r['gpu_ms']:>9.2f} "
            f"{r['host_ms']:>9.2f} {r['wall_ms']:>9.2f}  {'host' if r['host_bound'] else 'device':<6} "
            f"{speed['probe_us_before']:>7.0f} / {speed['probe_us_after']:<7.0f} {steal}"
        )
    suffix = "" if args.piecewise_cuda_graph else "_eager"
    if (
        args.piecewise_cuda_graph
        and args.piecewise_cuda_graph_max_tokens != ENGINE_DEFAULTS.piecewise_cuda_graph_max_tokens
    ):
        suffix += f"_piecewise-{args.piecewise_cuda_graph_max_tokens}"
    if args.disable_pdl:
        suffix += "_no-pdl"
    path = result_path(args.out, f"mixed-step_{model}{suffix}", hw)
    record = dict(
        benchmark="mixed_step",
        hardware=hw,
        model=model,
        settings=dict(
            context_len=args.context_len,
            prompt_len=args.prompt_len,
            steps=args.steps,
            piecewise_cuda_graph=args.piecewise_cuda_graph,
            piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
            pdl=not args.disable_pdl,
        ),
        rows=rows,
    )
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
