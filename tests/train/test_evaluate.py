"""pass@k: the unbiased estimator of Chen et al. 2021 against hand-computed values."""

import numpy as np
import pytest

from gspo_jax.evaluate import pass_at_k
from gspo_jax.tasks import rewards as R


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 2, 1 - 3 / 10),        # C(3,2)/C(5,2) = 3/10
    (10, 3, 5, 1 - 21 / 252),     # C(7,5)/C(10,5) = 21/252
    (4, 1, 1, 0.25),              # pass@1 = c/n
    (4, 0, 3, 0.0),               # nothing correct
    (8, 7, 2, 1.0),               # n - c = 1 < k: every pair holds a correct sample
    (8, 8, 8, 1.0),
])
def test_pass_at_k_by_hand(n, c, k, expected):
  assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_of_fixed_samples():
  # Two prompts, n = 4 samples each, scored by the exact_match built-in:
  # prompt A: answers "7": 2 of 4 right; prompt B: answer "3": 1 of 4 right.
  samples = [["7", "8", " 7", "1"], ["3", "4", "5", "6"]]
  answers = ["7", "3"]
  counts = [sum(R.exact_match(None, s, [a] * 4)) for s, a in zip(samples, answers)]
  assert counts == [2, 1]
  # pass@2: A = 1 - C(2,2)/C(4,2) = 1 - 1/6; B = 1 - C(3,2)/C(4,2) = 1 - 3/6.
  assert np.mean(pass_at_k(4, np.array(counts), 2)) == pytest.approx((5 / 6 + 1 / 2) / 2)


def test_pass_at_k_rejects_bad_arguments():
  with pytest.raises(ValueError, match="1 <= k <= n"):
    pass_at_k(4, 1, 5)
  with pytest.raises(ValueError, match=r"\[0, n=4\]"):
    pass_at_k(4, 5, 2)


@pytest.mark.parametrize("flags,message", [
    (["--k", "8", "--n", "4"], "--n must be >= --k"),
    (["--k", "-1"], "--k must be >= 0"),
    (["--n", "4"], "--n (samples per prompt) needs --k >= 1"),
    (["--size", "0"], "--size must be >= 1"),
    (["--examples", "-2"], "--examples must be >= 0"),
])
def test_evaluate_cli_refuses_bad_flags_by_name_before_loading(tmp_path, monkeypatch, capsys,
                                                               flags, message):
  from gspo_jax import evaluate
  monkeypatch.setattr(evaluate, "run_evaluation", lambda args: pytest.fail("loaded the run"))
  with pytest.raises(SystemExit):
    evaluate.main(["--run", str(tmp_path), *flags])
  assert message in capsys.readouterr().err
