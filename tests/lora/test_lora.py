"""LoRA (gspo_jax/lora/adapters.py, lora_run.py, lora_export.py): at init the adapted policy is the
base bit for bit; gradients reach the adapters only; pi_ref is the base with the adapters
off; 8 simulated devices (and a data:4 mesh) take the single device's first update;
resume is exact; the merged export is the adapted forward; the PEFT export follows PEFT's
layout (and loads in peft where it is installed); bad settings are refused by name."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax import config as C
from gspo_jax.lora import adapters as lora
from gspo_jax.lora import export as lora_export
from gspo_jax.lora import run as lora_run
from gspo_jax.models import config as model_config
from gspo_jax.models import hf, safetensors_io
from gspo_jax.parallel import sharding
from gspo_jax.train import checkpoint, step
from gspo_jax.train import loop as T
from gspo_jax.train import run as R
from gspo_jax.train.collect import rollout_step
from tests import adam_bounds
from tests.helpers import (
  TINY_MODEL,
  host,
  interrupted_copy,
  leaves,
  random_rewards_BxG,
  read_metrics,
  small_cfg,
  tiny_cfg,
)

LORA = lora.LoRAConfig(rank=4, alpha=8.0)


def lora_cfg(**kw):
  return tiny_cfg(**{"lora": LORA, "sft": C.SFTConfig(steps=0), **kw})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("lora"))  # the tokenizer is trained once, then loaded


@pytest.fixture(scope="module")
def run(run_dir):
  return R.setup(lora_cfg(loss=C.LossConfig(kl_coef=0.1)), run_dir)


def feed_rewards(run, r):
  rows, group = r.rewards_BxG.shape
  return sharding.feed(random_rewards_BxG(rows, group), run.layout.mesh, rows)


def train_steps(run, n):
  """n iterations (rollout, prepare with pi_ref, update on random rewards) of `run`."""
  for it in range(n):
    r = rollout_step(run, run.state.params, run.state.key, it)
    run.state, metrics = run.programs.update(run.state, r.batch, feed_rewards(run, r))
  return metrics


def adapted_logprobs(run, batch, adapters):
  f = jax.jit(lambda base, adapters: step.policy_logprobs(
      adapters, lora.Adapted(run.graphdef, base, run.frozen.scale), batch, run.programs.step_cfg)[0])
  return host(f(run.frozen.params, adapters))


def plain_logprobs(run, batch, params):
  f = jax.jit(lambda p: step.policy_logprobs(p, run.graphdef, batch, run.programs.step_cfg)[0])
  return host(f(params))


# -- at init -------------------------------------------------------------------------------

@pytest.mark.parametrize("model", [
    TINY_MODEL, dataclasses.replace(TINY_MODEL, scan_layers=True),
    model_config.tiny_moe(vocab_size=24, hidden=32, mlp_dim=64, num_heads=2, num_kv_heads=1,
                          head_dim=16),
    dataclasses.replace(TINY_MODEL, param_dtype="bfloat16")],
    ids=["unrolled", "scanned", "moe_attention", "bfloat16_base"])
def test_at_init_the_adapted_policy_is_the_base_exactly(run_dir, model):
  targets = ("q", "k", "v", "o") if model.num_experts else LORA.targets
  run = R.setup(lora_cfg(model=model, lora=dataclasses.replace(LORA, targets=targets)), run_dir)
  # The trained state is the adapters only, B = 0, A not.
  flat = dict(nnx.to_flat_state(run.state.params))
  assert {p[-1] for p in flat} == {lora.A, lora.B}
  assert len(flat) == 2 * len(targets) * (1 if model.scan_layers else model.num_layers)
  assert all(not np.any(host(v[...])) for p, v in flat.items() if p[-1] == lora.B)
  assert all(np.any(host(v[...])) for p, v in flat.items() if p[-1] == lora.A)
  assert all(v[...].dtype == jnp.float32 for v in flat.values())  # whatever the base's dtype
  # Teacher forcing and the greedy sampler: the base's log-probs and tokens, bit for bit.
  r = rollout_step(run, run.state.params, run.state.key, 0)
  np.testing.assert_array_equal(adapted_logprobs(run, r.batch, run.state.params),
                                plain_logprobs(run, r.batch, run.frozen.params))
  prompts, lens = r.batch.prompts_BxP, r.batch.prompt_lens_B
  adapted = run.programs.greedy(run.state.params, prompts, lens, jax.random.key(1))
  base = run.frozen.programs.greedy(run.frozen.params, prompts, lens, jax.random.key(1))
  np.testing.assert_array_equal(host(adapted.tokens_BxGxT), host(base.tokens_BxGxT))
  np.testing.assert_array_equal(host(adapted.logp_BxGxT), host(base.logp_BxGxT))


# -- training ------------------------------------------------------------------------------

def test_only_the_adapters_are_trained_and_donated(run):
  base_before = leaves(run.frozen.params)
  adapters_before = dict(nnx.to_flat_state(jax.tree.map(jnp.copy, run.state.params)))
  old_state = run.state
  metrics = train_steps(run, 2)
  assert all(x.is_deleted() for x in jax.tree.leaves(old_state.params))  # donated
  assert not any(x.is_deleted() for x in jax.tree.leaves(run.frozen.params))
  for a, b in zip(leaves(run.frozen.params), base_before):
    np.testing.assert_array_equal(a, b)  # the base, bit for bit
  after = dict(nnx.to_flat_state(run.state.params))
  assert all(not np.array_equal(host(after[p][...]), host(v[...]))  # A and B both moved
             for p, v in adapters_before.items())
  # The optimiser holds moments of the adapters and nothing of the base.
  assert lora.num_bytes(run.state.opt_state) < 3 * lora.num_bytes(run.state.params)
  assert float(metrics["kl"]) > 0 and float(metrics["skipped_updates"]) == 0


def test_kl_against_the_base_equals_kl_against_an_explicit_copy(run):
  if not any(np.any(host(v[...])) for p, v in nnx.to_flat_state(run.state.params)
             if p[-1] == lora.B):
    train_steps(run, 1)  # the policy must differ from the base for the KL to mean anything
  r = rollout_step(run, run.state.params, run.state.key, 5)
  copy = jax.tree.map(jnp.copy, run.frozen.params)
  merged = lora_export.merged_params(run)
  # The full model's own prepare, with an explicit reference copy passed in.
  prompts, lens = r.batch.prompts_BxP, r.batch.prompt_lens_B
  rollout = run.programs.sample(run.state.params, prompts, lens, run.state.key, 5)[0]
  lora_batch = run.programs.prepare(run.state.params, None, rollout, prompts, lens)
  full_batch = run.frozen.programs.prepare(merged, copy, rollout, prompts, lens)
  np.testing.assert_array_equal(host(lora_batch.ref_logp_BxGxT), host(full_batch.ref_logp_BxGxT))
  assert not np.array_equal(host(lora_batch.ref_logp_BxGxT), host(lora_batch.old_logp_BxGxT))
  rewards = feed_rewards(run, r)
  _, m_base = run.programs.update(jax.tree.map(jnp.copy, run.state), lora_batch, rewards)
  with_copy = lora_batch.replace(ref_logp_BxGxT=full_batch.ref_logp_BxGxT)
  _, m_copy = run.programs.update(jax.tree.map(jnp.copy, run.state), with_copy, rewards)
  assert float(m_base["kl"]) == float(m_copy["kl"]) > 0


@pytest.mark.parametrize("sampler_dtype", ["", "bfloat16"])
def test_the_sampler_decodes_with_the_adapters_merged_in(run, sampler_dtype):
  if not any(np.any(host(v[...])) for p, v in nnx.to_flat_state(run.state.params)
             if p[-1] == lora.B):
    train_steps(run, 1)
  r = run.reconfigure(dataclasses.replace(
      run.cfg, rollout=dataclasses.replace(run.cfg.rollout, sampler_dtype=sampler_dtype)))
  prompts, lens = host(jnp.full((4, 8), 5, jnp.int32)), host(jnp.full((4,), 3, jnp.int32))
  mesh = r.layout.mesh
  prompts, lens = sharding.feed(prompts, mesh, 4), sharding.feed(lens, mesh, 4)
  ours, _ = r.programs.sample(r.state.params, prompts, lens, r.state.key, 2)
  # The full model's own sampler on the adapters merged by hand: the same rollout.
  full, _ = r.frozen.programs.sample(lora_export.merged_params(r), prompts, lens, r.state.key, 2)
  np.testing.assert_array_equal(host(ours.tokens_BxGxT), host(full.tokens_BxGxT))
  np.testing.assert_array_equal(host(ours.logp_BxGxT), host(full.logp_BxGxT))
  base, _ = r.frozen.programs.sample(r.frozen.params, prompts, lens, r.state.key, 2)
  assert not np.allclose(host(ours.logp_BxGxT), host(base.logp_BxGxT), atol=1e-6)


# -- sharding ------------------------------------------------------------------------------

MESHES = {"data8": sharding.MeshConfig(data=8), "fsdp8": sharding.MeshConfig(data=1, fsdp=8),
          "2x2x2": sharding.MeshConfig(data=2, fsdp=2, tensor=2),
          "data4": sharding.MeshConfig(data=4, num_devices=4)}


def sharded_cfg(mesh):
  return dataclasses.replace(small_cfg(mesh), lora=LORA)


def one_update(run):
  r = rollout_step(run, run.state.params, run.state.key, 0)
  state, metrics = run.programs.update(jax.tree.map(jnp.copy, run.state), r.batch,
                                       feed_rewards(run, r))
  return r.batch, state, metrics


@pytest.fixture(scope="module")
def single(run_dir):
  run = R.setup(sharded_cfg(sharding.MeshConfig(num_devices=1)), run_dir)
  return run, one_update(run)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_first_update_equals_one_device(single, run_dir, mesh_name):
  ref_run, (ref_batch, ref_state, ref_metrics) = single
  run = R.setup(sharded_cfg(MESHES[mesh_name]), run_dir)
  mesh = run.layout.mesh
  batch, state, metrics = one_update(run)
  for a, b in zip(leaves(run.state.params), leaves(ref_run.state.params)):
    np.testing.assert_array_equal(a, b)  # the same adapters at init, however sharded
  for name in ("old_logp_BxGxT", "ref_logp_BxGxT"):
    np.testing.assert_allclose(host(getattr(batch, name)), host(getattr(ref_batch, name)),
                               atol=2e-5, err_msg=name)
  for k in ("loss", "grad_norm", "kl"):
    assert float(metrics[k]) == pytest.approx(float(ref_metrics[k]), rel=1e-5, abs=1e-6), k
  # Adam's first steps, entry by entry (a flipped sign, marin#4903's failure, is a step of
  # 2 lr): within the bounds float32 reductions in another order allow.
  adam_bounds.assert_steps_close(leaves(state.params), leaves(ref_state.params),
                                 run.cfg.optim.learning_rate, steps=run.cfg.num_minibatches,
                                 rtol=1e-5, atol=1e-5)
  # Each adapter is sharded as its logical axes say, which are its base weight's.
  is_var = lambda x: isinstance(x, nnx.Variable)
  base = dict(nnx.to_flat_state(run.frozen.params))
  for path, var in nnx.to_flat_state(state.params):
    spec = var[...].sharding.spec
    assert spec == sharding.spec_for(var.get_metadata()["logical_axes"], var[...].shape, mesh)
    w = base[path[:-1]][...].sharding.spec
    w = tuple(w) + (None,) * (base[path[:-1]][...].ndim - len(w))
    cut = lora._inputs(path[:-1])
    if path[-1] == lora.A:
      assert tuple(spec)[:cut] == w[:cut]
    else:
      assert tuple(spec)[1:] == w[cut:][:len(tuple(spec)) - 1]
  mu = state.opt_state[1].inner_state[0].mu
  for var, m in zip(jax.tree.leaves(state.params, is_leaf=is_var),
                    jax.tree.leaves(mu, is_leaf=is_var)):
    assert m[...].sharding.spec == var[...].sharding.spec
  if mesh_name == "fsdp8":  # the base's residual width is split 8 ways, A's too
    q = run.frozen.params["layers"][0]["attn"]["q"][...]
    assert q.sharding.spec == P_FSDP
    a = state.params["layers"][0]["attn"]["q"][lora.A][...]
    assert {s.data.shape for s in a.addressable_shards} == {(4, LORA.rank)}


P_FSDP = jax.sharding.PartitionSpec("fsdp", None, None)


# -- checkpoints, resume -------------------------------------------------------------------

RESUME_CFG = tiny_cfg(iterations=4, lora=LORA, loss=C.LossConfig(kl_coef=0.1),
                      sft=C.SFTConfig(steps=10, batch_size=32, learning_rate=3e-3))


def trained_run(tmp_path_factory, name, cfg, every):
  run_dir = tmp_path_factory.mktemp(name) / "run"
  T.train(cfg, str(run_dir), checkpoint_every=every, progress=False)
  return run_dir


def assert_resume_is_exact(cfg, trained, part, step, every, refused=()):
  """`trained` (a finished run of `cfg`) copied to `part` as stopped after `step`: each
  (changed config, message) of `refused` is refused with nothing in `part` changed; resuming
  `cfg` then gives every metric and every array (adapters, optimiser state, base) of the
  uninterrupted run."""
  part = interrupted_copy(trained, part, step)
  before = sorted((p.relative_to(part), p.stat().st_mtime_ns) for p in part.rglob("*"))
  for changed, match in refused:
    with pytest.raises(ValueError, match=match):
      T.train(changed, str(part), resume=True, progress=False)
  assert sorted((p.relative_to(part), p.stat().st_mtime_ns) for p in part.rglob("*")) == before
  T.train(cfg, str(part), resume=True, checkpoint_every=every, progress=False)
  a, b = read_metrics(trained), read_metrics(part)
  assert [r["step"] for r in b] == list(range(1, cfg.iterations + 1))
  for ra, rb in zip(a, b):
    for k in ("reward_mean", "loss", "kl", "grad_norm"):
      assert ra[k] == rb[k], (ra["step"], k)
  full, resumed = R.load_run(str(trained)), R.load_run(str(part))
  for x, y in zip(leaves((full.state.params, full.state.opt_state, full.frozen.params)),
                  leaves((resumed.state.params, resumed.state.opt_state,
                          resumed.frozen.params))):
    np.testing.assert_array_equal(x, y)
  return resumed


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  return trained_run(tmp_path_factory, "trained", RESUME_CFG, 2)


def test_checkpoints_hold_adapters_and_a_pointer_to_the_base(trained):
  pointer = json.loads((trained / lora_run.POINTER).read_text())
  assert pointer == {"base": "cold start", "directory": "base", "lora_rank": LORA.rank}
  ckpt = checkpoint.Checkpointer(str(trained / "checkpoints"), every=0, keep=3)
  try:
    stored = ckpt.manager.item_metadata(4)
  finally:
    ckpt.close()
  paths = [checkpoint._path(p) for p, _ in jax.tree_util.tree_flatten_with_path(stored)[0]]
  params = [p for p in paths if p.startswith("params/")]
  assert params and all(p.removesuffix("/value").endswith(("/lora_a", "/lora_b"))
                        for p in params)
  assert not (trained / "reference").exists()  # pi_ref is the base: no copy saved


def test_resume_is_exact_and_other_lora_settings_are_refused(trained, tmp_path):
  changed = lambda lc: dataclasses.replace(RESUME_CFG, lora=lc)
  assert_resume_is_exact(RESUME_CFG, trained, tmp_path / "part", 2, 2, refused=(
      (changed(C.LoRAConfig()), "lora.rank: saved 4, requested 0"),
      (changed(dataclasses.replace(LORA, rank=2)), "lora.rank"),
      (changed(dataclasses.replace(LORA, targets=("q",))), "lora.targets")))


@pytest.mark.parametrize("base_dtype", ["", "int8"])
def test_without_a_cold_start_the_base_is_the_initial_model(tmp_path, base_dtype):
  """(An int8 base: quantised once, at setup; a load quantises the rebuilt model again,
  the same program on the same weights.)"""
  cfg = lora_cfg(iterations=1, lora=dataclasses.replace(LORA, base_dtype=base_dtype))
  T.train(cfg, str(tmp_path / "run"), progress=False)
  pointer = json.loads((tmp_path / "run" / lora_run.POINTER).read_text())
  assert pointer == {"base": "initial model", "pretrained": "", "seed": 0, "lora_rank": 4,
                     **({"base_dtype": base_dtype} if base_dtype else {})}
  assert not (tmp_path / "run" / lora_run.BASE_DIR).exists()  # rebuilt from model + seed
  loaded = R.load_run(str(tmp_path / "run"))
  fresh = R.setup(cfg, str(tmp_path / "run"))
  for x, y in zip(leaves(loaded.frozen.params), leaves(fresh.frozen.params)):
    np.testing.assert_array_equal(x, y)
  assert int(loaded.state.step) == 1  # the checkpoint's adapters and optimiser state
  # The start of RL keeps the stored base (no dequantised copy, no second quantisation).
  stored = jax.tree.leaves(fresh.frozen.params)
  assert lora_run.cold_start_view(fresh) is fresh
  lora_run.start_rl(fresh, fresh.state.params, str(tmp_path / "run"))
  assert all(x is y for x, y in zip(jax.tree.leaves(fresh.frozen.params), stored))


def test_cost_script_measures_both_runs(tmp_path):
  from experiments import lora_cost
  record = lora_cost.main(["--config", os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                                                    "addition_tiny_lora.py:smoke"),
                           "--quick", "--out", str(tmp_path)])
  full, low = record["full"], record["lora"]
  assert full["frozen_base_bytes"] == 0 and low["frozen_base_bytes"] == full["param_bytes"]
  assert 0 < low["update_state_bytes"] < full["update_state_bytes"]
  assert all(r[k] > 0 for r in (full, low) for k in ("sample_s", "update_s"))
  assert (tmp_path / "benchmark_lora_cost.json").exists()


def test_curve_script_records_a_runs_heldout_curve(tmp_path):
  from experiments import lora_curve
  smoke = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "addition_tiny_lora.py:smoke")
  with pytest.raises(SystemExit, match="--variant full: .* lora.rank = 8"):
    lora_curve.main(["--variant", "full", "--config", smoke, "--out", str(tmp_path)])
  record = lora_curve.main(["--variant", "lora", "--config", smoke, "--set", "iterations=2",
                            "eval_every=1", "eval_size=8", "sft.steps=2", "--out", str(tmp_path)])
  assert [p[0] for p in record["heldout_curve"]] == [0, 1, 2]
  assert record["lora"]["rank"] == 8 and record["frozen_base_bytes"] > 0
  assert 3 * record["param_bytes"] <= record["update_state_bytes"] < 3.1 * record["param_bytes"]
  saved = json.load(open(tmp_path / "summary.json"))
  assert saved["lora"]["heldout_curve"] == record["heldout_curve"]
  # --from-run: the finished run recorded again, without training (no step 0, no seconds).
  args = ["--variant", "lora", "--config", smoke, "--out", str(tmp_path), "--from-run",
          str(tmp_path / "runs" / "lora"), "--set", "eval_every=1", "eval_size=8", "sft.steps=2"]
  with pytest.raises(SystemExit, match="its config.json is not"):
    lora_curve.main(args + ["iterations=3"])
  again = lora_curve.main(args + ["iterations=2"])
  assert again["heldout_curve"] == record["heldout_curve"][1:]
  assert again["train_seconds"] is None and again["peak_rss_mib"] is None
  assert again["update_state_bytes"] == record["update_state_bytes"]


def test_cost_script_times_the_int8_and_float_products(tmp_path):
  from experiments import lora_cost
  record = lora_cost.main(["--dot", "--quick", "--out", str(tmp_path)])
  assert set(record["dot_s"]) == {"float32", "dequantised_int8", "int8_int8_int32"}
  assert all(t > 0 for t in record["dot_s"].values())


def test_cost_script_counts_a_real_models_state_without_building_it(tmp_path):
  from experiments import lora_cost
  record = lora_cost.main(["--shapes", "qwen3_0_6b", "--rank", "8", "--out", str(tmp_path)])
  full, low = record["full"], record["lora"]
  # Qwen3-0.6B: 596M parameters (tied embeddings); Adam keeps two moments of each.
  assert full["param_bytes"] == 4 * 596_049_920 and full["opt_bytes"] >= 2 * full["param_bytes"]
  assert low["frozen_base_bytes"] == full["param_bytes"] // 2          # bfloat16
  # Rank 8 on q, k, v, o, gate, up, down of 28 layers: 8 * (in + out) per weight.
  D, Q, C, F = 1024, 16 * 128, 8 * 128, 3072
  per_layer = 8 * ((D + Q) * 2 + (D + C) * 2 + (D + F) * 3)
  assert low["param_bytes"] == 4 * 28 * per_layer
  # An int8 base: each dense weight entry 1 byte instead of 2, plus a float32 scale per
  # output channel (q: Q, k and v: C, o: D, gate and up: F, down: D).
  dense, scales = 2 * D * Q + 2 * D * C + 3 * D * F, Q + 2 * C + 2 * D + 2 * F
  assert low["frozen_base_int8_bytes"] == (low["frozen_base_bytes"] - 28 * dense
                                           + 4 * 28 * scales)


# -- exports -------------------------------------------------------------------------------

def test_export_command_writes_the_merged_run_and_its_adapter(trained, tmp_path):
  lora_export.main(["--run", str(trained), "--merged", str(tmp_path / "merged"),
                    "--peft", str(tmp_path / "adapter")])
  run = R.load_run(str(trained))
  r = rollout_step(run, run.state.params, run.state.key, 0)
  merged = nnx.state(hf.load(str(tmp_path / "merged")), nnx.Param)
  np.testing.assert_allclose(plain_logprobs(run, r.batch, merged),
                             adapted_logprobs(run, r.batch, run.state.params), rtol=1e-6, atol=1e-6)
  # The run's base is its cold start: written beside the adapter, which names it.
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert config["base_model_name_or_path"] == str(tmp_path / "adapter" / "base")
  base = nnx.state(hf.load(config["base_model_name_or_path"]), nnx.Param)
  for x, y in zip(leaves(base), leaves(run.frozen.params)):
    np.testing.assert_array_equal(x, y)


def test_merged_export_equals_the_adapted_forward(run, tmp_path):
  if not any(np.any(host(v[...])) for p, v in nnx.to_flat_state(run.state.params)
             if p[-1] == lora.B):
    train_steps(run, 1)
  lora_export.save_merged(run, str(tmp_path / "merged"))
  loaded = hf.load(str(tmp_path / "merged"))
  r = rollout_step(run, run.state.params, run.state.key, 3)
  adapted = adapted_logprobs(run, r.batch, run.state.params)
  exported = plain_logprobs(run, r.batch, nnx.state(loaded, nnx.Param))
  np.testing.assert_allclose(exported, adapted, rtol=1e-6, atol=1e-6)
  assert not np.allclose(adapted, plain_logprobs(run, r.batch, run.frozen.params), atol=1e-6)


def test_peft_export_is_the_merged_delta_in_peft_layout(run, tmp_path):
  if not any(np.any(host(v[...])) for p, v in nnx.to_flat_state(run.state.params)
             if p[-1] == lora.B):
    train_steps(run, 1)
  lora_export.save_base(run, str(tmp_path / "base"))
  lora_export.save_merged(run, str(tmp_path / "merged"))
  lora_export.save_peft(run, str(tmp_path / "adapter"), str(tmp_path / "base"))
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert config["r"] == LORA.rank and config["lora_alpha"] == LORA.alpha
  assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"])
  (tmp_path / "read").mkdir()  # safetensors_io.Checkpoint reads model.safetensors
  os.link(tmp_path / "adapter" / "adapter_model.safetensors", tmp_path / "read" / "model.safetensors")
  adapter = safetensors_io.Checkpoint(str(tmp_path / "read"))
  base = safetensors_io.Checkpoint(str(tmp_path / "base"))
  merged = safetensors_io.Checkpoint(str(tmp_path / "merged"))
  names = [n for n in merged.names() if any(m in n for m in lora_export.HF_MODULES.values())]
  assert len(names) == 7 * TINY_MODEL.num_layers
  for name in names:  # PEFT's forward: W + (alpha / r) * lora_B @ lora_A, HF layout (O, I)
    peft = name.replace("model.", "base_model.model.model.", 1).removesuffix(".weight")
    a = adapter.tensor(f"{peft}.lora_A.weight")
    b = adapter.tensor(f"{peft}.lora_B.weight")
    assert a.shape[0] == b.shape[1] == LORA.rank
    np.testing.assert_allclose(base.tensor(name) + LORA.scale * (b @ a), merged.tensor(name),
                               rtol=1e-6, atol=1e-6)


def test_peft_loads_the_adapter_and_reproduces_our_logprobs(run, tmp_path):
  torch = pytest.importorskip("torch", reason="optional: the PEFT round trip needs torch "
                              "(requirements-extras.txt: Python < 3.12; CI runs it there)")
  pytest.importorskip("transformers", reason="optional: the PEFT round trip needs transformers")
  peft = pytest.importorskip("peft", reason="optional: the PEFT round trip needs peft")
  import transformers
  lora_export.save_base(run, str(tmp_path / "base"))
  lora_export.save_peft(run, str(tmp_path / "adapter"), str(tmp_path / "base"))
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"),
                                                            torch_dtype=torch.float32)
  model = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
  r = rollout_step(run, run.state.params, run.state.key, 3)
  ours = adapted_logprobs(run, r.batch, run.state.params)[0, 0]
  prompt = host(r.batch.prompts_BxP)[0][:int(host(r.batch.prompt_lens_B)[0])]
  tokens = host(r.batch.tokens_BxGxT)[0, 0]
  ids = torch.tensor(np.concatenate([prompt, tokens])[None].astype(np.int64))
  with torch.no_grad():
    logits = model(ids).logits[0, len(prompt) - 1:-1].double()
  theirs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[:, None].astype(np.int64)))
  mask = host(r.batch.mask_BxGxT)[0, 0] > 0
  np.testing.assert_allclose(theirs[:, 0].numpy()[mask], ours[mask], atol=1e-4)


# -- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("lora_kw,match", [
    (dict(rank=-1), "lora.rank must be an int >= 1"),
    (dict(rank=2.5), "lora.rank must be an int"),
    (dict(rank=4, alpha=0.0), "lora.alpha must be > 0"),
    (dict(rank=4, targets=("q", "qkv")), r"lora.targets .*q, k, v, o, gate, up, down.*'qkv'"),
    (dict(rank=4, targets=("q", "q")), "lora.targets must name distinct"),
    (dict(rank=4, targets=()), "lora.targets must name"),
    (dict(rank=4, dropout=0.1), "lora.dropout must be 0"),
    # TINY_MODEL: hidden 32, one kv head of 16: k and v are 32 x 16 (rank 16 fits, 17 not)
    (dict(rank=17), r"lora.rank = 17 is larger than target 'k', a 32 x 16 weight"),
])
def test_bad_settings_are_refused_by_name(lora_kw, match):
  with pytest.raises(ValueError, match=match):
    tiny_cfg(lora=C.LoRAConfig(**lora_kw))


def test_rank_at_the_smallest_side_is_accepted():
  assert tiny_cfg(lora=C.LoRAConfig(rank=16)).lora.rank == 16


def test_moe_experts_and_multiturn_are_refused():
  moe = model_config.tiny_moe(vocab_size=24)
  with pytest.raises(ValueError, match=r"lora.targets \['gate', 'up', 'down'\] would adapt "
                                       "MoE expert weights"):
    tiny_cfg(model=moe, lora=LORA)
  assert tiny_cfg(model=moe, lora=dataclasses.replace(LORA, targets=("q", "o"))).lora.rank
  with pytest.raises(ValueError, match=r"does not support lora.rank"):
    tiny_cfg(lora=LORA, multiturn=C.MultiTurnConfig(env="calculator"),
             loss=C.LossConfig(name="gspo_token"))


def test_bad_setting_on_the_command_line_writes_nothing(tmp_path, capsys):
  run_dir = tmp_path / "never"
  with pytest.raises(SystemExit, match="lora.rank = 200 is larger than target"):
    T.main(["--config", os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                                     "addition_tiny_lora.py:smoke"),
            "--set", "lora.rank=200", "--run-dir", str(run_dir)])
  assert not run_dir.exists()


def test_the_planner_plans_a_lora_run_with_adapters_as_the_trained_state():
  """`python -m gspo_jax.plan` on a LoRA config: the programs take the frozen base as their
  first argument and train the adapters (here on this process's device: `local`); the
  update's arguments and outputs shrink to the adapters' state, the base is read, not
  donated."""
  from gspo_jax.plan import planner as plan
  only = ("sample", "prepare", "update")
  full = plan.plan(tiny_cfg(sft=C.SFTConfig(steps=0), loss=C.LossConfig(kl_coef=0.1)),
                   "local", only)
  lo = plan.plan(lora_cfg(loss=C.LossConfig(kl_coef=0.1)), "local", only)
  assert set(lo["programs"]) == set(only) and lo["params"] == full["params"]
  assert 0 < lo["trained_params"] < full["params"] / 2
  up, full_up = lo["programs"]["update"], full["programs"]["update"]
  assert up["output"] < full_up["output"] and 0 < up["alias"] < full_up["alias"]
