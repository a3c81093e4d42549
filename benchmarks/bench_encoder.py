"""Tokenizing a burst of prompts on a server's event loop: inline (one `Tokenizer.encode` after the other,
the routes' old way) against serving/encoder.py's BatchEncoder (batches on worker threads), same prompts,
same process.

For each burst size N, N chat prompts of one shape (--shape: `multi-turn`, a 6-turn conversation of 64-word
questions and 128-word answers; `shared-prefix`, a 2,048-word system prompt and a 64-word question, the
shapes of bench_online's chat workloads) are rendered with the tokenizer's chat template and handed to the
encoder at once, on an event loop that also runs a ticker (a coroutine yielding to the loop in a loop,
standing for the streams a server writes meanwhile). Reported, median of --repeats bursts:

  burst_ms   from the burst's start until every prompt's ids are back
  stall_ms   the longest time the loop ran nothing else (the ticker's longest gap): what a stream waits

Inline, the stall is the whole burst. Ids are checked equal to Tokenizer.encode's.

  python benchmarks/bench_encoder.py [--bursts 1 8 32 64] [--threads 1 2 4] [--shape multi-turn]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offline import hardware, result_path  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex our marble tables".split()


def prompts(tokenizer, shape: str, n: int, seed: int = 0) -> List[str]:
    """`n` rendered chat prompts of `shape`, each different (so no cache could help)."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    out = []
    for _ in range(n):
        if shape == "multi-turn":
            msgs: List[Dict[str, str]] = []
            for _turn in range(6):
                msgs += [{"role": "user", "content": words(64)}, {"role": "assistant", "content": words(128)}]
            msgs.append({"role": "user", "content": words(64)})
        else:
            msgs = [{"role": "system", "content": words(2048)}, {"role": "user", "content": words(64)}]
        out.append(tokenizer.chat_prompt_text(msgs))
    return out


async def timed_burst(encode_all: Callable, texts: List[str]) -> Dict[str, float]:
    """Runs `encode_all(texts)` (a coroutine function) beside a ticker; burst and longest stall in ms."""
    stall = 0.0
    done = False

    async def ticker() -> None:
        nonlocal stall
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            stall, last = max(stall, now - last), now

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    ids = await encode_all(texts)
    burst = time.perf_counter() - t0
    done = True
    await task
    return dict(burst_ms=burst * 1e3, stall_ms=stall * 1e3, ids=ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="tokenizer source (default: the default model)")
    p.add_argument("--shape", choices=["multi-turn", "shared-prefix"], default="multi-turn")
    p.add_argument("--bursts", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/encoder_<shape>_<hw>.json)")
    args = p.parse_args()

    from engine.models.source import resolve_model
    from engine.tokenizer import load_tokenizer
    from serving.encoder import BatchEncoder, default_threads

    tokenizer = load_tokenizer(resolve_model(args.model))
    texts = prompts(tokenizer, args.shape, max(args.bursts))
    want = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    mean_tokens = statistics.mean(len(w) for w in want)

    async def inline(batch: List[str]) -> List[List[int]]:
        return [tokenizer.encode(t, add_special_tokens=False) for t in batch]

    variants: Dict[str, Callable[[], Callable]] = {"inline": lambda: inline}
    for t in args.threads:
        variants[f"encoder, {t} thread{'s' if t > 1 else ''}"] = lambda t=t: BatchEncoder(tokenizer, threads=t)

    async def run() -> List[Dict]:
        rows = []
        for name, make in variants.items():
            made = make()
            encoder = made if isinstance(made, BatchEncoder) else None

            async def encode_all(batch: List[str], encoder=encoder, made=made) -> List[List[int]]:
                if encoder is None:
                    return await made(batch)
                return list(await asyncio.gather(*(encoder.encode(t, add_special_tokens=False) for t in batch)))

            for n in args.bursts:
                runs = [await timed_burst(encode_all, texts[:n]) for _ in range(args.repeats + 1)][1:]
                if any(r["ids"] != want[:n] for r in runs):
                    raise SystemExit(f"{name}: ids differ from Tokenizer.encode's")
                rows.append(
                    dict(
                        variant=name,
                        burst=n,
                        burst_ms=statistics.median(r["burst_ms"] for r in runs),
                        stall_ms=statistics.median(r["stall_ms"] for r in runs),
                    )
                )
            if encoder is not None:
                encoder.close()
        return rows

    rows = asyncio.run(run())
    hw = hardware()
    print(
        f"\n{args.shape} chat prompts ({mean_tokens:.0f} tokens on average), {hw.get('cpu_count')} CPUs "
        f"({hw.get('cpu')}); the encoder's default here: {default_threads()} thread(s); median of {args.repeats}"
    )
    print(f"{'variant':<22}{'burst':>7}{'burst ms':>11}{'stall ms':>11}{'x inline':>10}")
    base = {r["burst"]: r["burst_ms"] for r in rows if r["variant"] == "inline"}
    for r in rows:
        print(
            f"{r['variant']:<22}{r['burst']:>7}{r['burst_ms']:>11.2f}{r['stall_ms']:>11.2f}"
            f"{r['burst_ms'] / base[r['burst']]:>10.2f}"
        )
    out = result_path(args.out, f"encoder_{args.shape}", hw)
    with open(out, "w") as f:
        json.dump(
            dict(
                benchmark="bench_encoder",
                args=vars(args),
                hardware=hw,
                mean_prompt_tokens=mean_tokens,
                default_threads=default_threads(),
                results=rows,
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            ),
            f,
            indent=2,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
