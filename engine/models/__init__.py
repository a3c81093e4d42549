"""Model families and weight loading.

    source.py    the user's `model` argument → ModelSource (HF folder, GGUF file, default model)
    loader.py    config and weights: safetensors (sharded), GGUF (through transformers), dummy
    registry.py  architecture name → model class, imported lazily
    llama.py     LlamaForCausalLM: Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM (one implementation)
    layers.py    RMSNorm, rotary embedding (frequencies from transformers), SiLU-and-mul
    parallel_layers.py  tensor parallelism: row-parallel linear, vocabulary-parallel embedding and LM head

A model's forward takes a ForwardBatch and calls `batch.attn_backend` for attention.
"""
