"""Tasks: where prompts come from and how completions are scored.

Built-in tasks with exact rewards, small enough for a tiny model to learn on CPU, and
`DatasetTask` for your own prompts (a JSONL file) and reward functions. Every task scores
through `Task.score_batch`, which calls `gspo_jax.tasks.rewards.score_batch`:

    task = make_task("addition", digits=2)
    task = make_task("chain", digits=1, steps=12)   # long worked solutions (tasks/chain.py)
    examples = task.sample(np.random.default_rng(0), 64, "train")
    rewards_R, correct_R, parts = task.score_batch(examples, completions)

    task = DatasetTask(DataConfig(train_file="train.jsonl"), ["exact_match"])
"""

from __future__ import annotations

from gspo_jax.tasks.arithmetic import Addition, BinaryArithmetic, Multiplication
from gspo_jax.tasks.base import SPLITS, Example, Task
from gspo_jax.tasks.chain import Chain
from gspo_jax.tasks.dataset import DataConfig, DatasetTask, examples_from_file
from gspo_jax.tasks.tools import ToolMultiplication

TASKS: dict[str, type[Task]] = {"addition": Addition, "multiplication": Multiplication,
                                "chain": Chain, "tool_multiplication": ToolMultiplication}


def make_task(name: str, **kwargs) -> Task:
  """The built-in task registered as `name` in TASKS, built with `kwargs` (e.g. digits=3).
  A dataset task takes a DataConfig and reward specs instead: `DatasetTask(cfg, specs)`."""
  if name not in TASKS:
    raise ValueError(f"make_task: name must be one of {tuple(TASKS)}; got {name!r}")
  return TASKS[name](**kwargs)


__all__ = [
    "SPLITS", "TASKS", "Addition", "BinaryArithmetic", "Chain", "DataConfig", "DatasetTask", "Example",
    "Multiplication", "Task", "ToolMultiplication", "examples_from_file", "make_task",
]
