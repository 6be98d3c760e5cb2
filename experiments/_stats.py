"""The statistics every experiment's comparison uses: sample spreads, paired per-seed
differences with Student-t intervals, and Fisher's exact test for collapse counts.

Seeds are the unit of replication: each seed has its own cold start, shared by every variant
of that seed, so two variants are compared by their per-seed differences (a paired design).
With n seeds the 95% interval of the mean difference is mean ± t(0.975, n - 1) · sd / √n,
sd the sample standard deviation (ddof 1). At n = 3, t = 4.30: an interval is about 2.5 sd
wide on each side, which is why three seeds resolve only large differences.
"""

from __future__ import annotations

import decimal
import math

import numpy as np


def sample_std(xs) -> float:
  """Sample standard deviation (ddof 1); nan for fewer than two values."""
  xs = np.asarray(xs, float)
  return float(np.std(xs, ddof=1)) if len(xs) > 1 else float("nan")


def t_quantile(q: float, df: int) -> float:
  """The q-quantile of Student's t with df degrees of freedom."""
  from scipy import stats  # jax depends on scipy, so it is always installed with it
  return float(stats.t.ppf(q, df))


def paired(a, b, level: float = 0.95) -> dict:
  """a − b seed by seed (same seeds, same order): the differences, their mean, sample sd,
  the half-width of the `level` t-interval of the mean and the two-sided paired t-test's p.
  With one seed the spread, interval and p are nan: one pair resolves nothing."""
  d = np.subtract(np.asarray(a, float), np.asarray(b, float))
  n = len(d)
  out = {"n": n, "diffs": [float(x) for x in d], "mean": float(np.mean(d)),
         "sd": sample_std(d), "half_width": float("nan"), "p": float("nan")}
  if n > 1:
    se = out["sd"] / math.sqrt(n)
    out["half_width"] = t_quantile(0.5 + level / 2, n - 1) * se
    if se > 0:
      from scipy import stats
      out["p"] = float(2 * stats.t.sf(abs(out["mean"]) / se, n - 1))
    else:  # identical differences: p is 0 unless they are all 0
      out["p"] = 1.0 if out["mean"] == 0 else 0.0
  out["low"], out["high"] = out["mean"] - out["half_width"], out["mean"] + out["half_width"]
  return out


def resolved(p: dict) -> bool:
  """The interval excludes zero."""
  return bool(p["n"] > 1 and (p["low"] > 0 or p["high"] < 0))


def verdict(p: dict, higher: str, lower: str, digits: int = 3, width: bool = True) -> str:
  """The comparison in words, by its interval: "no difference resolved (±0.22)", or which
  side is higher when the interval excludes zero; `higher` / `lower` name a and b; without
  `width` the half-width is left out (a table prints it in its own column)."""
  if p["n"] < 2:
    return "one seed: no interval"
  hw = f"±{p['half_width']:.{digits}f}"
  if not resolved(p):
    return f"no difference resolved ({hw})" if width else "no difference resolved"
  first, second = (higher, lower) if p["mean"] > 0 else (lower, higher)
  return f"**{first} above {second}** ({hw + ', ' if width else ''}p = {p['p']:.2g})"


def fisher_exact(k1: int, n1: int, k2: int, n2: int, one_sided: bool = False) -> float:
  """p of Fisher's exact test on the 2x2 table (k1 of n1) vs (k2 of n2), both margins fixed:
  two-sided, the probability of a table at most as likely as the one seen; one-sided, of
  k1 or more events in the first group."""
  k, n = k1 + k2, n1 + n2

  def prob(x: int) -> float:  # hypergeometric: x of the k events in the first group
    return math.comb(n1, x) * math.comb(n2, k - x) / math.comb(n, k)

  seen = prob(k1)
  support = range(max(0, k - n2), min(k, n1) + 1)
  if one_sided:
    return float(min(1.0, sum(prob(x) for x in support if x >= k1)))
  # A relative tolerance, as R and scipy use, so that ties in probability count as ties.
  return float(min(1.0, sum(prob(x) for x in support if prob(x) <= seen * (1 + 1e-7))))


def signed(x: float, digits: int = 3) -> str:
  """+0.118 / −0.015 (a true minus sign, as the README writes them)."""
  text = rnd(x, digits)
  return text.replace("-", "−") if text.startswith("-") else "+" + text


def rnd(x: float, digits: int) -> str:
  """x to `digits` decimals, halves away from zero (0.5625 -> 0.563, as written by hand;
  Python's format rounds the binary value half to even, 0.562)."""
  q = decimal.Decimal(1).scaleb(-digits)
  return str(decimal.Decimal(repr(float(x))).quantize(q, rounding=decimal.ROUND_HALF_UP))
