"""The train step (gspo_jax/train/step.py). Its seams: the minibatch split is a tree map over
every Batch field (none is dropped, each is taken with its own rows), a Batch field added
in one place reaches the minibatch loss split by rows on an 8-device mesh, a reference
without a KL term is an error. Its contracts, each of which tools/mutation.py once found
a one-line bug in that every other test passed: which log-probs become pi_old (dense and
MoE with tracked routing), the sign of the KL term, the direction of the cold start's loss
(tiny models, pure functions under jit, no run directory)."""

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax import config as C
from gspo_jax.models import transformer
from gspo_jax.models.config import tiny, tiny_moe
from gspo_jax.objectives import losses
from gspo_jax.parallel import sharding
from gspo_jax.rollout import sampling
from gspo_jax.train import coldstart, optim, step
from gspo_jax.train.programs import step_config

B, G, T, PL, S, K = 4, 2, 3, 5, 8, 2   # prompts, group, response, prompt len, MoE positions, top-k
ROWS = ("data", "fsdp")


def row_ids_batch(cls=step.Batch, **extra) -> step.Batch:
  """A batch whose every field spells its row: response (b, g) holds 10*b + g in each of
  its entries (prompt fields hold 10*b), so a split can be checked field by field."""
  row_BxG = 10.0 * np.arange(B)[:, None] + np.arange(G)[None, :]
  per_token = np.broadcast_to(row_BxG[..., None], (B, G, T)).astype(np.float32)
  flat = np.broadcast_to(row_BxG.reshape(B * G, 1, 1), (B * G, S, K)).astype(np.int32)
  return cls(
      prompts_BxP=jnp.asarray(np.broadcast_to(10 * np.arange(B)[:, None], (B, PL)), jnp.int32),
      prompt_lens_B=jnp.asarray(10 * np.arange(B), jnp.int32),
      tokens_BxGxT=jnp.asarray(per_token, jnp.int32), mask_BxGxT=jnp.asarray(per_token),
      old_logp_BxGxT=jnp.asarray(per_token), ref_logp_BxGxT=jnp.asarray(per_token),
      old_experts=(jnp.asarray(flat), jnp.asarray(flat)),
      sampler_logp_BxGxT=jnp.asarray(per_token), turn_BxGxT=jnp.asarray(per_token, jnp.int32),
      **extra)


def cfg(**kw) -> step.StepConfig:
  return step.StepConfig(loss=losses.gspo_loss, **{"num_minibatches": 2, **kw})


