"""Losses, advantages and log-probs under a mesh of 8 simulated CPU devices equal the
single-device results (rows sharded; rows and tokens sharded)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.models import logprobs
from gspo_jax.objectives import advantages, losses
from tests.helpers import random_batch

MESHES = {
    "rows8": ((8,), ("data",), P("data")),
    "rows2x4": ((2, 4), ("data", "fsdp"), P(("data", "fsdp"))),
    "rows4_tokens2": ((4, 2), ("data", "seq"), P("data", "seq")),
}


def make(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


# The losses beside GSPO, token weights and the rollout corrections are checked on 8
# devices in tests/objectives/test_variant_losses.py (one program for all of them).
@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo", "kl"])
def test_sharded_loss_and_grad_equal_single_device(name, dtype, tol):
  # Every mesh of MESHES against one single-device reference (compiled once, not per mesh).
  # "kl" is the KL term a train step adds, kl_loss, with old_logp standing in for pi_ref.
  logp, old, adv, mask = random_batch(30, dtype, B=16, T=8, scale=0.1, empty_rows=(3,))
  if name == "kl":
    fn = lambda lp, r, a, m: losses.kl_loss(lp, r, m)
  else:
    fn = functools.partial(losses.LOSSES[name], eps_low=0.02, eps_high=0.03)
  value_and_grad = jax.value_and_grad(lambda lp, o, a, m: fn(lp, o, a, m), has_aux=True)
  (loss, metrics), grad = jax.jit(value_and_grad)(logp, old, adv, mask)

  for mesh_name, (shape, names, spec) in MESHES.items():
    mesh = make(shape, names)
    tok = NamedSharding(mesh, spec)
    row = NamedSharding(mesh, P(spec[0]))
    rep = NamedSharding(mesh, P())
    sharded = jax.jit(value_and_grad, in_shardings=(tok, tok, row, tok),
                      out_shardings=((rep, rep), tok))
    put = lambda x, s: jax.device_put(x, s)
    (loss_s, metrics_s), grad_s = sharded(put(logp, tok), put(old, tok), put(adv, row),
                                          put(mask, tok))
    assert grad_s.sharding.spec == spec and len(grad_s.sharding.device_set) == 8, mesh_name
    np.testing.assert_allclose(loss_s, loss, err_msg=mesh_name, **tol)
    for k in metrics:
      np.testing.assert_allclose(metrics_s[k], metrics[k], err_msg=f"{mesh_name}: {k}", **tol)
    np.testing.assert_allclose(grad_s, grad, err_msg=mesh_name, **tol)


def test_sharded_advantages_and_logprobs(dtype, tol):
  mesh = make((8,), ("data",))
  rows = NamedSharding(mesh, P("data"))
  rng = np.random.default_rng(0)
  r = jnp.asarray(rng.normal(size=(16, 4)).astype(dtype))
  np.testing.assert_allclose(jax.jit(advantages.group_advantages, in_shardings=rows)(
      jax.device_put(r, rows)), advantages.group_advantages(r), **tol)
  h = jnp.asarray(rng.normal(size=(8, 6, 4)).astype(dtype))
  w = jnp.asarray(rng.normal(size=(4, 10)).astype(dtype))
  t = jnp.asarray(rng.integers(0, 10, (8, 6)))
  f = lambda h, w, t: logprobs.token_logprobs_from_hidden(h, w, t, chunk_size=4)
  out = jax.jit(f, in_shardings=(rows, NamedSharding(mesh, P()), rows), out_shardings=rows)(
      jax.device_put(h, rows), w, jax.device_put(t, rows))
  np.testing.assert_allclose(out, logprobs.token_logprobs(h @ w, t), **tol)
