"""The NNX transformer: cached decode = full forward, causality, padding, RoPE, RMSNorm,
MoE plumbing and Routing Replay, logical axis names, and the real Qwen3 shapes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax.models import config, layers, transformer
from gspo_jax.models.transformer import KVCache


@nnx.jit
def forward(model, tokens, pos, valid=None, replay=None, embeds=None):
  return model(tokens, pos, valid, replay=replay, embeds_BxSxD=embeds)


@pytest.fixture(scope="module")
def dense():
  return transformer.create(config.tiny(), seed=1)


@pytest.fixture(scope="module")
def moe():
  return transformer.create(config.tiny_moe(), seed=2)


# The cached-decode test's three programs (prefill, one decode step, the reference
# forward), each with its logits: one compile each per model instead of six.
@nnx.jit
def prefill_logits(model, tokens, pos, valid, lens):
  out = model(tokens, pos, valid)
  last = out.hidden_BxSxD[jnp.arange(tokens.shape[0]), lens - 1]
  return out, model.logits(last)


@nnx.jit
def decode_logits(model, tokens, pos, cache):
  h, cache = model.decode(tokens, pos, cache)
  return model.logits(h), cache


@nnx.jit
def forward_logits(model, tokens, pos, valid):
  return model.logits(model(tokens, pos, valid).hidden_BxSxD)


def full_sequences(prompts_BxP, lens_B, resp_BxGxT):
  """Concatenate each row's valid prompt and response, left-aligned, for a plain forward."""
  B, G, T = resp_BxGxT.shape
  rows, n = [], []
  for b in range(B):
    for g in range(G):
      rows.append(np.concatenate([prompts_BxP[b, :lens_B[b]], resp_BxGxT[b, g]]))
      n.append(len(rows[-1]))
  S = max(n)
  seq = np.zeros((B * G, S), np.int32)
  for i, r in enumerate(rows):
    seq[i, :len(r)] = r
  return seq, np.array(n)


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_cached_decode_equals_full_forward(which, dense, moe):
  model = dense if which == "dense" else moe
  rng = np.random.default_rng(0)
  B, P, G, T = 3, 6, 2, 5
  lens = np.array([6, 2, 4])
  prompts = rng.integers(0, 64, (B, P)).astype(np.int32)
  prompts[1, 2:] = 0  # right padding (junk-free here; see the padding test)
  resp = rng.integers(0, 64, (B, G, T)).astype(np.int32)

  # Cached path: prefill the prompts once, then feed the response tokens one at a time.
  pos = np.broadcast_to(np.arange(P), (B, P))
  valid = pos < lens[:, None]
  out, last_logits = prefill_logits(model, jnp.asarray(prompts), jnp.asarray(pos),
                                    jnp.asarray(valid), jnp.asarray(lens))
  cached = [np.broadcast_to(np.asarray(last_logits)[:, None], (B, G, 64))]
  cache = KVCache.from_prefill(out, jnp.asarray(valid), G, T)
  for t in range(T - 1):
    step_logits, cache = decode_logits(model, jnp.asarray(resp[:, :, t]),
                                       jnp.asarray(lens[:, None] + t + 0 * resp[:, :, t]), cache)
    cached.append(np.asarray(step_logits))
  cached = np.stack(cached, axis=2)  # (B, G, T, V): logits predicting response token t

  # Reference: a plain causal forward over each concatenated row.
  seq, n = full_sequences(prompts, lens, resp)
  ref_logits = np.asarray(forward_logits(
      model, jnp.asarray(seq), jnp.asarray(np.broadcast_to(np.arange(seq.shape[1]), seq.shape)),
      jnp.asarray(np.arange(seq.shape[1])[None, :] < n[:, None])))
  for i in range(B * G):
    b, g = divmod(i, G)
    want = ref_logits[i, lens[b] - 1: lens[b] - 1 + T]
    np.testing.assert_allclose(cached[b, g], want, rtol=1e-5, atol=2e-5)


def test_causality_gradient_to_later_inputs_is_zero(dense):
  rng = np.random.default_rng(1)
  S, t = 7, 3
  emb = jnp.asarray(rng.normal(size=(2, S, 64)), jnp.float32)
  tokens = jnp.zeros((2, S), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(S), (2, S))
  grad = nnx.jit(lambda m, e: jax.grad(
      lambda e: jnp.sum(m(tokens, pos, embeds_BxSxD=e).hidden_BxSxD[:, t]))(e))
  g = np.asarray(grad(dense, emb))
  assert np.all(g[:, t + 1:] == 0.0)
  assert np.all(np.abs(g[:, :t + 1]).sum(-1) > 0)  # earlier positions do matter


