"""`python -m gspo_jax.train --config FILE [--set k=v ...]`: the training loop's command line."""

from gspo_jax.train.loop import main

if __name__ == "__main__":
  main()
