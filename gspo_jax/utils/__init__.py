"""Small shared helpers with no project imports: argument checks that hold under `jax.jit`
(`checks`), the run's named random streams (`rng`), and config files / `--set` / JSON for
frozen dataclasses (`configlib`).

May import: the standard library, jax, numpy, tyro, dacite. Nothing of gspo_jax.
"""
