"""A cold start that trains adapters only (`lora.cold_start = "adapters"`, gspo_jax/lora/run.py):
the frozen base stays the initial model (here stored in int8, the QLoRA way); RL goes on
from the cold start's adapters; pi_ref is the base with those adapters (saved once, adapter
bytes only); resume is exact; the whole-model cold start is unchanged."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from gspo_jax import config as C
from gspo_jax.lora import adapters as lora
from gspo_jax.lora import run as lora_run
from gspo_jax.train import checkpoint
from gspo_jax.train import run as R
from tests.helpers import host, leaves, read_metrics, tiny_cfg
from tests.lora.test_lora import LORA, assert_resume_is_exact, trained_run

ADAPTERS = dataclasses.replace(LORA, base_dtype="int8", cold_start="adapters")
CFG = tiny_cfg(iterations=2, lora=ADAPTERS, loss=C.LossConfig(kl_coef=0.1),
               sft=C.SFTConfig(steps=6, batch_size=32, learning_rate=3e-3))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  return trained_run(tmp_path_factory, "adapters_cold", CFG, 1)


def restore(run_dir, name, target, step):
  ckpt = checkpoint.Checkpointer(str(run_dir / name), every=0, keep=3)
  try:
    return ckpt.restore(target, step)
  finally:
    ckpt.close()


def test_the_cold_start_trains_the_adapters_on_the_initial_base(trained):
  pointer = json.loads((trained / lora_run.POINTER).read_text())
  assert pointer == {"base": "initial model", "pretrained": "", "seed": 0, "lora_rank": 4,
                     "base_dtype": "int8"}
  assert not (trained / lora_run.BASE_DIR).exists()
  fresh = R.setup(CFG, str(trained))      # the initial model, quantised, adapters at B = 0
  loaded = R.load_run(str(trained))
  for x, y in zip(leaves(loaded.frozen.params), leaves(fresh.frozen.params)):
    np.testing.assert_array_equal(x, y)  # the base never moved
  # Step 0 (after the cold start): the adapters moved off B = 0.
  start = restore(trained, "checkpoints", fresh.state, 0)
  assert all(np.any(host(v[...])) for p, v in nnx.to_flat_state(start.params) if p[-1] == lora.B)
  assert int(start.step) == 0
  # pi_ref is the cold start's adapters, saved once: adapter arrays only.
  ref = restore(trained, "reference", fresh.state.params, 0)
  for x, y in zip(leaves(ref), leaves(start.params)):
    np.testing.assert_array_equal(x, y)
  assert {p[-1] for p, _ in nnx.to_flat_state(ref)} == {lora.A, lora.B}
  rows = read_metrics(trained)
  assert [r["step"] for r in rows] == [1, 2] and rows[-1]["kl"] > 0


def test_resume_after_an_adapter_cold_start_is_exact(trained, tmp_path):
  assert_resume_is_exact(CFG, trained, tmp_path / "part", 1, 1, refused=(
      (dataclasses.replace(CFG, lora=dataclasses.replace(ADAPTERS, cold_start="full")),
       "lora.cold_start"),))


def test_the_sft_program_trains_only_the_adapters(tmp_path):
  """The adapter cold start's step: the adapters and their optimiser state donated, the
  base neither donated nor changed; the whole-model cold start's programs are the full
  model's."""
  run = R.setup(dataclasses.replace(CFG, lora=dataclasses.replace(ADAPTERS, base_dtype="")),
                str(tmp_path / "a"))
  assert run.programs.sft is not run.frozen.programs.sft
  full = R.setup(dataclasses.replace(CFG, lora=LORA), str(tmp_path / "b"))
  assert full.programs.sft is full.frozen.programs.sft
  from gspo_jax.train import coldstart
  examples = run.task.sample(np.random.default_rng(0), CFG.sft.batch_size, "train")
  batch = coldstart.supervised_batch(run, examples)
  base = leaves(run.frozen.params)
  params = jax.tree.map(lambda x: x.copy(), run.state.params)
  opt = run.programs.sft_init(params)
  new, opt, loss = run.programs.sft(params, opt, batch)
  assert all(x.is_deleted() for x in jax.tree.leaves(params))
  new, _, loss = run.programs.sft(new, opt, batch)  # the schedule's warmup starts at 0
  assert not any(x.is_deleted() for x in jax.tree.leaves(run.frozen.params))
  for x, y in zip(leaves(run.frozen.params), base):
    np.testing.assert_array_equal(x, y)
  assert np.isfinite(float(loss))
  assert any(np.any(host(v[...])) for p, v in nnx.to_flat_state(new) if p[-1] == lora.B)


@pytest.mark.parametrize("kw,match", [
    (dict(rank=4, cold_start="lora"), r"lora.cold_start must be one of \('full', 'adapters'\)"),
    (dict(rank=0, cold_start="adapters"), r"lora.cold_start = 'adapters' needs lora.rank > 0"),
])
def test_bad_cold_start_settings_are_refused_by_name(kw, match):
  with pytest.raises(ValueError, match=match):
    tiny_cfg(lora=C.LoRAConfig(**kw))
