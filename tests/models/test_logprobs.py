"""token_logprobs and its memory-lean variant: values, gradients, temperature, bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.models.logprobs import token_logprobs, token_logprobs_from_hidden


def test_hand_values(dtype, tol):
  # logits [0, ln 2, ln 5] -> softmax [1, 2, 5] / 8.
  logits = jnp.asarray(np.array([[[0.0, math.log(2), math.log(5)]] * 2], dtype))
  tokens = jnp.asarray([[0, 2]])
  np.testing.assert_allclose(token_logprobs(logits, tokens), [[math.log(1 / 8), math.log(5 / 8)]],
                             **tol)
  # Temperature 2: logits / 2 -> weights [1, sqrt 2, sqrt 5].
  z = 1 + math.sqrt(2) + math.sqrt(5)
  np.testing.assert_allclose(token_logprobs(logits, tokens, temperature=2.0),
                             [[math.log(1 / z), math.log(math.sqrt(5) / z)]], **tol)


def test_matches_log_softmax_and_upcasts_bf16():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(0, 3, (2, 3, 5, 11)), jnp.bfloat16)
  tokens = jnp.asarray(rng.integers(0, 11, (2, 3, 5)))
  out = token_logprobs(logits, tokens)
  assert out.dtype == jnp.float32 and out.shape == (2, 3, 5)
  want = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), tokens[..., None],
                             -1)[..., 0]
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T,chunk", [(13, 4), (8, 8), (5, 128), (1, 3)])
def test_lean_variant_equals_plain_values_and_gradients(T, chunk, dtype, tol):
  rng = np.random.default_rng(T)
  B, D, V = 3, 8, 37
  h = jnp.asarray(rng.normal(0, 1, (B, T, D)).astype(dtype))
  w = jnp.asarray(rng.normal(0, 0.5, (D, V)).astype(dtype))
  tok = jnp.asarray(rng.integers(0, V, (B, T)))
  cot = jnp.asarray(rng.normal(0, 1, (B, T)).astype(dtype))  # an arbitrary downstream gradient

  plain = lambda h, w: token_logprobs(jnp.einsum("btd,dv->btv", h, w), tok, temperature=0.7)
  lean = lambda h, w: token_logprobs_from_hidden(h, w, tok, temperature=0.7, chunk_size=chunk)
  grad = lambda f, h, w: jax.grad(lambda h, w: jnp.sum(cot * f(h, w)), argnums=(0, 1))(h, w)

  # Values and gradients of both as one compiled program (cold compiles dominate here).
  @jax.jit
  def both(h, w):
    return lean(h, w), plain(h, w), grad(lean, h, w), grad(plain, h, w)

  v_lean, v_plain, g_lean, g_plain = both(h, w)
  np.testing.assert_allclose(v_lean, v_plain, **tol)
  for a, b in zip(g_lean, g_plain):
    np.testing.assert_allclose(a, b, **tol)


def test_lean_variant_leading_dims_and_vmap():
  rng = np.random.default_rng(1)
  h = jnp.asarray(rng.normal(size=(2, 3, 6, 4)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, 9)), jnp.float32)
  tok = jnp.asarray(rng.integers(0, 9, (2, 3, 6)))
  out = token_logprobs_from_hidden(h, w, tok, chunk_size=4)
  np.testing.assert_allclose(out, token_logprobs(h @ w, tok), rtol=1e-5, atol=1e-5)
  vm = jax.vmap(lambda a, t: token_logprobs_from_hidden(a, w, t, chunk_size=4))(h, tok)
  np.testing.assert_allclose(vm, out, rtol=1e-6, atol=1e-6)


def test_lean_variant_does_not_keep_full_logits():
  # The compiled gradient's temporary buffers must stay well below one B x T x V f32 array.
  B, T, D, V = 2, 256, 16, 4096
  h = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
  w = jax.ShapeDtypeStruct((D, V), jnp.float32)
  tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
  full = B * T * V * 4
  lean = jax.jit(jax.grad(lambda h, w, t: jnp.sum(token_logprobs_from_hidden(h, w, t,
                                                                             chunk_size=16)),
                          argnums=(0, 1)))
  temp = lean.lower(h, w, tok).compile().memory_analysis().temp_size_in_bytes
  assert temp < full / 4, (temp, full)


def test_bad_input():
  logits = jnp.zeros((2, 3, 5))
  with pytest.raises(ValueError, match="tokens_BxT"):
    token_logprobs(logits, jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"tokens_BxT must lie in \[0, 5\)"):
    token_logprobs(logits, jnp.full((2, 3), 5))
  with pytest.raises(ValueError, match="tokens_BxT must hold integer"):
    token_logprobs(logits, jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match="temperature"):
    token_logprobs(logits, jnp.zeros((2, 3), jnp.int32), temperature=0.0)
  with pytest.raises(ValueError, match="unembed_DxV"):
    token_logprobs_from_hidden(jnp.zeros((2, 3, 4)), jnp.zeros((5, 7)), jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="chunk_size"):
    token_logprobs_from_hidden(jnp.zeros((2, 3, 4)), jnp.zeros((4, 7)), jnp.zeros((2, 3), jnp.int32),
                               chunk_size=0)


def test_plain_jit_vmap_grad(dtype, tol):
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(3, 2, 4, 7)).astype(dtype))
  tok = jnp.asarray(rng.integers(0, 7, (3, 2, 4)))
  eager = token_logprobs(logits, tok)
  np.testing.assert_allclose(jax.jit(token_logprobs)(logits, tok), eager, **tol)
  np.testing.assert_allclose(jax.vmap(token_logprobs)(logits, tok), eager, **tol)
  # d logp / d logits = onehot - softmax.
  g = jax.grad(lambda x: jnp.sum(token_logprobs(x, tok)))(logits)
  want = jax.nn.one_hot(tok, 7, dtype=logits.dtype) - jax.nn.softmax(logits)
  np.testing.assert_allclose(g, want, **tol)
