"""Every random stream of a run changes where it must and repeats where it must.

Resume and determinism tests compare a run with itself, so a stream that never changes
(the same sampling noise, minibatch order or demonstration batch every iteration) passes
them. These tests pin the other half of the contract (gspo_jax/utils/rng.py):

  * each stream differs between iterations (sampling noise, minibatch order, data order,
    cold-start batches), between decode steps and rows of one rollout, and between the
    processes' rows of a multi-host batch;
  * the same iteration draws the same values again, also from a state restored from a
    checkpoint (a resume).

Multi-host is simulated: every process draws the same global batch and keeps the rows its
devices hold (`sharding.local_part`), so a process is simulated by the set of devices it
can address.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax import config as C
from gspo_jax.models import config as model_config
from gspo_jax.models import transformer
from gspo_jax.parallel import sharding
from gspo_jax.rollout.sampling import SamplerConfig, sample_groups
from gspo_jax.tasks import make_task
from gspo_jax.train import checkpoint, coldstart, evaluation
from gspo_jax.train import run as R
from gspo_jax.train.collect import rollout_step
from gspo_jax.utils import rng

# seed != 0: a stream that fell back to jax.random.key(0) / default_rng(0) must show.
SEED = 5


def tiny_cfg(**kw) -> C.TrainConfig:
  base = dict(
      model=model_config.tiny(vocab_size=24, hidden=32, mlp_dim=64, num_heads=2, num_layers=1,
                              num_kv_heads=1, head_dim=16),
      rollout=C.RolloutConfig(prompts_per_iter=4, group_size=4, max_new_tokens=4,
                              max_prompt_len=8),
      sft=C.SFTConfig(steps=0), optim=C.OptimConfig(learning_rate=1e-3), iterations=2,
      eval_every=0, eval_size=8, num_minibatches=2, seed=SEED,
      mesh=sharding.MeshConfig(num_devices=1))
  return C.TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return R.setup(tiny_cfg(), str(tmp_path_factory.mktemp("streams")))


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def same(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))


# ------------------------------------------------------------------------------ keys


def test_device_streams_are_distinct_per_iteration_and_stream():
  key = jax.random.key(SEED)
  drawn = {(s, name): tuple(np.asarray(jax.random.key_data(rng.device_key(key, s, name))))
           for s in range(64) for name in rng.DEVICE_STREAMS}
  assert len(set(drawn.values())) == len(drawn)  # no (iteration, stream) reuses a key
  # The traced step the programs pass derives the same key as a host int.
  traced = jax.jit(lambda k, s: rng.device_key(k, s, "sample"))(key, jnp.int32(7))
  assert np.array_equal(jax.random.key_data(traced), np.asarray(drawn[7, "sample"]))
  other = jax.random.key_data(rng.device_key(jax.random.key(SEED + 1), 0, "sample"))
  assert not np.array_equal(other, np.asarray(drawn[0, "sample"]))


def test_host_streams_are_distinct_and_repeatable():
  first = lambda seed, name: tuple(rng.host_rng(seed, name).integers(0, 2**62, 4))
  draws = {(seed, name): first(seed, name) for seed in (0, SEED) for name in rng.HOST_STREAMS}
  assert len(set(draws.values())) == len(draws)
  assert first(SEED, "sft_batches") == draws[SEED, "sft_batches"]


# ------------------------------------------------------------------------------ sampler


@pytest.fixture(scope="module")
def uniform_model():
  """A policy whose logits are exactly 0: every token's distribution is uniform, so the
  sampled tokens are the noise's argmax and show directly which draws are shared."""
  model = transformer.create(model_config.tiny(), seed=0)
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, state))


