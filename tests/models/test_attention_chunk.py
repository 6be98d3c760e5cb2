"""Query-chunked attention (`ModelConfig.attention_chunk`, `attention.attend_chunked`)
computes what attention over all queries at once does — values and gradients, with own
keys only (`Transformer.__call__`) and shared + own keys (`Transformer.extend`) — and the
compiled update step holds less memory with it. So does attention in causal query blocks
that skip the masked keys (`ModelConfig.attention_block`, `attention.attend_causal`).

Legend as in gspo_jax/models/attention.py: B rows, G responses, S queries, K keys,
N query heads, C kv heads, H head_dim."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax.config import RolloutConfig, TrainConfig
from gspo_jax.models import config, transformer
from gspo_jax.models.attention import attend, attend_causal
from gspo_jax.rollout import teacher_forcing
from gspo_jax.train import optim, step
from gspo_jax.train.programs import step_config
from gspo_jax.utils import configlib

B, G, S, N, C, H, P = 2, 3, 7, 4, 2, 8, 5


def _inputs():
  """Queries, own keys/values (K = S), shared keys/values (K = P), masks, a cotangent."""
  rng = np.random.default_rng(0)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  causal_SxS = np.tril(np.ones((S, S), bool))
  valid_BxGxS = np.ones((B, G, S), bool)
  valid_BxGxS[1, 2, 0] = False    # key 0 invalid: query 0 of that response sees nothing
  valid_BxGxS[0, 1, 5:] = False   # trailing padding keys
  own_mask = causal_SxS[None, None] & valid_BxGxS[:, :, None, :]   # (B, G, S, S)
  assert not own_mask[1, 2, 0].any()  # the fully masked query row the test is about
  prefix_valid_BxP = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
  return dict(q=f(B, G, S, N, H), k=f(B, G, S, C, H), v=f(B, G, S, C, H),
              pk=f(B, P, C, H), pv=f(B, P, C, H), own_mask=jnp.asarray(own_mask),
              causal_mask=jnp.asarray(causal_SxS[None, None]),              # (1, 1, S, S)
              prefix_mask=jnp.asarray(prefix_valid_BxP[:, None, None, :]),  # (B, 1, 1, P)
              w=f(B, G, S, N, H))


def _value_and_grads(x, chunk, shared):
  """(o, d(sum w*o)/dq, dk, dv[, dpk, dpv]) of one compiled program."""
  def f(q, k, v, pk, pv):
    if shared:  # as `extend`: the prompt's keys, then the response's own causal keys
      return attend(q, shared=(pk, pv, x["prefix_mask"]), own=(k, v, x["causal_mask"]),
                    query_chunk=chunk)
    return attend(q, own=(k, v, x["own_mask"]), query_chunk=chunk)

  def loss(*args):
    o = f(*args)
    return jnp.sum(o * x["w"]), o

  grads, o = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
      x["q"], x["k"], x["v"], x["pk"], x["pv"])
  return (o,) + grads


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared_own"])
def test_chunked_attention_equals_all_queries_at_once(shared):
  x = _inputs()
  want = _value_and_grads(x, 0, shared)
  assert all(np.isfinite(a).all() for a in want)  # the fully masked row stays finite
  # 3 does not divide S = 7 (padded to 9); 7 = S is one chunk; 16 > S runs unchunked.
  for chunk in (1, 3, 7, 16):
    got = _value_and_grads(x, chunk, shared)
    for name, g, w in zip(("o", "dq", "dk", "dv", "dpk", "dpv"), got, want):
      # Same float32 formula per query row. Values come out bit-equal here; the gradients
      # of k and v sum over query chunks, so they may differ in the last bits.
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=f"{name}, chunk {chunk}")


def test_padded_queries_reach_no_key():
  # S = 7 in chunks of 3 pads two all-False query rows, which softmax uniformly over every
  # key; their outputs are dropped, so a key no real query attends to (response (0, 1),
  # padding keys 5 and 6) must still get exactly zero gradient.
  x = _inputs()
  _, dq, dk, dv, _, _ = _value_and_grads(x, 3, False)
  assert dq.shape == x["q"].shape
  np.testing.assert_array_equal(dk[0, 1, 5:], 0.0)
  np.testing.assert_array_equal(dv[0, 1, 5:], 0.0)
  assert np.abs(dv[0, 1, :5]).min() > 0  # the real keys do get one


# One layer: each compile here is most of a test's time.
TINY = config.tiny(vocab_size=64, hidden=32, mlp_dim=64, num_layers=1, num_heads=4,
                   num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("field,T", [("attention_chunk", 5), ("attention_block", 9)])
def test_model_logprobs_and_gradients_do_not_change(field, T):
  # Shared prompts. Chunks: `__call__` over the 6 prompt positions (4 + 2) and `extend`
  # over the 5 response positions (4 + 1), so both teacher-forcing entry points chunk.
  # Causal blocks: `extend` over 9 response positions in blocks of 4 + 4 + 1.
  rng = np.random.default_rng(1)
  lens = jnp.asarray([6, 3], jnp.int32)
  prompts = jnp.asarray(rng.integers(2, 64, (2, 6)), jnp.int32)
  tokens = jnp.asarray(rng.integers(2, 64, (2, 2, T)), jnp.int32)

  def logp_and_grad(cfg):
    graphdef, params = nnx.split(transformer.create(cfg, seed=4), nnx.Param)

    def loss(params):
      logp = teacher_forcing.response_logprobs(nnx.merge(graphdef, params), prompts, lens,
                                               tokens)[0]
      return jnp.sum(logp), logp
    return jax.jit(jax.grad(loss, has_aux=True))(params)

  want_grad, want = logp_and_grad(TINY)
  got_grad, got = logp_and_grad(dataclasses.replace(TINY, **{field: 4}))
  # Not bit-equal: XLA fuses and orders the chunked program's float32 sums differently.
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * np.abs(w).max())


def _update_temp_bytes(mcfg, rows=4, P_=8, T=120):
  """XLA's temporaries of the update step over rows of P_ + T tokens, compiled from
  abstract inputs (nothing is initialised or run)."""
  cfg = TrainConfig(model=mcfg, num_minibatches=1, share_prompts=False,
                    rollout=RolloutConfig(prompts_per_iter=rows // 2, group_size=2,
                                          max_new_tokens=T, max_prompt_len=P_))
  model = nnx.eval_shape(lambda: transformer.Transformer(mcfg, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optim.make_optimizer(cfg.optim)
  state = step.TrainState(params=params, opt_state=jax.eval_shape(tx.init, params),
                          step=jax.ShapeDtypeStruct((), jnp.int32),
                          key=jax.eval_shape(lambda: jax.random.key(0)))
  Bp, i32, f32 = rows // 2, jnp.int32, jnp.float32
  batch = step.Batch(prompts_BxP=jax.ShapeDtypeStruct((Bp, P_), i32),
                     prompt_lens_B=jax.ShapeDtypeStruct((Bp,), i32),
                     tokens_BxGxT=jax.ShapeDtypeStruct((Bp, 2, T), i32),
                     mask_BxGxT=jax.ShapeDtypeStruct((Bp, 2, T), f32),
                     old_logp_BxGxT=jax.ShapeDtypeStruct((Bp, 2, T), f32))
  update = jax.jit(lambda s, b, r: step.update(s, b, r, graphdef=graphdef, tx=tx,
                                                    cfg=step_config(cfg)))
  compiled = update.lower(state, batch, jax.ShapeDtypeStruct((Bp, 2), f32)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_update_step_holds_less_memory_with_chunks():
  # S = 128 queries and keys: unchunked, the layer keeps (S x S) float32 scores and
  # probabilities for the backward; with 16-query chunks, one chunk's at a time. Measured
  # 4.7 MiB -> 2.1 MiB of temporaries (XLA:CPU); memory is deterministic, so a margin
  # against other buffers is all the bound needs.
  off = _update_temp_bytes(TINY)
  on = _update_temp_bytes(dataclasses.replace(TINY, attention_chunk=16))
  assert on < 0.6 * off, (on, off)


@pytest.mark.parametrize("matmul_dtype", [None, jnp.bfloat16], ids=["f32", "bf16_inputs"])
def test_causal_blocks_equal_attention_over_all_keys(matmul_dtype):
  # `attend_causal` drops, per query block, the own keys after its last query: masked for
  # every query of the block, so the same values and gradients (float32 summation order).
  x = _inputs()

  def grads(block, chunk):
    def loss(q, k, v, pk, pv):
      shared = (pk, pv, x["prefix_mask"])
      if block:
        o = attend_causal(q, block, own_kv=(k, v), shared=shared, query_chunk=chunk,
                          matmul_dtype=matmul_dtype)
      else:
        o = attend(q, shared=shared, own=(k, v, x["causal_mask"]), matmul_dtype=matmul_dtype)
      return jnp.sum(o * x["w"]), o
    g, o = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        x["q"], x["k"], x["v"], x["pk"], x["pv"])
    return (o,) + g

  want = grads(0, 0)
  # 1: every query its own block; 3 does not divide S = 7; 7 = S is one block; with a
  # query chunk inside each block too.
  for block, chunk in ((1, 0), (3, 0), (7, 0), (16, 0), (4, 3)):
    got = grads(block, chunk)
    for name, g, w in zip(("o", "dq", "dk", "dv", "dpk", "dpv"), got, want):
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6,
                                 err_msg=f"{name}, block {block}, chunk {chunk}")


@pytest.mark.parametrize("field", ["attention_chunk", "attention_block"])
@pytest.mark.parametrize("bad", [-1, 2.5, True, "64"])
def test_bad_chunk_is_refused_naming_the_field(field, bad):
  with pytest.raises(ValueError, match=f"ModelConfig.{field} must be a non-negative int"):
    config.tiny(**{field: bad})


def test_chunk_round_trips_through_overrides_and_json(tmp_path):
  cfg = configlib.apply_overrides(TrainConfig(), ["model.attention_chunk=128"])
  assert cfg.model.attention_chunk == 128
  path = str(tmp_path / "config.json")
  configlib.save_json(cfg, path)
  assert configlib.load_json(TrainConfig, path) == cfg
  # A config written before the field existed loads with chunking off.
  old = configlib.to_dict(TrainConfig())
  del old["model"]["attention_chunk"]
  assert configlib.from_dict(TrainConfig, old).model.attention_chunk == 0
  with pytest.raises(configlib.ConfigError, match="ModelConfig.attention_chunk"):
    configlib.apply_overrides(TrainConfig(), ["model.attention_chunk=-3"])


def test_causal_blocks_without_shared_prompts_are_refused():
  # The blocks apply to the prompt-shared forward only: set without it they would do
  # nothing, so the setting is refused by name before any work.
  with pytest.raises(ValueError, match="model.attention_block needs share_prompts=True"):
    TrainConfig(model=dataclasses.replace(TINY, attention_block=64), share_prompts=False)
  TrainConfig(model=dataclasses.replace(TINY, attention_block=64), share_prompts=True)
