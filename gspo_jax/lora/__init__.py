"""LoRA: low-rank adapters on a frozen base (`adapters`), the base in int8 (`quant`), what a
LoRA run does differently from a full one (`run`), and its exports, merged or as a PEFT
adapter (`export`, `python -m gspo_jax.lora.export`).

May import: adapters and quant: gspo_jax.models, gspo_jax.parallel, gspo_jax.utils. run and
export build on a run: gspo_jax.train (programs, step, checkpoints; export loads a run).
"""
