"""experiments/_stats.py against numbers worked out by hand (each derivation in a comment)."""

import math

import pytest

from experiments import _stats


def test_sample_std_is_ddof_1():
  # mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5; 5 / (4 - 1) = 5/3.
  assert _stats.sample_std([1, 2, 3, 4]) == pytest.approx(math.sqrt(5 / 3))
  assert math.isnan(_stats.sample_std([0.7]))


def test_t_quantiles_of_the_table():
  # Student-t 97.5% points from any printed table: df 1, 2, 5.
  for df, t in ((1, 12.706), (2, 4.303), (5, 2.571)):
    assert _stats.t_quantile(0.975, df) == pytest.approx(t, abs=5e-4)


def test_paired_interval_and_p_by_hand():
  # d = (3-1, 5-2, 7-3) = (2, 3, 4): mean 3, sd 1, se 1/sqrt(3); half-width 4.3027/sqrt(3)
  # = 2.4841. t = 3 sqrt(3); for df 2 the two-sided p is 1 - t / sqrt(2 + t^2)
  # = 1 - 5.19615 / sqrt(29) = 0.035099.
  p = _stats.paired([3, 5, 7], [1, 2, 3])
  assert p["diffs"] == [2, 3, 4] and p["n"] == 3
  assert p["mean"] == 3 and p["sd"] == pytest.approx(1)
  assert p["half_width"] == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
  assert p["p"] == pytest.approx(1 - 3 * math.sqrt(3) / math.sqrt(29), rel=1e-6)
  assert (p["low"], p["high"]) == pytest.approx((3 - 2.484138, 3 + 2.484138), rel=1e-6)
  assert _stats.resolved(p)


def test_one_pair_resolves_nothing():
  p = _stats.paired([0.5], [0.2])
  assert p["mean"] == pytest.approx(0.3) and math.isnan(p["half_width"])
  assert not _stats.resolved(p) and _stats.verdict(p, "A", "B") == "one seed: no interval"


def test_verdicts_by_the_interval():
  # d = (1, -1, 0): mean 0, the interval straddles zero.
  assert _stats.verdict(_stats.paired([1, 0, 1], [0, 1, 1]), "A", "B", digits=2) == (
      "no difference resolved (±2.48)")
  # (2, 3, 4) below zero when the sides swap: B above A.
  assert _stats.verdict(_stats.paired([1, 2, 3], [3, 5, 7]), "A", "B", digits=2).startswith(
      "**B above A** (±2.48, p = 0.035")


def test_fisher_exact_by_hand():
  # 2 of 3 vs 0 of 3: margins 2 events of 6; P(x events in group 1) = C(3,x) C(3,2-x) / C(6,2)
  # = 3/15, 9/15, 3/15 for x = 0, 1, 2. Two-sided: the tables as unlikely as x = 2 are
  # x = 0 and 2, 0.4; one-sided (x >= 2): 0.2.
  assert _stats.fisher_exact(2, 3, 0, 3) == pytest.approx(0.4)
  assert _stats.fisher_exact(2, 3, 0, 3, one_sided=True) == pytest.approx(0.2)
  assert _stats.fisher_exact(1, 2, 1, 2) == pytest.approx(1.0)


def test_signed_uses_a_minus_sign():
  assert _stats.signed(0.1184) == "+0.118" and _stats.signed(-0.0152) == "−0.015"
