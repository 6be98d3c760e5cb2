"""`python -m gspo_jax.plan --config FILE --topology v5e:2x2`: the planner's command line."""

from gspo_jax.plan.planner import main

if __name__ == "__main__":
  main()