def test_sampler_noise_differs_per_row_member_and_decode_step(uniform_model):
  V, T = uniform_model.cfg.vocab_size, 8
  cfg = SamplerConfig(group_size=8, max_new_tokens=T, eos_id=1, max_prompt_len=4)
  prompts = jnp.full((4, 4), 5, jnp.int32)  # four rows with the same prompt
  lens = jnp.full((4,), 4, jnp.int32)
  out = sample_groups(uniform_model, prompts, lens, jax.random.key(SEED), cfg)
  tokens, mask = np.asarray(out.tokens_BxGxT), np.asarray(out.mask_BxGxT)
  # No two of the 32 responses agree (identical prompts: only the noise tells them apart).
  assert len({tuple(t) for t in tokens.reshape(-1, T)}) == 32
  # Consecutive tokens agree at rate 1/V under fresh noise each step; shared noise between
  # two steps makes them agree everywhere.
  live = mask[..., 1:] > 0
  repeats = np.sum((tokens[..., 1:] == tokens[..., :-1]) & live) / np.sum(live)
  assert repeats < 0.15, repeats
  assert np.sum(live[..., 0]) > 16  # enough rows got past token 0 to see it
  first = tokens[..., :2]
  assert np.mean(first[..., 0] == first[..., 1]) < 0.15
  # And the tokens are spread over the vocabulary as uniform noise would spread them.
  assert len(np.unique(tokens[mask > 0])) > V // 2


def test_rollout_noise_differs_between_iterations_and_repeats_for_one(run, monkeypatch):
  # The same prompts every iteration: only the sampling stream can tell iterations apart.
  fixed = run.task.train_batch(SEED, 0, run.cfg.rollout.prompts_per_iter)
  monkeypatch.setattr(run.task, "train_batch", lambda seed, step, n: fixed)
  params, key = run.state.params, run.state.key
  tokens = [np.asarray(rollout_step(run, params, key, s, log=lambda *a: None).batch.tokens_BxGxT)
            for s in (0, 1, 2, 1)]
  for a, b in itertools.combinations(tokens[:3], 2):
    assert not np.array_equal(a, b)
  np.testing.assert_array_equal(tokens[1], tokens[3])


def test_rollout_prompts_follow_the_iteration(run):
  prompts = [np.asarray(rollout_step(run, run.state.params, run.state.key, s,
                                     log=lambda *a: None).batch.prompts_BxP) for s in (0, 1, 0)]
  assert not np.array_equal(prompts[0], prompts[1])
  np.testing.assert_array_equal(prompts[0], prompts[2])


def test_evaluation_chunks_draw_their_own_noise(run):
  """pass@k samples the examples chunk by chunk (one sampler call each): every chunk draws
  its own noise, so a problem repeated in two chunks gets independent samples."""
  example = run.task.train_batch(SEED, 0, 1)[0]
  # The run's rollout program as the sampler (already compiled; same shapes as a chunk).
  def respond(params, prompts, lens, key, examples):
    out = run.programs.sample(params, prompts, lens, key, 0)[0]
    return out.tokens_BxGxT, out.mask_BxGxT
  _, _, shown = evaluation._responses(run, respond, run.state.params, [example] * 8, batch=4)
  texts = [texts for _, texts in shown]
  assert texts[:4] != texts[4:]


# ------------------------------------------------------------------------------ update


def random_rewards(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def test_minibatch_order_differs_between_iterations_and_repeats_for_one(run):
  """The update reads `state.step` only through the minibatch stream (the learning rate
  follows the optimiser's own count), and with two minibatches the order of the optax
  steps changes the result: equal updates at steps 0 and 1 mean the same order."""
  r = rollout_step(run, run.state.params, run.state.key, 0, log=lambda *a: None)
  rewards = random_rewards(r.rewards_BxG.shape, 0)
  at = lambda s: run.programs.update(jax.tree.map(jnp.copy, run.state.replace(
      step=jnp.int32(s))), r.batch, rewards)[0].params
  p0, p1, p2, p1_again = at(0), at(1), at(2), at(1)
  assert not same(p0, p1) and not same(p1, p2) and not same(p0, p2)
  assert same(p1, p1_again)


# ------------------------------------------------------------------------------ resume


def test_a_restored_state_draws_what_the_original_does(run, tmp_path):
  """What a resumed run draws at iteration 1 (its rollout and its update) equals what the
  uninterrupted run draws: the key and the step come back from the checkpoint."""
  r0 = rollout_step(run, run.state.params, run.state.key, 0, log=lambda *a: None)
  state, _ = run.programs.update(jax.tree.map(jnp.copy, run.state), r0.batch,
                                 random_rewards(r0.rewards_BxG.shape, 1))
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=1)
  try:
    ckpt.maybe_save(1, state)
    restored = ckpt.restore(run.state)
  finally:
    ckpt.close()
  assert int(restored.step) == 1
  np.testing.assert_array_equal(jax.random.key_data(restored.key),
                                jax.random.key_data(jax.random.key(SEED)))

  def iteration_1(s):
    r = rollout_step(run, s.params, s.key, int(s.step), log=lambda *a: None)
    new, _ = run.programs.update(jax.tree.map(jnp.copy, s), r.batch,
                                 random_rewards(r.rewards_BxG.shape, 2))
    return np.asarray(r.batch.tokens_BxGxT), new.params

  tokens_a, params_a = iteration_1(state)
  tokens_b, params_b = iteration_1(restored)
  np.testing.assert_array_equal(tokens_a, tokens_b)
  assert same(params_a, params_b)


