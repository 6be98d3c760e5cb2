"""The model: a Qwen3 dense / MoE transformer in Flax NNX (`transformer`, `attention`,
`moe`, `layers`), its configs (`config`), matmul precision (`matmul`), log-probs from
logits or hidden states in chunks (`logprobs`), and Hugging Face / GGUF weights (`hf`,
`safetensors_io`, `gguf_convert`).

May import: jax, flax, numpy, gspo_jax.parallel and gspo_jax.utils.
"""
