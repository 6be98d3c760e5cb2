"""Tasks solved with a tool: the model calls a calculator in text and copies its result.

    "123*456=" -> "[123*456]" (model turn, ends at the stop token "]")
                  "56088;"    (observation: the calculator's value, appended by the
                               environment `gspo_jax.multiturn.envs.CalculatorEnv`)
                  "56088"     (model turn, ends at EOS)

A tiny model cannot multiply three-digit numbers in its head, but it can copy the operands
into a call and the result out of the observation. Train with `multiturn.env=calculator`
(configs/tool_multiplication.py). The operands, splits and answers are `Multiplication`'s.
"""

from __future__ import annotations

import numpy as np

from gspo_jax.tasks.arithmetic import Multiplication
from gspo_jax.tasks.base import Example

OPEN, CLOSE, RESULT_END = "[", "]", ";"   # CalculatorEnv's tags


class ToolMultiplication(Multiplication):
  """Multiplication with a calculator tool (see the module docstring). Correct: the text
  after the episode's last observation (its last RESULT_END) is the answer; a direct
  answer without a call counts too."""
  name = "tool_multiplication"

  def demonstration_segments(self, example: Example) -> list[tuple[str, bool]]:
    a, b = example.meta["a"], example.meta["b"]
    return [(f"{OPEN}{a}*{b}{CLOSE}", False), (f"{example.answer}{RESULT_END}", True),
            (example.answer, False)]

  def demonstration(self, example: Example) -> str:
    return "".join(t for t, _ in self.demonstration_segments(example))

  def is_correct(self, example: Example, completion: str) -> bool:
    if not isinstance(completion, str):
      raise ValueError(f"{type(self).__name__}.is_correct: completion must be a str; "
                       f"got {type(completion).__name__}")
    return completion.rpartition(RESULT_END)[2].strip() == example.answer

  def reward(self, example: Example, completion: str) -> float:
    return 1.0 if self.is_correct(example, completion) else 0.0

  def corpus(self, rng: np.random.Generator, n: int) -> list[str]:
    """The demonstrations, and the calculator's answer to a malformed call ("?;"), so that
    the tokenizer can encode every observation."""
    return super().corpus(rng, n) + [f"?{RESULT_END}"]
