"""gspo_jax.tasks: splits, answers, rewards, and Task.score_batch with a failing reward."""

import math
import operator
import re

import numpy as np
import pytest

from gspo_jax.tasks import TASKS, Addition, Example, Multiplication, make_task
from gspo_jax.tasks.rewards import RewardError

OPS = {"+": operator.add, "*": operator.mul}
ALL = [Addition(), Multiplication(), Addition(digits=3), Multiplication(digits=1)]


def _ids(task):
  return f"{task.name}{task.digits}"


def _parse(prompt):
  """Independent parser: the operands and operator of a canonical prompt."""
  m = re.fullmatch(r"([0-9]+)([+*])([0-9]+)=", prompt)
  assert m, f"prompt {prompt!r} is not canonical (digits, operator, digits, '=', no spaces)"
  return int(m[1]), m[2], int(m[3])


def test_registry():
  assert set(TASKS) == {"addition", "multiplication", "chain", "tool_multiplication"}
  task = make_task("multiplication", digits=3)
  assert isinstance(task, Multiplication) and task.digits == 3 and task.name == "multiplication"
  names = r"\('addition', 'multiplication', 'chain', 'tool_multiplication'\)"
  with pytest.raises(ValueError, match=r"make_task: name must be one of " + names):
    make_task("division")


@pytest.mark.parametrize("task", ALL, ids=_ids)
@pytest.mark.parametrize("split", ["train", "heldout"])
def test_sampling_is_deterministic(task, split):
  a = task.sample(np.random.default_rng(7), 200, split)
  b = task.sample(np.random.default_rng(7), 200, split)
  c = task.sample(np.random.default_rng(8), 200, split)
  assert a == b and len(a) == 200
  assert a != c
  assert task.sample(np.random.default_rng(7), 0, split) == []


@pytest.mark.parametrize("task", [Addition(), Multiplication()], ids=_ids)
def test_splits_are_disjoint(task):
  rng = np.random.default_rng(0)
  train = task.sample(rng, 5000, "train")
  heldout = task.sample(rng, 2000, "heldout")
  train_pairs = {(e.meta["a"], e.meta["b"]) for e in train}
  held_pairs = {(e.meta["a"], e.meta["b"]) for e in heldout}
  assert not {e.prompt for e in train} & {e.prompt for e in heldout}
  # Commuted problems share a split: "b op a" in train would leak a held-out "a op b".
  assert not {(b, a) for a, b in held_pairs} & train_pairs
  assert {task.split_of(e) for e in train} == {"train"}
  assert {task.split_of(e) for e in heldout} == {"heldout"}
  # The held-out share over all 10^4 pairs is near heldout_fraction = 0.1.
  a, b = np.divmod(np.arange(10**4), 100)
  assert 0.07 < task.is_heldout(a, b).mean() < 0.13


def test_tasks_hold_out_different_problems():
  a, b = np.divmod(np.arange(10**4), 100)
  add, mul = Addition().is_heldout(a, b), Multiplication().is_heldout(a, b)
  assert (add != mul).mean() > 0.1  # salted by name, not the same 10% for every task


@pytest.mark.parametrize("task", ALL, ids=_ids)
def test_answers_match_python_arithmetic(task):
  for split in ("train", "heldout"):
    for ex in task.sample(np.random.default_rng(1), 300, split):
      a, op, b = _parse(ex.prompt)
      assert op == task.symbol and (a, b) == (ex.meta["a"], ex.meta["b"])
      assert 0 <= a < 10**task.digits and 0 <= b < 10**task.digits
      assert ex.answer == str(OPS[op](a, b))
  assert Addition().example(37, 85) == Example("37+85=", "122", {"a": 37, "b": 85})
  assert Multiplication().example(12, 34).answer == "408"


@pytest.mark.parametrize("task", ALL, ids=_ids)
def test_demonstration_earns_full_reward(task):
  examples = task.sample(np.random.default_rng(2), 50, "train")
  demos = [task.demonstration(ex) for ex in examples]
  assert demos == [ex.answer for ex in examples]  # no EOS, no prompt echo
  assert all(task.is_correct(ex, d) for ex, d in zip(examples, demos))
  rewards, correct, parts = task.score_batch(examples, demos)
  np.testing.assert_array_equal(rewards, np.ones(50, np.float32))
  assert rewards.dtype == np.float32 and correct.dtype == bool and correct.all() and parts == {}


