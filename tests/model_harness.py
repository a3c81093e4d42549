"""A minimal greedy driver for model tests (not the engine's scheduler).

Request i owns KV slots [1 + i * max_len, 1 + (i + 1) * max_len) (slot 0 stays
unused, like the pool's page 0) and req_to_token row i. Prefill may be split
into chunks to exercise the prefix path; decode runs all requests together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import transformers
import transformers.modeling_gguf_pytorch_utils

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.kv_pool import KVPool
from kernels.attention.base import get_backend_class
from engine.models.gguf_folder import cached_gguf_name_map
from engine.models.source import ModelSource


@dataclass
class GreedyResult:
    prefill_logits: List[torch.Tensor]
    """per request: (prompt_len, vocab) float32 — logits at every prompt position."""
    decode_logits: List[torch.Tensor]
    """per request: (max_new_tokens - 1, vocab) float32 — logits of each decode step (fed token j, predicts j + 1)."""
    output_ids: List[List[int]]
    """per request: max_new_tokens greedy tokens."""


class GreedyHarness:
    def __init__(
        self,
        model,
        max_len: int = 256,
        max_reqs: int = 16,
        backend: str = "torch_native",
        kv_dtype: Optional[torch.dtype] = None,
        backend_kwargs: Optional[dict] = None,
    ):
        param = next(model.parameters())
        self.model, self.device, self.max_len = model, param.device, max_len
        self.kv_pool = KVPool(
            1 + max_reqs * max_len,
            model.num_layers,
            model.num_kv_heads,
            model.head_dim,
            kv_dtype or param.dtype,
            self.device,
        )
        self.req_to_token = (1 + torch.arange(max_reqs * max_len, dtype=torch.int32, device=self.device)).view(
            max_reqs, max_len
        )
        self.backend = get_backend_class(backend)(
            self.req_to_token,
            self.kv_pool,
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
            model.head_dim**-0.5,
            **(backend_kwargs or {}),
        )

    def _forward(
        self, mode: ForwardMode, seqs: List[List[int]], prefix: List[int], seq_lens: List[int], rows: List[int]
    ) -> torch.Tensor:
        """Run the new tokens seqs[i][prefix[i]:seq_lens[i]] of request rows[i]; -> (T, vocab) logits."""
        ids, pos, locs = [], [], []
        for s, p, n, r in zip(seqs, prefix, seq_lens, rows):
            ids += s[p:n]
            pos += list(range(p, n))
            locs += [1 + r * self.max_len + j for j in range(p, n)]
        batch = ForwardBatch.build(mode, ids, pos, torch.tensor(locs), rows, seq_lens, prefix, self.device)
        batch.attn_backend = self.backend
        self.backend.init_forward_metadata(batch)
        with torch.no_grad():
            return self.model.compute_logits(self.model(batch))

    def generate(
        self, prompts: List[List[int]], max_new_tokens: int, prefill_chunk: Optional[int] = None
    ) -> GreedyResult:
        seqs = [list(p) for p in prompts]
        rows = list(range(len(prompts)))
        lens = [len(p) for p in prompts]
        chunk = prefill_chunk or max(lens)
        prefill = [[] for _ in prompts]
        for done in range(0, max(lens), chunk):  # every request advances by one chunk per forward
            live = [i for i in rows if lens[i] > done]
            ends = [min(lens[i], done + chunk) for i in live]
            logits = self._forward(ForwardMode.EXTEND, [seqs[i] for i in live], [done] * len(live), ends, live)
            for i, part in zip(live, logits.split([e - done for e in ends])):
                prefill[i].append(part)
        prefill_logits = [torch.cat(p) for p in prefill]
        next_ids = [int(p[-1].argmax()) for p in prefill_logits]
        decode = [[] for _ in prompts]
        for step in range(max_new_tokens):
            for s, t in zip(seqs, next_ids):
                s.append(t)
            if step == max_new_tokens - 1:
                break
            n = [len(s) for s in seqs]
            logits = self._forward(ForwardMode.DECODE, seqs, [x - 1 for x in n], n, rows)
            for i in rows:
                decode[i].append(logits[i])
            next_ids = logits.argmax(-1).tolist()
        decode_logits = [torch.stack(d) if d else torch.empty(0) for d in decode]
        return GreedyResult(prefill_logits, decode_logits, [s[len(p) :] for s, p in zip(seqs, prompts)])


def hf_model_from_gguf(source: ModelSource, config) -> torch.nn.Module:
    """The HF reference on the same dequantized weights (what from_pretrained(gguf_file=...) does, minus accelerate)."""
    with torch.device("meta"):
        names_model = transformers.AutoModelForCausalLM.from_config(config)
    with cached_gguf_name_map():
        tensors = transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint(
            source.gguf_path, return_tensors=True, model_to_load=names_model
        )["tensors"]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    result = hf.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # tied
    return hf