# ------------------------------------------------------------------------------ data order


@pytest.mark.parametrize("name", ["addition", "chain"])
def test_built_in_task_data_order_follows_seed_and_iteration(name):
  task = make_task(name, digits=2)
  batch = lambda seed, step: [e.prompt for e in task.train_batch(seed, step, 8)]
  assert batch(SEED, 0) != batch(SEED, 1) != batch(SEED, 2)
  assert batch(SEED, 0) != batch(SEED + 1, 0)
  assert batch(SEED, 1) == batch(SEED, 1)


def test_cold_start_batches_differ_per_step_and_repeat_per_seed(run, monkeypatch):
  """The demonstration batches of the cold start (host stream "sft_batches"): a new batch
  every step, the same sequence for the same seed, another for another seed. The SFT
  program is replaced by a no-op: only which examples it is fed matters here."""
  seen = []
  monkeypatch.setattr(coldstart, "supervised_batch",
                      lambda run, examples: seen.append([e.prompt for e in examples]))
  fake = dataclasses.replace(run.programs, sft=lambda p, o, b: (p, o, jnp.zeros(())),
                             sft_init=lambda p: None)

  def batches(seed):
    cfg = dataclasses.replace(run.cfg, seed=seed, sft=C.SFTConfig(steps=4, batch_size=8,
                                                                  target_accuracy=0.0))
    seen.clear()
    coldstart.cold_start(dataclasses.replace(run, cfg=cfg, programs=fake), log=lambda *a: None)
    return list(seen)

  first = batches(SEED)
  assert len(first) == 4
  assert all(a != b for a, b in itertools.combinations(first, 2))
  assert batches(SEED) == first
  assert batches(SEED + 1) != first
  # Not the probe's draws (its own stream): the accuracy probe is not the training data.
  probe = run.task.sample(rng.host_rng(SEED, "sft_probe"), 8, "train")
  assert first[0] != [e.prompt for e in probe]


# ------------------------------------------------------------------------------ multi-host


class _ProcessView:
  """A row sharding as one process of a multi-host run sees it: only `devices` (that
  process's) are addressable."""

  def __init__(self, real, devices):
    self.real, self.devices = real, set(devices)

  def addressable_devices_indices_map(self, shape):
    return {d: i for d, i in self.real.devices_indices_map(shape).items() if d in self.devices}


@pytest.mark.parametrize("processes", [2, 4])
def test_each_process_keeps_its_own_rows_of_every_host_stream(monkeypatch, processes):
  """With 8 devices over `processes` processes, each process's rows of the global prompt
  batch (data stream) and of a cold-start batch (sft_batches stream) are its own: together
  they are the global batch, in order, and no two processes get the same rows."""
  mesh = sharding.make_mesh(sharding.MeshConfig(data=4, fsdp=2))
  real = sharding.batch_sharding
  per = len(mesh.devices.flat) // processes
  task = make_task("addition", digits=2)
  streams = {"data": task.train_batch(SEED, 3, 16),
             "sft_batches": task.sample(rng.host_rng(SEED, "sft_batches"), 16, "train")}
  for name, global_batch in streams.items():
    parts = []
    for p in range(processes):
      devices = list(mesh.devices.flat)[p * per:(p + 1) * per]
      monkeypatch.setattr(sharding, "batch_sharding",
                          lambda m, ndim=2: _ProcessView(real(m, ndim), devices))
      parts.append(sharding.local_part(global_batch, mesh))
    assert [e for part in parts for e in part] == global_batch, name
    assert all(len(part) == 16 // processes for part in parts), name
    assert all(a != b for a, b in itertools.combinations(parts, 2)), name
