"""Building blocks shared by the model families: Linear, RMSNorm, rotary embedding, SiLU-and-mul.

Every layer works on the flat token layout of a ForwardBatch: activations are
(T, hidden) or (T, heads, head_dim), T = tokens of the whole batch. Numerics
follow Hugging Face transformers (the reference): norms and rotary angles are
computed in float32 and cast back to the activation dtype.

On CUDA the layers run fused Triton kernels (kernels/triton/fused_layers.py: one
launch for residual-add + RMSNorm, SiLU-and-mul, and RoPE of q and k together),
which round at the same places as the torch code; elsewhere plain torch. The
kernel module is imported on first CUDA use, so CPU installs never import triton.
`Linear` runs a product of up to GEMV_MAX_ROWS rows (the decode step of a small
batch, or those rows' logits) with kernels/triton/gemv.py on CUDA, a product of a
few more rows (up to CUBLASLT_MAX_ROWS: a decode step of a medium batch) with
torch's cuBLASLt path, every other product with F.linear as torch dispatches it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.errors import UnsupportedModelError

# Rope types whose frequencies depend on the running sequence length; a batch
# mixes requests of many lengths, so one set of frequencies cannot serve them.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def _fused(x: torch.Tensor):
    """kernels.triton.fused_layers when `x` is on CUDA (the fused path), else None (plain torch)."""
    if not x.is_cuda:
        return None
    from kernels.triton import fused_layers  # noqa: PLC0415  (imports triton: GPU path only)

    return fused_layers


GEMV_MAX_ROWS = 16  # kernels.triton.gemv.MAX_ROWS (not imported here: that module imports triton)


def gemv_applies(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether the product of `x` ((rows, K)) with `module`'s weight goes to the GEMV kernels: CUDA, 1 to
    `module.gemv_rows` rows (a decode step of a small batch; set_gemv, EngineConfig.gemv_max_rows), 16-bit
    activations.

    float32 stays on F.linear: it is the reference dtype, whose Triton decode is batch-composition invariant
    (a request's tokens do not depend on which others share its batch); kernels for few rows only would
    make a request's last steps, decoded alone, round differently from its earlier ones.
    """
    return (
        x.is_cuda
        and x.dim() == 2
        and 1 <= x.shape[0] <= getattr(module, "gemv_rows", GEMV_MAX_ROWS)
        and x.dtype in (torch.bfloat16, torch.float16)
    )


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias) -> (M, N), M <= GEMV_MAX_ROWS, with kernels/triton/gemv.py (CUDA)."""
    from kernels.triton.gemv import gemv as gemv_kernel  # noqa: PLC0415  (imports triton: GPU path only)

    return gemv_kernel(x, weight, bias, out_dtype=out_dtype)


def gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for weight (2d, K) = [gate | up] -> (M, d), M <= GEMV_MAX_ROWS, in one
    launch on CUDA: the same bits as SiluAndMul()(gemv(x, weight, bias)), one kernel and one (M, 2d) round trip
    through memory fewer per decode step."""
    from kernels.triton.gemv import gemv_silu_mul as gemv_silu_mul_kernel  # noqa: PLC0415  (GPU path only)

    return gemv_silu_mul_kernel(x, weight, bias)


CUBLASLT_MAX_ROWS = 64


