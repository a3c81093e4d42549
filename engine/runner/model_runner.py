"""ModelRunner: weights, KV memory and the attention backend of one replica; runs a batch.

    ScheduleBatch (CPU plan, forward_batch prepared) → model.forward → logits of the
    last new token of each sampled request → Sampler (grammar rows masked by their
    Req.grammar bitmask) → LaunchedBatch (device; engine/runner/batch_result.py) → BatchResult (host lists)

Memory layout decided here: KV pool capacity (from `max_total_tokens`, or from the
device memory left after the weights, an activation estimate and the share that
`mem_fraction_static` keeps free), the ReqToTokenPool rows and the page allocator.
On CUDA, DECODE batches replay captured CUDA graphs (engine/runner/cuda_graph.py)
unless `disable_cuda_graph`, with or without tensor parallelism; with `enable_piecewise_cuda_graph`,
prefill and mixed steps replay each layer's work outside attention (engine/runner/piecewise_graph.py).

Tensor parallelism (`tensor_parallel_size` N > 1, engine.parallel): the engine core's runner is rank 0. It
starts ranks 1..N-1 (engine/runner/follower.py: a ModelRunner each, built with their TPGroup) and, before
each forward, broadcasts the step (engine.parallel.step) so that every rank runs it on its shard. Only rank
0 samples, from the all-gathered logits; its scheduler and KV allocator are the only ones, and every rank's
KV pool has the same slots. The ranks agree on the pool's size (the smallest any rank can hold).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Optional, Tuple

import torch

from engine.config import EngineConfig
from engine.errors import InvalidConfigError, OutOfMemoryError
from engine.memory.allocator import TokenToKVPoolAllocator
from engine.memory.kv_pool import KVPool
from engine.forward_batch import ForwardMode
from engine.memory.req_to_token import RecordingReqToTokenPool, ReqToTokenPool
from engine.models.layers import set_cublaslt, set_gemv
from engine.models.loader import load_config, load_model
from engine.models.source import ModelSource
from engine.outputs import TokenLogprob
from engine.parallel.shard import check_heads
from engine.runner.batch_result import BatchResult, LaunchedBatch
from engine.runner.device_clock import DeviceClock
from engine.runner.sampler import Sampler, SamplingBatchInfo
from kernels.attention.base import get_backend_class, graph_batch_size

if TYPE_CHECKING:  # pragma: no cover
    from engine.parallel.group import TPGroup

logger = logging.getLogger(__name__)

# Headroom kept free on a GPU beyond the activation estimate: CUDA graphs, attention workspaces,
# cuBLAS workspaces and allocator fragmentation (bytes).
GPU_FIXED_RESERVE = 1 << 30
# Rows of the request table beyond max_running_requests (for chunked / retracting requests).
EXTRA_REQ_ROWS = 8
FOLLOWER_MODULE = "engine.runner.follower"
"""What ranks 1..N-1 run (`python -m`)."""


def resolve_device(name: str) -> torch.device:
    """EngineConfig.device as a torch.device ('auto': cuda when available, else cpu)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OutOfMemoryError(f"device {name!r} requested but CUDA is not available")
    return device


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, tp: Optional["TPGroup"] = None):
        """`tp`: the TPGroup of a follower rank (engine/runner/follower.py). Rank 0 passes None and, when
        config.tensor_parallel_size > 1, starts the other ranks here."""
        self.config = config
        self.source = source
        self.device = resolve_device(config.device)
        self.dtype = _resolve_dtype(config.dtype, self.device)
        self.tp = tp
        self.model_config = load_config(self.source)
        try:
            if tp is None and config.tensor_parallel_size > 1:
                self.tp = self._start_tensor_parallel()
            if self.tp is None:
                self._init_device_state()
            else:  # a rank that dies while the others start: TensorParallelError naming it
                self.device = self.tp.device
                with self.tp.guard():
                    self._init_device_state()
        except BaseException:
            self.close()
            raise
        self.sampler = Sampler()
        self.device_clock = DeviceClock(self.device)
        """The device time of the steps launched here (EngineStats.device_busy_s)."""

    def _init_device_state(self) -> None:
        self._init_model()
        if self.tp is not None and self.device.type == "cuda" and not self.config.disable_custom_all_reduce:
            self.tp.enable_peer_all_reduce(self.dtype)
        self._init_memory()
        self._init_attention_backend()

    def _start_tensor_parallel(self) -> "TPGroup":
        """Rank 0: check that the model splits over the ranks, then start them (engine.parallel.launch)."""
        cfg = self.model_config
        check_heads(
            cfg.num_attention_heads,
            getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            self.config.tensor_parallel_size,
        )
        from engine.parallel.launch import start_group  # noqa: PLC0415  (torch.distributed: TP only)

        return start_group(self.config, self.device, FOLLOWER_MODULE)

    def _init_model(self) -> None:
        free_before = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        try:
            self.model = load_model(
                self.source,
                self.model_config,
                self.config.load_format,
                self.dtype,
                self.device,
                seed=self.config.random_seed,
                tp=self.tp,
            )
        except torch.cuda.OutOfMemoryError as exc:
            n = _param_count(self.model_config)
            size = n * torch.empty((), dtype=self.dtype).element_size()
            raise OutOfMemoryError(
                f"the model's weights (~{n / 1e9:.2f} B parameters, ~{size / 2**30:.1f} GiB in {self.dtype}) do not "
                f"fit on {self.device} ({free_before / 2**30:.1f} GiB free): use a GPU with more memory, a "
                f"smaller dtype or a smaller model"
            ) from exc
        set_gemv(self.model, 0 if self.config.disable_gemv else self.config.gemv_max_rows)
        set_cublaslt(self.model, self.config.cublaslt_max_rows)
        if self.device.type == "cuda":
            from kernels.triton import pdl  # noqa: PLC0415  (GPU path only)

            pdl.set_enabled(not self.config.disable_pdl)
        self.vocab_size = int(self.model_config.vocab_size)
        self.context_len = int(self.config.context_length or self.model_config.max_position_embeddings)
        window = self.model.sliding_window
        if window is not None and self.context_len > window:
            # Attention here is full, not windowed: it matches the model only within the window.
            logger.warning("context length capped at the model's sliding window (%d tokens)", window)
            self.context_len = window

    def _kv_capacity_tokens(self, bytes_per_token: int) -> int:
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Memory this process's allocator caches but no tensor uses (e.g. an earlier engine's) is free too.
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            activations = self.activation_bytes()
            budget = free - total * (1 - self.config.mem_fraction_static) - activations
            tokens = int(budget // bytes_per_token)
            need = min(self.context_len, 4096)
            if tokens < need:
                raise OutOfMemoryError(
                    f"after the weights, {self.device} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB; "
                    f"activations need ~{activations / 2**30:.1f} GiB and mem_fraction_static="
                    f"{self.config.mem_fraction_static} keeps "
                    f"{(1 - self.config.mem_fraction_static) * total / 2**30:.1f}"
                    f" GiB free, leaving room for {max(tokens, 0)} KV tokens ({bytes_per_token} bytes each), fewer "
                    f"than {need}: raise mem_fraction_static, lower max_prefill_tokens / chunked_prefill_size, "
                    f"or use a smaller model or dtype"
                )
            return tokens
        import psutil  # noqa: PLC0415  (CPU sizing only)

        budget = psutil.virtual_memory().available * (1 - self.config.mem_fraction_static)
        return int(min(budget // bytes_per_token, self.config.cpu_max_total_tokens))

    def _uses_piecewise_graphs(self) -> bool:
        return (
            self.device.type == "cuda"
            and self.config.enable_piecewise_cuda_graph
            and not self.config.disable_cuda_graph
            and self.tp is None
        )

    def activation_bytes(self) -> int:
        """Estimate of the peak activation memory of one forward (bytes): the largest prefill batch's
        per-token tensors (qkv, ~6 hidden-sized temporaries, gate/up and its product) plus the logits and
        sampler temporaries of a full decode batch, plus GPU_FIXED_RESERVE. Piecewise CUDA graphs hold
        their own pool and buffers for the largest piecewise step besides (the same per-token tensors)."""
        cfg, m = self.model_config, self.model
        elem = torch.empty((), dtype=self.dtype).element_size()
        chunk = self.config.chunked_prefill_size
        tokens = max(self.config.max_prefill_tokens, chunk if chunk > 0 else 0)
        if self._uses_piecewise_graphs():
            tokens += self.config.piecewise_cuda_graph_max_tokens
        per_token = (
            (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + 6 * cfg.hidden_size + 3 * cfg.intermediate_size
        ) * elem
        logits = self.config.max_running_requests * self.vocab_size * 4 * 3
        return tokens * per_token + logits + GPU_FIXED_RESERVE

    def _init_memory(self) -> None:
        m = self.model
        bytes_per_token = KVPool.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, self.dtype)
        ps = self.config.page_size
        tokens = self._kv_capacity_tokens(bytes_per_token)
        if self.tp is not None:  # slot indices must mean the same on every rank
            tokens = self.tp.agree_min(tokens)
        num_pages = tokens // ps + 1  # + the reserved page 0
        self.kv_pool = KVPool(
            num_pages * ps,
            m.num_layers,
            m.num_kv_heads,
            m.head_dim,
            self.dtype,
            self.device,
            shared=self.config.share_kv_pool,
        )
        self.allocator = TokenToKVPoolAllocator(num_pages, ps)
        rows = self.config.max_running_requests + EXTRA_REQ_ROWS
        # Rank 0 of a tensor-parallel group records its table writes for the other ranks' copies.
        table = RecordingReqToTokenPool if self.tp is not None and self.tp.rank == 0 else ReqToTokenPool
        self.req_to_token_pool = table(rows, self.context_len + ps, self.device)
        logger.info(
            "KV pool: %d tokens (%d pages of %d), %.1f MiB",
            self.allocator.size,
            num_pages - 1,
            ps,
            num_pages * ps * bytes_per_token / 2**20,
        )

    def _resolve_backend_name(self) -> str:
        name = self.config.attention_backend
        if name != "auto":
            return name
        if self.device.type != "cuda":
            return "torch_native"
        if self.dtype in (torch.float16, torch.bfloat16):
            try:
                import flashinfer  # noqa: F401, PLC0415

                return "flashinfer"
            except ImportError:
                logger.warning(
                    "flashinfer is not installed (pip install 'radixserve[gpu]'): using the triton attention backend"
                )
        return "triton"

    def _init_attention_backend(self) -> None:
        name = self._resolve_backend_name()
        if name in ("flashinfer", "triton") and self.device.type != "cuda":
            raise InvalidConfigError(f"attention_backend={name!r} needs a CUDA device (got {self.device})")
        self.attn_backend_name = name
        m = self.model
        args = (self.req_to_token_pool.req_to_token, self.kv_pool, m.num_heads, m.num_kv_heads, m.head_dim)
        # FlashInfer's mixed steps attend their decode rows with the Triton decode kernels unless those are off.
        extra = {}
        if name == "flashinfer":
            from kernels.attention.flashinfer import resolve_prefill_kind  # noqa: PLC0415

            try:
                prefill = resolve_prefill_kind(
                    self.config.flashinfer_prefill, torch.cuda.get_device_capability(self.device)
                )
            except ValueError as exc:
                raise InvalidConfigError(f"flashinfer_prefill: {exc}") from exc
            logger.info("attention: flashinfer, prompt rows on %s", prefill)
            extra = dict(triton_decode_rows=self.config.triton_decode_max_bs > 0, prefill=prefill)
        self.attn_backend = get_backend_class(name)(*args, m.head_dim**-0.5, **extra)
        self.triton_decode_backend = None
        """The Triton backend for decode steps of up to `triton_decode_max_bs` requests when the main backend is
        FlashInfer (see decode_backend); None: the main backend runs every step."""
        if name == "flashinfer" and self.config.triton_decode_max_bs > 0:
            self.triton_decode_backend = get_backend_class("triton")(*args, m.head_dim**-0.5)
        self.graph_runner = None
        # Tensor-parallel ranks capture the same graphs in the same order: the forward's collectives
        # (peer-memory or NCCL all-reduces, the logits' all-gather) are captured with it.
        if self.device.type == "cuda" and not self.config.disable_cuda_graph and self.attn_backend.supports_cuda_graph:
            from engine.runner.cuda_graph import CudaGraphRunner  # noqa: PLC0415

            max_bs = self.config.cuda_graph_max_bs or min(self.config.max_running_requests, 256)
            self.graph_runner = CudaGraphRunner(
                self.model, self.decode_backend, self.req_to_token_pool, max_bs, self.device, self.decode_uses_pdl
            )

        self.piecewise_runner = None
        """Runs prefill and mixed steps of up to piecewise_cuda_graph_max_tokens tokens (piecewise_graph.py)."""
        if self._uses_piecewise_graphs():
            from engine.runner.piecewise_graph import PiecewiseGraphRunner  # noqa: PLC0415

            self.piecewise_runner = PiecewiseGraphRunner(
                self.model, self.config.piecewise_cuda_graph_max_tokens, self.device, self.attn_backend
            )

    def decode_backend(self, batch_size: int):
        """The attention backend of a DECODE step of `batch_size` requests: the Triton backend up to
        `triton_decode_max_bs` requests when the main backend is FlashInfer (Triton's decode kernels read the
        KV pool faster than FlashInfer's, need no host-side plan per step, and in the GEMV kernels' steps wait
        for their predecessor through PDL, so no kernel boundary of such a step drains the GPU), the main backend
        otherwise. Decided on the power of two at or above `batch_size`, the CUDA graph a step of that size
        replays, so a step runs the same kernels with graphs on and off."""
        if self.triton_decode_backend is not None and graph_batch_size(batch_size) <= self.config.triton_decode_max_bs:
            return self.triton_decode_backend
        return self.attn_backend

    def decode_uses_pdl(self, batch_size: int) -> bool:
        """Whether a DECODE step of `batch_size` requests launches its Triton kernels with PDL (where PDL is
        on at all): exactly where its matmuls run our GEMV kernels (the batch rounded up to its CUDA graph's
        power of two is at most `gemv_max_rows`, and `disable_gemv` is off), which fetch their first weight
        tile before waiting for the kernel before them. Other steps multiply with cuBLAS GEMMs, and there
        PDL's early launches cost time (kernels/triton/pdl.py; `bench_decode.py --disable-pdl`)."""
        return not self.config.disable_gemv and graph_batch_size(batch_size) <= self.config.gemv_max_rows

    def pdl_scope(self, fb) -> ContextManager[None]:
        """Around the launches of ForwardBatch `fb`'s forward: suspends PDL for a DECODE step that
        `decode_uses_pdl` keeps without it; a no-op for every other step and off CUDA."""
        if self.device.type != "cuda" or fb.forward_mode is not ForwardMode.DECODE:
            return contextlib.nullcontext()
        from kernels.triton import pdl  # noqa: PLC0415  (GPU path only)

        return pdl.suspended(not self.decode_uses_pdl(fb.batch_size))

    def backend_for(self, fb) -> object:
        """The attention backend that runs ForwardBatch `fb` (prefill and mixed steps: the main one)."""
        if fb.forward_mode is ForwardMode.DECODE:
            return self.decode_backend(fb.batch_size)
        return self.attn_backend

    def run_batch(self, batch) -> BatchResult:
        """Forward `batch` (a prepared ScheduleBatch), sample its sampled requests, wait for the tokens."""
        return self.launch_batch(batch).resolve()

    @torch.inference_mode()
    def launch_batch(self, batch, steps: Optional[List[int]] = None) -> LaunchedBatch:
        """Queue the forward of `batch` (a prepared ScheduleBatch) and the sampling of its sampled requests
        on the device, and the copy of the results to the host; on CUDA nothing here waits for the device
        except prompt logprobs (computed on the host now). `steps`: the sampling step of each sampled
        request (default: its len(output_ids); overlap scheduling adds the token still in flight).
        Tensor-parallel: every rank runs the step; a rank's death raises TensorParallelError."""
        started = self.device_clock.start()
        if self.tp is None:
            launched = self._launch(batch, steps)
        else:
            with self.tp.guard():
                launched = self._launch(batch, steps)
        self.device_clock.stop(started, _step_kind(batch))
        return launched

    def forward_hidden(self, fb) -> torch.Tensor:
        """Final-normed hidden states (T, hidden) of a ForwardBatch run without a decode graph (its
        attn_backend set): the attention plan, then the piecewise CUDA graphs when they take the step,
        else the model's forward. A piecewise result is a static buffer, valid until the next step's
        forward: whatever reads it must be queued before that."""
        fb.attn_backend.init_forward_metadata(fb)
        if self.piecewise_runner is not None and self.piecewise_runner.can_run(fb):
            return self.piecewise_runner.forward(fb)
        return self.model(fb)

    def _launch(self, batch, steps: Optional[List[int]]) -> LaunchedBatch:
        fb = batch.forward_batch
        fb.attn_backend = self.backend_for(fb)
        reqs = batch.sampled_reqs
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            if self.tp is not None:
                self._send_step(fb, [], len(reqs))
            logits = self.graph_runner.replay(fb)  # DECODE: every request is sampled, no prompt logprobs
            prompt_logprobs = {}
        else:
            rows = self._prompt_logprob_rows(batch) if fb.forward_mode is ForwardMode.EXTEND else []
            if self.tp is not None:
                self._send_step(fb, rows, len(reqs))
            with self.pdl_scope(fb):
                hidden = self.forward_hidden(fb)
                prompt_logprobs = self._prompt_logprobs(batch, hidden, rows) if rows else {}
                if not reqs:
                    return LaunchedBatch.empty(self.device, prompt_logprobs)
                logits = self.model.compute_logits(hidden[fb.last_token_rows[: len(reqs)]])
        info = SamplingBatchInfo.build(
            [r.sampling_params for r in reqs],
            seeds=[r.seed for r in reqs],
            steps=[len(r.output_ids) for r in reqs] if steps is None else steps,
            output_ids=[r.output_ids for r in reqs],
            prompt_ids=[r.origin_input_ids for r in reqs],
            vocab_size=self.vocab_size,
            device=self.device,
            grammars=[r.grammar for r in reqs],
        )
        out = self.sampler(logits, info)
        return LaunchedBatch.start(
            out.next_token_ids,
            out.logprobs,
            out.top_logprob_ids,
            out.top_logprob_vals,
            [r.sampling_params.top_logprobs for r in reqs],
            prompt_logprobs,
        )

    def _prompt_logprob_rows(self, batch) -> List[Tuple[int, int, int]]:
        """(batch index, first hidden row, rows) of each request owing prompt logprobs whose rows this step
        computes. Row j of request i holds position kv_len + j; it scores prompt token kv_len + j + 1 (the
        last prompt position predicts an output token instead)."""
        rows = []
        for i, req in enumerate(batch.reqs):
            if not req.needs_prompt_logprobs:
                continue
            first = req.kv_len
            if first != len(req.prompt_logprobs):  # prompt logprobs forbid prefix reuse, so these agree
                raise RuntimeError(f"{req}: prompt logprobs out of step ({len(req.prompt_logprobs)} != {first})")
            n = min(req.extend_len, len(req.origin_input_ids) - 1 - first)
            if n > 0:
                rows.append((i, batch.forward_batch.extend_start_loc_cpu[i], n))
        return rows

    def _prompt_logprobs(
        self, batch, hidden: torch.Tensor, rows: List[Tuple[int, int, int]]
    ) -> Dict[int, List[TokenLogprob]]:
        """The logprob of each prompt token scored by `rows` (_prompt_logprob_rows), per batch index."""
        result: Dict[int, List[TokenLogprob]] = {}
        for i, start, n in rows:
            req = batch.reqs[i]
            first = req.kv_len
            logp = torch.log_softmax(self.model.compute_logits(hidden[start : start + n]), dim=-1)
            targets = torch.tensor(req.origin_input_ids[first + 1 : first + 1 + n], device=logp.device)
            chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
            k = req.sampling_params.prompt_logprobs
            top = logp.topk(k, dim=-1) if k else None
            top_ids = top.indices.tolist() if top is not None else [[] for _ in range(n)]
            top_vals = top.values.tolist() if top is not None else [[] for _ in range(n)]
            result[i] = [
                TokenLogprob(int(t), lp, list(zip(ti, tv)))
                for t, lp, ti, tv in zip(targets.tolist(), chosen, top_ids, top_vals)
            ]
        return result

    # ---- tensor parallelism ------------------------------------------------------------------------
    def _send_step(self, fb, prompt_rows: List[Tuple[int, int, int]], num_sampled: int) -> None:
        """Rank 0: broadcast the step about to run (engine.parallel.step)."""
        from engine.parallel.step import send_step  # noqa: PLC0415  (TP only)

        edits = self.req_to_token_pool.take_edits()
        send_step(self.tp, fb, edits, [(start, n) for _, start, n in prompt_rows], num_sampled)

    def call_other_ranks(self, module: str, function: str, args: Tuple[Any, ...]) -> None:
        """Rank 0, in the engine loop between two steps: every other rank runs `module.function(runner, *args)`
        in its step loop, after the steps sent so far (engine.parallel.step.send_call). Raises
        TensorParallelError when a rank is dead."""
        if self.tp is None:
            raise RuntimeError("call_other_ranks needs a tensor-parallel engine")
        from engine.parallel.step import RankCall, send_call  # noqa: PLC0415  (TP only)

        with self.tp.guard():
            send_call(self.tp, RankCall(module, function, tuple(args)))

    def check_ranks(self) -> None:
        """Rank 0: raise TensorParallelError if another rank's process has exited (a no-op otherwise)."""
        failure = self.tp.failure if self.tp is not None else None
        if failure is not None:
            raise failure

    @property
    def watches_ranks(self) -> bool:
        """Rank 0 of a tensor-parallel group: other ranks' processes can die under it."""
        return self.tp is not None and self.tp.processes is not None

    def close(self) -> None:
        """Rank 0: stop the other ranks; every rank: leave the group; a shared KV pool's segment is removed.
        Idempotent."""
        kv_pool = getattr(self, "kv_pool", None)
        if kv_pool is not None:
            kv_pool.close()
        tp, self.tp = self.tp, None
        if tp is None:
            return
        if tp.processes is not None:
            if tp.failure is None:
                try:
                    from engine.parallel.step import send_stop  # noqa: PLC0415

                    send_stop(tp)
                    tp.processes.stop()
                except Exception:  # noqa: BLE001 - a rank died meanwhile: end them all
                    logger.warning("tensor-parallel ranks did not stop cleanly: killing them", exc_info=True)
            tp.processes.kill()
        tp.close()


def _step_kind(batch) -> str:
    """DeviceClock's kind of a batch: "decode", "mixed" (an EXTEND batch with decode rows) or "prefill"."""
    if batch.forward_batch.forward_mode is ForwardMode.DECODE:
        return "decode"
    return "mixed" if batch.num_decode else "prefill"


def _param_count(cfg) -> int:
    """Approximate parameter count of a Llama-style config (for error messages)."""
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    d = getattr(cfg, "head_dim", None) or h // heads
    per_layer = h * heads * d * 2 + 2 * h * kv * d + 3 * h * cfg.intermediate_size
    embed = cfg.vocab_size * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    return L * per_layer + embed
