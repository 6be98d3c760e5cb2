"""A long-reasoning task: a chain of additions and subtractions with every running total
written out.

    prompt      "17a+5b-3c+8="
    completion  "a:17+5=22;b:22-3=19;c:19+8=27;#27"

The prompt is a start value followed by `steps` operations, each labelled by a letter
(a, b, c, ...). A solution writes one step per operation, "<letter>:<total><op><operand>=
<new total>;", then "#" and the final total. Totals are zero-padded to `digits + 1` digits
and stay in [0, 10**(digits + 1)) (the generator picks the sign that keeps them there), so
every step has the same width: the solution length is set by `steps` alone, about 10
tokens per step at digits=1 (`solution_chars`).

Why this format is learnable from scratch by a tiny decoder: each step depends only on
the step before it (copy the total, advance the letter) and on one operation of the
prompt, found by its unique letter (an induction-head lookup, not counting positions);
the arithmetic is one column-wise addition or subtraction of fixed-width numbers. The
final total, by contrast, cannot be produced without the running totals: a small model
that skips the work guesses.

Held-out split: a problem belongs to it when a salted 64-bit hash (blake2b) of its prompt
falls below `heldout_fraction`, so membership never depends on the rng and the splits are
disjoint by construction.
"""

from __future__ import annotations

import hashlib
import numbers
import re
import string

import numpy as np

from gspo_jax.tasks.base import Example, Task, check_sample_args

LETTERS = string.ascii_lowercase
MAX_STEPS = len(LETTERS)   # one letter per operation
MAX_DIGITS = 3
DEFAULT_STEPS = 12
_MAX_ROUNDS = 1000         # backstop: rejection-sampling rounds before giving up on a split


def _bad_int(x, lo: int, hi: int) -> bool:
  return isinstance(x, bool) or not isinstance(x, numbers.Integral) or not lo <= x <= hi


