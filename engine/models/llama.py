"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and SmolLM share this file.

Differences between the families are config switches, not subclasses:
  - q/k/v bias: Qwen2 always, others when `config.attention_bias`;
  - per-head q/k RMSNorm before rope: Qwen3;
  - rope scaling (llama3, linear, yarn, ...): computed by transformers' rope utils;
  - tied input/output embeddings: `config.tie_word_embeddings`.

Parameter names mirror HF's except the fused projections: `qkv_proj` holds
[q_proj; k_proj; v_proj] rows and `gate_up_proj` holds [gate_proj; up_proj]
rows, one matmul each. `load_weights` maps HF names onto those slices.

Tensor parallelism (`tp`, engine.parallel): a rank holds its attention heads (qkv_proj rows of its
query and KV heads, o_proj columns: RowParallelLinear), its MLP columns (gate_up_proj rows, down_proj
columns) and its vocabulary rows (VocabParallelEmbedding, VocabParallelLMHead; compute_logits
all-gathers them); norms are replicated. `load_weights` then takes each rank's slice of every checkpoint
tensor. Without `tp` the layers are the plain ones: no collective anywhere.
Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window) is not
applied: contexts must stay within `sliding_window` for HF-identical outputs.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, NamedTuple, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.errors import UnsupportedModelError
from engine.forward_batch import ForwardBatch
from engine.models.layers import (
    GEMV_MAX_ROWS,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    gemv,
    gemv_applies,
    gemv_silu_mul,
)
from engine.models.parallel_layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead
from engine.parallel.shard import HeadShard, TensorParallel, TensorSlice, head_shard, split_range

# HF projection name -> (fused parameter name, shard id)
_STACKED: Dict[str, Tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class _Target(NamedTuple):
    """Where one checkpoint tensor goes: rows `rows` of `param` (None: all of it), which take the slice
    `source` of the tensor (None: all of it)."""

    param: nn.Parameter
    rows: Optional[Tuple[int, int]]
    source: Optional[TensorSlice]


def _read(tensor: Any, source: Optional[TensorSlice]) -> torch.Tensor:
    """The part of a checkpoint tensor (a torch.Tensor or a safetensors slice) that a target takes."""
    if source is not None:
        return source.take(tensor)
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]


