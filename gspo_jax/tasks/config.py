"""The `task` config group: which problems a run trains on and how they are scored.

    task.name     a built-in (`gspo_jax.tasks.TASKS`), "dataset" (JSONL prompts scored by
                  `task.reward`) or "gym" (a reasoning-gym dataset)
    task.digits   built-in arithmetic and chains: digits per number
    task.steps    task.name="chain" only: operations per problem (None = 12)
    task.data.*   where a dataset's prompts come from and how they are shown (DataConfig)
    task.reward   reward specs for "dataset" (and extra terms for "gym")
    task.gym.*    the reasoning-gym dataset (GymConfig)

Each task checks its own settings here, naming the fields as the user sets them; the checks
that need the rollout's widths (a chain's solutions must fit `rollout.max_new_tokens`) are
`TaskConfig.check_widths`, which `TrainConfig` calls.
"""

from __future__ import annotations

import dataclasses

from gspo_jax.tasks.chain import DEFAULT_STEPS, Chain
from gspo_jax.tasks.dataset import DataConfig
from gspo_jax.tasks.gym import GymConfig
from gspo_jax.tasks.gym import check_settings as check_gym


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  name: str = "addition"            # a built-in (gspo_jax.tasks.TASKS), "dataset" or "gym"
  digits: int = 2
  # name="chain" only: operations per problem, the difficulty knob of its solution length
  # (about 10 tokens per step at digits=1: 5 -> 52, 26 -> 262); None = 12.
  steps: int | None = None
  # name="dataset": prompts from data.train_file, scored by `reward`: specs
  # "module:fn", "path/file.py:fn" or a built-in name, each optionally "*weight"
  # (see gspo_jax/tasks/rewards.py); the first one decides correctness.
  data: DataConfig = DataConfig()
  reward: tuple[str, ...] = ()
  # name="gym": a reasoning-gym dataset's problems, scored by its own verifier (then by
  # `reward`, if set); data.* says how prompts are shown (gspo_jax/tasks/gym.py).
  gym: GymConfig = GymConfig()

  def __post_init__(self):
    if self.steps is not None and self.name != "chain":
      raise ValueError(f"task.steps applies to task.name='chain'; task.name is {self.name!r}")
    if self.name == "dataset" and not (self.data.train_file and self.reward):
      raise ValueError("task.name='dataset' needs task.data.train_file (JSONL) and "
                       "task.reward (e.g. task.reward=my_module:my_reward)")
    if self.name not in ("dataset", "gym") and (self.data.train_file or self.reward):
      raise ValueError(f"task.data.train_file and task.reward apply to task.name='dataset' "
                       f"(task.reward also to task.name='gym'); task.name is {self.name!r}")
    check_gym(self.name, self.gym, self.data)

  def check_widths(self, max_new_tokens: int, max_prompt_len: int) -> None:
    """A chain's settings against the rollout's widths (before any tokenizer exists)."""
    if self.name == "chain":
      Chain.check_settings(self.digits, DEFAULT_STEPS if self.steps is None else self.steps,
                           max_new_tokens, max_prompt_len)

  def builtin_kwargs(self) -> dict:
    """What a built-in task's constructor takes (`tasks.make_task(name, **kwargs)`)."""
    return {"digits": self.digits, **({} if self.steps is None else {"steps": self.steps})}
