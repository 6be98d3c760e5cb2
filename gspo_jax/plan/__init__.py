"""The TPU planner: compile a run's programs for a Cloud TPU topology on this CPU machine
and report memory, traffic and a roofline per chip (`planner`, `python -m gspo_jax.plan`);
chip figures and analytic costs (`cost`), collectives read from the HLO (`hlo`), the text
report (`report`), and the real-model recipes it plans (`recipes`).

May import: anything in gspo_jax below it (config, train, lora, models, parallel, ...).
Nothing in gspo_jax imports plan.
"""
