"""The asynchronous pipeline (gspo_jax/train/pipeline.py, gspo_jax/parallel/placement.py): staleness 0 is
the synchronous run to the bit, with k = 1 each update uses the responses of the version
before it, the bound holds with a slow trainer, the sampler's own mesh is laid out by the
rules, a resume mid-pipeline equals the uninterrupted run, and bad settings are named."""

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import config as C
from gspo_jax.parallel import sharding
from gspo_jax.parallel.placement import AsyncConfig, PlacementConfig
from gspo_jax.train import loop as T
from gspo_jax.train import pipeline
from gspo_jax.train.run import setup
from tests.helpers import interrupted_copy, leaves, read_metrics, tiny_cfg

# No cold start (the policy is the random init: the pipeline is what is tested), 3 updates.
FAST = dict(sft=C.SFTConfig(steps=0), iterations=3, optim=C.OptimConfig(learning_rate=3e-3))
NOT_TIMED = lambda m: {k: v for k, v in m.items() if not k.startswith(("time_", "tokens_per_s",
                                                                       "sample_tokens_per_s"))}


def trained(tmp_path, name, **kw):
  run_dir = str(tmp_path / name)
  T.train(tiny_cfg(**{**FAST, **kw}), run_dir, checkpoint_every=1, progress=False)
  return read_metrics(run_dir), run_dir


def final_params(run_dir, cfg):
  from gspo_jax.train.run import load_run
  return leaves(load_run(run_dir).state.params)


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
  return trained(tmp_path_factory.mktemp("sync"), "run")


@pytest.mark.parametrize("kw", [
    dict(asynchronous=AsyncConfig(timeline=True)),           # the pipeline's path at k = 0
    dict(placement=PlacementConfig(sampler_devices=1)),      # 1 trainer + 1 sampler device
], ids=["pipeline", "placement"])
def test_staleness_0_is_the_synchronous_run_bit_for_bit(sync_run, tmp_path, kw):
  rows, run_dir = trained(tmp_path, "run", **kw)
  for a, b in zip(sync_run[0], rows, strict=True):
    assert {k: v for k, v in NOT_TIMED(a).items() if k in b} == \
        {k: v for k, v in NOT_TIMED(b).items() if k in a}
    assert b["staleness"] == 0.0
  for x, y in zip(final_params(sync_run[1], None), final_params(run_dir, None), strict=True):
    np.testing.assert_array_equal(x, y)
  if "asynchronous" in kw:  # every phase of every iteration is on the timeline
    import json
    events = [json.loads(l) for l in open(os.path.join(run_dir, "timeline.jsonl"))]
    assert {(e["iteration"], e["phase"]) for e in events} >= {
        (i, p) for i in range(3) for p in ("sample", "score", "update")}
    assert all(e["end"] >= e["start"] for e in events if e["phase"] != "score")


def _iterate_recording(cfg, *, delay=0.0, iterations=4):
  """`train.iterate` on a fresh run, recording each update's batch and the parameters of
  every version, the pipeline's in-flight count at each launch, and the metrics."""
  run = setup(cfg, "/tmp/unused_async_run")
  score = run.task.score_batch

  def varied(examples, texts, log=print):  # rewards that vary within groups: updates move
    _, correct, parts = score(examples, texts, log=log)
    return [float(sum(map(ord, t)) % 3) for t in texts], correct, parts

  object.__setattr__(run.task, "score_batch", varied)
  versions = {0: jax.tree.map(jnp.copy, run.state.params)}
  batches, inflight, metrics = {}, [], {}
  update = run.programs.update

  def slow_update(state, batch, rewards):
    batches[len(batches)] = jax.tree.map(jnp.copy, batch)
    out = update(state, batch, rewards)
    if delay:
      jax.block_until_ready(out)
      time.sleep(delay)  # a trainer slower than the sampler
    return out

  run.programs = dataclasses.replace(run.programs, update=slow_update)
  feed = pipeline.Pipeline(run, 0, None, log=lambda *a: None)
  inflight.extend((item.step, item.version, n) for n, item in enumerate(feed.pending))  # fresh
  launch = feed._launch

  def counted(step, version):
    inflight.append((step, version, len(feed.pending)))
    return launch(step, version)

  feed._launch = counted

  def on_step(step):
    versions[step] = jax.tree.map(jnp.copy, run.state.params)

  T.iterate(run, 0, iterations, on_step=on_step, rollouts=feed,
            on_metrics=lambda s, m: metrics.__setitem__(s, m))
  return run, versions, batches, inflight, metrics


