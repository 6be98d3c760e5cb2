"""Making responses inside one compiled program: the in-graph group sampler (`sampling`),
live-row compaction (`compaction`), teacher-forced log-probs of given responses
(`teacher_forcing`), length shaping and metrics (`lengths`) and DAPO's dynamic sampling
with static shapes (`dynamic_sampling`). The host side of a rollout (launch, score, feed
back) is `gspo_jax.train.collect`; multi-turn episodes are `gspo_jax.multiturn`.

May import: jax, numpy, gspo_jax.models, gspo_jax.parallel, gspo_jax.utils.
"""