class Chain(Task):
  """Running totals of `steps` labelled operations on `digits`-digit operands.

  Completion format: the steps, then "#" and the final total (zero-padded, e.g. "#07").
  Leading and trailing whitespace is ignored.

  is_correct: the completion holds exactly one "#" and the text after it is the final
  total, exactly as the demonstration writes it. Only the answer is verified: the steps
  before it are the model's own business (`format_ok` checks their grammar,
  `step_errors` their arithmetic, for diagnostics).

  Reward: 1.0 when correct; `format_reward` (default 0.0: binary) for a wrong answer in a
  completion that `format_ok` accepts; 0.0 otherwise.
  """

  name = "chain"

  def __init__(self, digits: int = 1, steps: int = DEFAULT_STEPS, *,
               heldout_fraction: float = 0.1, format_reward: float = 0.0):
    fn = type(self).__name__
    if _bad_int(digits, 1, MAX_DIGITS):
      raise ValueError(f"{fn}: digits must be an int in [1, {MAX_DIGITS}]; got {digits!r}")
    if _bad_int(steps, 1, MAX_STEPS):
      raise ValueError(f"{fn}: steps must be an int in [1, {MAX_STEPS}] (one letter per "
                       f"operation); got {steps!r}")
    if not 0.0 < heldout_fraction < 1.0:
      raise ValueError(f"{fn}: heldout_fraction must lie in (0, 1); got {heldout_fraction!r}")
    if not 0.0 <= format_reward < 1.0:
      raise ValueError(f"{fn}: format_reward must lie in [0, 1) so that only a correct "
                       f"answer earns 1.0; got {format_reward!r}")
    self.digits, self.steps = int(digits), int(steps)
    self.heldout_fraction = float(heldout_fraction)
    self.format_reward = float(format_reward)
    self.width = self.digits + 1          # digits of every running total
    self.modulus = 10**self.width         # totals lie in [0, modulus)
    w, d = self.width, self.digits
    self._format = re.compile(
        rf"(?:[a-z]:[0-9]{{{w}}}[+-][0-9]{{{d}}}=[0-9]{{{w}}};)*#[0-9]{{{w}}}")

  def __repr__(self) -> str:
    return (f"Chain(digits={self.digits}, steps={self.steps}, "
            f"heldout_fraction={self.heldout_fraction}, format_reward={self.format_reward})")

  # -- lengths

  def solution_chars(self) -> int:
    """Characters of every demonstration: steps * (5 + 2 * width + digits) + 1 + width."""
    return self.steps * (5 + 2 * self.width + self.digits) + 1 + self.width

  def solution_digits(self) -> int:
    """Digit characters of every demonstration. With split digits each is its own token,
    so this (+1 for EOS) is a lower bound on the tokens any task tokenizer needs."""
    return self.steps * (2 * self.width + self.digits) + self.width

  def prompt_chars(self) -> int:
    return self.width + self.steps * (2 + self.digits) + 1

  def prompt_digits(self) -> int:
    return self.width + self.steps * self.digits

  @staticmethod
  def check_settings(digits: int, steps: int, max_new_tokens: int, max_prompt_len: int) -> None:
    """Config-time checks (no tokenizer yet), naming the config fields: digits and steps in
    range, and rollout.max_new_tokens / rollout.max_prompt_len not below the digit count of
    every solution + EOS / prompt + BOS (split digits: each digit is one token whatever the
    tokenizer, so these are lower bounds; `check_fits` checks exactly at setup)."""
    if _bad_int(digits, 1, MAX_DIGITS):
      raise ValueError(f"task.name='chain' needs task.digits in [1, {MAX_DIGITS}]; got {digits!r}")
    if _bad_int(steps, 1, MAX_STEPS):
      raise ValueError(f"task.name='chain' needs task.steps in [1, {MAX_STEPS}] (one letter per "
                       f"operation); got {steps!r}")
    task = Chain(digits, steps)
    need = task.solution_digits() + 1
    if need > max_new_tokens:
      raise ValueError(f"task.name='chain' with task.steps={steps}, task.digits={digits} needs "
                       f"rollout.max_new_tokens >= {need} (its solutions hold {need - 1} "
                       f"digit tokens, + EOS; about {task.solution_chars() + 1} tokens with a "
                       f"task tokenizer); got rollout.max_new_tokens={max_new_tokens}")
    need = task.prompt_digits() + 1
    if need > max_prompt_len:
      raise ValueError(f"task.name='chain' with task.steps={steps}, task.digits={digits} needs "
                       f"rollout.max_prompt_len >= {need} (its prompts hold {need - 1} digit "
                       f"tokens, + BOS; about {task.prompt_chars() + 1} tokens with a task "
                       f"tokenizer); got rollout.max_prompt_len={max_prompt_len}")

  # -- problems

  def is_heldout(self, prompt: str) -> bool:
    """blake2b-64 of (name, prompt) / 2**64 < heldout_fraction."""
    h = hashlib.blake2b(f"{self.name}|{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64 < self.heldout_fraction

  def split_of(self, example: Example) -> str:
    return "heldout" if self.is_heldout(example.prompt) else "train"

  def example(self, start: int, ops: list[tuple[str, int]]) -> Example:
    """The Example of start value `start` and operations [("+", 5), ("-", 3), ...] (any
    split). Raises ValueError if a running total would leave [0, 10**(digits + 1))."""
    start = int(start)
    if not 0 <= start < self.modulus:
      raise ValueError(f"Chain.example: start must lie in [0, {self.modulus}); got {start}")
    totals = [start]
    for sign, x in ops:
      if sign not in "+-" or not 1 <= x < 10**self.digits:
        raise ValueError(f"Chain.example: bad operation {sign}{x} (sign + or -, operand in "
                         f"[1, {10**self.digits}))")
      totals.append(totals[-1] + x if sign == "+" else totals[-1] - x)
      if not 0 <= totals[-1] < self.modulus:
        raise ValueError(f"Chain.example: running total {totals[-1]} leaves [0, {self.modulus})")
    w, d = self.width, self.digits
    prompt = f"{start:0{w}d}" + "".join(
        f"{LETTERS[i]}{s}{x:0{d}d}" for i, (s, x) in enumerate(ops)) + "="
    return Example(prompt=prompt, answer=f"{totals[-1]:0{w}d}",
                   meta={"start": start, "ops": [(s, int(x)) for s, x in ops], "totals": totals})

  def _draw(self, rng: np.random.Generator) -> Example:
    total = int(rng.integers(0, self.modulus))
    start, ops = total, []
    for _ in range(self.steps):
      x = int(rng.integers(1, 10**self.digits))
      sign = "+" if rng.random() < 0.5 else "-"
      # The sign that keeps the total in range (x < modulus / 2, so one always does).
      if sign == "+" and total + x >= self.modulus:
        sign = "-"
      elif sign == "-" and total - x < 0:
        sign = "+"
      total = total + x if sign == "+" else total - x
      ops.append((sign, x))
    return self.example(start, ops)

  def sample(self, rng: np.random.Generator, n: int, split: str) -> list[Example]:
    """`n` examples of `split`, by rejection sampling; deterministic given `rng`'s state."""
    check_sample_args("Chain.sample", rng, n, split)
    want_heldout = split == "heldout"
    out: list[Example] = []
    tries, limit = 0, _MAX_ROUNDS * max(n, 1)
    while len(out) < n:
      if tries == limit:
        raise ValueError(f"Chain.sample: the {split!r} split of {self!r} is empty or nearly so")
      tries += 1
      ex = self._draw(rng)
      if self.is_heldout(ex.prompt) == want_heldout:
        out.append(ex)
    return out

  # -- solutions and scoring

  def demonstration(self, example: Example) -> str:
    """Every step with its running total, then "#" and the answer (no EOS)."""
    w, d, totals = self.width, self.digits, example.meta["totals"]
    steps = "".join(f"{LETTERS[i]}:{totals[i]:0{w}d}{s}{x:0{d}d}={totals[i + 1]:0{w}d};"
                    for i, (s, x) in enumerate(example.meta["ops"]))
    return f"{steps}#{example.answer}"

  def is_correct(self, example: Example, completion: str) -> bool:
    if not isinstance(completion, str):
      raise ValueError(f"Chain.is_correct: completion must be a str; "
                       f"got {type(completion).__name__}")
    text = completion.strip()
    return text.count("#") == 1 and text.partition("#")[2] == example.answer

  def format_ok(self, completion: str) -> bool:
    """The completion follows the solution grammar (steps, "#", a padded total)."""
    return self._format.fullmatch(completion.strip()) is not None

  def step_errors(self, example: Example, completion: str) -> int | None:
    """How many of the written steps differ from the demonstration's (None when the
    completion has a different number of steps or is not well formed)."""
    text = completion.strip()
    if not self.format_ok(text):
      return None
    got = text.split(";")[:-1]
    want = self.demonstration(example).split(";")[:-1]
    if len(got) != len(want):
      return None
    return sum(g != w for g, w in zip(got, want))

  def reward(self, example: Example, completion: str) -> float:
    if self.is_correct(example, completion):
      return 1.0
    return self.format_reward if self.format_ok(completion) else 0.0

  def check_fits(self, tok, max_new_tokens: int, max_prompt_len: int,
                 n: int = 256, seed: int = 0) -> tuple[int, int]:
    """(solution tokens incl. EOS, prompt tokens incl. BOS), the most over `n` train
    problems, under the run's tokenizer `tok`; ValueError naming rollout.max_new_tokens or
    rollout.max_prompt_len when they do not fit (the cold start would silently cut the
    demonstrations, and no response could reach the answer)."""
    examples = self.sample(np.random.default_rng(seed), n, "train")
    sol = max(len(tok.encode(self.demonstration(e))) for e in examples) + 1
    prompt = max(len(tok.encode(e.prompt, add_special_tokens=True)) for e in examples)
    if sol > max_new_tokens:
      raise ValueError(f"task {self.name!r} with task.steps={self.steps}, task.digits="
                       f"{self.digits} has solutions of up to {sol} tokens (EOS included) "
                       f"> rollout.max_new_tokens={max_new_tokens}; raise "
                       f"rollout.max_new_tokens or lower task.steps")
    if prompt > max_prompt_len:
      raise ValueError(f"task {self.name!r} with task.steps={self.steps}, task.digits="
                       f"{self.digits} has prompts of up to {prompt} tokens > "
                       f"rollout.max_prompt_len={max_prompt_len}; raise rollout.max_prompt_len "
                       f"or lower task.steps")
    return sol, prompt
