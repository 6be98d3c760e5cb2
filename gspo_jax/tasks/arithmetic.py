"""Integer arithmetic tasks: "37+85=" -> "122", "12*34=" -> "408".

Small enough for a tiny decoder to learn on CPU, and exactly verifiable. Texts use only
the characters 0-9, the operator and "=" (no spaces), so a character-level tokenizer
round-trips them exactly.

Operands are uniform on [0, 10**digits), drawn with replacement. A problem belongs to the
held-out split when a fixed 64-bit hash of (task name, sorted operands) falls below
`heldout_fraction`, so membership never depends on the rng and the splits are disjoint
by construction.
"""

from __future__ import annotations

import abc
import numbers
import re
import zlib

import numpy as np

from gspo_jax.tasks.base import Example, Task, check_sample_args

_NUMBER = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() would accept "²" and "٣"
_MAX_ROUNDS = 1000  # backstop: rejection-sampling rounds before giving up on a split


def _mix64(x: np.ndarray) -> np.ndarray:
  """splitmix64 finaliser: a platform-independent bijective hash of uint64 values.

  Not Python's `hash()`: that is salted per process for strings, and the split of a
  problem must never change between runs.
  """
  # Arrays, not numpy scalars: scalar uint64 products warn on the (intended) wrap-around.
  x = np.array(x, np.uint64, ndmin=1)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


class BinaryArithmetic(Task):
  """`a <op> b =` with operands of up to `digits` decimal digits.

  Completion format: the answer in canonical decimal (no sign, no leading zeros), e.g.
  "122". Leading and trailing whitespace is ignored (stripped before comparison), since
  decoders and hand-written completions often carry a stray space or newline; anything
  else, inner spaces and leading zeros included, is wrong.

  Reward: 1.0 for the exact answer; `format_reward` (default 0.0, so the reward is
  binary) for a well-formed but wrong number; 0.0 otherwise.
  """

  symbol: str = ""

  def __init__(self, digits: int = 2, *, heldout_fraction: float = 0.1, format_reward: float = 0.0):
    fn = type(self).__name__
    # 9 digits keeps every product below 2**63 and every operand pair key below 2**64.
    if isinstance(digits, bool) or not isinstance(digits, numbers.Integral) or not 1 <= digits <= 9:
      raise ValueError(f"{fn}: digits must be an int in [1, 9]; got {digits!r}")
    if not 0.0 < heldout_fraction < 1.0:
      raise ValueError(f"{fn}: heldout_fraction must lie in (0, 1); got {heldout_fraction!r}")
    if not 0.0 <= format_reward < 1.0:
      raise ValueError(f"{fn}: format_reward must lie in [0, 1) so that only a correct "
                       f"answer earns 1.0; got {format_reward!r}")
    self.digits = int(digits)
    self.heldout_fraction = float(heldout_fraction)
    self.format_reward = float(format_reward)
    # Salted by the task name so that addition and multiplication hold out different pairs.
    self._salt = _mix64(np.array(zlib.crc32(self.name.encode()), np.uint64))[0]
    if self.digits <= 3:  # small problem space: check both splits exist (<= 1e6 pairs, ~20 ms)
      a, b = np.divmod(np.arange(10**(2 * self.digits), dtype=np.int64), 10**self.digits)
      held = int(self.is_heldout(a, b).sum())
      if held == 0 or held == a.size:
        raise ValueError(f"{fn}: heldout_fraction={heldout_fraction} leaves the "
                         f"{'heldout' if held == 0 else 'train'} split empty at digits={digits}")

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(digits={self.digits}, "
            f"heldout_fraction={self.heldout_fraction}, "
            f"format_reward={self.format_reward})")

  @staticmethod
  @abc.abstractmethod
  def apply(a: int, b: int) -> int:
    """The exact result (Python ints, no overflow)."""

  def is_heldout(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bool array: which operand pairs belong to the held-out split.

    The pair is sorted first because both operators are commutative: if "85+37" were in
    train, a held-out "37+85" would test memorisation, not generalisation.
    """
    a, b = np.asarray(a, np.uint64), np.asarray(b, np.uint64)
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    key = self._salt ^ (lo * np.uint64(10**self.digits) + hi)
    unit = (_mix64(key) >> np.uint64(11)).astype(np.float64) / 2.0**53  # uniform in [0, 1)
    return (unit < self.heldout_fraction).reshape(lo.shape)

  def split_of(self, example: Example) -> str:
    """The split of `example` ("train" or "heldout"), from its operands in `meta`."""
    return "heldout" if self.is_heldout(example.meta["a"], example.meta["b"]) else "train"

  def sample(self, rng: np.random.Generator, n: int, split: str) -> list[Example]:
    """`n` examples of `split`, by rejection sampling of uniform operand pairs.

    Deterministic given the state of `rng` (which it advances). Raises ValueError if the
    split is so small (tiny `digits`) that it cannot be filled.
    """
    check_sample_args(f"{type(self).__name__}.sample", rng, n, split)
    want_heldout = split == "heldout"
    p = self.heldout_fraction if want_heldout else 1.0 - self.heldout_fraction
    # About two acceptances per slot, so one round usually does; capped to bound memory.
    batch = min(max(64, int(2 * n / p)), 1 << 16)
    a_out, b_out = [], []
    got, rounds = 0, 0
    while got < n:
      if rounds == _MAX_ROUNDS:
        raise ValueError(f"{type(self).__name__}.sample: the {split!r} split of {self!r} is empty "
                         "or nearly so; use more digits or another heldout_fraction")
      rounds += 1
      a = rng.integers(0, 10**self.digits, size=batch, dtype=np.int64)
      b = rng.integers(0, 10**self.digits, size=batch, dtype=np.int64)
      keep = self.is_heldout(a, b) == want_heldout
      a_out.append(a[keep])
      b_out.append(b[keep])
      got += int(keep.sum())
    a_all = np.concatenate(a_out)[:n].tolist() if n else []
    b_all = np.concatenate(b_out)[:n].tolist() if n else []
    return [self.example(a, b) for a, b in zip(a_all, b_all)]

  def example(self, a: int, b: int) -> Example:
    """The Example for operands `a`, `b` (whatever split they belong to)."""
    a, b = int(a), int(b)
    return Example(prompt=f"{a}{self.symbol}{b}=", answer=str(self.apply(a, b)),
                   meta={"a": a, "b": b})

  def demonstration(self, example: Example) -> str:
    """The answer digits; EOS is appended by the tokenizer layer, not written here."""
    return example.answer

  def is_correct(self, example: Example, completion: str) -> bool:
    """completion.strip() == example.answer."""
    if not isinstance(completion, str):
      raise ValueError(f"{type(self).__name__}.is_correct: completion must be a str; "
                       f"got {type(completion).__name__}")
    return completion.strip() == example.answer

  def reward(self, example: Example, completion: str) -> float:
    """1.0 if correct, `format_reward` for a wrong plain number, else 0.0."""
    if self.is_correct(example, completion):
      return 1.0
    return self.format_reward if _NUMBER.fullmatch(completion.strip()) else 0.0


class Addition(BinaryArithmetic):
  """Addition: prompt "37+85=", completion "122"."""
  name = "addition"
  symbol = "+"

  @staticmethod
  def apply(a: int, b: int) -> int:
    return a + b


class Multiplication(BinaryArithmetic):
  """Multiplication: prompt "12*34=", completion "408".

  Harder than addition: each answer digit depends on all operand digits, not on a carry.
  """
  name = "multiplication"
  symbol = "*"

  @staticmethod
  def apply(a: int, b: int) -> int:
    return a * b