@pytest.mark.parametrize("share_prompts", [False, True])
def test_every_batch_field_is_split_with_its_rows(share_prompts):
  """No field is dropped (turn_BxGxT was, when the split listed fields by hand), and every
  entry of every minibatch belongs to the row the tokens say: the prompt fields to its
  prompt, per-response fields and advantages to its response, the flat (B*G, ...) expert
  choices to theirs."""
  batch = row_ids_batch()
  adv_BxG = batch.old_logp_BxGxT[..., 0] + 0.5
  mb = step.split_minibatches(jax.random.key(1), batch, adv_BxG, cfg(share_prompts=share_prompts),
                              weights_BxGxT=batch.old_logp_BxGxT + 0.25)
  rows = mb.rows
  for f in dataclasses.fields(step.Batch):
    assert getattr(rows, f.name) is not None, f.name
  tokens = np.asarray(rows.tokens_BxGxT)                  # (M, b, g, T)
  row = tokens[..., 0]                                     # (M, b, g): 10*prompt + response
  assert sorted(row.ravel()) == sorted((10 * np.arange(B)[:, None] + np.arange(G)).ravel())
  for name in ("mask_BxGxT", "old_logp_BxGxT", "ref_logp_BxGxT", "sampler_logp_BxGxT",
               "turn_BxGxT"):
    np.testing.assert_array_equal(np.asarray(getattr(rows, name)), tokens, err_msg=name)
  np.testing.assert_array_equal(np.asarray(mb.adv_bxg), row + 0.5)
  np.testing.assert_array_equal(np.asarray(mb.token_weights_bxgxT), tokens + 0.25)
  prompt = np.asarray(rows.prompts_BxP)                    # (M, b, P)
  np.testing.assert_array_equal(prompt[..., 0], row[..., 0] // 10 * 10)
  np.testing.assert_array_equal(np.asarray(rows.prompt_lens_B), row[..., 0] // 10 * 10)
  for experts in rows.old_experts:                         # (M, b*g, S, K), row-major
    np.testing.assert_array_equal(np.asarray(experts)[:, :, 0, 0], row.reshape(2, -1))
  if share_prompts:  # whole groups: each minibatch row holds one prompt's G responses
    assert row.shape[-1] == G and (row[..., 1] == row[..., 0] + 1).all()
  else:
    assert row.shape[-1] == 1


@flax.struct.dataclass
class ToyBatch(step.Batch):
  """A feature's batch field, added in one place: a per-response bonus (B, G)."""
  bonus_BxG: jax.Array | None = None


def test_a_new_batch_field_reaches_the_minibatch_loss_split_by_rows():
  """The worked example of docs/adding_a_feature.md: `ToyBatch` adds one field; the update's
  batch sharding (`sharding.rows`, a prefix of any Batch) takes it as it is, the split
  hands each minibatch its rows of it, sharded over the batch mesh axes, and a loss reads
  it there. Its per-minibatch sums equal the sums of the rows the minibatch order picked."""
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
  bonus = np.arange(B * G, dtype=np.float32).reshape(B, G) + 1.0
  batch = row_ids_batch(ToyBatch, bonus_BxG=jnp.asarray(bonus))
  adv = jnp.zeros((B, G))
  config = cfg()
  key = jax.random.key(7)

  def scan_minibatches(batch, adv):
    mbs = step.split_minibatches(key, batch, adv, config, mesh)

    def minibatch_loss(carry, mb):   # a loss that reads the new field
      return carry, (jnp.sum(mb.rows.bonus_BxG), mb.rows.bonus_BxG)
    return jax.lax.scan(minibatch_loss, 0.0, mbs)[1], mbs.rows.bonus_BxG

  program = jax.jit(scan_minibatches, in_shardings=(sharding.rows(mesh), sharding.rows(mesh)))
  (sums, seen), split = program(batch, adv)
  order = np.asarray(step.minibatch_order(key, B * G, 1))   # the rows, as the split drew them
  want = bonus.reshape(-1)[order].reshape(2, -1)
  np.testing.assert_array_equal(np.asarray(sums), want.sum(-1))
  np.testing.assert_array_equal(np.asarray(seen)[..., 0], want)
  assert split.sharding.is_equivalent_to(NamedSharding(mesh, P(None, ROWS, None)), 3), \
      split.sharding


def test_a_reference_without_a_kl_term_is_an_error():
  """pi_ref's log-probs in a minibatch with no KL term configured would be silently ignored:
  the step refuses it instead."""
  batch = row_ids_batch().replace(old_experts=None)
  mb = step.Minibatch(batch, jnp.zeros((B, G)))
  with pytest.raises(ValueError, match="StepConfig.kl"):
    jax.eval_shape(lambda mb: step.minibatch_loss(None, None, mb, cfg()), mb)


# -- contracts: pi_old, tracked routing, the KL term, the cold start ----------------------

MODEL = tiny(vocab_size=24, hidden=32, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16,
             num_layers=1)
RB, RG, RT, RP = 2, 4, 4, 3   # prompts, group, response, prompt len


def train_cfg(**kw) -> C.TrainConfig:
  return C.TrainConfig(**{**dict(model=MODEL, rollout=C.RolloutConfig(
      prompts_per_iter=RB, group_size=RG, max_new_tokens=RT, max_prompt_len=RP),
      sft=C.SFTConfig(steps=0), num_minibatches=1), **kw})


@pytest.fixture(scope="module")
def setting():
  graphdef, params = nnx.split(transformer.create(MODEL, seed=4), nnx.Param)
  rng = np.random.default_rng(1)
  prompts = jnp.asarray(rng.integers(2, MODEL.vocab_size, (RB, RP)), jnp.int32)
  lens = jnp.asarray([RP, 2], jnp.int32)
  tokens = jnp.asarray(rng.integers(2, MODEL.vocab_size, (RB, RG, RT)), jnp.int32)
  lengths = jnp.asarray(rng.integers(1, RT + 1, (RB, RG)), jnp.int32)
  mask = (jnp.arange(RT)[None, None, :] < lengths[..., None]).astype(jnp.float32)
  return graphdef, params, prompts, lens, tokens, mask


def trainer_logprobs(setting):
  graphdef, params, prompts, lens, tokens, mask = setting
  rows = step.Batch(prompts, lens, tokens, mask, jnp.zeros_like(mask))
  fn = jax.jit(functools.partial(step.policy_logprobs, graphdef=graphdef,
                                 cfg=step_config(train_cfg())))
  return np.asarray(fn(params, rows=rows)[0])


def sampler_rollout(tokens, mask):
  """A rollout whose log-probs are not the trainer's (as a bf16 inference engine's are
  not): a constant -1 on counted tokens."""
  return sampling.Rollout(tokens, mask, jnp.full(mask.shape, -1.0) * mask, jnp.zeros_like(mask),
                          jnp.sum(mask, -1).astype(jnp.int32), jnp.ones((RB, RG), bool),
                          jnp.zeros((RB, RG), bool), jnp.asarray(RT, jnp.int32))


@pytest.mark.parametrize("old_logp", ["recompute", "sampler"])
def test_pi_old_is_the_trainers_recomputation_or_the_samplers_as_configured(setting, old_logp):
  """"recompute" makes pi_old the trainer's teacher-forced log-probs, "sampler" the
  sampler's; masked positions are 0 in both."""
  graphdef, params, prompts, lens, tokens, mask = setting
  rollout = sampler_rollout(tokens, mask)
  sampler_logp = rollout.logp_BxGxT
  prepare = jax.jit(functools.partial(step.prepare, graphdef=graphdef,
                                      cfg=step_config(train_cfg(old_logp=old_logp))))
  old = np.asarray(prepare(params, None, rollout, prompts, lens).old_logp_BxGxT)
  want = trainer_logprobs(setting) * np.asarray(mask) if old_logp == "recompute" else \
      np.asarray(sampler_logp)
  np.testing.assert_allclose(old, want, rtol=1e-5, atol=1e-6)
  assert not np.allclose(trainer_logprobs(setting) * np.asarray(mask), sampler_logp)


@pytest.mark.parametrize("share_prompts", [False, True])
def test_prepare_in_chunks_of_prompts_gives_the_same_log_probs(setting, share_prompts):
  """`prepare_chunks`: pi_old and pi_ref computed for one prompt at a time (2 chunks of 1)
  equal the one-pass values (float rounding apart: the matmuls see other shapes)."""
  graphdef, params, prompts, lens, tokens, mask = setting
  rollout = sampler_rollout(tokens, mask)
  ref = jax.tree.map(lambda x: x * 0.9, params)

  def prepared(chunks):
    cfg = step_config(train_cfg(prepare_chunks=chunks, share_prompts=share_prompts,
                                loss=C.LossConfig(kl_coef=0.1)))
    prepare = jax.jit(functools.partial(step.prepare, graphdef=graphdef, cfg=cfg))
    batch = prepare(params, ref, rollout, prompts, lens)
    return np.asarray(batch.old_logp_BxGxT), np.asarray(batch.ref_logp_BxGxT)

  (old1, ref1), (old2, ref2) = prepared(1), prepared(2)
  np.testing.assert_allclose(old2, old1, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ref2, ref1, rtol=1e-5, atol=1e-6)
  assert not np.allclose(ref1, old1)   # pi_ref is another policy: the test can tell them apart


def test_tracked_routing_keeps_the_samplers_pi_old_when_configured(setting):
  """routing="track" needs the trainer's forward (for pi_old's expert choices) even when
  pi_old's log-probs are the sampler's: that forward's log-probs must not replace them."""
  _, _, prompts, lens, tokens, mask = setting
  moe = tiny_moe(vocab_size=24, hidden=32, mlp_dim=64, moe_mlp_dim=16, num_heads=2,
                 num_kv_heads=1, head_dim=16, num_layers=1)
  graphdef, params = nnx.split(transformer.create(moe, seed=5), nnx.Param)
  rollout = sampler_rollout(tokens, mask)
  cfg = train_cfg(model=moe, routing="track", old_logp="sampler")
  batch = jax.jit(functools.partial(step.prepare, graphdef=graphdef, cfg=step_config(cfg)))(
      params, None, rollout, prompts, lens)
  np.testing.assert_array_equal(batch.old_logp_BxGxT, rollout.logp_BxGxT)
  assert [e.shape for e in batch.old_experts] == [(RB * RG, RP + RT, moe.experts_per_token)]


def test_the_kl_term_is_added_to_the_policy_loss(setting):
  """loss = pg_loss + kl_coef * kl, with kl >= 0 (k3): the penalty pulls the policy toward
  the reference, it does not push it away."""
  graphdef, params, prompts, lens, tokens, mask = setting
  logp = trainer_logprobs(setting)
  rows = step.Batch(prompts, lens, tokens, mask, jnp.asarray(logp) * mask,
                    ref_logp_BxGxT=(jnp.asarray(logp) - 0.5) * mask)
  adv = jnp.asarray(np.random.default_rng(2).normal(size=(RB, RG)), jnp.float32)
  cfg = train_cfg(loss=C.LossConfig(kl_coef=0.25))
  loss, m = jax.jit(functools.partial(step.minibatch_loss, graphdef=graphdef,
                                      cfg=step_config(cfg)))(
      params, mb=step.Minibatch(rows, adv))
  # Every counted token has log pi_ref - log pi_theta = -0.5: k3 = e^-0.5 + 0.5 - 1.
  np.testing.assert_allclose(m["kl"], np.exp(-0.5) - 0.5, rtol=1e-5)
  np.testing.assert_allclose(loss, m["pg_loss"] + 0.25 * m["kl"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(m["loss"], loss, rtol=1e-6)


def test_a_cold_start_step_raises_the_demonstrations_likelihood(setting):
  """The SFT loss is the negative mean log-likelihood of the counted demonstration tokens,
  and a step on it makes them more likely."""
  graphdef, params, prompts, lens, tokens, mask = setting
  tokens_BxT, mask_BxT = tokens[:, 0], mask[:, 0]
  want = -np.sum(trainer_logprobs(setting)[:, 0] * np.asarray(mask_BxT)) / np.sum(mask_BxT)
  batch = (prompts, lens, tokens_BxT, mask_BxT)
  sft_loss = jax.jit(lambda p, *b: coldstart.sft_loss(p, graphdef, *b))
  loss = sft_loss(params, *batch)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  assert loss > 0
  tx = optim.sft_optimizer(steps=10, learning_rate=1e-2)
  sft = jax.jit(functools.partial(coldstart.sft_step, graphdef=graphdef, tx=tx))
  p, o = params, tx.init(params)
  for _ in range(3):  # the schedule warms up from 0: the first step does not move
    p, o, _ = sft(p, o, batch)
  assert sft_loss(p, *batch) < loss
