"""Reward functions: loading by path or module, per-example functions (a task's `reward`),
weighted sums with hand-computed values, and the errors for every way a reward can go
wrong."""

import importlib.util
import math
import sys
import textwrap

import numpy as np
import pytest

from gspo_jax.tasks import rewards as R
from gspo_jax.tasks.rewards import RewardError

MODULE = textwrap.dedent("""
    import math

    def length(prompts, completions, **fields):
      return [float(len(c)) for c in completions]

    def is_answer(prompts, completions, answer):
      return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    def too_few(prompts, completions, **fields):
      return [1.0] * (len(completions) - 1)

    def nan_on_second(prompts, completions, **fields):
      return [math.nan if i == 1 else 0.0 for i in range(len(completions))]

    def text_value(prompts, completions, **fields):
      return ["1.0"] * len(completions)

    def explodes(prompts, completions, **fields):
      raise KeyError("answer")

    def one_argument(completions):
      return [0.0] * len(completions)
""")


@pytest.fixture
def module_file(tmp_path):
  path = tmp_path / "my_rewards.py"
  path.write_text(MODULE)
  return str(path)


PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4="]
DONE = ["2", "5", " 6 ", "8!"]
FIELDS = {"answer": ["2", "4", "6", "8"]}


def test_weighted_sum_and_components_by_path(module_file):
  rs = R.load_rewards([f"{module_file}:is_answer", f"{module_file}:length*0.5"])
  total, parts = R.score_batch(rs, PROMPTS, DONE, FIELDS)
  # is_answer: "2"=="2" yes, "5" no, " 6 " stripped yes, "8!" no -> 1, 0, 1, 0
  # length: 1, 1, 3, 2 -> half: 0.5, 0.5, 1.5, 1.0
  np.testing.assert_array_equal(parts["is_answer"], [1, 0, 1, 0])
  np.testing.assert_array_equal(parts["length"], [1, 1, 3, 2])
  np.testing.assert_allclose(total, [1.5, 0.5, 2.5, 1.0])
  assert [r.weight for r in rs] == [1.0, 0.5] and rs[0].needs == ("answer",)


def test_module_on_sys_path_and_duplicate_names(tmp_path, monkeypatch):
  (tmp_path / "rewards_mod_x.py").write_text(MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  rs = R.load_rewards(["rewards_mod_x:length", "rewards_mod_x:length*2"])
  assert [r.name for r in rs] == ["length", "length_2"]
  total, _ = R.score_batch(rs, PROMPTS, DONE, FIELDS)
  np.testing.assert_allclose(total, 3 * np.array([1, 1, 3, 2]))
  sys.modules.pop("rewards_mod_x", None)


def test_only_the_fields_a_reward_names_are_passed(module_file):
  r = R.load_reward(f"{module_file}:is_answer")
  # `op` is not a parameter of is_answer and must not be passed (it would be a TypeError).
  values = R.call_reward(r, PROMPTS, DONE, {**FIELDS, "op": ["+"] * 4})
  np.testing.assert_array_equal(values, [1, 0, 1, 0])


@pytest.mark.parametrize("fn,match", [
    ("too_few", r"too_few .* returned 3 values for 4 completions"),
    ("nan_on_second", r"nan_on_second .* non-finite value nan at index 1; prompt '2\+2=', "
                      r"completion '5'"),
    ("text_value", r"text_value .* returned str '1.0', not a real number at index 0"),
    ("explodes", r"explodes .* raised KeyError: 'answer' on a batch of 4; first: prompt '1\+1='"),
])
def test_bad_rewards_are_rejected_naming_the_function(module_file, fn, match):
  r = R.load_reward(f"{module_file}:{fn}")
  with pytest.raises(RewardError, match=match) as e:
    R.score_batch([r], PROMPTS, DONE, FIELDS)
  assert e.value.fn_name == fn


def test_load_errors_name_the_spec(module_file, tmp_path):
  with pytest.raises(ValueError, match="cannot import module 'no_such_module_zz'"):
    R.load_reward("no_such_module_zz:f")
  with pytest.raises(ValueError, match="has no function 'missing'"):
    R.load_reward(f"{module_file}:missing")
  with pytest.raises(ValueError, match="not found"):
    R.load_reward(str(tmp_path / "absent.py") + ":f")
  broken = tmp_path / "broken.py"
  broken.write_text("raise RuntimeError('boom at import')\n")
  with pytest.raises(ValueError, match=r"broken.py raised RuntimeError: boom at import"):
    R.load_reward(f"{broken}:f")
  with pytest.raises(ValueError, match="must take \\(prompts, completions"):
    R.load_reward(f"{module_file}:one_argument")
  with pytest.raises(ValueError, match="weight after '\\*' must be a number"):
    R.load_reward("exact_match*heavy")
  with pytest.raises(ValueError, match="not a built-in"):
    R.load_reward("exact_matches")
  with pytest.raises(ValueError, match="no reward function"):
    R.load_rewards([])


def test_missing_field_is_named(module_file):
  r = R.load_reward(f"{module_file}:is_answer")
  with pytest.raises(RewardError, match=r"needs the field\(s\) \['answer'\]"):
    R.call_reward(r, PROMPTS, DONE, {"op": ["+"] * 4})


def test_slow_reward_is_reported_with_the_sample(module_file):
  lines = []
  R.score_batch([R.load_reward(f"{module_file}:length")], PROMPTS, DONE, FIELDS, slow_s=1e-9,
                log=lines.append)
  assert len(lines) == 1 and "slow reward: length" in lines[0] and "'1+1='" in lines[0]


# ------------------------------------------------------------------------------ per example


def _length(example, completion):
  return float(len(completion))


def _answered(example, completion):
  return completion.strip() == example  # a bool counts as 0 / 1


def _by_row(fns, completions, examples, prompts=None):
  return R.score_batch(fns, prompts or [f"q{i}" for i in range(len(completions))], completions,
                       {"example": examples})


def test_per_example_weighted_sum():
  rs = [R.per_example(_answered, weight=2.0), R.per_example(_length, weight=0.5)]
  total, parts = _by_row(rs, ["3", "12"], ["3", "10"])
  # answered: 1, 0 (x2); length: 1, 2 (x0.5) -> 2.5, 1.0
  assert total.dtype == np.float32 and total.shape == (2,)
  np.testing.assert_array_equal(total, [2.5, 1.0])
  np.testing.assert_array_equal(parts["_answered"], [1, 0])
  assert rs[0].name == "_answered" and rs[0].spec.endswith(":_answered")
  # numpy scalars are numbers; an empty batch scores to an empty array.
  total, _ = _by_row([R.per_example(lambda e, c: np.float32(0.25))], ["a"], [None])
  np.testing.assert_array_equal(total, [0.25])
  assert _by_row([R.per_example(_length)], [], [])[0].shape == (0,)


def _picky(example, completion):
  if completion == "boom":
    raise KeyError("no such key")
  return 1.0


def test_per_example_raising_function_names_the_row():
  with pytest.raises(RewardError) as info:
    _by_row([R.per_example(_length), R.per_example(_picky, name="picky")], ["3", "boom"],
            ["a", "b"], prompts=["1+2=", "37+85="])
  err, msg = info.value, str(info.value)
  assert (err.fn_name, err.index) == ("picky", 1) and isinstance(err.__cause__, KeyError)
  assert "reward picky (" in msg and "raised KeyError: 'no such key' at index 1" in msg
  assert "'37+85='" in msg and "'boom'" in msg


def test_per_example_error_truncates_long_completions():
  with pytest.raises(RewardError) as info:
    _by_row([R.per_example(lambda e, c: 1 / 0)], ["x" * 5000], [None])
  assert "<lambda>" in str(info.value) and "ZeroDivisionError" in str(info.value)
  assert len(str(info.value)) < 800


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None, "1.0", [1.0], 1 + 2j])
def test_per_example_rejects_bad_return_values(bad):
  def returns_bad(example, completion):
    return bad
  with pytest.raises(RewardError, match=r"returns_bad .*returned .* at index 0; prompt '1\+2='"):
    _by_row([R.per_example(returns_bad)], ["3"], [None], prompts=["1+2="])


