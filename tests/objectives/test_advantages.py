"""gspo_jax.objectives.advantages.group_advantages: hand values, invariances, edge cases, bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.objectives.advantages import group_advantages


def test_hand_values(dtype, tol):
  # Group {1, 0, 1, 0}: mean 0.5, std (ddof 1) = sqrt(4 * 0.25 / 3) = sqrt(1/3).
  # A = +-0.5 / (sqrt(1/3) + 1e-6).
  # Group {3, 0, 0, 1}: mean 1, deviations (2, -1, -1, 0), std = sqrt(6 / 3) = sqrt(2).
  r = jnp.asarray(np.array([[1.0, 0, 1, 0], [3, 0, 0, 1]], dtype))
  a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
  b = 1 / (math.sqrt(2) + 1e-6)
  np.testing.assert_allclose(group_advantages(r), [[a, -a, a, -a], [2 * b, -b, -b, 0]], **tol)
  # Dr. GRPO: no std scaling.
  np.testing.assert_allclose(group_advantages(r, scale_by_std=False),
                             [[0.5, -0.5, 0.5, -0.5], [2, -1, -1, 0]], **tol)
  # TRL's eps (1e-4) gives 0.86588 on the first group (computed by hand).
  np.testing.assert_allclose(group_advantages(r, eps=1e-4)[0, 0], 0.86588, rtol=1e-5)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_equal_rewards_give_exactly_zero(scale_by_std, dtype):
  # 0.1 is not representable: mean(0.1, 0.1, 0.1) - 0.1 is a rounding residue, not 0.
  r = jnp.asarray(np.array([[0.1, 0.1, 0.1], [1.0, 2.0, 4.0], [-5, -5, -5]], dtype))
  adv = np.asarray(group_advantages(r, scale_by_std=scale_by_std))
  assert np.all(adv[0] == 0.0) and np.all(adv[2] == 0.0)
  assert np.all(adv[1] != 0.0)


def test_invariances(dtype, tol):
  rng = np.random.default_rng(0)
  r = rng.normal(size=(5, 8)).astype(dtype)
  base = group_advantages(jnp.asarray(r))
  shift = rng.normal(size=(5, 1)).astype(dtype) * 10
  # Adding a constant to a group's rewards changes nothing (up to rounding of r + c).
  np.testing.assert_allclose(group_advantages(jnp.asarray(r + shift)), base, rtol=1e-4, atol=1e-5)
  # Scaling by a positive constant changes nothing up to eps.
  np.testing.assert_allclose(group_advantages(jnp.asarray(r * 7.0)), base, rtol=1e-5, atol=1e-5)
  # Permuting responses within a group permutes the advantages.
  perm = rng.permutation(8)
  np.testing.assert_allclose(group_advantages(jnp.asarray(r[:, perm])), np.asarray(base)[:, perm],
                             **tol)
  # Each group sums to zero.
  np.testing.assert_allclose(np.asarray(base).sum(1), 0, atol=1e-5)


def test_integer_and_bool_rewards():
  adv = group_advantages(jnp.asarray([[1, 0, 0, 1]]))
  assert adv.dtype == jnp.float32
  np.testing.assert_allclose(group_advantages(jnp.asarray([[True, False, False, True]])), adv)


def test_jit_vmap_grad_and_sharding(dtype, tol):
  rng = np.random.default_rng(1)
  r = jnp.asarray(rng.normal(size=(8, 4)).astype(dtype))
  eager = group_advantages(r)
  np.testing.assert_allclose(jax.jit(group_advantages)(r), eager, **tol)
  stacked = jnp.stack([r, 2 * r + 1])
  np.testing.assert_allclose(jax.vmap(group_advantages)(stacked)[1], group_advantages(2 * r + 1),
                             **tol)
  g = jax.grad(lambda x: jnp.sum(group_advantages(x) * jnp.arange(4.0)[None, :]))(r)
  assert np.all(np.isfinite(g))
  # Gradient of a normalised quantity is orthogonal to a per-group shift.
  np.testing.assert_allclose(np.asarray(g).sum(1), 0, atol=1e-4)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  sharded = jax.jit(group_advantages, in_shardings=spec, out_shardings=spec)(
      jax.device_put(r, spec))
  assert len(sharded.sharding.device_set) == 8
  np.testing.assert_allclose(sharded, eager, **tol)


def test_group_of_one_is_an_error():
  with pytest.raises(ValueError, match="G >= 2"):
    group_advantages(jnp.ones((4, 1)))


@pytest.mark.parametrize("bad,match", [
    (jnp.ones(4), "rewards_BxG"),
    (jnp.ones((2, 3, 4)), "rewards_BxG"),
])
def test_wrong_rank(bad, match):
  with pytest.raises(ValueError, match=match):
    group_advantages(bad)


@pytest.mark.parametrize("eps", [0.0, -1e-6])
def test_eps_must_be_positive(eps):
  with pytest.raises(ValueError, match="eps"):
    group_advantages(jnp.ones((2, 2)), eps=eps)


def test_nan_rewards_are_an_error_eagerly():
  r = np.array([[1.0, 0.0], [np.nan, 1.0], [0.0, 0.0]])
  with pytest.raises(ValueError, match=r"NaN value\(s\), first at index \(1, 0\)"):
    group_advantages(r)


def test_nan_rewards_are_an_error_under_jit():
  r = jnp.asarray([[1.0, 0.0], [np.nan, 1.0]])
  with pytest.raises(Exception, match="NaN"):
    jax.block_until_ready(jax.jit(group_advantages)(r))
