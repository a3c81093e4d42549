"""FlashInferAttnBackend: paged attention with FlashInfer's kernels (the default on GPU).

The KV pool is used in place as FlashInfer's paged cache with page size 1 (one token per "page"), NHD
layout: layer l's k_buffers[l] (num_slots, Hkv, D) is viewed as (num_slots, 1, Hkv, D). Those are strided
views of the token-major pool (slot stride num_layers·2·Hkv·D elements); FlashInfer reads the strides of the
K/V tensors it is given (its paged_kv_t takes a page stride and computes offsets in 64 bits). Each forward:

    init_forward_metadata:  host  kv_indptr = cumsum(seq_lens_cpu), qo_indptr = cumsum(extend_seq_lens_cpu)
                            device kv_indices = req_to_token rows flattened (one Triton launch, no sync)
                            plan() of the decode or the prefill wrapper (FlashInfer's host-side scheduling)
    forward (per layer):    store the new K/V (Triton store_kv; not when the caller stored them: kv_stored), then
                            EXTEND  BatchPrefillWithPagedKVCacheWrapper.run: causal over [cached prefix |
                                    new tokens], the query rows aligned to the end of each request's KV
                            DECODE  BatchDecodeWithPagedKVCacheWrapper.run

The prompt rows of an EXTEND step take one of four kernels (`prefill`, EngineConfig.flashinfer_prefill;
"auto" picks "ragged-fa3" on Hopper, "paged-fa2" elsewhere: resolve_prefill_kind):
"paged-fa2" / "paged-fa3" run the paged prefill kernel above (FlashInfer's FA2 or Hopper FA3 family);
"ragged-fa2" / "ragged-fa3" attend the step's own K/V as contiguous tensors with
BatchPrefillWithRaggedKVCacheWrapper (causal) when no prompt request of the step has a cached prefix (or an
earlier chunk), and run the paged kernel of their family otherwise: the paged kernel reads the prefix where
it lies, in one pass, where the ragged kernel would need a second pass over the prefix and a log-sum-exp
merge (SGLang's split; with the FA3 family that split's rows disagree with the reference when requests
without a prefix sit beside ones with one: bench_prefill_attention.py's "split fa3" shows it).

A mixed step (EXTEND) leads with the running requests' decode tokens: one new token each. FlashInfer's
prefill kernel gives each request a whole tile of query rows, so those one-token requests would cost it a
tile each while reading their whole KV; instead the batch's leading run of one-token requests goes to
radixserve's Triton decode kernels (kernels/triton/decode_attention.py, the decode step's own kernels) and
only the requests after it are planned for the prefill wrapper. The two write disjoint rows of the output.

CUDA graphs: one decode wrapper per captured batch size, in FlashInfer's CUDA-graph mode (fixed indptr /
last-page-len buffers and one shared indices buffer); capture plans it with plan(), replay re-plans it with
the real lengths through fast_decode_plan (no Python-side checks, no extra copies).

Only fp16 / bf16 are served (FlashInfer has no float32 kernels): float32 models use the Triton backend.
flashinfer is imported when the backend is built, never at `import kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from kernels.attention.base import AttentionBackend, ForwardBatchLike
from kernels.attention.triton import DecodeMeta, TritonAttnBackend, plan_decode, run_decode

WORKSPACE_BYTES = 256 << 20
"""FlashInfer's float workspace (split-KV partial results), shared by every wrapper of one backend."""

PREFILL_KINDS = ("auto", "paged-fa2", "paged-fa3", "ragged-fa2", "ragged-fa3")
"""The prompt rows' kernels (module docstring): layout, then FlashInfer's kernel family; "auto": see
resolve_prefill_kind."""


