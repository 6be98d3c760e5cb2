"""The rollout-correction functions (gspo_jax/objectives/rollout_correction.py): importance weights
by token, sequence and geometric mean, truncated or masked, and DeepSeek-V3.2's off-policy
sequence mask, by hand; weights exactly 1 when the sampler is pi_old. Their use in the
losses is in test_variant_losses.py, in the train step in test_rollout_correction_train.py.
Numeric tests run in float32 and float64 (`dtype`)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.objectives import losses as L
from tests.helpers import arr, random_batch


def test_rollout_correction_hand_values(dtype, tol):
  # log(pi_old / pi_sampler): row0 [log 3, log 0.4, 0], row1 [log 1.5, *, *] (masked junk).
  sampler = arr([[0.0, 0.0, -1.0], [-2.0, 0.0, 0.0]], dtype)
  old = sampler + arr([[math.log(3), math.log(0.4), 0.0], [math.log(1.5), np.nan, np.inf]], dtype)
  mask = jnp.asarray([[1, 1, 1], [1, 0, 0]], jnp.float32)
  rc = lambda **kw: L.rollout_correction(old, sampler, mask, **kw)
  cases = {
      # Token, min(w, 2): [2, 0.4, 1], [1.5]; one token of four truncated.
      ("token", "truncate"): ([[2, 0.4, 1], [1.5, 0, 0]], 1 / 4),
      # Sequence: products 3 * 0.4 * 1 = 1.2 and 1.5, on every token of the row.
      ("sequence", "truncate"): ([[1.2] * 3, [1.5, 0, 0]], 0),
      # Geometric: 1.2^(1/3) = 1.06266 and 1.5.
      ("geometric", "truncate"): ([[1.2 ** (1 / 3)] * 3, [1.5, 0, 0]], 0),
      # Mask outside [1/2, 2]: 3 and 0.4 are dropped (weight 0), 1 and 1.5 keep their weight.
      ("token", "mask"): ([[0, 0, 1], [1.5, 0, 0]], 2 / 4),
  }
  for (level, mode), (want, frac) in cases.items():
    w, m = rc(level=level, mode=mode)
    np.testing.assert_allclose(w, want, err_msg=f"{level} {mode}", **tol)
    np.testing.assert_allclose(m["rollout_corr_frac"], frac, err_msg=f"{level} {mode}", **tol)
  # threshold_low 0.3 keeps 0.4; at threshold 1.4 the row-1 weight 1.5 goes too.
  w, _ = rc(mode="mask", threshold=1.4, threshold_low=0.3)
  np.testing.assert_allclose(w, [[0, 0.4, 1], [0, 0, 0]], **tol)
  # Sequence-level mask at threshold 1.3: row 1 (1.5) is dropped whole, row 0 (1.2) kept.
  w, m = rc(level="sequence", mode="mask", threshold=1.3)
  np.testing.assert_allclose(w, [[1.2] * 3, [0, 0, 0]], **tol)
  # Metrics: k3 = w - 1 - log w per token, mean over the 4 counted tokens; max weight and
  # log-weights before truncation.
  _, m = rc()
  k3 = sum(x - 1 - math.log(x) for x in (3, 0.4, 1, 1.5)) / 4
  np.testing.assert_allclose(m["rollout_corr_kl"], k3, **tol)
  np.testing.assert_allclose([m["rollout_corr_weight_mean"], m["rollout_corr_weight_max"],
                              m["rollout_corr_log_weight_min"], m["rollout_corr_log_weight_max"]],
                             [4.9 / 4, 2, math.log(0.4), math.log(3)], **tol)


def test_off_policy_sequence_mask_hand_values(dtype, tol):
  # d_i = mean_t (log pi_sampler - log pi_theta): rows 0, 1 drift 0.2, row 2 0.05, row 3 empty.
  logp = arr(np.full((4, 2), -1.0), dtype)
  sampler = logp + arr([[0.3, 0.1], [0.2, 0.2], [0.05, np.nan], [9.0, 9.0]], dtype)
  mask = jnp.asarray([[1, 1], [1, 1], [1, 0], [0, 0]], jnp.float32)
  adv = arr([-1.0, 1.0, -1.0, -1.0], dtype)
  w, m = L.off_policy_sequence_mask(logp, sampler, adv, mask, threshold=0.1)
  # Row 0: A < 0 and 0.2 > 0.1: dropped. Row 1: A > 0: kept. Row 2: 0.05 <= 0.1: kept.
  np.testing.assert_array_equal(w, [[0, 0], [1, 1], [1, 0], [0, 0]])
  np.testing.assert_allclose([m["off_policy_masked_frac"], m["off_policy_kl_mean"]],
                             [1 / 3, 0.45 / 3], **tol)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_rollout_weights_are_exactly_one_when_the_sampler_is_pi_old(level, dtype):
  logp, _, _, mask = random_batch(35, dtype, prefix=False, empty_rows=(1,))
  for mode in ("truncate", "mask"):
    w, m = L.rollout_correction(logp, logp, mask, level=level, mode=mode)
    np.testing.assert_array_equal(w, np.asarray(mask))
    assert float(m["rollout_corr_kl"]) == 0 and float(m["rollout_corr_frac"]) == 0
    assert float(m["rollout_corr_weight_mean"]) == 1 == float(m["rollout_corr_weight_max"])
