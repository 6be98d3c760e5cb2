"""Multi-turn rollouts with tools: environments (`envs`), the pausing in-graph sampler
(`sampler`), the host loop between its turns (`episodes`) and the kind of rollout a run with
an environment makes (`rollout.Episodes`).

May import: gspo_jax.rollout, models, tasks, parallel, utils, config, and
gspo_jax.train's programs and collect (an episode rollout is launched like a group one).
"""