class LlamaAttention(nn.Module):
    """Self-attention of one layer: fused qkv projection, optional q/k norm, rope, paged attention, o_proj."""

    def __init__(self, config: PretrainedConfig, layer_id: int, tp: Optional[TensorParallel] = None):
        super().__init__()
        self.layer_id = layer_id
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.heads = HeadShard(0, heads, 0, kv_heads) if tp is None else head_shard(heads, kv_heads, tp.rank, tp.size)
        """This rank's query and KV heads (all of them without tensor parallelism)."""
        self.tp = tp
        self.num_heads = self.heads.num_heads
        self.num_kv_heads = self.heads.num_kv_heads
        self.head_dim = _head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        is_qwen2 = config.model_type == "qwen2"
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=is_qwen2 or attention_bias)
        o_bias = attention_bias and not is_qwen2
        if tp is None:
            self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        else:
            q_columns = (self.heads.q_start * self.head_dim, self.heads.q_end * self.head_dim)
            self.o_proj = RowParallelLinear(q_columns, config.hidden_size, o_bias, tp)
        self.has_qk_norm = config.model_type == "qwen3"
        if self.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def shard_rows(self, shard: str) -> Tuple[int, int]:
        """Row range [start, end) of shard 'q' | 'k' | 'v' inside qkv_proj."""
        return {
            "q": (0, self.q_size),
            "k": (self.q_size, self.q_size + self.kv_size),
            "v": (self.q_size + self.kv_size, self.q_size + 2 * self.kv_size),
        }[shard]

    def source_slice(self, shard: str) -> Optional[TensorSlice]:
        """Rows of the checkpoint's q_proj / k_proj / v_proj ('q' | 'k' | 'v') this rank holds; None: all."""
        if self.tp is None:
            return None
        h, d = self.heads, self.head_dim
        if shard == "q":
            return TensorSlice(0, h.q_start * d, h.q_end * d)
        return TensorSlice(0, h.kv_start * d, h.kv_end * d)

    def project_qkv(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, hidden); cos/sin (T, 1, head_dim) -> q (T, H, D), k and v (T, Hkv, D): projected, q/k
        normed (Qwen3) and rotated; what the attention backend takes. `out`: contiguous (q, k, v) tensors of
        those shapes that receive them (the rotation writes q and k there directly)."""
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm.normalize(q), self.k_norm.normalize(k)
        q, k = RotaryEmbedding.apply_qk(q, k, cos, sin, None if out is None else out[:2])
        return q, k, v if out is None else out[2].copy_(v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x (T, hidden); cos/sin (T, 1, head_dim) -> (T, hidden)."""
        q, k, v = self.project_qkv(x, cos, sin)
        out = batch.attn_backend.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one (2 * intermediate, hidden) matmul."""

    def __init__(self, config: PretrainedConfig, tp: Optional[TensorParallel] = None):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        full = config.intermediate_size
        self.columns = (0, full) if tp is None else split_range(full, tp.size, tp.rank)
        """This rank's intermediate columns [start, end) (all of them without tensor parallelism)."""
        self.tp = tp
        self.intermediate_size = self.columns[1] - self.columns[0]
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        if tp is None:
            self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=bias)
        else:
            self.down_proj = RowParallelLinear(self.columns, config.hidden_size, bias, tp)
        self.act = SiluAndMul()

    def shard_rows(self, shard: str) -> Tuple[int, int]:
        """Row range [start, end) of shard 'gate' | 'up' inside gate_up_proj."""
        n = self.intermediate_size
        return (0, n) if shard == "gate" else (n, 2 * n)

    def source_slice(self, shard: str) -> Optional[TensorSlice]:
        """Rows of the checkpoint's gate_proj / up_proj this rank holds; None: all."""
        return None if self.tp is None else TensorSlice(0, *self.columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, hidden). Where the gate_up product takes the GEMV kernels, SiLU-and-mul runs in
        its epilogue (layers.gemv_silu_mul: the same bits, one launch fewer)."""
        if gemv_applies(self.gate_up_proj, x):
            return self.down_proj(gemv_silu_mul(x, self.gate_up_proj.weight, self.gate_up_proj.bias))
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is threaded through the fused-add RMSNorms."""

    def __init__(self, config: PretrainedConfig, layer_id: int, tp: Optional[TensorParallel] = None):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """x, residual (T, hidden) -> (mlp output, residual); the layer's output is their sum."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, batch)
        return self.after_attention(x, residual)

    # The same layer in two parts around its attention call, for runners that run the parts apart
    # (engine/runner/piecewise_graph.py): before_attention, the backend's forward, o_proj, after_attention
    # compute what forward computes.
    def before_attention(
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x, residual (T, hidden; residual None in the first layer) -> q, k, v (project_qkv) and the
        residual stream after this layer's input norm. `out`: contiguous (q, k, v, residual) tensors that
        receive them (returned), e.g. a runner's static buffers; `residual` must not be one of them."""
        x, residual = self.input_layernorm(x, residual, None if out is None else out[3])
        q, k, v = self.self_attn.project_qkv(x, cos, sin, None if out is None else out[:3])
        return q, k, v, residual

    def after_attention(self, x: torch.Tensor, residual: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """x: the attention block's output after o_proj (T, hidden) -> (mlp output, residual)."""
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: Optional[TensorParallel] = None):
        super().__init__()
        self.rotary_emb = RotaryEmbedding(config, _head_dim(config))
        if tp is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """batch.input_ids (T,) -> final-normed hidden states (T, hidden)."""
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary_emb.cos_sin(batch.positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, batch)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Causal LM over a ForwardBatch; attention goes through `batch.attn_backend`.

    With `tp` (engine.parallel.shard.TensorParallel) it is this rank's shard: every rank must run the same
    forwards and compute_logits calls, in the same order (their collectives pair up)."""

    def __init__(self, config: PretrainedConfig, tp: Optional[TensorParallel] = None):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported by the Llama family (only 'silu')")
        self.config = config
        self.tp = tp
        self.vocab_size = int(config.vocab_size)
        self.model = LlamaModel(config, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.gemv_rows = GEMV_MAX_ROWS  # few-row logits through the GEMV kernels on CUDA (layers.set_gemv)
        if not self.tie_word_embeddings:
            if tp is None:
                self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
            else:
                self.lm_head = VocabParallelLMHead(config.hidden_size, config.vocab_size, tp)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def num_heads(self) -> int:
        return self.model.layers[0].self_attn.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    @property
    def attn_scale(self) -> float:
        """Softmax scale the attention backend must use: head_dim ** -0.5."""
        return self.head_dim**-0.5

    @property
    def sliding_window(self) -> Optional[int]:
        """The HF config's sliding window (not applied here: cap contexts to it), or None."""
        uses = getattr(self.config, "use_sliding_window", True)
        return getattr(self.config, "sliding_window", None) if uses else None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> (T, hidden) final-normed hidden states of every new token."""
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, hidden) -> logits (N, vocab) float32 (on every rank: the shards are all-gathered)."""
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        if gemv_applies(self, hidden):
            logits = gemv(hidden, weight, out_dtype=torch.float32)
        else:
            logits = F.linear(hidden, weight).float()
        if self.tp is not None:  # every rank's vocabulary rows, in rank order, then the padding cut off
            logits = self.tp.all_gather_last_dim(logits)
            if logits.shape[-1] != self.vocab_size:
                logits = logits[:, : self.vocab_size].contiguous()
        return logits

    # ---- weights -------------------------------------------------------------------------------
    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor]]:
        """The HF tensors that `tensor`, a value of parameter `name` of this model, stands for: the parts of
        a fused projection (views of it), else (name, tensor)."""
        parts = [(hf, shard) for hf, (fused, shard) in _STACKED.items() if f".{fused}." in name]
        if not parts:
            yield name, tensor
            return
        for hf, shard in parts:
            fused = _STACKED[hf][0]
            start, end = self.get_submodule(name.rsplit(".", 2)[0]).shard_rows(shard)
            yield name.replace(f".{fused}.", f".{hf}."), tensor[start:end]

    def expected_weight_names(self) -> Set[str]:
        """HF tensor names a complete checkpoint provides (fused parameters expanded to their parts)."""
        names = set()
        for name, _ in self.named_parameters():
            parts = [hf for hf, (fused, _) in _STACKED.items() if f".{fused}." in name]
            for hf in parts:
                fused = _STACKED[hf][0]
                names.add(name.replace(f".{fused}.", f".{hf}."))
            if not parts:
                names.add(name)
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[Tuple[str, Any]]) -> None:
        """Copy HF-named tensors into the parameters (cast to their dtype/device).

        A tensor is a torch.Tensor or, for a tensor-parallel rank, a safetensors slice, of which only this
        rank's part is read. Raises UnsupportedModelError on an unknown name, a shape mismatch, or when
        a parameter is still missing at the end. `lm_head.weight` is skipped when tied.
        """
        params = dict(self.named_parameters())
        loaded: Set[str] = set()
        for name, source in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target = self._locate(name, params)
            if target is None:  # another rank's (a row-parallel bias: rank 0 holds it)
                continue
            tensor = _read(source, target.source)
            rows = target.rows
            dst = target.param if rows is None else target.param[rows[0] : rows[1]]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise UnsupportedModelError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            loaded.add(name)
        missing = self.expected_weight_names() - loaded
        if missing:
            raise UnsupportedModelError(f"checkpoint is missing {len(missing)} weight(s), e.g. {sorted(missing)[:5]}")
        if self.tp is not None:
            for module in self.modules():
                if isinstance(module, (VocabParallelEmbedding, VocabParallelLMHead)):
                    module.zero_padding()

    def _locate(self, name: str, params: Dict[str, nn.Parameter]) -> Optional[_Target]:
        """HF name -> where it goes; None for a tensor another rank holds (tensor parallelism)."""
        if name in params:
            if self.tp is None:
                return _Target(params[name], None, None)
            owner_name, attr = name.rsplit(".", 1)
            owner = self.get_submodule(owner_name)
            source = owner.source_slice(attr) if hasattr(owner, "source_slice") else None
            rows = owner.target_rows(attr) if hasattr(owner, "target_rows") else None
            return _Target(params[name], rows, source)
        for hf, (fused, shard) in _STACKED.items():
            if f".{hf}." in name:
                fused_name = name.replace(f".{hf}.", f".{fused}.")
                if fused_name in params:
                    owner = self.get_submodule(fused_name.rsplit(".", 2)[0])
                    return _Target(params[fused_name], owner.shard_rows(shard), owner.source_slice(shard))
        if self.tp is not None and name.endswith(".bias"):
            try:
                owner = self.get_submodule(name.rsplit(".", 1)[0])
            except AttributeError:
                owner = None
            if isinstance(owner, RowParallelLinear):
                return None
        raise UnsupportedModelError(f"unexpected weight {name!r} for {type(self).__name__} ({self.config.model_type})")
