"""Environments for multi-turn episodes: plain Python objects that read each model turn as
text and answer with an observation (or end the episode) and a per-turn reward.

Protocol. An environment *factory* (a class or function) is called once per episode with
the episode's `Example` and returns an object with

    step(turn_text: str, *, final: bool) -> EnvStep(observation: str | None, reward=0.0,
                                                     info={})

`turn_text` is the model's latest turn, decoded (its stop token included, EOS excluded).
`final` is True when the episode ends whatever the environment says (the turn ended at
EOS or at the token budget, or it was the last of `max_turns`); the observation is then
not used. Otherwise `observation=None` ends the episode and a string is appended to the
episode (tokenized, fed onto the KV cache) before the model's next turn. `reward` is this
turn's reward r_k (finite); `info` holds numbers to count (e.g. {"malformed_calls": 1}),
summed over episodes and reported as `env/<key>`.

A spec names a factory: "module:Name", "path/to/file.py:Name", or a built-in below by its
bare name. Loading and every call are checked: a failure is an EnvError naming the
environment, the example and the turn.

Built-ins:
  calculator   `CalculatorEnv`: evaluates `[EXPR]` tool calls (integers, + - * and
               parentheses) and rewards the final answer.
  calculator_shaped   `ShapedCalculatorEnv`: the same, and 0.1 for the first well-formed call.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import numbers
import operator
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gspo_jax.tasks import rewards


@dataclasses.dataclass(frozen=True)
class EnvStep:
  """An environment's answer to one model turn."""
  observation: str | None
  reward: float = 0.0
  info: Mapping[str, float] = dataclasses.field(default_factory=dict)


class Environment(Protocol):
  def step(self, turn_text: str, *, final: bool) -> EnvStep: ...


EnvFactory = Callable[[Any], Environment]


class EnvError(ValueError):
  """An environment raised or answered something unusable. `env`, `example` (the row's
  prompt) and `turn` locate it; the original exception, if any, is `__cause__`."""

  def __init__(self, message: str, *, env: str, example: str, turn: int):
    super().__init__(message)
    self.env, self.example, self.turn = env, example, turn


@dataclasses.dataclass(frozen=True)
class LoadedEnv:
  spec: str
  factory: EnvFactory

  def make(self, example) -> Environment:
    try:
      env = self.factory(example)
    except Exception as e:
      raise EnvError(f"environment {self.spec!r} raised {type(e).__name__}: {e} when created "
                     f"for example {_show(example)}", env=self.spec, example=_show(example),
                     turn=-1) from e
    if not callable(getattr(env, "step", None)):
      raise EnvError(f"environment {self.spec!r}: the factory returned {type(env).__name__}, "
                     "which has no step(turn_text, *, final) method", env=self.spec,
                     example=_show(example), turn=-1)
    return env

  def step(self, env: Environment, example, turn: int, text: str, *, final: bool) -> EnvStep:
    """env.step, checked: raises EnvError naming the environment, example and turn."""
    where = dict(env=self.spec, example=_show(example), turn=turn)
    context = f"on example {_show(example)}, turn {turn}, turn text {text[-80:]!r}"
    try:
      out = env.step(text, final=final)
    except Exception as e:
      raise EnvError(f"environment {self.spec!r} raised {type(e).__name__}: {e} {context}",
                     **where) from e
    if not isinstance(out, EnvStep):
      raise EnvError(f"environment {self.spec!r} returned {type(out).__name__}, not an EnvStep, "
                     f"{context}", **where)
    if out.observation is not None and not isinstance(out.observation, str):
      raise EnvError(f"environment {self.spec!r} returned an observation of type "
                     f"{type(out.observation).__name__} (not str or None) {context}", **where)
    bad = [k for k, v in {"reward": out.reward, **out.info}.items()
           if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)]
    if bad:
      raise EnvError(f"environment {self.spec!r} returned a non-finite or non-numeric "
                     f"{bad[0]} {context}", **where)
    return out


def _show(example) -> str:
  shown = repr(getattr(example, "prompt", example))
  return shown if len(shown) <= 120 else shown[:120] + "..."


def load_env(spec: str) -> LoadedEnv:
  """The environment factory named by `spec` (see the module docstring); ValueError naming
  the spec when it cannot be found."""
  if ":" not in spec:
    if spec not in BUILTINS:
      raise ValueError(f"environment {spec!r}: not a built-in ({', '.join(BUILTINS)}); write "
                       "'module:Name' or 'path/to/file.py:Name'")
    return LoadedEnv(spec, BUILTINS[spec])
  module, _, attr = spec.rpartition(":")
  factory = getattr(rewards.import_module(module, spec, kind="environment"), attr, None)
  if not callable(factory):
    raise ValueError(f"environment {spec!r}: module {module!r} has no callable {attr!r}")
  return LoadedEnv(spec, factory)


# ----------------------------------------------------------------------------- calculator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expr: str) -> int:
  """Integer + - * (and parentheses, unary minus) of `expr`; ValueError on anything else."""
  def ev(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      return -ev(node.operand)
    raise ValueError(f"not an integer + - * expression: {expr!r}")
  if len(expr) > 64:
    raise ValueError("expression longer than 64 characters")
  try:
    tree = ast.parse(expr.strip(), mode="eval")
  except SyntaxError as e:
    raise ValueError(f"not an expression: {expr!r}") from e
  return ev(tree.body)


class CalculatorEnv:
  """A calculator tool. A turn that ends with `CLOSE` is a tool call: the text after the
  last `OPEN` is evaluated (`calculate`) and the observation is the value followed by
  `RESULT_END` (e.g. "[12*34]" -> "408;"; one-character tags, so that a small tokenizer
  has them as single tokens and "]" can be the stop token). A call that is not a
  well-formed expression gets the observation "?" + RESULT_END and counts in
  `malformed_calls`; well-formed ones count in `tool_calls`. The episode's reward is earned
  on its final turn: 1.0 when that turn's text (stripped) is the example's answer, else
  0.0; tool calls themselves earn nothing. The episode ends at the first turn that is not
  a tool call."""

  OPEN, CLOSE, RESULT_END = "[", "]", ";"
  CALL_REWARD = 0.0   # earned by the episode's first well-formed call (ShapedCalculatorEnv)

  def __init__(self, example):
    self.answer = example.answer.strip()
    self.calls = 0

  def step(self, turn_text: str, *, final: bool) -> EnvStep:
    if final or not turn_text.endswith(self.CLOSE):
      return EnvStep(None, 1.0 if turn_text.strip() == self.answer else 0.0)
    call = turn_text[:-len(self.CLOSE)].rpartition(self.OPEN)
    try:
      if not call[1]:
        raise ValueError("no opening tag")
      value = calculate(call[2])
    except ValueError:
      return EnvStep("?" + self.RESULT_END, 0.0, {"malformed_calls": 1})
    self.calls += 1
    return EnvStep(f"{value}{self.RESULT_END}", self.CALL_REWARD if self.calls == 1 else 0.0,
                   {"tool_calls": 1})


class ShapedCalculatorEnv(CalculatorEnv):
  """`CalculatorEnv` whose first well-formed call earns 0.1 on its turn: a per-turn reward,
  so that per-turn credit (GSPO-token on `advantages.turn_advantages`) differs from the
  episode's (only the call's turn is credited with it); at most 0.1 of an episode's 1.1."""
  CALL_REWARD = 0.1


BUILTINS: dict[str, EnvFactory] = {"calculator": CalculatorEnv,
                                   "calculator_shaped": ShapedCalculatorEnv}
