"""JSON-schema exactness of the grammar backends, without a model.

For every MaskBench-format file (JSONSchemaBench: {"schema", "tests": [{"data", ...}]}) in
--data, each backend compiles the schema (or refuses it), then every test instance, serialized
the way that backend generates JSON, is fed to its matcher token by token, then EOS. An instance
is valid or invalid by the `jsonschema` library. The peer is measured in the same run:

- xgrammar: `GrammarCompiler.compile_json_schema(any_whitespace=False)` (what the engine used before);
- engine: radixserve's own path (engine/runner/grammar.py: llguidance, exact or refused).

"invalid accepted" must be 0 for a backend that never lets an invalid object through.

    python benchmarks/bench_grammar.py                          # tests/data/jsonschemabench
    python benchmarks/bench_grammar.py --data PATH/maskbench/data --limit 400 --seed 0
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(ROOT, "tests", "data", "jsonschemabench"))
    ap.add_argument("--limit", type=int, default=None, help="sample this many files (random.Random(seed))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--label", default=None, help="names the data in the JSON and its file name")
    args = ap.parse_args()

    import jsonschema
    import xgrammar as xgr

    from engine import InvalidRequestError, SamplingParams
    from engine.models.source import resolve_model
    from engine.runner.grammar import GrammarCompiler, GrammarState
    from engine.tokenizer import load_tokenizer

    files = sorted(glob.glob(os.path.join(args.data, "*.json")))
    if args.limit:
        files = random.Random(args.seed).sample(files, min(args.limit, len(files)))
    tok = load_tokenizer(resolve_model(None))
    eos = min(tok.eos_token_ids)
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=len(tok.hf), stop_token_ids=[eos])
    xgr_compiler = xgr.GrammarCompiler(info, max_threads=1)
    engine_compiler = GrammarCompiler(tok.hf, len(tok.hf), tok.eos_token_ids)

    def xgr_compile(schema):
        return xgr_compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def xgr_accepts(grammar, value):
        m = xgr.GrammarMatcher(grammar)
        return m.accept_string(json.dumps(value, ensure_ascii=False)) and m.accept_token(eos)

    def engine_compile(schema):
        return engine_compiler.compile(SamplingParams(json_schema=json.dumps(schema)))

    def engine_accepts(grammar, value):
        state = GrammarState(grammar)
        ids = tok.hf.encode(json.dumps(value, ensure_ascii=False), add_special_tokens=False) + [eos]
        return all(state.accept(t) for t in ids) and state.is_terminated()

    backends = {"xgrammar": (xgr_compile, xgr_accepts), "engine": (engine_compile, engine_accepts)}
    stats = {
        name: dict(compiled=0, refused=0, valid=0, valid_accepted=0, invalid=0, invalid_accepted=0) for name in backends
    }
    schemas = 0
    for path in files:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        schema, tests = d.get("schema"), d.get("tests") or []
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
            validator = jsonschema.validators.validator_for(schema)(schema)
        except Exception:  # noqa: BLE001 - not a valid schema: not part of the measurement
            continue
        schemas += 1
        for name, (compile_, accepts) in backends.items():
            s = stats[name]
            try:
                grammar = compile_(schema)
            except (InvalidRequestError, RuntimeError, ValueError):
                s["refused"] += 1
                continue
            s["compiled"] += 1
            for case in tests:
                valid = validator.is_valid(case["data"])
                ok = accepts(grammar, case["data"])
                s["valid" if valid else "invalid"] += 1
                s[("valid" if valid else "invalid") + "_accepted"] += bool(ok)

    print(f"{schemas} schemas from {args.data}")
    print(f"{'backend':10} {'compiled':>9} {'refused':>8} {'invalid accepted':>17} {'valid accepted':>15}")
    for name, s in stats.items():
        print(
            f"{name:10} {s['compiled']:>9} {s['refused']:>8} {s['invalid_accepted']:>8} of {s['invalid']:<6}"
            f" {s['valid_accepted']:>6} of {s['valid']:<6}"
        )
    os.makedirs(args.out, exist_ok=True)
    label = args.label or os.path.basename(args.data.rstrip("/"))
    out = os.path.join(args.out, f"grammar_exactness_{schemas}-schemas_{label.split()[0]}.json")
    with open(out, "w") as f:
        json.dump(
            dict(
                data=args.label or os.path.relpath(args.data, ROOT),
                limit=args.limit,
                seed=args.seed,
                schemas=schemas,
                versions={m: importlib.metadata.version(m) for m in ("xgrammar", "llguidance")},
                stats=stats,
            ),
            f,
            indent=1,
        )
    print("wrote", out)


if __name__ == "__main__":
    main()