def test_k1_updates_on_the_previous_versions_responses():
  cfg = tiny_cfg(**FAST, asynchronous=AsyncConfig(max_staleness=1))
  run, versions, batches, inflight, metrics = _iterate_recording(cfg)
  prepare = run.programs.prepare
  for i, batch in batches.items():
    sampled_by = max(0, i - 1)
    assert metrics[i + 1]["staleness"] == i - sampled_by
    rollout = sampling_rollout(batch)
    old = prepare(versions[sampled_by], None, rollout, batch.prompts_BxP, batch.prompt_lens_B)
    np.testing.assert_array_equal(np.asarray(old.old_logp_BxGxT),
                                  np.asarray(batch.old_logp_BxGxT))
    if i >= 2:  # and not by the version the update starts from
      now = prepare(versions[i], None, rollout, batch.prompts_BxP, batch.prompt_lens_B)
      assert np.max(np.abs(np.asarray(now.old_logp_BxGxT - batch.old_logp_BxGxT))) > 1e-4


def sampling_rollout(batch):
  """A Rollout carrying `batch`'s tokens and mask (what teacher forcing reads)."""
  from gspo_jax.rollout.sampling import Rollout
  B, G, T_ = batch.tokens_BxGxT.shape
  z = jnp.zeros((B, G), jnp.int32)
  return Rollout(batch.tokens_BxGxT, batch.mask_BxGxT, jnp.zeros((B, G, T_)),
                 jnp.zeros((B, G, T_)), z, z.astype(bool), z.astype(bool), jnp.int32(T_))


def test_the_bound_holds_with_a_slow_trainer():
  cfg = tiny_cfg(**FAST, asynchronous=AsyncConfig(max_staleness=2))
  _, _, _, inflight, metrics = _iterate_recording(cfg, delay=0.3, iterations=4)
  # Fresh: rollouts 0, 1 by version 0, then rollout i + 2 by version i at iteration i.
  assert [(s, v) for s, v, _ in inflight] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2), (5, 3)]
  assert all(step - version <= 2 and n <= 2 for step, version, n in inflight)
  assert [metrics[i]["staleness"] for i in range(1, 5)] == [0.0, 1.0, 2.0, 2.0]


def test_a_sampler_of_its_own_on_4_plus_4_devices_has_the_rules_shardings(tmp_path):
  mesh = sharding.MeshConfig(data=1, fsdp=4, num_devices=4)
  cfg = tiny_cfg(**{**FAST, "iterations": 2}, mesh=mesh,
                 placement=PlacementConfig(sampler_devices=4,
                                           sampler_mesh=sharding.MeshConfig(data=2, fsdp=2)),
                 asynchronous=AsyncConfig(max_staleness=1))
  run = setup(cfg, str(tmp_path / "run"))
  devices = jax.devices()
  assert list(run.layout.mesh.devices.flat) == devices[:4]
  smesh = run.sampler.layout.mesh
  assert list(smesh.devices.flat) == devices[4:]
  assert {a: smesh.shape[a] for a in ("data", "fsdp", "tensor")} == {"data": 2, "fsdp": 2,
                                                                     "tensor": 1}
  expect = sharding.param_shardings(run.state.params, smesh)
  for got, want in zip(jax.tree.leaves(run.sampler.layout.state.params), jax.tree.leaves(expect),
                       strict=True):
    assert got == want
  T.train(cfg, str(tmp_path / "trained"), checkpoint_every=0, progress=False)
  m = read_metrics(tmp_path / "trained")
  nbytes = sum(x.nbytes for x in jax.tree.leaves(run.state.params))
  assert [r["weight_copy_bytes"] for r in m] == [nbytes, nbytes]
  assert [r["staleness"] for r in m] == [0.0, 1.0]
  assert all(np.isfinite(r["loss"]) for r in m)


