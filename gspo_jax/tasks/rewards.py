"""Reward functions and the one way they are called: loaded by import path, called on whole
batches, checked strictly.

Every task scores through `score_batch` here: a dataset task with the user's functions, a
built-in task with its per-example `reward` method wrapped by `per_example`. So the values
are checked the same way for both, and any failure is the same RewardError naming the
function and the row. The protocol lives in this module, not in `gspo_jax.tasks`, because
it is about functions on text, not about where prompts come from; tasks import it, and it
imports nothing from them.

A reward is a plain Python function on decoded text:

    def my_reward(prompts: list[str], completions: list[str], **fields) -> list[float]

`prompts[i]` is the user's prompt text (before any chat template), `completions[i]` the
decoded response (cut at EOS), and each extra dataset field (e.g. `answer`) arrives as a
list aligned with them: the G responses to one prompt repeat that prompt's fields (None
where a record lacks a field others have). A function may name the fields it needs
(`answer`) and/or take `**fields`; it is given only what it asks for, and a field it names
without a default must be in every record (checked when the data is loaded). Each value
must be a finite real number (bool counts as 0 / 1).

A spec string names one: "module:function", "path/to/file.py:function", or a built-in
below by its bare name ("exact_match"); a "*weight" suffix scales it ("format_reward*0.2").
Several rewards are summed with their weights, r_i = sum_k w_k * f_k(...)[i], and each
component is logged as `reward/<name>`.

Built-ins (the answer is read from the last <answer>...</answer> tag when there is one,
else from the whole completion):
  exact_match    1.0 when answer text == the `answer` field (both stripped)
  numeric_match  1.0 when the last number in the answer equals `answer` within
                 |x - y| <= 1e-6 * max(1, |y|)
  format_reward  1.0 when the completion holds exactly one <answer>...</answer> tag
  math_verify    1.0 when the `math-verify` package judges the answer equal to `answer`
                 (optional extra: pip install math-verify)
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

BatchRewardFn = Callable[..., Sequence[float]]  # fn(prompts, completions, **fields) -> values
ExampleRewardFn = Callable[[Any, str], float]   # fn(example, completion) -> value

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_SHOW = 200  # characters of a prompt / completion quoted in an error message


# ------------------------------------------------------------------------------ errors


class RewardError(ValueError):
  """A reward function raised, or returned something that is not one finite number per
  completion.

  Attributes `fn_name` and `index` locate the failure (index -1: the whole batch, e.g. a
  batch function that raised or returned the wrong number of values); the message also
  quotes the prompt and the completion. The original exception, if any, is `__cause__`.
  Never swallowed: a silently zeroed reward would still train the policy, towards the
  wrong thing.
  """

  def __init__(self, message: str, *, fn_name: str, index: int):
    super().__init__(message)
    self.fn_name = fn_name
    self.index = index


class _BadReturn(ValueError):
  """A reward function returned a value `_as_reward` cannot use."""


class _RowFailed(Exception):
  """Raised by a `per_example` wrapper when the function fails on row `index` (the
  function's exception is `__cause__`), so that the RewardError can name the row."""

  def __init__(self, index: int):
    super().__init__(index)
    self.index = index


def _show(text: Any) -> str:
  shown = repr(text)
  return shown if len(shown) <= _SHOW else shown[:_SHOW] + f"... ({len(shown)} chars)"


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


def _fn_name(fn: Callable) -> str:
  # __qualname__ tells bound methods apart ("Addition.reward"); partials have neither name.
  return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


# ------------------------------------------------------------------------------ built-ins


def extract_answer(completion: str) -> str:
  """The text of the last <answer>...</answer> tag, else the whole completion; stripped."""
  found = _ANSWER_TAG.findall(completion)
  return (found[-1] if found else completion).strip()


def exact_match(prompts, completions, answer, **_) -> list[float]:
  """1.0 where extract_answer(completion) == str(answer).strip(), else 0.0."""
  return [float(extract_answer(c) == str(a).strip()) for c, a in zip(completions, answer)]


def _last_number(text: str) -> float | None:
  found = _NUMBER.findall(text)
  return float(found[-1].replace(",", "")) if found else None


def numeric_match(prompts, completions, answer, **_) -> list[float]:
  """1.0 where the last number of extract_answer(completion) is within
  1e-6 * max(1, |answer|) of float(answer), else 0.0 (no number: 0.0)."""
  out = []
  for c, a in zip(completions, answer):
    x, y = _last_number(extract_answer(c)), float(str(a).replace(",", ""))
    out.append(float(x is not None and abs(x - y) <= 1e-6 * max(1.0, abs(y))))
  return out


def format_reward(prompts, completions, **_) -> list[float]:
  """1.0 where the completion holds exactly one <answer>...</answer> tag, else 0.0."""
  return [float(len(_ANSWER_TAG.findall(c)) == 1) for c in completions]


def math_verify(prompts, completions, answer, **_) -> list[float]:
  """1.0 where math_verify.verify(parse(answer), parse(completion's answer)) holds.

  math-verify (Hugging Face) compares LaTeX / plain expressions symbolically with sympy. It
  is an optional extra, imported on first use."""
  try:
    import math_verify as mv
  except ImportError:
    raise ImportError("the math_verify reward needs the optional package math-verify: "
                      "pip install math-verify") from None
  out = []
  for c, a in zip(completions, answer):
    gold, pred = mv.parse(str(a)), mv.parse(extract_answer(c))
    out.append(float(bool(gold) and bool(pred) and mv.verify(gold, pred)))
  return out


BUILTINS: dict[str, BatchRewardFn] = {
    "exact_match": exact_match, "numeric_match": numeric_match, "format_reward": format_reward,
    "math_verify": math_verify}


# ------------------------------------------------------------------------------ loading


@dataclasses.dataclass(frozen=True)
class Reward:
  """One loaded reward: its spec, display name, weight, function and the fields it takes."""
  spec: str
  name: str
  weight: float
  fn: BatchRewardFn
  needs: tuple[str, ...]        # keyword parameters without a default: required fields
  takes: tuple[str, ...]        # every keyword parameter it names
  takes_all: bool               # has **fields: receives every field


def split_spec(spec: str) -> tuple[str, float]:
  """"target*w" -> (target, w); "target" -> (target, 1.0)."""
  target, star, weight = spec.strip().rpartition("*")
  if not star:
    return spec.strip(), 1.0
  try:
    w = float(weight)
  except ValueError:
    raise ValueError(f"reward {spec!r}: the weight after '*' must be a number; got "
                     f"{weight!r}") from None
  if not math.isfinite(w):
    raise ValueError(f"reward {spec!r}: the weight must be finite; got {w}")
  return target.strip(), w


def import_module(module: str, spec: str, kind: str = "reward"):
  """A module by dotted name, or a .py file by path (imported under a private name);
  errors name the `kind` of thing being loaded and its spec."""
  if module.endswith(".py") or os.sep in module:
    path = os.path.abspath(module)
    if not os.path.isfile(path):
      raise ValueError(f"{kind} {spec!r}: file {module!r} not found")
    name = f"_gspo_{kind}_" + re.sub(r"\W", "_", path)
    if name in sys.modules:
      return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = mod
    try:
      loader_spec.loader.exec_module(mod)
    except Exception as e:
      del sys.modules[name]
      raise ValueError(f"{kind} {spec!r}: importing {path} raised {type(e).__name__}: {e}") from e
    return mod
  try:
    return importlib.import_module(module)
  except Exception as e:
    raise ValueError(f"{kind} {spec!r}: cannot import module {module!r} "
                     f"({type(e).__name__}: {e}); is it on PYTHONPATH?") from e


def _parameters(fn: Callable, spec: str) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    return (), (), True  # builtins without a signature: pass everything
  positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
    raise ValueError(f"reward {spec!r}: must take (prompts, completions, **fields); "
                     f"its signature is {inspect.signature(fn)}")
  named = [p for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
  needs = tuple(p.name for p in named if p.default is p.empty)
  return needs, tuple(p.name for p in named), any(p.kind == p.VAR_KEYWORD for p in params)


def load_reward(spec: str) -> Reward:
  """The reward named by `spec` (see the module docstring). Raises ValueError naming the
  spec when the module cannot be imported or has no such callable."""
  target, weight = split_spec(spec)
  if ":" not in target:
    if target not in BUILTINS:
      raise ValueError(f"reward {spec!r}: not a built-in ({', '.join(BUILTINS)}); write "
                       "'module:function' or 'path/to/file.py:function'")
    fn, name = BUILTINS[target], target
  else:
    module, _, attr = target.rpartition(":")
    mod = import_module(module, spec)
    fn = getattr(mod, attr, None)
    if not callable(fn):
      raise ValueError(f"reward {spec!r}: module {module!r} has no function {attr!r}")
    name = attr
  return Reward(spec, name, weight, fn, *_parameters(fn, spec))


def load_rewards(specs: Sequence[str]) -> list[Reward]:
  """Every spec loaded; display names made unique (a second "f" becomes "f_2")."""
  if not specs:
    raise ValueError("reward: no reward function given; e.g. --set task.reward=my_module:my_reward")
  out, seen = [], {}
  for spec in specs:
    r = load_reward(spec)
    seen[r.name] = seen.get(r.name, 0) + 1
    out.append(r if seen[r.name] == 1 else dataclasses.replace(r, name=f"{r.name}_{seen[r.name]}"))
  return out


# ------------------------------------------------------------------------------ per example


def per_example(fn: ExampleRewardFn, *, name: str | None = None, weight: float = 1.0) -> Reward:
  """A per-example function `fn(example, completion) -> float` (a task's `reward` method)
  as a Reward of the batch protocol.

  The Reward takes the field "example" (one object per completion, e.g. a task's Example)
  and calls `fn` row by row, so that an exception names its row like a bad value does.
  Its name defaults to fn's qualified name, its spec is "module:qualname" (where the code
  is)."""
  if not callable(fn):
    raise ValueError(f"per_example: fn must be callable; got {type(fn).__name__}")
  w = float(weight)
  if not math.isfinite(w):
    raise ValueError(f"per_example: weight must be finite; got {weight!r}")

  def rows(prompts, completions, example):
    values = []
    for i, (e, c) in enumerate(zip(example, completions)):
      try:
        values.append(fn(e, c))
      except Exception as err:  # noqa: BLE001 -- becomes a RewardError in call_reward
        raise _RowFailed(i) from err
    return values

  qualname = _fn_name(fn)
  return Reward(spec=f"{getattr(fn, '__module__', None) or '?'}:{qualname}",
                name=name or qualname, weight=w, fn=rows, needs=("example",),
                takes=("example",), takes_all=False)


# ------------------------------------------------------------------------------ calling


def _check_values(r: Reward, values: Any, prompts, completions) -> np.ndarray:
  """values as float64 (n,); RewardError naming the function and quoting the sample."""
  n = len(completions)
  where = lambda i: f"prompt {_show(prompts[i])}, completion {_show(completions[i])}"
  if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
    raise RewardError(f"reward {r.name} ({r.spec}) returned {type(values).__name__} "
                      f"{_show(values)}, not a list of {n} numbers", fn_name=r.name, index=-1)
  if len(values) != n:
    raise RewardError(f"reward {r.name} ({r.spec}) returned {len(values)} values for {n} "
                      f"completions (one per completion expected); first: {where(0)}",
                      fn_name=r.name, index=-1)
  out = np.empty(n, np.float64)
  for i, v in enumerate(values):
    try:
      out[i] = _as_reward(v)
    except _BadReturn as e:
      raise RewardError(f"reward {r.name} ({r.spec}) {e} at index {i}; {where(i)}",
                        fn_name=r.name, index=i) from None
  return out


def call_reward(r: Reward, prompts: Sequence[str], completions: Sequence[str],
                fields: Mapping[str, list]) -> np.ndarray:
  """r.fn(prompts, completions, **the fields it takes), checked: float64 (n,) of finite
  values. An exception inside the function becomes a RewardError (chained) quoting its row
  for a `per_example` reward, else the first sample of the batch."""
  kwargs = fields if r.takes_all else {k: fields[k] for k in r.takes if k in fields}
  missing = [k for k in r.needs if k not in kwargs]
  if missing:
    raise RewardError(f"reward {r.name} ({r.spec}) needs the field(s) {missing}, which no "
                      f"record has (fields: {sorted(fields)})", fn_name=r.name, index=-1)
  try:
    values = r.fn(list(prompts), list(completions), **kwargs)
  except _RowFailed as e:
    i, cause = e.index, e.__cause__
    raise RewardError(f"reward {r.name} ({r.spec}) raised {type(cause).__name__}: {cause} at "
                      f"index {i}; prompt {_show(prompts[i])}, completion "
                      f"{_show(completions[i])}", fn_name=r.name, index=i) from cause
  except Exception as e:  # noqa: BLE001 -- re-raised with context, never swallowed
    raise RewardError(f"reward {r.name} ({r.spec}) raised {type(e).__name__}: {e} on a batch "
                      f"of {len(completions)}; first: prompt {_show(prompts[0])}, completion "
                      f"{_show(completions[0])}", fn_name=r.name, index=-1) from e
  return _check_values(r, values, prompts, completions)


def _check_batch(rewards: Sequence[Reward], prompts, completions, fields) -> None:
  if not rewards:
    raise ValueError("score_batch: rewards is empty; pass at least one Reward")
  n = len(completions)
  lengths = {"prompts": len(prompts), **{f"field {k!r}": len(v) for k, v in fields.items()}}
  wrong = {k: m for k, m in lengths.items() if m != n}
  if wrong:
    raise ValueError(f"score_batch: prompts and every field need one entry per completion "
                     f"({n}); got {wrong}")


def score_batch(rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str],
                fields: Mapping[str, list], *, slow_s: float = 0.0,
                log: Callable[[str], None] = print) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Weighted sum of the rewards and each unweighted component: the one place reward
  functions are called (see the module docstring).

  Args:
    rewards: loaded (`load_rewards`) or wrapped (`per_example`) reward functions.
    prompts, completions: one entry per row R (a group repeats its prompt G times).
    fields: extra per-row inputs by name, each a list of R values.
    slow_s: a call longer than this many seconds (0 = never) is reported through `log`
      with the first sample of the batch.
  Returns:
    (total_R float32, {name: values_R float64}).
  Raises:
    ValueError: no rewards, or prompts / fields not aligned with completions.
    RewardError: a function raised, or returned something other than R finite numbers.
  """
  _check_batch(rewards, prompts, completions, fields)
  total = np.zeros(len(completions), np.float64)
  parts = {}
  for r in rewards:
    t0 = time.perf_counter()
    parts[r.name] = call_reward(r, prompts, completions, fields)
    took = time.perf_counter() - t0
    if slow_s and took > slow_s:
      log(f"slow reward: {r.name} ({r.spec}) took {took:.1f} s for {len(completions)} "
          f"completions (> {slow_s} s); first: prompt {_show(prompts[0])}, completion "
          f"{_show(completions[0])}")
    total += r.weight * parts[r.name]
  return total.astype(np.float32), parts
