"""Verifiable tasks: the `Example` record, the `Task` interface and reward scoring.

A task produces prompts with a known answer, so a completion (decoded text, cut at EOS by
the caller) can be scored without a learned reward model. Rewards are plain Python
functions `fn(example, completion) -> float`; `score` combines several of them and refuses
to hide a failing one.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gspo_jax import _checks

SPLITS = ("train", "heldout")

RewardFn = Callable[["Example", str], float]

_SHOW = 200  # characters of a prompt / completion quoted in an error message


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
                  log: Callable[[str], None] = print):
    """(rewards_R float32, correct_R bool, reward components {"reward/<name>": values_R})
    of decoded completions, one Example per completion. Tasks with several reward
    functions report each component; here there is one, `reward`."""
    rewards = score([self.reward], examples, completions)
    correct = np.array([self.is_correct(e, c) for e, c in zip(examples, completions)], bool)
    return rewards, correct, {}

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
  _checks.check_choice(fn, "split", split, SPLITS)


class RewardError(ValueError):
  """A reward function raised, or returned something that is not a finite number.

  Attributes `fn_name` and `index` locate the failure; the message also quotes the
  prompt and the completion. The original exception, if any, is `__cause__`.
  """

  def __init__(self, message: str, *, fn_name: str, index: int):
    super().__init__(message)
    self.fn_name = fn_name
    self.index = index


def _fn_name(fn: Callable) -> str:
  # __qualname__ tells bound methods apart ("Addition.reward"); partials have neither name.
  return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _show(text: Any) -> str:
  shown = repr(text)
  return shown if len(shown) <= _SHOW else shown[:_SHOW] + f"... ({len(shown)} chars)"


class _BadReturn(ValueError):
  """A reward function returned a value `score` cannot use."""


def _as_reward(value: Any) -> float:
  """`value` as a finite float (bool counts as 0 / 1); raises _BadReturn otherwise."""
  if isinstance(value, numbers.Real):
    out = float(value)
  elif isinstance(value, np.ndarray) and value.ndim == 0 and np.issubdtype(value.dtype, np.number) \
      and not np.issubdtype(value.dtype, np.complexfloating):
    out = float(value)
  else:
    raise _BadReturn(f"returned {type(value).__name__} {_show(value)}, not a real number")
  if not math.isfinite(out):
    raise _BadReturn(f"returned the non-finite value {out}")
  return out


def score(reward_fns: Sequence[RewardFn], examples: Sequence[Example], completions: Sequence[str],
          weights: Sequence[float] | None = None) -> np.ndarray:
  """r_i = sum_k weights[k] * reward_fns[k](examples[i], completions[i]).

  Args:
    reward_fns: plain Python functions `fn(example, completion) -> float` on decoded text
      (a task's bound `reward` method qualifies). Each must return a finite real number.
    examples: one Example per completion (repeat an example G times for a group).
    completions: decoded completions, same length as `examples`.
    weights: one finite float per function; default 1.0 each.
  Returns:
    float32 array of shape (len(completions),).
  Raises:
    ValueError: on mismatched lengths, no functions, or non-finite weights.
    RewardError: when a function raises (chained with `from`) or returns NaN, inf or a
      non-number. Never swallowed: a silently zeroed reward would still train the policy,
      towards the wrong thing.
  """
  fn = "score"
  if callable(reward_fns) or isinstance(reward_fns, (str, bytes)):
    raise ValueError(f"{fn}: reward_fns must be a sequence of functions; wrap a single one as [fn]")
  reward_fns = list(reward_fns)
  if not reward_fns:
    raise ValueError(f"{fn}: reward_fns is empty; pass at least one reward function")
  for k, f in enumerate(reward_fns):
    if not callable(f):
      raise ValueError(f"{fn}: reward_fns[{k}] is not callable; got {type(f).__name__}")
  if len(examples) != len(completions):
    raise ValueError(f"{fn}: examples and completions must have the same length; "
                     f"got {len(examples)} and {len(completions)}")
  if weights is None:
    w = np.ones(len(reward_fns))
  else:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(reward_fns),):
      raise ValueError(f"{fn}: weights must hold one number per reward function "
                       f"({len(reward_fns)}); got shape {w.shape}")
    if not np.all(np.isfinite(w)):
      raise ValueError(f"{fn}: weights must be finite; got {w.tolist()}")

  total = np.zeros(len(completions), np.float64)
  for i, (example, completion) in enumerate(zip(examples, completions)):
    for k, f in enumerate(reward_fns):
      try:
        value = _as_reward(f(example, completion))
      except Exception as e:  # noqa: BLE001 -- re-raised with context, never swallowed
        raise _reward_error(fn, f, k, i, example, completion, e) from e
      total[i] += w[k] * value
  return total.astype(np.float32)


def _reward_error(fn: str, f: Callable, k: int, i: int, example: Any, completion: Any,
                  e: Exception) -> RewardError:
  name = _fn_name(f)
  # _as_reward's own errors say "returned ..."; anything else was raised by the function.
  what = str(e) if isinstance(e, _BadReturn) else f"raised {type(e).__name__}: {e}"
  prompt = getattr(example, "prompt", example)
  return RewardError(
      f"{fn}: reward function {name} (reward_fns[{k}]) {what} at index {i}; "
      f"prompt {_show(prompt)}, completion {_show(completion)}", fn_name=name, index=i)