@pytest.mark.parametrize("pi_old", ["behaviour", "proximal"])
def test_resume_mid_pipeline_equals_the_uninterrupted_run(tmp_path, pi_old):
  kw = dict(iterations=4, asynchronous=AsyncConfig(max_staleness=2, pi_old=pi_old))
  full, full_dir = trained(tmp_path, "full", **kw)
  assert sorted(os.listdir(os.path.join(full_dir, "inflight"))) == ["2.npz", "3.npz", "4.npz"]
  part = interrupted_copy(tmp_path / "full", tmp_path / "part", 2)
  T.train(tiny_cfg(**{**FAST, **kw}), str(part), resume=True, checkpoint_every=1,
          progress=False)
  resumed = read_metrics(part)
  assert [r["step"] for r in resumed] == [1, 2, 3, 4]
  for a, b in zip(full, resumed, strict=True):
    assert NOT_TIMED(a) == NOT_TIMED(b), a["step"]
  for x, y in zip(final_params(full_dir, None), final_params(part, None), strict=True):
    np.testing.assert_array_equal(x, y)


def test_a_resume_with_another_bound_is_refused(tmp_path):
  kw = dict(iterations=1, asynchronous=AsyncConfig(max_staleness=1))
  _, run_dir = trained(tmp_path, "run", **kw)
  before = sorted(os.listdir(run_dir))
  other = tiny_cfg(**{**FAST, **kw, "asynchronous": AsyncConfig(max_staleness=2)})
  with pytest.raises(T.rundir.RunDirError, match="asynchronous.max_staleness"):
    T.train(other, run_dir, resume=True, progress=False)
  assert sorted(os.listdir(run_dir)) == before


@pytest.mark.parametrize("kw, field", [
    (dict(asynchronous=AsyncConfig(max_staleness=1), old_logp="sampler",
          rollout_correction=C.RolloutCorrectionConfig()), None),
    (dict(asynchronous=AsyncConfig(pi_old="proximal"), old_logp="sampler"),
     "asynchronous.pi_old='proximal'"),
    (dict(asynchronous=AsyncConfig(max_staleness=1), multiturn=C.MultiTurnConfig(env="calculator")),
     "multiturn.env"),
    (dict(placement=PlacementConfig(sampler_devices=2), lora=C.LoRAConfig(rank=2)), "lora.rank"),
])
def test_combinations_are_refused_by_name(kw, field):
  if field is None:  # allowed: the sampler's own log-probs as pi_old, k = 1
    tiny_cfg(**kw)
    return
  with pytest.raises(ValueError, match=field.replace("(", r"\(")):
    tiny_cfg(**kw)


@pytest.mark.parametrize("override, field", [
    ("async.max_staleness=-1", "asynchronous.max_staleness"),
    ("placement.sampler_devices=-2", "placement.sampler_devices"),
    ("placement.sampler_mesh.data=2", "placement.sampler_mesh"),
    ("async.pi_old=current", "pi_old"),
])
def test_bad_settings_name_the_field(override, field):
  from gspo_jax.utils import configlib
  with pytest.raises(ValueError, match=field):
    configlib.apply_overrides(tiny_cfg(), [override])


@pytest.mark.parametrize("kw, field", [
    (dict(placement=PlacementConfig(sampler_devices=8)), "placement.sampler_devices=8"),
    (dict(placement=PlacementConfig(sampler_devices=3)),   # 4 prompts over 3 sampler devices
     "placement.sampler_mesh"),
    (dict(placement=PlacementConfig(sampler_devices=2, sampler_mesh=sharding.MeshConfig(data=3))),
     "placement.sampler_mesh"),
    (dict(placement=PlacementConfig(sampler_devices=2,  # the tiny model has one KV head
                                    sampler_mesh=sharding.MeshConfig(data=1, tensor=2))),
     r"placement.sampler_mesh .*model.num_kv_heads"),
])
def test_meshes_that_do_not_fit_are_refused_before_any_work(tmp_path, kw, field):
  cfg = tiny_cfg(**FAST, **{**kw, "mesh": sharding.MeshConfig(num_devices=0 if "=8" in field
                                                               else 1)})
  with pytest.raises(ValueError, match=field):
    setup(cfg, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