@pytest.mark.parametrize("completion", [
    "123", "12", "0122", "+122", "-122", "1 22", "122=", "122122", "37+85=122", "",
    "   ", "abc", "١٢٢", "１２２", "12²", "122.0", "None",
])
def test_wrong_and_garbage_completions_get_zero(completion):
  task, ex = Addition(), Addition().example(37, 85)
  assert task.reward(ex, completion) == 0.0
  assert not task.is_correct(ex, completion)


def test_surrounding_whitespace_is_ignored():
  # Documented: completion.strip() is compared, so a stray space or newline from the
  # decoder does not cost the reward; whitespace inside the number does.
  task, ex = Multiplication(), Multiplication().example(12, 34)
  for completion in ["408", " 408", "408 ", "\n408\n", "\t408  "]:
    assert task.is_correct(ex, completion) and task.reward(ex, completion) == 1.0
  assert task.reward(ex, "4 08") == 0.0


def test_format_reward():
  task = Addition(format_reward=0.1)
  ex = task.example(1, 2)
  assert task.reward(ex, "3") == 1.0
  assert task.reward(ex, " 4 ") == 0.1 and not task.is_correct(ex, "4")
  assert task.reward(ex, "x") == 0.0
  with pytest.raises(ValueError, match="format_reward must lie in"):
    Addition(format_reward=1.0)


def test_corpus():
  task = Addition()
  texts = task.corpus(np.random.default_rng(3), 100)
  assert texts == task.corpus(np.random.default_rng(3), 100)
  examples = task.sample(np.random.default_rng(3), 100, "train")
  assert texts == [ex.prompt + ex.answer for ex in examples]
  assert all(re.fullmatch(r"[0-9]+\+[0-9]+=[0-9]+", t) for t in texts)


def test_example_is_hashable_and_frozen():
  ex = Addition().example(3, 4)
  assert hash(ex) == hash(Addition().example(3, 4))
  with pytest.raises(AttributeError):
    ex.answer = "8"


def test_bad_arguments():
  task, rng = Addition(), np.random.default_rng(0)
  with pytest.raises(ValueError, match=r"split must be one of \('train', 'heldout'\)"):
    task.sample(rng, 3, "test")
  with pytest.raises(ValueError, match="n must be an int >= 0"):
    task.sample(rng, -1, "train")
  with pytest.raises(ValueError, match="rng must be a numpy.random.Generator"):
    task.sample(0, 3, "train")
  with pytest.raises(ValueError, match=r"digits must be an int in \[1, 9\]"):
    Multiplication(digits=0)
  with pytest.raises(ValueError, match="heldout_fraction must lie in"):
    Addition(heldout_fraction=0.0)
  with pytest.raises(ValueError, match="leaves the heldout split empty"):
    Addition(digits=1, heldout_fraction=1e-9)
  with pytest.raises(ValueError, match="completion must be a str"):
    task.is_correct(task.example(1, 2), 3)


# --- score_batch ---------------------------------------------------------------------------


def test_score_batch_is_reward_and_is_correct_per_row():
  task = Addition(format_reward=0.1)
  examples = [task.example(1, 2)] * 3 + [task.example(37, 85)]
  rewards, correct, parts = task.score_batch(examples, ["3", " 4 ", "x", "122"])
  np.testing.assert_array_equal(rewards, np.float32([1.0, 0.1, 0.0, 1.0]))
  np.testing.assert_array_equal(correct, [True, False, False, True])
  assert parts == {}  # one reward function: no components to log


class Picky(Addition):
  def reward(self, example, completion):
    if completion == "boom":
      raise KeyError("no such key")
    return math.nan if completion == "nan" else super().reward(example, completion)


def test_a_raising_reward_names_the_task_and_the_row():
  task = Picky()
  examples = [task.example(1, 2), task.example(37, 85)]
  with pytest.raises(RewardError) as info:
    task.score_batch(examples, ["3", "boom"])
  err, msg = info.value, str(info.value)
  assert isinstance(err, ValueError) and (err.fn_name, err.index) == ("Picky.reward", 1)
  assert "reward Picky.reward (" in msg and ":Picky.reward) raised KeyError" in msg
  assert "index 1" in msg and "'37+85='" in msg and "'boom'" in msg
  assert isinstance(err.__cause__, KeyError)


def test_a_non_finite_reward_names_the_row():
  task = Picky()
  with pytest.raises(RewardError, match=r"Picky.reward .* non-finite value nan at index 0; "
                                        r"prompt '1\+2=', completion 'nan'") as info:
    task.score_batch([task.example(1, 2)], ["nan"])
  assert info.value.index == 0


def test_score_batch_needs_one_example_per_completion():
  task = Addition()
  with pytest.raises(ValueError, match="one entry per completion"):
    task.score_batch([task.example(1, 2)], ["3", "4"])
