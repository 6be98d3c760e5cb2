"""Training: the train step as pure functions (`step`), every compiled program of a run
(`programs`), the optimisers (`optim`), the cold start (`coldstart`), the host side of a
rollout (`collect`), the asynchronous pipeline (`pipeline`), checkpoints (`checkpoint`), the
run directory (`rundir`), metrics (`metrics`), a run's setup (`run`), the loop (`loop`) and
the fused one-program iteration (`fused`).

    python -m gspo_jax.train --config configs/addition_tiny.py

May import: everything below it (gspo_jax.config, objectives, rollout, models, tasks,
parallel, utils, lora.adapters/quant). `run.py` alone chooses a run's kind and so imports
gspo_jax.lora.run and gspo_jax.multiturn, which build on `programs` and `collect`.
Nothing here imports gspo_jax.plan.
"""
