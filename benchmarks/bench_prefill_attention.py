"""Prefill attention alone: the prompt rows of one prefill or mixed step, FlashInfer's kernels per backend.

A step is a list of requests, each `new` prompt tokens after `prefix` tokens already in the KV pool, written
`new` or `new@prefix` (`--steps 1024,960` is two whole prompts, 1,984 tokens: a 2,048-token step of random
1024 -> 256 beside 64 decodes; `512@512,1024,448` has a chunk whose first half was cached by the step
before). Llama-3.1-8B's heads by default (32 query heads, 8 KV heads, head_dim 128, bf16), one call per
layer of --layers layers, each layer's KV in its own place (the engine's token-major pool,
(slots, layers, 2, Hkv, D), page size 1, each request's slots shuffled as after churn). Variants:

  paged fa2    BatchPrefillWithPagedKVCacheWrapper, backend "fa2", causal over [prefix | new] in the pool
  paged fa3    the same with backend "fa3" (Hopper)
  ragged fa2   what the engine runs for EngineConfig.flashinfer_prefill "ragged-fa2": on a step without
               cached prefixes, BatchPrefillWithRaggedKVCacheWrapper over the step's own K/V (contiguous
               (T, Hkv, D)), causal; on a step with one, the paged kernel above
  ragged fa3   the same with backend "fa3"
  split fa2    SGLang's split, for comparison: the ragged kernel over the new K/V, plus (steps with a
               prefix) the paged kernel over the prefixes alone, not causal, merged by log-sum-exp
               (FlashInfer's merge_state_in_place)
  split fa3    the same with backend "fa3"

Each variant's output is checked against the first variant's (paged fa2 by default; max abs difference).
Timed eagerly: --layers calls between two CUDA events, best of 5, after two warm-up rounds (plan() runs
once, outside the timing, as the engine plans once per step). Reported: microseconds per layer call and
TFLOP/s (4 · causal pairs · heads · head_dim per call).

  python benchmarks/bench_prefill_attention.py [--steps 1024,960 512@512,1024,448 1024,1024,1024,1024]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ("paged fa2", "paged fa3", "ragged fa2", "ragged fa3", "split fa2", "split fa3")


def parse_step(text: str) -> List[Tuple[int, int]]:
    """'1024,512@512' -> [(1024, 0), (512, 512)]: (new tokens, cached prefix) per request."""
    out = []
    for part in text.split(","):
        new, _, prefix = part.partition("@")
        n, p = int(new), int(prefix or 0)
        if n < 1 or p < 0:
            raise ValueError(f"bad request {part!r} in step {text!r}: NEW >= 1 tokens, PREFIX >= 0")
        out.append((n, p))
    return out


def causal_pairs(step: List[Tuple[int, int]]) -> int:
    """(query, key) pairs one head attends over: each new token sees the prefix and the new tokens up to it."""
    return sum(n * p + n * (n + 1) // 2 for n, p in step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", nargs="+", default=["1024,960", "512@512,1024,448", "1024,1024,1024,1024"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/prefill-attention_<gpu>.json)")
    args = p.parse_args()
    steps = {text: parse_step(text) for text in args.steps}

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_prefill_attention needs a CUDA device")
    import flashinfer
    from bench_decode_attention import write_result
    from bench_gemv import time_eager
    from bench_offline import hardware, result_path

    from kernels.attention.flashinfer import lengths_indptr

    dev = torch.device("cuda")
    n_layers, hq, hkv, d = args.layers, args.num_heads, args.num_kv_heads, args.head_dim
    scale = d**-0.5
    kw = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale)
    rows: List[Dict] = []
    for text, step in steps.items():
        total_new = sum(n for n, _ in step)
        total_kv = sum(n + p for n, p in step)
        pool = torch.randn((total_kv + 1, n_layers, 2, hkv, d), dtype=torch.bfloat16, device=dev)
        slots = (torch.randperm(total_kv, device=dev) + 1).to(torch.int32)  # slot 0 unused, as in the engine
        q = [torch.randn(total_new, hq, d, dtype=torch.bfloat16, device=dev) for _ in range(n_layers)]
        # Each request's slots: prefix first, then its new tokens; the step's own K/V are the pool's rows of them.
        kv_starts = [0]
        for n, p_ in step:
            kv_starts.append(kv_starts[-1] + n + p_)
        new_slots = torch.cat([slots[s + p_ : s + p_ + n] for s, (n, p_) in zip(kv_starts, step)]).long()
        pre_slots = torch.cat([slots[s : s + p_] for s, (n, p_) in zip(kv_starts, step)] + [slots[:0]])
        caches = [(pool[:, i, 0].unsqueeze(1), pool[:, i, 1].unsqueeze(1)) for i in range(n_layers)]
        new_kv = [(pool[new_slots, i, 0].contiguous(), pool[new_slots, i, 1].contiguous()) for i in range(n_layers)]
        qo_indptr = lengths_indptr([n for n, _ in step])
        all_indptr = lengths_indptr([n + p_ for n, p_ in step])
        pre_indptr = lengths_indptr([p_ for _, p_ in step])
        has_prefix = any(p_ for _, p_ in step)
        ones = torch.ones(len(step), dtype=torch.int32)
        flops = 4 * causal_pairs(step) * hq * d
        ref = None
        for variant in args.variants:
            layout, backend = variant.split()
            workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
            try:
                if layout == "paged" or (layout == "ragged" and has_prefix):
                    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
                    wrapper.plan(qo_indptr, all_indptr, slots, ones, hq, hkv, d, 1, causal=True, **kw)

                    def fn(i, wrapper=wrapper):
                        return wrapper.run(q[i], caches[i])
                else:
                    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend)
                    ragged.plan(qo_indptr, qo_indptr, hq, hkv, d, causal=True, **kw)
                    prefix_wrapper = None
                    if has_prefix:  # split: one workspace for both wrappers
                        prefix_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                            workspace, "NHD", backend=backend
                        )
                        prefix_wrapper.plan(qo_indptr, pre_indptr, pre_slots, ones, hq, hkv, d, 1, causal=False, **kw)

                    def fn(i, ragged=ragged, prefix_wrapper=prefix_wrapper):
                        k, v = new_kv[i]
                        out = torch.empty_like(q[i])
                        if prefix_wrapper is None:
                            return ragged.run(q[i], k, v, out=out)
                        _, lse = ragged.run(q[i], k, v, out=out, return_lse=True)
                        prefix_out, prefix_lse = prefix_wrapper.run(q[i], caches[i], return_lse=True)
                        flashinfer.merge_state_in_place(out, lse, prefix_out, prefix_lse)
                        return out

                out = fn(0)
                torch.cuda.synchronize()
                sec = time_eager(fn, n_layers)
            except Exception as exc:  # noqa: BLE001 - a backend this device or build cannot run is reported
                print(f"{text}: {variant} failed: {type(exc).__name__}: {str(exc)[:200]}")
                rows.append(dict(step=text, variant=variant, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
                continue
            ref = out if ref is None else ref
            diff = float((out.float() - ref.float()).abs().max())
            row = dict(step=text, tokens=total_new, variant=variant, us=sec * 1e6, tflops=flops / sec / 1e12)
            row["max_abs_diff_vs_first"] = diff
            rows.append(row)
            print(f"{text}: {variant}: {row['us']:.1f} us per layer, {row['tflops']:.0f} TFLOP/s, |diff| {diff:.2e}")

    hw = hardware()
    print(f"\nprefill attention per layer call (us, TFLOP/s); {hw.get('gpu')}")
    print(f"{'step':>28}" + "".join(f"{v:>20}" for v in args.variants))
    for text in steps:
        cells = []
        for variant in args.variants:
            r = next(x for x in rows if x["step"] == text and x["variant"] == variant)
            cells.append(f"{'failed':>20}" if "error" in r else f"{r['us']:>10.1f} {r['tflops']:>6.0f} TF")
        print(f"{text:>28}" + "".join(cells))
    write_result(result_path(args.out, "prefill-attention", hw), "bench_prefill_attention", args, hw, None, rows)


if __name__ == "__main__":
    main()
