"""The pure loss math: arrays in, `(loss, metrics)` out, no model and no config.

  losses              GSPO, GSPO-token, GRPO, the KL term, the registry `LOSSES`
  blocks              the building blocks they are assembled from (sequence log-ratio, clip)
  variants            SAPO, CISPO, GMPO from the same blocks
  advantages          group-normalised advantages, per-turn credit
  rollout_correction  TIS / MIS / IcePop weights and the off-policy sequence mask
  row_skip            which rows have an exactly-zero gradient (the update skips them)

May import: jax, numpy and gspo_jax.utils only.
"""
