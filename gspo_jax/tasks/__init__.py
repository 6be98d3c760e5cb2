"""Verifiable tasks with exact rewards, small enough for a tiny model to learn on CPU.

    task = make_task("addition", digits=2)
    examples = task.sample(np.random.default_rng(0), 64, "train")
    rewards = score([task.reward], examples, completions)
"""

from __future__ import annotations

from gspo_jax.tasks.arithmetic import Addition, BinaryArithmetic, Multiplication
from gspo_jax.tasks.base import SPLITS, Example, RewardError, RewardFn, Task, score

TASKS: dict[str, type[Task]] = {"addition": Addition, "multiplication": Multiplication}


def make_task(name: str, **kwargs) -> Task:
  """The task registered as `name` in TASKS, built with `kwargs` (e.g. digits=3)."""
  if name not in TASKS:
    raise ValueError(f"make_task: name must be one of {tuple(TASKS)}; got {name!r}")
  return TASKS[name](**kwargs)


__all__ = [
    "SPLITS", "TASKS", "Addition", "BinaryArithmetic", "Example", "Multiplication", "RewardError",
    "RewardFn", "Task", "make_task", "score",
]
