"""The reference engine: tensor-parallel Llama-family inference on CPU with a paged KV cache."""