def test_padding_junk_changes_nothing(dense):
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, 64, (2, 8)).astype(np.int32)
  pos = np.broadcast_to(np.arange(8), (2, 8))
  valid = pos < np.array([[5], [8]])
  junk = tokens.copy()
  junk[0, 5:] = rng.integers(0, 64, 3)
  a = forward(dense, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(valid)).hidden_BxSxD
  b = forward(dense, jnp.asarray(junk), jnp.asarray(pos), jnp.asarray(valid)).hidden_BxSxD
  np.testing.assert_array_equal(np.asarray(a)[0, :5], np.asarray(b)[0, :5])
  # And a shorter unpadded row gives the same hidden states.
  c = forward(dense, jnp.asarray(tokens[:1, :5]), jnp.asarray(pos[:1, :5])).hidden_BxSxD
  np.testing.assert_allclose(np.asarray(a)[0, :5], np.asarray(c)[0], rtol=1e-5, atol=1e-6)


def test_rope_split_half_hand_values():
  # One head, H = 4: pairs (x0, x2) and (x1, x3) rotate by p * theta^(-0/4) and p * theta^(-2/4).
  theta, p = 100.0, 3
  x = jnp.asarray([[[[1.0, 2.0, 3.0, 4.0]]]])
  out = np.asarray(layers.rope(x, jnp.asarray([[p]]), theta))[0, 0, 0]
  a0, a1 = p * 1.0, p / math.sqrt(theta)
  want = [1 * math.cos(a0) - 3 * math.sin(a0), 2 * math.cos(a1) - 4 * math.sin(a1),
          3 * math.cos(a0) + 1 * math.sin(a0), 4 * math.cos(a1) + 2 * math.sin(a1)]
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
  # Relative: <rope(q, m), rope(k, n)> depends only on m - n.
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32) for _ in range(2))
  dot = lambda m, n: float(jnp.sum(layers.rope(q, jnp.asarray([[m]]), 1e4) *
                                   layers.rope(k, jnp.asarray([[n]]), 1e4)))
  np.testing.assert_allclose(dot(7, 3), dot(104, 100), rtol=1e-4)


def test_rmsnorm_hand_values():
  norm = layers.RMSNorm(2, eps=0.0, axis_name="embed", param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  norm.weight[...] = jnp.asarray([2.0, 1.0])
  # x = (3, 4): rms = sqrt((9 + 16) / 2) -> (3, 4) / 3.5355 * (2, 1)
  np.testing.assert_allclose(norm(jnp.asarray([3.0, 4.0])), [6 / math.sqrt(12.5), 4 / math.sqrt(12.5)],
                             rtol=1e-6)


def test_config_variants_build_and_run():
  for cfg in (config.tiny(qk_norm=False), config.tiny(tie_embeddings=True),
              config.tiny(num_kv_heads=4), config.tiny(num_kv_heads=1, head_dim=8)):
    # Built eagerly: transformer.create's one-program initialisation (covered by the
    # fixtures) is a cold compile of several seconds per config; eager ops are shared.
    model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
    out = forward(model, jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None])
    assert out.hidden_BxSxD.shape == (1, 3, 64) and np.all(np.isfinite(out.hidden_BxSxD))
    assert (model.lm_head is None) == cfg.tie_embeddings
    assert (model.layers[0].attn.q_norm is None) == (not cfg.qk_norm)


def test_every_parameter_has_logical_axes(moe):
  names = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "expert"}
  params = nnx.state(moe, nnx.Param)
  leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert leaves
  for var in leaves:
    axes = var.get_metadata()["logical_axes"]
    assert len(axes) == var[...].ndim and set(axes) <= names, axes
  assert moe.layers[0].mlp.router.get_metadata()["logical_axes"] == ("embed", "expert")


def test_moe_model_returns_routing_and_replay(moe):
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 6)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
  out = forward(moe, tokens, pos)
  assert len(out.router.indices) == 2 and out.router.indices[0].shape == (2, 6, 2)
  assert np.isfinite(float(out.router.aux_loss)) and float(out.router.aux_loss) > 0
  same = forward(moe, tokens, pos, replay=out.router.indices)
  np.testing.assert_allclose(same.hidden_BxSxD, out.hidden_BxSxD, rtol=1e-6, atol=1e-6)
  other = tuple((i + 1) % 4 for i in out.router.indices)
  changed = forward(moe, tokens, pos, replay=other)
  assert np.max(np.abs(np.asarray(changed.hidden_BxSxD - out.hidden_BxSxD))) > 1e-3
  with pytest.raises(ValueError, match="replay"):
    moe(tokens, pos, replay=out.router.indices[:1])