def resolve_prefill_kind(kind: str, capability: Tuple[int, int]) -> str:
    """The prompt-row kernel to run on a GPU of compute `capability` (major, minor) for `kind`, one of
    PREFILL_KINDS. "auto": "ragged-fa3" on Hopper (9.x), where FlashInfer's FA3 kernels run, else "paged-fa2".
    Raises ValueError for an unknown kind, or an FA3 kind on a GPU other than Hopper."""
    if kind not in PREFILL_KINDS:
        raise ValueError(f"prefill must be one of {PREFILL_KINDS}, got {kind!r}")
    hopper = capability[0] == 9
    if kind == "auto":
        return "ragged-fa3" if hopper else "paged-fa2"
    if kind.endswith("fa3") and not hopper:
        raise ValueError(
            f"prefill={kind!r} runs FlashInfer's FA3 kernels, which need a Hopper GPU (compute capability 9.x); "
            f"this one is {capability[0]}.{capability[1]}: use an fa2 kind or auto"
        )
    return kind


@dataclass
class _GraphState:
    wrapper: object
    """BatchDecodeWithPagedKVCacheWrapper in CUDA-graph mode for this batch size."""
    indptr: torch.Tensor
    """(bs + 1,) int32, device — the wrapper's fixed indptr buffer."""
    last_page_len: torch.Tensor
    """(bs,) int32, device — all ones (page size 1)."""
    last_page_len_host: torch.Tensor
    """(bs,) int32, host — the same ones, for the planner."""


