"""Attention backends and Triton kernels. Holds no scheduling logic and never imports `engine`.

attention/base.py          AttentionBackend interface + registry (lazy imports)
attention/torch_native.py  the CPU path and the reference every other backend is tested against
attention/triton.py        TritonAttnBackend over our kernels:
attention/flashinfer.py    FlashInferAttnBackend (default on GPU for bf16/fp16; flashinfer imported lazily)
triton/                    store_kv.py, decode_attention.py (split-K), extend_attention.py (cached prefix
                           + causal new tokens); each has a plain-torch *_reference and tests, run on CPU
                           under TRITON_INTERPRET=1 and compiled on CUDA; fused_layers.py (RMSNorm,
                           SiLU-and-mul, RoPE, KV indices) and sampling.py (Gumbel-max) serve the engine's
                           GPU layers and sampler
"""
