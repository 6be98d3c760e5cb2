"""gspo_jax.models.moe: a naive numpy reference, dense == ragged (values and gradients),
Routing Replay, hand-computed aux loss and masking, jit/grad, metadata, bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax.models import config
from gspo_jax.models.moe import MoE, route

DISPATCHES = ("dense", "ragged")


def make(dtype=np.float32, **overrides):
  name = np.dtype(dtype).name
  cfg = config.tiny_moe(**{"dtype": name, "param_dtype": name, **overrides})
  return MoE(cfg, rngs=nnx.Rngs(0))


def rand_x(seed, B=2, S=5, D=64, dtype=np.float32):
  return jnp.asarray(np.random.default_rng(seed).normal(0, 1, (B, S, D)).astype(dtype))


def params_np(moe):
  return {n: np.asarray(getattr(moe, n)[...], np.float64) for n in ("router", "gate", "up", "down")}


def naive_moe(p, x_BxSxD, k, norm_topk_prob, replay_BxSxK=None):
  """Per-token loop in float64 numpy: (y_BxSxD, indices_BxSxK)."""
  B, S, D = x_BxSxD.shape
  x = np.asarray(x_BxSxD, np.float64)
  y = np.zeros((B, S, D))
  chosen = np.zeros((B, S, k), np.int64)
  for b in range(B):
    for s in range(S):
      logits = x[b, s] @ p["router"]
      probs = np.exp(logits - logits.max())
      probs /= probs.sum()
      idx = np.argsort(-probs)[:k] if replay_BxSxK is None else np.asarray(replay_BxSxK)[b, s]
      w = probs[idx]
      if norm_topk_prob:
        w = w / w.sum()
      for wi, e in zip(w, idx):
        g = x[b, s] @ p["gate"][e]
        u = x[b, s] @ p["up"][e]
        y[b, s] += wi * ((g / (1 + np.exp(-g)) * u) @ p["down"][e])
      chosen[b, s] = idx
  return y, chosen


def naive_aux(p, x_BxSxD, indices_BxSxK, valid_BxS):
  """E * sum_e f_e P_e by explicit counting over valid tokens, float64."""
  E = p["router"].shape[1]
  counts, prob_sum, n = np.zeros(E), np.zeros(E), 0
  for b, s in zip(*np.nonzero(np.asarray(valid_BxS))):
    logits = np.asarray(x_BxSxD, np.float64)[b, s] @ p["router"]
    probs = np.exp(logits - logits.max())
    prob_sum += probs / probs.sum()
    for e in np.asarray(indices_BxSxK)[b, s]:
      counts[e] += 1
    n += 1
  return E * np.sum((counts / n) * (prob_sum / n))


# ---------------------------------------------------------------- naive reference


@pytest.mark.parametrize("dispatch", DISPATCHES)
@pytest.mark.parametrize("norm", [True, False])
def test_matches_naive_per_token_loop(dispatch, norm, dtype, tol):
  moe = make(dtype, moe_dispatch=dispatch, norm_topk_prob=norm)
  x = rand_x(1, dtype=dtype)
  y, idx, aux = moe(x)
  want_y, want_idx = naive_moe(params_np(moe), x, 2, norm)
  np.testing.assert_array_equal(idx, want_idx)
  # Reference is float64 and accumulates in another order: allow float32 rounding.
  f32_tol = dict(rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(y, want_y, **(tol if dtype == np.float64 else f32_tol))
  valid = np.ones((2, 5), bool)
  np.testing.assert_allclose(aux, naive_aux(params_np(moe), x, want_idx, valid), rtol=1e-6)
  if not norm:  # without renormalisation the weights are raw probs: sum_k w < 1
    assert not np.allclose(y, naive_moe(params_np(moe), x, 2, True)[0], rtol=1e-3)


# ---------------------------------------------------------------- dense == ragged


def loss_and_grads(moe, x, c, replay=None):
  graphdef, state = nnx.split(moe)

  def loss(state, x):
    y, _, aux = nnx.merge(graphdef, state)(x, replay_BxSxK=replay)
    return jnp.sum(y * c) + 0.1 * aux

  # One jitted program: op-by-op eager autodiff compiles every small op and is much slower.
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)


def test_dense_equals_ragged_values_and_gradients(dtype, tol):
  # norm_topk_prob only changes route(), which both paths share; the naive test covers both.
  dense = make(dtype, moe_dispatch="dense")
  ragged = make(dtype, moe_dispatch="ragged")
  x = rand_x(2, B=3, S=7, dtype=dtype)
  c = jnp.asarray(np.random.default_rng(3).normal(0, 1, x.shape).astype(dtype))
  y_d, idx_d, aux_d = dense(x)
  y_r, idx_r, aux_r = ragged(x)
  np.testing.assert_array_equal(idx_d, idx_r)
  np.testing.assert_allclose(y_r, y_d, **tol)
  np.testing.assert_allclose(aux_r, aux_d, **tol)
  l_d, (gs_d, gx_d) = loss_and_grads(dense, x, c)
  l_r, (gs_r, gx_r) = loss_and_grads(ragged, x, c)
  np.testing.assert_allclose(l_r, l_d, **tol)
  np.testing.assert_allclose(gx_r, gx_d, **tol)
  for name in ("router", "gate", "up", "down"):
    g_d, g_r = gs_d[name][...], gs_r[name][...]
    assert np.abs(g_d).max() > 0, name  # every parameter is actually reached
    np.testing.assert_allclose(g_r, g_d, **tol, err_msg=name)


def test_dense_equals_ragged_with_idle_experts():
  # Every token on experts {0, 3}: experts 1 and 2 get empty ragged groups.
  tol = dict(rtol=1e-5, atol=1e-6)
  dense = make(moe_dispatch="dense")
  ragged = make(moe_dispatch="ragged")
  x = rand_x(4)
  replay = jnp.broadcast_to(jnp.asarray([3, 0], jnp.int32), (2, 5, 2))
  c = jnp.asarray(np.random.default_rng(5).normal(0, 1, x.shape).astype(np.float32))
  l_d, (gs_d, gx_d) = loss_and_grads(dense, x, c, replay)
  l_r, (gs_r, gx_r) = loss_and_grads(ragged, x, c, replay)
  np.testing.assert_allclose(l_r, l_d, **tol)
  np.testing.assert_allclose(gx_r, gx_d, **tol)
  for name in ("router", "gate", "up", "down"):
    np.testing.assert_allclose(gs_r[name][...], gs_d[name][...], **tol, err_msg=name)
  # Idle experts get exactly zero gradient.
  assert not np.any(gs_r["gate"][...][1:3]) and not np.any(gs_r["down"][...][1:3])


# ---------------------------------------------------------------- Routing Replay


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_replay_own_indices_is_identity_and_other_indices_follow_the_reference(dispatch):
  moe = make(moe_dispatch=dispatch)
  x = rand_x(6)
  y, idx, aux = moe(x)
  assert idx.dtype == jnp.int32
  y2, idx2, aux2 = moe(x, replay_BxSxK=idx)
  np.testing.assert_allclose(y2, y, rtol=0, atol=1e-6)
  np.testing.assert_array_equal(idx2, idx)
  np.testing.assert_allclose(aux2, aux, rtol=0, atol=1e-6)

  other = (idx + 1) % 4
  y3, idx3, _ = moe(x, replay_BxSxK=other)
  np.testing.assert_array_equal(idx3, other)
  assert np.abs(np.asarray(y3) - np.asarray(y)).max() > 1e-2
  want, _ = naive_moe(params_np(moe), x, 2, True, replay_BxSxK=other)
  np.testing.assert_allclose(y3, want, rtol=1e-5, atol=2e-6)


def test_replay_keeps_router_gradient():
  moe = make(moe_dispatch="ragged")
  x = rand_x(7)
  c = jnp.asarray(np.random.default_rng(8).normal(0, 1, x.shape).astype(np.float32))
  replay = (moe(x)[1] + 1) % 4
  graphdef, router, rest = nnx.split(moe, nnx.PathContains("router"), ...)

  @jax.jit
  def loss(router):  # no aux term: the router gradient must come through the weights
    return jnp.sum(nnx.merge(graphdef, router, rest)(x, replay_BxSxK=replay)[0] * c)

  g = jax.grad(loss)(router)["router"][...]
  assert np.abs(np.asarray(g)).max() > 1e-4
  # Central finite difference of one router entry (float32, so a loose tolerance).
  eps = 1e-2
  fd = (loss(jax.tree.map(lambda r: r.at[0, 1].add(eps), router))
        - loss(jax.tree.map(lambda r: r.at[0, 1].add(-eps), router))) / (2 * eps)
  np.testing.assert_allclose(g[0, 1], fd, rtol=2e-2, atol=1e-4)


# ---------------------------------------------------------------- aux loss


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_aux_uniform_router_is_exactly_k(dispatch):
  moe = make(moe_dispatch=dispatch)
  moe.router[...] = jnp.zeros_like(moe.router[...])
  _, _, aux = moe(rand_x(9))
  assert aux.dtype == jnp.float32 and aux.shape == ()
  assert float(aux) == 2.0  # probs exactly 1/4: E * sum_e f_e / E = sum_e f_e = k


def test_aux_hand_value_and_padding_is_ignored():
  # Router rows 0 and 1 are log-probabilities, x picks one row per token:
  #   token 0 = e_0: probs [1/2, 1/4, 1/8, 1/8] -> top-2 {0, 1}
  #   token 1 = e_1: probs [1/4, 1/8, 1/8, 1/2] -> top-2 {3, 0}
  #   token 2: padding (anything).
  # counts [2, 1, 0, 1] / 2 -> f = [1, 1/2, 0, 1/2];  P = [3/8, 3/16, 1/8, 5/16]
  # aux = 4 * (3/8 + 3/32 + 0 + 5/32) = 4 * 5/8 = 2.5
  moe = make()
  router = np.zeros((64, 4), np.float32)
  router[0] = np.log([4.0, 2.0, 1.0, 1.0])
  router[1] = np.log([2.0, 1.0, 1.0, 4.0])
  moe.router[...] = jnp.asarray(router)
  x = np.zeros((1, 3, 64), np.float32)
  x[0, 0, 0] = 1.0
  x[0, 1, 1] = 1.0
  x[0, 2] = np.random.default_rng(10).normal(0, 3, 64)
  valid = jnp.asarray([[True, True, False]])
  _, idx, aux = moe(jnp.asarray(x), valid_BxS=valid)
  assert sorted(np.asarray(idx)[0, 0].tolist()) == [0, 1]
  assert sorted(np.asarray(idx)[0, 1].tolist()) == [0, 3]
  np.testing.assert_allclose(aux, 2.5, rtol=1e-6)
  # Changing the padded token does not change aux; 0/1 masks act like bools.
  x[0, 2] = np.random.default_rng(11).normal(0, 3, 64)
  _, _, aux2 = moe(jnp.asarray(x), valid_BxS=jnp.asarray([[1, 1, 0]], jnp.int32))
  np.testing.assert_allclose(aux2, 2.5, rtol=1e-6)
  # Without the mask the padded token counts, and aux moves.
  assert abs(float(moe(jnp.asarray(x))[2]) - 2.5) > 1e-3


def test_aux_random_mask_matches_counting():
  moe = make(moe_dispatch="ragged")
  x = rand_x(12, B=3, S=6)
  valid = np.random.default_rng(13).uniform(size=(3, 6)) < 0.6
  _, idx, aux = moe(x, valid_BxS=jnp.asarray(valid))
  np.testing.assert_allclose(aux, naive_aux(params_np(moe), x, idx, valid), rtol=1e-5)


def test_aux_all_padding_is_zero_not_nan():
  moe = make()
  _, _, aux = moe(rand_x(14), valid_BxS=jnp.zeros((2, 5), bool))
  assert float(aux) == 0.0


# ---------------------------------------------------------------- jit, grad, dtypes, metadata


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_jit_grad_shapes_and_dtypes(dispatch):
  moe = make(moe_dispatch=dispatch)
  x = rand_x(15)
  valid = jnp.asarray(np.arange(10).reshape(2, 5) < 8)
  y, idx, aux = moe(x, valid_BxS=valid)
  y_j, idx_j, aux_j = nnx.jit(lambda m, x, v: m(x, valid_BxS=v))(moe, x, valid)
  assert y_j.shape == (2, 5, 64) and idx_j.shape == (2, 5, 2) and idx_j.dtype == jnp.int32
  np.testing.assert_allclose(y_j, y, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(idx_j, idx)
  np.testing.assert_allclose(aux_j, aux, rtol=1e-6)
  # Replay under jit too (values cannot be range-checked there).
  y_r = nnx.jit(lambda m, x, r: m(x, replay_BxSxK=r)[0])(moe, x, idx)
  np.testing.assert_allclose(y_r, y, rtol=1e-5, atol=1e-6)

  @nnx.jit
  def step(m, x):
    return nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2) + m(x)[2])(m)

  grads = step(moe, x)
  for name in ("router", "gate", "up", "down"):
    g = np.asarray(grads[name][...])
    assert g.shape == getattr(moe, name)[...].shape and np.all(np.isfinite(g)) and g.any(), name


def test_bf16_compute_with_f32_params():
  for dispatch in DISPATCHES:
    cfg = config.tiny_moe(moe_dispatch=dispatch, dtype="bfloat16", param_dtype="float32")
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    assert moe.gate[...].dtype == jnp.float32
    y, idx, aux = moe(rand_x(16))
    assert y.dtype == jnp.bfloat16 and idx.dtype == jnp.int32 and aux.dtype == jnp.float32
    # The softmax runs in float32 even for bf16 activations (HF), the weights come back in bf16.
    w, _, probs = route(rand_x(16).reshape(10, 64).astype(jnp.bfloat16), moe.router[...], 2,
                        norm_topk_prob=True)
    assert probs.dtype == jnp.float32 and w.dtype == jnp.bfloat16
    y32, _, _ = make(moe_dispatch=dispatch)(rand_x(16))
    np.testing.assert_allclose(np.asarray(y, np.float32), y32, rtol=0.1, atol=0.05)


def test_parameters_axes_and_init_scale():
  moe = make()
  want = {"router": ((64, 4), ("embed", "expert")),
          "gate": ((4, 64, 32), ("expert", "embed", "mlp")),
          "up": ((4, 64, 32), ("expert", "embed", "mlp")),
          "down": ((4, 32, 64), ("expert", "mlp", "embed"))}
  for name, (shape, axes) in want.items():
    var = getattr(moe, name)
    assert var[...].shape == shape, name
    assert tuple(var.get_metadata()["logical_axes"]) == axes, name
  # N(0, 1/fan_in) with fan_in = the contracted width: 64 for gate/up, 32 for down.
  np.testing.assert_allclose(np.std(moe.gate[...]), 1 / 8, rtol=0.05)
  np.testing.assert_allclose(np.std(moe.down[...]), 1 / math.sqrt(32), rtol=0.05)


# ---------------------------------------------------------------- bad input


def test_bad_input_raises():
  moe = make()
  x = rand_x(17)
  with pytest.raises(ValueError, match="replay_BxSxK"):
    moe(x, replay_BxSxK=jnp.zeros((2, 5, 3), jnp.int32))
  with pytest.raises(ValueError, match="replay_BxSxK"):
    moe(x, replay_BxSxK=jnp.zeros((2, 5), jnp.int32))
  with pytest.raises(ValueError, match="replay_BxSxK.*integer"):
    moe(x, replay_BxSxK=jnp.zeros((2, 5, 2), jnp.float32))
  with pytest.raises(ValueError, match=r"replay_BxSxK.*\[0, 4\)"):
    moe(x, replay_BxSxK=jnp.full((2, 5, 2), 4, jnp.int32))
  with pytest.raises(ValueError, match="valid_BxS"):
    moe(x, valid_BxS=jnp.ones((2, 4), bool))
  with pytest.raises(ValueError, match="x_BxSxD"):
    moe(x[0])
  with pytest.raises(ValueError, match="hidden"):
    moe(x[..., :32])
  with pytest.raises(ValueError, match="num_experts"):
    MoE(config.tiny(), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_out_of_range_replay_under_jit_is_nan_only_for_that_token(dispatch):
  moe = make(moe_dispatch=dispatch)
  x = rand_x(18)
  y, idx, _ = moe(x)
  for bad in (-1, 4):
    replay = idx.at[0, 2, 1].set(bad)
    y_bad = nnx.jit(lambda m, x, r: m(x, replay_BxSxK=r)[0])(moe, x, replay)
    assert np.all(np.isnan(np.asarray(y_bad)[0, 2]))
    keep = np.ones((2, 5), bool)
    keep[0, 2] = False
    np.testing.assert_allclose(np.asarray(y_bad)[keep], np.asarray(y)[keep], rtol=1e-5, atol=1e-6)
