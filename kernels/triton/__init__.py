"""radixserve's own Triton kernels for paged attention. Importing this package is cheap: it does not import triton.

    store_kv.py          new tokens' K/V (T, Hkv, D) -> KV pool slots `loc`                    (one program per token)
    decode_attention.py  one query per request over its paged KV, split-K (flash-decoding):
                         stage 1 partial softmax per (request, kv head, split), stage 2 merges the splits
    extend_attention.py  new tokens of each request over its cached prefix (paged, via req_to_token)
                         plus the causal part of its own new tokens (contiguous rows of k/v)
    fused_layers.py      decoder layers in one launch each: RMSNorm (+ residual add), SiLU-and-mul, RoPE of q
                         and k; and the flattened KV indices of a batch (FlashInfer's page table)
    sampling.py          Gumbel-max sampling (counter-based noise + argmax) in one pass over the logits

Each kernel module exposes a plain-torch reference (`*_reference`) that tests/kernels/test_triton_kernels.py checks it
against; kernels/attention/triton.py (TritonAttnBackend) calls them. Slot indices come from
`req_to_token` ((rows, max_ctx) int32); every kernel accumulates in float32 and accepts fp32/fp16/bf16.
"""


def interpreted(kernel) -> bool:
    """Whether `kernel`, a @triton.jit function, runs under Triton's interpreter (TRITON_INTERPRET, read by
    triton.jit when the kernel was defined) rather than compiled."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(kernel, InterpretedFunction)


def fix_interpreter_scalar_index() -> None:
    """Make the Triton interpreter (TRITON_INTERPRET=1, used on CPU) work with numpy >= 2.4.

    triton 3.6's interpreter holds scalars as 1-element arrays and turns them into Python ints with int(array),
    which numpy >= 2.4 rejects, so `range(start, end)` over loaded bounds fails (triton-lang/triton#9171).
    This wraps its tensor patching to take the element explicitly. Idempotent; a no-op where not needed.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_scalar_index_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._scalar_index_fixed = True
    interpreter._patch_lang_tensor = patched