def test_score_batch_argument_errors():
  r = R.per_example(_length)
  with pytest.raises(ValueError, match="one entry per completion"):
    R.score_batch([r], ["q"], ["3", "4"], {"example": [None, None]})
  with pytest.raises(ValueError, match=r"one entry per completion .*field 'example'"):
    R.score_batch([r], ["q", "q"], ["3", "4"], {"example": [None]})
  with pytest.raises(ValueError, match="rewards is empty"):
    R.score_batch([], ["q"], ["3"], {})
  with pytest.raises(ValueError, match="fn must be callable"):
    R.per_example(1.0)
  with pytest.raises(ValueError, match="weight must be finite"):
    R.per_example(_length, weight=math.nan)


# ------------------------------------------------------------------------------ built-ins


def test_builtins_by_hand():
  completions = ["<answer>12</answer>", "The answer is 12.", "<answer> 1,200 </answer>",
                 "12.0000001", "<answer>1</answer><answer>2</answer>", "none"]
  answers = ["12", "12", "1200", "12", "2", "3"]
  # exact_match reads the last tag (or the whole text): "12", "The answer is 12.", "1,200",
  # "12.0000001", "2", "none".
  assert R.exact_match(None, completions, answers) == [1, 0, 0, 0, 1, 0]
  # numeric_match: last number within 1e-6 * max(1, |y|): 12, 12, 1200, 12.0000001
  # (off by 1e-7 <= 1.2e-5), 2, none.
  assert R.numeric_match(None, completions, answers) == [1, 1, 1, 1, 1, 0]
  assert R.numeric_match(None, ["12.1"], ["12"]) == [0.0]
  assert R.format_reward(None, completions) == [1, 0, 1, 0, 0, 0]


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is not None,
                    reason="math-verify is installed: the missing-package error cannot occur")
def test_math_verify_without_the_package_says_how_to_install():
  with pytest.raises(RewardError, match="pip install math-verify"):
    R.score_batch([R.load_reward("math_verify")], ["q"], ["1/2"], {"answer": ["0.5"]})


def test_math_verify_with_the_package():
  if importlib.util.find_spec("math_verify") is None:
    pytest.skip("math-verify is not installed (optional extra: pip install math-verify)")
  assert R.math_verify(None, ["$\\frac{1}{2}$", "<answer>0.5</answer>", "3"],
                       ["0.5", "\\frac{1}{2}", "4"]) == [1.0, 1.0, 0.0]
