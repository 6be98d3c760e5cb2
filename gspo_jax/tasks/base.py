"""Verifiable tasks: the `Example` record and the `Task` interface.

A task produces prompts with a known answer, so a completion (decoded text, cut at EOS by
the caller) can be scored without a learned reward model. A built-in task's reward is its
per-example `reward(example, completion)` method; `Task.score_batch`, what the trainer
calls, hands it to `gspo_jax.tasks.rewards.score_batch`, the same scoring path a dataset task's
user functions take, so both are checked alike and fail with the same RewardError. This
module says what a task provides; how reward functions are called and checked lives in
`gspo_jax.tasks.rewards`.
"""

from __future__ import annotations

import abc
import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gspo_jax.tasks import rewards as R
from gspo_jax.utils import checks

SPLITS = ("train", "heldout")


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem: the prompt text, the canonical answer text, and task-specific data.

  `meta` (e.g. the operands) takes part in equality but not in the hash, so an Example
  stays hashable although a dict is not.
  """
  prompt: str
  answer: str
  meta: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)


class Task(abc.ABC):
  """A family of problems with a verifiable answer.

  Contract for subclasses:
    * `sample(rng, n, split)` is deterministic given the state of `rng`, and the
      "train" and "heldout" splits are disjoint by construction (membership is a fixed
      function of the problem, not of the rng), so held-out accuracy measures
      generalisation rather than recall.
    * `reward` lies in [0, 1]; it is 1.0 exactly when `is_correct` is True.
    * `demonstration(example)` is a completion that earns reward 1.0 (supervised cold
      start). It holds no EOS: the tokenizer layer appends that token.
  """

  name: str = ""  # registry key, set by each subclass

  @abc.abstractmethod
  def sample(self, rng: np.random.Generator, n: int, split: str) -> list[Example]:
    """`n` examples of `split` ("train" or "heldout"), drawn with replacement."""

  @abc.abstractmethod
  def demonstration(self, example: Example) -> str:
    """The ideal completion text for `example`."""

  def demonstration_segments(self, example: Example) -> list[tuple[str, bool]]:
    """The demonstration as (text, is_observation) segments, for multi-turn tasks whose
    demonstrations hold an environment's observations (not trained on in the cold start).
    Single-turn tasks: one model segment, `demonstration(example)`."""
    return [(self.demonstration(example), False)]

  @abc.abstractmethod
  def is_correct(self, example: Example, completion: str) -> bool:
    """True when `completion` states the right answer (the accuracy metric)."""

  def reward(self, example: Example, completion: str) -> float:
    """1.0 when `is_correct`, else 0.0. Subclasses may add partial credit below 1.0."""
    return 1.0 if self.is_correct(example, completion) else 0.0

  def train_batch(self, seed: int, step: int, n: int) -> list[Example]:
    """The `n` training prompts of iteration `step`: a pure function of (seed, step), so a
    resumed run sees the prompts an uninterrupted one would."""
    return self.sample(np.random.default_rng([seed, step]), n, "train")

  def position(self, step: int, batch: int) -> tuple[int, int] | None:
    """(epoch, index) in a finite dataset of iteration `step`'s first prompt; None for a
    generated task (no epochs)."""
    return None

  def eval_examples(self, seed: int, n: int) -> list[Example]:
    """The fixed held-out set of a run (the same for every evaluation)."""
    return self.sample(np.random.default_rng([seed, 7_777_777]), n, "heldout")

  def score_batch(self, examples: Sequence[Example], completions: Sequence[str], *,
                  log: Callable[[str], None] = print
                  ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(rewards_R float32, correct_R bool, reward components {"reward/<name>": values_R})
    of decoded completions, one Example per completion (R rows).

    Scored by `rewards.score_batch` with `reward` wrapped as a per-example function (a
    failing call is a RewardError naming "<Task>.reward" and the row). Tasks with several
    reward functions report each component; a built-in task has one and reports none."""
    reward = R.per_example(self.reward, name=f"{type(self).__name__}.reward")
    total, _ = R.score_batch([reward], [e.prompt for e in examples], completions,
                             {"example": list(examples)}, log=log)
    correct = np.array([self.is_correct(e, c) for e, c in zip(examples, completions)], bool)
    return total, correct, {}

  def corpus(self, rng: np.random.Generator, n: int) -> list[str]:
    """`n` texts prompt + demonstration, to train a tokenizer on.

    Drawn from the train split only: a tokenizer is fitted on training data like
    anything else (the character set is the same in both splits anyway).
    """
    return [ex.prompt + self.demonstration(ex) for ex in self.sample(rng, n, "train")]


def check_sample_args(fn: str, rng: Any, n: Any, split: Any) -> None:
  """Shared argument checks for `Task.sample` implementations."""
  if not isinstance(rng, np.random.Generator):
    raise ValueError(f"{fn}: rng must be a numpy.random.Generator (np.random.default_rng(seed)); "
                     f"got {type(rng).__name__}")
  if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
    raise ValueError(f"{fn}: n must be an int >= 0; got {n!r}")
  checks.check_choice(fn, "split", split, SPLITS)
