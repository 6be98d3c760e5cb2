"""Hugging Face checkpoints: parity with transformers' logits (committed fixtures made by
tests/data/hf_fixtures/make_fixtures.py with every weight randomised, norms included),
export/load round trips, sharded placement, both config spellings, and bad input."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax.models import hf, safetensors_io
from gspo_jax.models.config import tiny, tiny_moe
from gspo_jax.parallel import sharding
from tests.helpers import FIXTURES, logits

CASES = ["qwen3_untied", "qwen3_tied", "qwen3_sharded", "qwen3_moe", "qwen3_moe_nonorm", "llama"]


def fixture(case):
  return os.path.join(FIXTURES, case)


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(case):
  model = hf.load(fixture(case))
  ids = np.load(os.path.join(fixture(case), "inputs.npy"))
  want = np.load(os.path.join(fixture(case), "logits.npy"))
  np.testing.assert_allclose(logits(model, ids), want, atol=1e-5, rtol=0)


def test_configs_are_read_as_written():
  moe = hf.load(fixture("qwen3_moe")).cfg
  assert moe.moe_layers == (0, 2) and moe.norm_topk_prob and moe.num_experts == 4
  assert moe.head_dim * moe.num_heads != moe.hidden and moe.qk_norm
  assert not hf.load(fixture("qwen3_moe_nonorm")).cfg.norm_topk_prob
  assert hf.load(fixture("qwen3_tied")).lm_head is None
  llama = hf.load(fixture("llama")).cfg
  assert not llama.qk_norm and llama.rope_theta == 1e4 and llama.param_dtype == "float32"


def test_transformers_4_and_5_spellings_agree():
  v5 = hf.read_config(fixture("qwen3_moe"))
  v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "num_local_experts", "dtype")}
  v4.update(rope_theta=10000.0, num_experts=4, torch_dtype="float32")
  assert hf.config_from_hf(v4) == hf.config_from_hf(v5)


@pytest.mark.parametrize("case", ["qwen3_untied", "qwen3_tied", "qwen3_moe", "llama"])
def test_export_writes_the_same_tensors_and_round_trips(case, tmp_path):
  model = hf.load(fixture(case))
  files = hf.save(model, str(tmp_path))
  assert files == ["config.json", "model.safetensors"]
  ours, theirs = safetensors_io.Checkpoint(str(tmp_path)), safetensors_io.Checkpoint(fixture(case))
  assert ours.names() == theirs.names()  # tied: no lm_head.weight in either
  for name in theirs.names():
    np.testing.assert_array_equal(ours.tensor(name), theirs.tensor(name), err_msg=name)
  again = hf.load(str(tmp_path))
  assert again.cfg == model.cfg
  for a, b in zip(jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(model))):
    np.testing.assert_array_equal(a, b)
  ids = np.load(os.path.join(fixture(case), "inputs.npy"))
  np.testing.assert_array_equal(logits(again, ids), logits(model, ids))


def test_sharded_export_and_bfloat16_round_trip(tmp_path):
  from gspo_jax.models import transformer
  model = transformer.create(tiny_moe(param_dtype="bfloat16", dtype="bfloat16"), seed=3)
  files = hf.save(model, str(tmp_path), max_shard_bytes=40_000)
  assert "model.safetensors.index.json" in files and len(files) > 3
  index = json.load(open(tmp_path / "model.safetensors.index.json"))
  assert set(index["weight_map"].values()) == {f for f in files if f.startswith("model-")}
  again = hf.load(str(tmp_path))
  assert again.cfg.param_dtype == "bfloat16" and again.embed[...].dtype == jnp.bfloat16
  for a, b in zip(jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(model))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert hf.load(str(tmp_path), param_dtype="float32").embed[...].dtype == jnp.float32


def test_load_places_each_tensor_in_its_sharding():
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
  model = hf.load(fixture("qwen3_moe"), mesh=mesh)
  is_var = lambda x: isinstance(x, nnx.Variable)
  for var in jax.tree.leaves(nnx.state(model), is_leaf=is_var):
    want = sharding.spec_for(var.get_metadata()["logical_axes"], var[...].shape, mesh)
    assert var[...].sharding.spec == want
  q = model.layers[0].attn.q[...]
  assert q.addressable_shards[0].data.shape == (32, 2, 32)  # (D/fsdp, N/tensor, H)
  ids = np.load(os.path.join(fixture("qwen3_moe"), "inputs.npy"))
  np.testing.assert_allclose(logits(model, ids),
                             np.load(os.path.join(fixture("qwen3_moe"), "logits.npy")), atol=1e-5)


# ------------------------------------------------------------------------------ bad input


def copy_fixture(case, tmp_path):
  out = tmp_path / case
  shutil.copytree(fixture(case), out)
  return out


def edit_config(directory, **changes):
  path = directory / "config.json"
  cfg = json.loads(path.read_text())
  cfg.update(changes)
  path.write_text(json.dumps(cfg))


def test_missing_files_are_named(tmp_path):
  with pytest.raises(hf.CheckpointError, match="no config.json"):
    hf.load(str(tmp_path))
  d = copy_fixture("llama", tmp_path)
  os.remove(d / "model.safetensors")
  with pytest.raises(safetensors_io.SafetensorsError, match="no model.safetensors"):
    hf.load(str(d))
  s = copy_fixture("qwen3_sharded", tmp_path)
  os.remove(s / "model-00003-of-00005.safetensors")
  with pytest.raises(safetensors_io.SafetensorsError, match="model-00003-of-00005.safetensors .*missing"):
    hf.load(str(s))


@pytest.mark.parametrize("change,match", [
    (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
     "rope_type = 'llama3' is not supported"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_type = 'yarn'"),
    (dict(attention_bias=True), "attention_bias = True is not supported"),
    (dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
])
def test_unsupported_configs_are_refused(tmp_path, change, match):
  d = copy_fixture("llama", tmp_path)
  edit_config(d, **change)
  with pytest.raises(hf.CheckpointError, match=match):
    hf.load(str(d))


def test_shapes_that_do_not_match_the_config_name_the_tensor(tmp_path):
  d = copy_fixture("llama", tmp_path)
  edit_config(d, intermediate_size=80)
  with pytest.raises(hf.CheckpointError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(96, 64\)"):
    hf.load(str(d))
  d = copy_fixture("qwen3_tied", tmp_path)
  edit_config(d, tie_word_embeddings=False)
  with pytest.raises(safetensors_io.SafetensorsError, match="no tensor 'lm_head.weight'"):
    hf.load(str(d))
  d = copy_fixture("qwen3_untied", tmp_path / "x")
  edit_config(d, tie_word_embeddings=True)
  with pytest.raises(hf.CheckpointError, match="does not explain: \\['lm_head.weight'\\]"):
    hf.load(str(d))


def test_corrupt_safetensors_name_the_file_and_tensor(tmp_path):
  d = copy_fixture("llama", tmp_path)
  path = d / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[: len(data) - 1000])  # truncated: the last tensors are cut off
  with pytest.raises(safetensors_io.SafetensorsError, match=r"model.safetensors: tensor '.*' ends at byte"):
    hf.load(str(d))
  path.write_bytes(data[:8] + b"{not json" + data[17:])
  with pytest.raises(safetensors_io.SafetensorsError, match="model.safetensors: corrupt header"):
    hf.load(str(d))
  path.write_bytes(b"\x01\x02")
  with pytest.raises(safetensors_io.SafetensorsError, match="truncated"):
    hf.load(str(d))


def test_live_comparison_with_transformers(tmp_path):
  torch = pytest.importorskip("torch", reason="optional: torch + transformers regenerate the "
                              "parity fixtures live; the committed fixtures are checked above")
  transformers = pytest.importorskip("transformers", reason="optional: needs transformers")
  from gspo_jax.models import transformer
  model = transformer.create(tiny(), seed=1)
  hf.save(model, str(tmp_path))
  theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                             torch_dtype=torch.float32)
  ids = np.arange(14).reshape(2, 7) % 64
  with torch.no_grad():
    want = theirs(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(logits(model, ids), want, atol=1e-4)


def test_live_fresh_random_checkpoints_of_every_case(tmp_path):
  """Regenerates each fixture case with new random weights (in tmp_path; the committed
  fixtures stay as they are) and compares our logits with transformers' live."""
  torch = pytest.importorskip("torch", reason="optional: needs torch + transformers")
  pytest.importorskip("transformers", reason="optional: needs transformers")
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "make_fixtures", os.path.join(FIXTURES, "make_fixtures.py"))
  make = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(make)
  ids = np.load(os.path.join(fixture("llama"), "inputs.npy"))
  for name, (cfg_cls, model_cls, cfg_kwargs, save_kwargs, seed) in make.case_specs().items():
    torch.manual_seed(1000 + seed)
    theirs = model_cls(cfg_cls(**cfg_kwargs)).to(torch.float32).eval()
    make.randomise_(theirs)
    theirs.save_pretrained(str(tmp_path / name), safe_serialization=True, **save_kwargs)
    with torch.no_grad():
      want = theirs(input_ids=torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(logits(hf.load(str(tmp_path / name)), ids), want, atol=1e-4,
                               err_msg=name)


@pytest.mark.parametrize("case", ["qwen3_untied", "qwen3_tied", "qwen3_moe_nonorm"])
def test_a_checkpoint_loads_into_the_scanned_model_and_exports_back(case, tmp_path):
  """`scan_layers=True`: every layer weight stacked on a leading axis in layer order (layer i
  of the stack is the unrolled model's layer i, bit for bit), placed in its sharding on a
  2x2x2 mesh; the scanned model's logits equal transformers'; exporting it writes the
  checkpoint's own tensors."""
  unrolled = hf.load(fixture(case))
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
  scanned = hf.load(fixture(case), mesh=mesh, scan_layers=True)
  assert scanned.cfg == dataclasses.replace(unrolled.cfg, scan_layers=True)
  stacked = dict(nnx.to_flat_state(nnx.state(scanned.layers)))
  for i, layer in enumerate(unrolled.layers):
    for path, var in nnx.to_flat_state(nnx.state(layer)):
      np.testing.assert_array_equal(np.asarray(stacked[path][...][i]), np.asarray(var[...]))
  for var in jax.tree.leaves(nnx.state(scanned), is_leaf=lambda x: isinstance(x, nnx.Variable)):
    assert var[...].sharding.spec == sharding.spec_for(var.get_metadata()["logical_axes"],
                                                       var[...].shape, mesh)
  ids = np.load(os.path.join(fixture(case), "inputs.npy"))
  np.testing.assert_allclose(logits(scanned, ids), np.load(os.path.join(fixture(case), "logits.npy")),
                             atol=1e-5, rtol=0)
  hf.save(scanned, str(tmp_path))
  ours, theirs = safetensors_io.Checkpoint(str(tmp_path)), safetensors_io.Checkpoint(fixture(case))
  assert sorted(ours.names()) == sorted(theirs.names())
  for name in theirs.names():
    np.testing.assert_array_equal(ours.tensor(name), theirs.tensor(name))