class FlashInferAttnBackend(AttentionBackend):
    """See AttentionBackend for the shapes of `forward`. `triton_decode_rows`: a mixed step's leading one-token
    requests run the Triton decode kernels (False: FlashInfer's prefill kernel runs every request). `prefill`:
    one of PREFILL_KINDS (module docstring)."""

    supports_cuda_graph = True

    def __init__(self, *args, triton_decode_rows: bool = True, prefill: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.triton_decode_rows = triton_decode_rows
        import flashinfer  # noqa: PLC0415

        self._fi = flashinfer
        device = self.req_to_token.device
        if device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device; use torch_native on CPU")
        self.prefill_kind = resolve_prefill_kind(prefill, torch.cuda.get_device_capability(device))
        """The prompt rows' kernel this backend runs: `prefill` with "auto" resolved for the device."""
        k_buf, _ = self.kv_pool.get_kv_buffer(0)
        self.dtype = k_buf.dtype
        if self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"the flashinfer attention backend serves float16 / bfloat16 KV, not {self.dtype}; "
                "use attention_backend='triton' for float32"
            )
        self.device = device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Tensor-core decode pays off for wide GQA groups (as in SGLang: group >= 4).
        self.decode_tensor_cores = self.num_heads // self.num_kv_heads >= 4
        layout, family = self.prefill_kind.split("-")
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=family)
        self.ragged_wrapper = (
            flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend=family)
            if layout == "ragged"
            else None
        )
        """"ragged-*": the prompt rows' kernel over the step's own K/V, for steps without cached prefixes."""
        self._ragged_planned = False
        """This EXTEND step's prompt rows run on ragged_wrapper (planned), not on prefill_wrapper."""
        self.decode_wrapper = self._new_decode_wrapper()
        self._mode: Optional[str] = None
        self._active_decode = self.decode_wrapper
        self._graphs: Dict[int, _GraphState] = {}
        self._graph_indices: Optional[torch.Tensor] = None
        self._decode_rows = 0
        """EXTEND: the leading one-token requests run by the Triton decode kernels (0: none), with _decode_meta."""
        self._decode_meta: Optional[DecodeMeta] = None

    def _new_decode_wrapper(self, graph: Optional[_GraphState] = None, indices: Optional[torch.Tensor] = None):
        kwargs = dict(use_tensor_cores=self.decode_tensor_cores, backend="fa2")
        if graph is not None:
            kwargs.update(
                use_cuda_graph=True,
                paged_kv_indptr_buffer=graph.indptr,
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=graph.last_page_len,
            )
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", **kwargs)

    # ---- metadata ----------------------------------------------------------------------------
    def _kv_indices(self, batch: ForwardBatchLike, kv_indptr_host: torch.Tensor, first: int = 0) -> torch.Tensor:
        """KV slots of requests [first, bs) of `batch`, laid out by `kv_indptr_host` (their seq_lens' cumsum)."""
        from kernels.triton.fused_layers import build_kv_indices  # noqa: PLC0415

        total = int(kv_indptr_host[-1])
        out = torch.empty(max(total, 1), dtype=torch.int32, device=self.device)
        indptr = kv_indptr_host.to(self.device, non_blocking=True)
        rows = batch.req_pool_indices[first:]
        return build_kv_indices(self.req_to_token, rows, batch.seq_lens[first:], indptr, out)[:total]

    def _plan_kwargs(self) -> dict:
        return dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)

    def init_forward_metadata(self, batch: ForwardBatchLike) -> None:
        bs = batch.batch_size
        self._decode_rows, self._decode_meta = 0, None
        if _is_decode(batch):
            kv_indptr = lengths_indptr(batch.seq_lens_cpu)
            kv_indices = self._kv_indices(batch, kv_indptr)
            last_page_len = torch.ones(bs, dtype=torch.int32)
            self.decode_wrapper.plan(
                kv_indptr,
                kv_indices,
                last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                1,
                **self._plan_kwargs(),
            )
            self._mode, self._active_decode = "decode", self.decode_wrapper
        else:
            first = _leading_one_token_requests(batch.extend_seq_lens_cpu) if self.triton_decode_rows else 0
            if first:
                args = (self.num_heads, self.num_kv_heads, self.head_dim, max(batch.seq_lens_cpu[:first]), self.device)
                self._decode_rows, self._decode_meta = first, plan_decode(first, first, *args)
            if first < bs:
                self._plan_prefill(batch, first)
            self._mode = "extend"
        self._meta_batch = batch

    def _plan_prefill(self, batch: ForwardBatchLike, first: int) -> None:
        """Plan the prompt rows' kernels on requests [first, bs) of `batch`."""
        qo_indptr = lengths_indptr(batch.extend_seq_lens_cpu[first:])
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        self._ragged_planned = self.ragged_wrapper is not None and not any(batch.extend_prefix_lens_cpu[first:])
        if self._ragged_planned:
            self.ragged_wrapper.plan(qo_indptr, qo_indptr, *heads, causal=True, **self._plan_kwargs())
            return
        kv_indptr = lengths_indptr(batch.seq_lens_cpu[first:])
        self.prefill_wrapper.plan(
            qo_indptr,
            kv_indptr,
            self._kv_indices(batch, kv_indptr, first),
            torch.ones(batch.batch_size - first, dtype=torch.int32),
            *heads,
            1,
            causal=True,
            **self._plan_kwargs(),
        )

    def init_forward_metadata_capture(self, batch: ForwardBatchLike) -> None:
        """A CUDA-graph decode wrapper for batch.batch_size, planned on the batch's current lengths."""
        bs = batch.batch_size
        if self._graph_indices is None:
            # Room for every captured batch at full context: rows of req_to_token are context-wide.
            self._graph_indices = torch.zeros(
                self.req_to_token.shape[0] * self.req_to_token.shape[1], dtype=torch.int32, device=self.device
            )
        state = _GraphState(
            None,
            torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
            torch.ones(bs, dtype=torch.int32, device=self.device),
            torch.ones(bs, dtype=torch.int32),
        )
        state.wrapper = self._new_decode_wrapper(state, self._graph_indices)
        self._graphs[bs] = state
        self._plan_graph(state, batch)

    def init_forward_metadata_replay(self, batch: ForwardBatchLike) -> None:
        """Re-plan the graph's wrapper for the real lengths, the lean way (FlashInfer's fast_decode_plan, as
        SGLang does): indptr is copied and kv indices are built straight into the wrapper's fixed buffers,
        then only FlashInfer's C++ planner runs (split-KV work lists in its int workspace)."""
        from flashinfer.decode import fast_decode_plan  # noqa: PLC0415

        state = self._graphs[batch.batch_size]
        kv_indptr = lengths_indptr(batch.seq_lens_cpu)
        total = int(kv_indptr[-1])
        if total > self._graph_indices.numel():
            raise RuntimeError(
                f"decode batch needs {total} KV indices, graph buffer holds {self._graph_indices.numel()}"
            )
        from kernels.triton.fused_layers import build_kv_indices  # noqa: PLC0415

        state.indptr.copy_(kv_indptr, non_blocking=True)
        build_kv_indices(self.req_to_token, batch.req_pool_indices, batch.seq_lens, state.indptr, self._graph_indices)
        fast_decode_plan(
            state.wrapper,
            state.indptr,
            self._graph_indices[:total],
            state.last_page_len_host,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            global_override_indptr_cpu=kv_indptr,
            **self._plan_kwargs(),
        )
        self._mode, self._active_decode, self._meta_batch = "decode", state.wrapper, batch

    def _plan_graph(self, state: _GraphState, batch: ForwardBatchLike) -> None:
        kv_indptr = lengths_indptr(batch.seq_lens_cpu)
        total = int(kv_indptr[-1])
        if total > self._graph_indices.numel():
            raise RuntimeError(
                f"decode batch needs {total} KV indices, graph buffer holds {self._graph_indices.numel()}"
            )
        # Built into scratch, then plan() copies them into the wrapper's fixed buffer (same stream, ordered).
        kv_indices = self._kv_indices(batch, kv_indptr)
        state.wrapper.plan(
            kv_indptr,
            kv_indices,
            torch.ones(batch.batch_size, dtype=torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            **self._plan_kwargs(),
        )
        self._mode, self._active_decode, self._meta_batch = "decode", state.wrapper, batch

    # ---- forward -----------------------------------------------------------------------------
    store_kv = TritonAttnBackend.store_kv  # the same Triton store (kernels/triton/store_kv.py)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        batch: ForwardBatchLike,
        out: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """See AttentionBackend._attend."""
        q = q if q.is_contiguous() else q.contiguous()
        cache = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))  # (num_slots, page_size 1, Hkv, D)
        if q.shape[0] == 0:
            return torch.empty_like(q) if out is None else out
        if self._mode == "decode":
            return self._active_decode.run(q, cache) if out is None else self._active_decode.run(q, cache, out=out)
        n = self._decode_rows
        if out is None:
            out = torch.empty_like(q)
        if n < batch.batch_size:
            self._run_prompt_rows(q[n:], k[n:], v[n:], cache, out[n:])
        if n:
            rows = (batch.req_pool_indices[:n], batch.seq_lens[:n])
            run_decode(self._decode_meta, q[:n], k_buf, v_buf, out[:n], self.req_to_token, *rows, self.scale)
        return out

    def _run_prompt_rows(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple, out: torch.Tensor
    ) -> None:
        """The prompt rows' attention into `out` (T', H, D): q (T', H, D), k/v (T', Hkv, D), this step's own."""
        if self._ragged_planned:
            k, v = (x if x.is_contiguous() else x.contiguous() for x in (k, v))
            self.ragged_wrapper.run(q, k, v, out=out)
        else:
            self.prefill_wrapper.run(q, cache, out=out)


def lengths_indptr(lengths: List[int]) -> torch.Tensor:
    """(n + 1,) int32 host tensor: 0, then the running sum of `lengths`."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, out=out[1:])
    return out


def _leading_one_token_requests(extend_lens: List[int]) -> int:
    """How many requests at the head of an EXTEND batch add exactly one token (its decode rows)."""
    for i, n in enumerate(extend_lens):
        if n != 1:
            return i
    return len(extend_lens)


def _is_decode(batch: ForwardBatchLike) -> bool:
    mode = batch.forward_mode
    return getattr(mode, "value", mode) == "decode"
