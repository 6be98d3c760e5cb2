"""Scan over layers and rematerialisation change how the model runs, not what it computes:
same seed -> same weights (stacked), same logits, router choices, sampled tokens and
gradients; the stacked `layers` axis shards by the rules table (replicated)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from gspo_jax.models import config, transformer
from gspo_jax.models.transformer import Transformer
from gspo_jax.parallel import sharding
from gspo_jax.rollout import sampling
from tests.helpers import compiled_sampler, loop_copies

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)
POS = jnp.broadcast_to(jnp.arange(9), (2, 9))


@nnx.jit
def logits_and_router(model, tokens, pos, replay=None):
  out = model(tokens, pos, replay=replay)
  return model.logits(out.hidden_BxSxD), out.router, out.k


def pair(cfg, seed=3, **scanned):
  return (transformer.create(cfg, seed=seed),
          transformer.create(dataclasses.replace(cfg, scan_layers=True, **scanned), seed=seed))


@pytest.mark.parametrize("cfg", [config.tiny(num_layers=3), config.tiny_moe()],
                         ids=["dense", "moe"])
def test_scanned_model_computes_what_the_unrolled_one_does(cfg):
  unrolled, scanned = pair(cfg)
  for i, layer in enumerate(unrolled.layers):  # the same weights, stacked
    np.testing.assert_array_equal(scanned.layers.attn.q[...][i], layer.attn.q[...])
  assert scanned.layers.attn.q.get_metadata()["logical_axes"] == ("layers", "embed", "heads",
                                                                   "head_dim")
  want, want_router, want_k = logits_and_router(unrolled, TOKENS, POS)
  got, got_router, got_k = logits_and_router(scanned, TOKENS, POS)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
  np.testing.assert_allclose(got_k[cfg.num_layers - 1], want_k[-1], rtol=0, atol=1e-6)
  assert len(got_router.indices) == len(want_router.indices) == cfg.num_moe_layers
  for g, w in zip(got_router.indices, want_router.indices):
    np.testing.assert_array_equal(g, w)
  np.testing.assert_allclose(got_router.aux_loss, want_router.aux_loss, rtol=1e-6)
  if cfg.num_experts:  # Routing Replay: forced experts reach the scanned layers too
    replay = tuple((i + 1) % cfg.num_experts * jnp.ones_like(x) for i, x in
                   enumerate(want_router.indices))
    want, _, _ = logits_and_router(unrolled, TOKENS, POS, replay)
    got, got_router, _ = logits_and_router(scanned, TOKENS, POS, replay)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got_router.indices[1], replay[1])


def test_scanned_sampler_draws_the_same_tokens():
  # The unrolled model decodes in one phase over all 6 cache slots, the scanned one in
  # phases of 2, 4 and 6 slots (`sampling.decode_windows`), its cache written in place.
  unrolled, scanned = pair(config.tiny())
  scfg = sampling.SamplerConfig(group_size=3, max_new_tokens=6, eos_id=63, max_prompt_len=9)
  lens = jnp.array([9, 4])
  want = sampling.sample_groups(unrolled, TOKENS, lens, jax.random.key(1), scfg)
  got, hlo = compiled_sampler(scanned, (TOKENS, lens), jax.random.key(1),
                              dataclasses.replace(scfg, decode_window=2))
  np.testing.assert_array_equal(got.tokens_BxGxT, want.tokens_BxGxT)
  # float32 summation order differs between the scanned and unrolled programs: a few ulps of
  # log-probs near -4 (1.4e-6 on a 2-core AMD EPYC); a wrong cache slot moves them by O(0.1).
  np.testing.assert_allclose(got.logp_BxGxT, want.logp_BxGxT, rtol=0, atol=1e-5)
  assert loop_copies(hlo, 2, 3, scanned.cfg.num_kv_heads, scanned.cfg.head_dim, (2, 4, 6)) == []


def test_scanned_moe_sampler_records_the_unrolled_expert_choices():
  # Rollout Routing Replay reads the sampler's choices; the scanned decode returns them as a
  # scan output per layer, the unrolled one per layer in a list: the same (B*G, P+T, K).
  unrolled, scanned = pair(config.tiny_moe())
  scfg = sampling.SamplerConfig(group_size=2, max_new_tokens=5, eos_id=63, max_prompt_len=9,
                                record_experts=True, decode_window=2)
  lens = jnp.array([9, 4])
  sample = jax.jit(sampling.sample, static_argnames=("graphdef", "cfg"))
  want, got = (sample(*nnx.split(m), TOKENS, lens, jax.random.key(2), cfg=scfg)
               for m in (unrolled, scanned))
  np.testing.assert_array_equal(got.tokens_BxGxT, want.tokens_BxGxT)
  assert len(got.experts) == len(want.experts) == unrolled.cfg.num_layers
  for g, w in zip(got.experts, want.experts):
    assert g.shape == (4, 9 + 5, unrolled.cfg.experts_per_token)
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_the_gradient(remat):
  cfg = config.tiny()
  loss = lambda m: jnp.sum(jnp.tanh(m.logits(m(TOKENS, POS).hidden_BxSxD)))
  grad = nnx.jit(nnx.grad(loss))
  want = nnx.state(grad(transformer.create(cfg, seed=3)))
  # Recomputation reorders float32 sums: equal up to roundoff relative to the largest entry.
  close = lambda got, want: np.testing.assert_allclose(got, want, rtol=0,
                                                       atol=1e-5 * np.abs(want).max())
  for scan in (False, True):
    got = nnx.state(grad(transformer.create(dataclasses.replace(cfg, remat=remat,
                                                                scan_layers=scan), seed=3)))
    close(got["embed"][...], want["embed"][...])
    q = got["layers"]["attn"]["q"][...][1] if scan else got["layers"][1]["attn"]["q"][...]
    close(q, want["layers"][1]["attn"]["q"][...])


def test_scanned_model_shards_by_the_rules_table():
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
  cfg = config.tiny(scan_layers=True)
  model = sharding.init_sharded(Transformer, cfg, mesh, seed=3)
  q = model.layers.attn.q[...]
  assert q.sharding.spec == P(None, "fsdp", "tensor", None)  # `layers` replicated
  _, reference = pair(config.tiny())
  np.testing.assert_array_equal(q, reference.layers.attn.q[...])
  rows = sharding.batch_sharding(mesh)
  fwd = nnx.jit(lambda m, t, p: m(t, p).hidden_BxSxD)
  tokens = jnp.tile(TOKENS, (4, 1))
  pos = jnp.tile(POS, (4, 1))
  np.testing.assert_allclose(fwd(model, jax.device_put(tokens, rows), jax.device_put(pos, rows)),
                             fwd(reference, tokens, pos), rtol=1e-5, atol=1e-5)


def test_unsupported_combinations_name_the_field(tmp_path):
  with pytest.raises(ValueError, match="ModelConfig.scan_layers needs every layer alike.*moe_layers"):
    config.tiny_moe(num_layers=3, moe_layers=(1,), scan_layers=True)
  with pytest.raises(ValueError, match="ModelConfig.remat must be one of"):
    config.tiny(remat="some")
