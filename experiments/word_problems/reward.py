"""Rewards for the word problems (a module outside gspo_jax, loaded by path):

    --set reward=experiments/word_problems/reward.py:correct,experiments/word_problems/reward.py:brief*0.1
"""

import re

_INT = re.compile(r"-?\d+")


def correct(prompts, completions, answer):
  """1.0 when the last integer in the completion is the answer ("7", "5 + 2 = 7",
  "Tom has 7 apples."), as GSM8K-style graders read the final number."""
  out = []
  for c, a in zip(completions, answer):
    found = _INT.findall(c)
    out.append(1.0 if found and int(found[-1]) == int(a) else 0.0)
  return out


def brief(prompts, completions, **fields):
  """1.0 when the completion is just a number (optionally with a final period): the prompt
  asks for that, and it keeps responses inside the token budget."""
  return [1.0 if re.fullmatch(r"\s*-?\d+\.?\s*", c) else 0.0 for c in completions]