def cublaslt_applies(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether the product of `x` ((rows, K)) with `module`'s weight takes torch's cuBLASLt path: CUDA, more
    rows than the GEMV kernels take and at most `module.cublaslt_rows` (set_cublaslt,
    EngineConfig.cublaslt_max_rows), 16-bit activations.

    Both of torch's BLAS paths call NVIDIA's kernels, but their heuristics pick different ones: on the
    decode steps of 32 and 64 requests cuBLASLt's are faster, on products of 128 rows they are not
    (benchmarks/README.md, "cuBLASLt for medium batches"). The choice depends on the row count alone, so a
    step rounds the same way with CUDA graphs on and off.
    """
    return (
        x.is_cuda
        and x.dim() == 2
        and getattr(module, "gemv_rows", GEMV_MAX_ROWS) < x.shape[0] <= getattr(module, "cublaslt_rows", 0)
        and x.dtype in (torch.bfloat16, torch.float16)
    )


def linear_cublaslt(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear through torch's cuBLASLt path (`torch.backends.cuda.preferred_blas_library`, a process-wide
    setting read when the product is launched), the setting restored afterwards. The engine runs its
    forward passes on one thread, so no other product sees the switch."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, weight, bias)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def set_cublaslt(model: nn.Module, max_rows: int) -> None:
    """Products of more rows than the GEMV kernels take and up to `max_rows` (0: none) of every Linear in
    `model` take torch's cuBLASLt path."""
    if max_rows < 0:
        raise ValueError(f"max_rows must be >= 0, got {max_rows}")
    for module in model.modules():
        if isinstance(module, Linear):
            module.cublaslt_rows = max_rows


def set_gemv(model: nn.Module, max_rows: int) -> None:
    """Products of up to `max_rows` rows (0: none) of every Linear in `model`, and of its logits, go to the
    GEMV kernels."""
    if not 0 <= max_rows <= GEMV_MAX_ROWS:
        raise ValueError(f"max_rows must be in [0, {GEMV_MAX_ROWS}], got {max_rows}")
    for module in model.modules():
        if hasattr(module, "gemv_rows"):  # every Linear, and the model (its logits)
            module.gemv_rows = max_rows


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) whose few-row products on CUDA run the GEMV kernels.

    A small-batch decode step multiplies a few rows by every weight: kernels/triton/gemv.py streams it at
    close to the memory bandwidth without a split-K reduction kernel and, on Hopper, starts reading it
    before the previous kernel has finished. Rounds like F.linear (float32 sums, one rounding).
    """

    gemv_rows = GEMV_MAX_ROWS
    cublaslt_rows = CUBLASLT_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gemv_applies(self, x):
            return gemv(x, self.weight, self.bias)
        if cublaslt_applies(self, x):
            return linear_cublaslt(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), reduced in float32.

    `forward(x, residual)` fuses the residual add of a pre-norm block:
    it returns (norm(x + residual), x + residual), or (norm(x), x) without a
    residual, so decoder layers thread one `residual` tensor through.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., hidden), x's dtype."""
        fused = _fused(x)
        if fused is not None and self.weight.dtype == x.dtype:
            return fused.rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, residual_out: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """x, residual: (T, hidden). Returns (normed, new_residual), both (T, hidden); new_residual is
        `residual_out` (contiguous (T, hidden), written) when given."""
        fused = _fused(x)
        if residual is not None and fused is not None and self.weight.dtype == x.dtype == residual.dtype:
            return fused.fused_add_rmsnorm(x, residual, self.weight, self.eps, residual_out)
        if residual is not None:
            x = x + residual
        if residual_out is not None:
            x = residual_out.copy_(x)
        return self.normalize(x), x


def _rope_init_fn(rope_type: str):
    """transformers' inverse-frequency function for `rope_type` (config, device) -> (inv_freq, attention_scaling)."""
    if rope_type == "default":
        # transformers keeps the unscaled formula on each model's rotary class, not in ROPE_INIT_FUNCTIONS.
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return lambda config, device: LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type in _DYNAMIC_ROPE_TYPES or rope_type not in ROPE_INIT_FUNCTIONS:
        supported = ["default"] + [t for t in ROPE_INIT_FUNCTIONS if t not in _DYNAMIC_ROPE_TYPES]
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported; supported: {', '.join(supported)}")
    return ROPE_INIT_FUNCTIONS[rope_type]


def rope_parameters(config: PretrainedConfig) -> dict:
    """The config's rope settings in the transformers-5 layout (`rope_parameters`, with `rope_type`).

    Configs built by older code paths keep them in `rope_scaling` / `rope_theta`;
    transformers' `standardize_rope_params` folds those into `rope_parameters`.
    """
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(params)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half / NeoX layout, like HF Llama).

    Frequencies come from transformers' rope init functions, so every scaling
    scheme the library knows (linear, llama3, yarn, ...) is computed by the
    library. `cos_sin(positions)` runs once per forward; `apply` once per layer.
    The frequency table is a plain float32 attribute (not a module buffer), so
    a model built on the meta device keeps it; it follows the positions' device.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int):
        super().__init__()
        rope_type = rope_parameters(config).get("rope_type", "default")
        with torch.device("cpu"):  # also when the model is being built on the meta device
            inv_freq, scaling = _rope_init_fn(rope_type)(config, torch.device("cpu"))
        self.inv_freq = inv_freq.to(device="cpu", dtype=torch.float32)
        """(rotary_dim // 2,) float32 — inverse frequency of each rotated pair."""
        self.attention_scaling = float(scaling)
        self.rotary_dim = 2 * self.inv_freq.numel()
        if self.rotary_dim != head_dim:
            raise UnsupportedModelError(
                f"partial rotary embeddings (rotary dim {self.rotary_dim} != head_dim {head_dim}) are not supported"
            )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) int64 -> cos, sin: (T, 1, head_dim) in `dtype`, broadcastable over heads."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (T, heads, head_dim) rotated by cos/sin from `cos_sin`; same shape and dtype."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @staticmethod
    def apply_qk(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """q (T, H, D) and k (T, Hkv, D) rotated by cos/sin from `cos_sin`: one fused launch on CUDA
        (new contiguous tensors), two `apply` calls elsewhere. `out` (q_out, k_out): contiguous tensors of
        q's and k's shapes, not overlapping them, that receive the results (returned)."""
        fused = _fused(q)
        if fused is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            return fused.rope(q, k, cos, sin, out)
        rotated = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        if out is None:
            return rotated
        return out[0].copy_(rotated[0]), out[1].copy_(rotated[1])


class SiluAndMul(nn.Module):
    """(T, 2 * d) = [gate | up] -> (T, d) = silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = _fused(x)
        if fused is not None:
            return fused.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
