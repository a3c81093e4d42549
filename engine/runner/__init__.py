"""Running a batch on the device.

ModelRunner (model_runner.py)  loads the model, sizes and owns the KV pool, picks the attention
                               backend, runs forward + sampling for a prepared ScheduleBatch
follower (follower.py)         a tensor-parallel rank other than 0: its ModelRunner runs rank 0's steps
Sampler (sampler.py)           logits → token ids (+ logprobs), batched, counter-based seeded RNG
GrammarCompiler (grammar.py)   structured output: JSON schema / Lark → llguidance, regex / EBNF → xgrammar
                               (Engine-owned, cached); GrammarState per request → token bitmask
                               applied by the Sampler
json_schema (json_schema.py)   JSON schema → llguidance grammar, exact or refused (400 naming the keyword)
"""