def count(cfg):
  abstract = nnx.eval_shape(lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def test_real_qwen3_shapes_match_published_sizes():
  # Qwen3-0.6B model card: 0.6B parameters, 0.44B non-embedding (tied).
  c = config.qwen3_0_6b()
  total = count(c)
  assert 0.55e9 <= total < 0.65e9
  assert 0.44e9 <= total - c.vocab_size * c.hidden < 0.45e9
  # Qwen3-30B-A3B model card: 30.5B total, 3.3B activated (8 of 128 experts).
  m = config.qwen3_30b_a3b()
  total = count(m)
  assert 30.5e9 <= total < 30.6e9
  per_expert = 3 * m.hidden * m.moe_mlp_dim
  active = total - m.num_layers * (m.num_experts - m.experts_per_token) * per_expert
  assert 3.3e9 <= active < 3.4e9


@pytest.mark.parametrize("kw,match", [
    (dict(num_heads=3), "multiple of num_kv_heads"),
    (dict(head_dim=7), "head_dim must be even"),
    (dict(hidden=0), "hidden"),
    (dict(moe_dispatch="scatter"), "moe_dispatch"),
    (dict(num_experts=4, experts_per_token=5, moe_mlp_dim=8), "experts_per_token"),
    (dict(num_experts=4, experts_per_token=2, moe_mlp_dim=0), "moe_mlp_dim"),
    (dict(dtype="float17"), "dtype"),
])
def test_bad_config(kw, match):
  with pytest.raises(ValueError, match=match):
    config.tiny(**kw)


def test_float32_master_parameters_keep_an_rl_sized_step_that_bfloat16_rounds_away():
  """One AdamW step at lr 1e-6 (the first step moves each weight by ~lr) on the same
  gradient: bfloat16 parameters (8 bits of mantissa: ~0.4% relative resolution) keep almost
  every weight of magnitude > 1e-3 unchanged; float32 masters (the real-model presets, with
  bfloat16 compute) change every weight with a nonzero gradient."""
  import optax
  changed = {}
  for param_dtype in ("bfloat16", "float32"):
    c = config.tiny(vocab_size=32, dtype="bfloat16", param_dtype=param_dtype)
    _, params = nnx.split(transformer.create(c, seed=0), nnx.Param)
    grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
    tx = optax.adamw(1e-6, weight_decay=0.0)
    new = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
    big = [(np.asarray(a, np.float32), np.asarray(b, np.float32))
           for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new))]
    moved = sum(int(np.sum((a != b) & (np.abs(a) > 1e-3))) for a, b in big)
    counted = sum(int(np.sum(np.abs(a) > 1e-3)) for a, _ in big)
    changed[param_dtype] = moved / counted
  assert changed["float32"] == 1.0 and changed["bfloat16"] < 0.05, changed
  assert config.qwen3_0_6b().param_dtype == config.qwen3_30b_a3b().param_dtype == "float32"
  assert config.qwen3_0_6b().dtype == "bfloat16"


@pytest.mark.parametrize("preset,total,non_embedding", [
    ("qwen3_0_6b", 0.596, 0.440), ("qwen3_1_7b", 1.721, 1.409), ("qwen3_4b", 4.022, 3.634),
    ("qwen3_8b", 8.191, 6.946)])
def test_qwen3_presets_have_the_model_cards_parameter_counts(preset, total, non_embedding):
  """The planner's and the recipes' shapes: the model cards give 0.6B (0.44B without the
  embedding), 1.7B (1.4B), 4.0B (3.6B), 8.2B (6.95B); the embedding is tied below 8B."""
  from gspo_jax.models.config import PRESETS
  cfg = PRESETS[preset]()
  params = nnx.state(nnx.eval_shape(lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(0))),
                     nnx.Param)
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  embedding = cfg.vocab_size * cfg.hidden * (1 if cfg.tie_embeddings else 2)
  assert round(count / 1e9, 3) == total and round((count - embedding) / 1e9, 3) == non_embedding
  assert cfg.tie_embeddings == (preset != "qwen3_8b")
