"""configs/: every file and its smoke variant loads, validates and round-trips through JSON;
the smoke variants are small; the Literal choices of TrainConfig match the registries its
checks use; `-- --help` lists every field of the training config; the addition smoke
variant trains end to end."""

import argparse
import io
import json
import os
import typing

import numpy as np
import pytest

from gspo_jax import config, demo
from gspo_jax.config import TrainConfig
from gspo_jax.models.config import tiny, tiny_moe
from gspo_jax.objectives import losses
from gspo_jax.rollout import sampling
from gspo_jax.train import loop as train
from gspo_jax.train import programs
from gspo_jax.utils import configlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".py"))


def _load(name: str, variant: str = ""):
  return configlib.load_config(os.path.join(ROOT, "configs", name) + variant)


def test_every_config_file_is_listed():
  assert CONFIGS == ["addition_tiny.py", "addition_tiny_lora.py", "demo.py", "long_chain.py",
                     "plan_qwen3_0_6b.py", "plan_qwen3_30b_a3b.py", "plan_qwen3_8b.py", "qwen3_0_6b_math.py",
                     "qwen3_1_7b_math.py", "qwen3_4b_math.py", "qwen3_8b_math.py",
                     "smollm2_addition.py", "smollm2_addition_lora.py", "smollm2_gym.py",
                     "smollm2_word_problems.py", "tool_multiplication.py"]


@pytest.mark.parametrize("variant", ["", ":smoke"])
@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_validates_and_round_trips(tmp_path, name, variant):
  cfg = _load(name, variant)  # building the dataclasses runs their __post_init__ checks
  assert isinstance(cfg, demo.DemoConfig if name == "demo.py" else TrainConfig)
  if isinstance(cfg, TrainConfig):
    config.check_routing(cfg)
    assert set(cfg.loss.kwargs()) >= {"eps_low", "eps_high"}
  path = str(tmp_path / "config.json")
  configlib.save_json(cfg, path)
  assert configlib.load_json(type(cfg), path) == cfg


@pytest.mark.parametrize("name", CONFIGS)
def test_smoke_variant_is_small(name):
  full, smoke = _load(name), _load(name, ":smoke")
  assert smoke.iterations <= 3 < full.iterations
  if isinstance(smoke, TrainConfig):
    assert smoke.rollout.prompts_per_iter * smoke.rollout.group_size <= 32
    assert smoke.eval_size <= 16 and smoke.sft.steps <= 2
    # Same job: task, data and starting model are the full run's.
    assert (smoke.task, smoke.pretrained) == (full.task, full.pretrained)


@pytest.mark.parametrize("name", CONFIGS)
def test_unknown_variant_is_refused(name):
  with pytest.raises(configlib.ConfigError, match=(
      f"{name}: get_config\\('big'\\) failed: unknown variant 'big' \\(this file has: smoke\\)")):
    _load(name, ":big")


def test_demo_smoke_runs():
  out = io.StringIO()
  history = demo.train(_load("demo.py", ":smoke"), out=out)
  assert len(history["reward"]) == 3 and "mean reward" in out.getvalue()


def test_choices_match_the_registries():
  hints, loss = typing.get_type_hints(TrainConfig), typing.get_type_hints(config.LossConfig)
  choices = lambda name, h=hints: tuple(a for a in typing.get_args(h[name]) if a is not type(None))
  assert choices("name", loss) == tuple(losses.LOSSES)
  assert typing.get_args(choices("aggregation", loss)[0]) == losses.AGGREGATIONS
  assert choices("kl_estimator", loss) == losses.KL_ESTIMATORS
  assert choices("old_logp") == config.OLD_LOGP_SOURCES
  assert choices("routing") == config.ROUTING_MODES
  rollout = typing.get_type_hints(config.RolloutConfig)
  assert typing.get_args(rollout["sampler_dtype"]) == config.SAMPLER_DTYPES
  assert typing.get_args(rollout["kv_cache_dtype"]) == sampling.CACHE_DTYPES


def test_kv_cache_dtype_reaches_the_sampler_and_bf16_of_float64_is_refused():
  tok = argparse.Namespace(eos_id=1, pad_id=0, vocab_size=32)
  cfg = TrainConfig(rollout=config.RolloutConfig(kv_cache_dtype="bfloat16"))
  assert all(s.cache_dtype == "bfloat16" for s in programs.sampler_configs(tok, cfg))
  with pytest.raises(ValueError, match="rollout.kv_cache_dtype"):
    config.RolloutConfig(kv_cache_dtype="float16")
  f64 = dict(model=tiny(vocab_size=32, dtype="float64", param_dtype="float64"))
  with pytest.raises(ValueError, match=r"rollout.kv_cache_dtype='bfloat16'.*float64"):
    TrainConfig(rollout=config.RolloutConfig(kv_cache_dtype="bfloat16"), **f64)
  TrainConfig(rollout=config.RolloutConfig(kv_cache_dtype="bfloat16", sampler_dtype="bfloat16"),
              **f64)  # the sampler computes in bfloat16


def test_responses_beyond_the_models_positions_are_refused(tmp_path):
  rollout = config.RolloutConfig(max_prompt_len=40, max_new_tokens=100)
  with pytest.raises(ValueError, match=r"rollout.max_prompt_len \+ rollout.max_new_tokens = "
                                       r"40 \+ 100 = 140 .* max_positions = 128.* at most 88"):
    TrainConfig(model=tiny(vocab_size=32, max_positions=128), rollout=rollout)
  TrainConfig(model=tiny(vocab_size=32, max_positions=140), rollout=rollout)  # exactly fits
  with pytest.raises(ValueError, match="ModelConfig.max_positions"):
    tiny(max_positions=0)
  # A pretrained model's limit is its config.json's max_position_embeddings, checked before
  # its weights load (there are none here).
  from gspo_jax.models import hf
  (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(tiny(max_positions=64))))
  assert hf.config_from_hf(hf.read_config(str(tmp_path))).max_positions == 64
  cfg = TrainConfig(pretrained=str(tmp_path), rollout=rollout)
  with pytest.raises(ValueError, match="max_positions = 64"):
    config.check_positions(hf.config_from_hf(hf.read_config(cfg.pretrained)), cfg.rollout)


def test_help_lists_every_training_field(capsys):
  parser = configlib.add_cli_args(argparse.ArgumentParser())
  args = parser.parse_args(["--config", os.path.join(ROOT, "configs", "addition_tiny.py"),
                            "--set", "seed=3", "--", "--help"])
  with pytest.raises(SystemExit):
    configlib.config_from_args(args, TrainConfig)
  text = " ".join(capsys.readouterr().out.split())  # undo the help's line wrapping
  for path, tp in configlib._fields(TrainConfig).items():
    if configlib._nested(tp) is None:
      flag = "--" + path.replace("_", "-")
      assert flag in text, flag
  assert "--seed INT (default: 3)" in text  # the value after --config and --set
  assert ("--loss.name {gspo,gspo_token,grpo,luspo,sapo,sapo_seq,cispo,gmpo} a key of "
          "losses.LOSSES (default: gspo)") in text
  # A comment above a field describes that field only, not the ones after it.
  assert "--iterations INT (default: 300)" in text
  assert "--num-minibatches INT (default: 4)" in text


@pytest.mark.slow  # ~15 s, nearly all of it compiling
def test_addition_tiny_smoke_trains(tmp_path):
  summary = train.train(_load("addition_tiny.py", ":smoke"), str(tmp_path), progress=False)
  assert np.isfinite(float(summary["last"]["loss"])) and summary["last"]["skipped_updates"] == 0
  assert os.path.isdir(tmp_path / "checkpoints" / "2")  # the last iteration's checkpoint
  assert configlib.load_json(TrainConfig, str(tmp_path / "config.json")) == _load(
      "addition_tiny.py", ":smoke")


def test_group_names_have_aliases_and_flat_names_point_to_their_groups():
  """`--set loss=grpo` / `task=NAME` set the groups' names; the flat names of earlier
  versions are errors that name the grouped field (`TrainConfig.MOVED`); a typo still gets
  its close matches."""
  cfg = configlib.apply_overrides(TrainConfig(), ["loss=grpo", "task=multiplication"])
  assert (cfg.loss.name, cfg.task.name) == ("grpo", "multiplication")
  assert cfg.loss == config.LossConfig(name="grpo")  # the alias sets the name alone
  for old, new in [("eps_low=0.1", "loss.eps_low"), ("aggregation=token-mean",
                   "loss.aggregation"), ("kl_coef=0.1", "loss.kl_coef"),
                   ("task_digits=3", "task.digits"), ("task_steps=3", "task.steps"),
                   ("data.train_file=x.jsonl", "task.data.train_file"),
                   ("reward=exact_match", "task.reward"), ("gym.name=chain_sum",
                                                           "task.gym.name")]:
    with pytest.raises(configlib.ConfigError, match=f"'{old.split('=')[0]}' is now '{new}'"):
      configlib.apply_overrides(TrainConfig(), [old])
  with pytest.raises(configlib.ConfigError, match="did you mean loss.eps_low"):
    configlib.apply_overrides(TrainConfig(), ["loss.eps_lo=0.1"])
  with pytest.raises(configlib.ConfigError, match="did you mean .*loss.eps_low"):
    configlib.apply_overrides(TrainConfig(), ["eps_lo=0.1"])


def test_each_group_checks_itself_naming_its_fields():
  with pytest.raises(ValueError, match="loss.kl_coef must be >= 0"):
    config.LossConfig(kl_coef=-0.1)
  with pytest.raises(ValueError, match="loss.eps_high must be > 0"):
    config.LossConfig(eps_high=0.0)
  with pytest.raises(ValueError, match="task.steps applies to task.name='chain'"):
    config.TaskConfig(steps=3)
  # What crosses groups is the TrainConfig's: a chain's solutions against the rollout.
  with pytest.raises(ValueError, match="rollout.max_new_tokens"):
    TrainConfig(task=config.TaskConfig(name="chain", digits=1, steps=12))


def test_compact_rows_is_bounded_by_the_rollout_rows_on_both_sides():
  """2**compact_rows <= B_s * G: 32 rows take 5 halvings, not 6 (refused when the config is
  built, naming the field, not by the sampler after the tokenizer and the cold start);
  oversampled prompts count (64 rows take 6)."""
  config.RolloutConfig(prompts_per_iter=8, group_size=4, compact_rows=5)
  with pytest.raises(ValueError, match=r"rollout.compact_rows=6 halves the B\*G = 32 rows .* "
                                       r"at most 5 halvings"):
    config.RolloutConfig(prompts_per_iter=8, group_size=4, compact_rows=6)
  config.RolloutConfig(prompts_per_iter=8, group_size=4, oversample=8, compact_rows=6)


@pytest.mark.parametrize("sets,match", [
    (dict(prepare_chunks=0), r"prepare_chunks = 0 must be a positive int that divides"),
    (dict(prepare_chunks=3), r"prepare_chunks = 3 .* divides the prompts sampled per "
                             r"iteration \(8\)"),
    (dict(prepare_chunks=2, routing="track", model=tiny_moe()),
     r"prepare_chunks > 1 needs routing='free'"),
])
def test_bad_prepare_chunks_are_named(sets, match):
  with pytest.raises(ValueError, match=match):
    TrainConfig(rollout=config.RolloutConfig(prompts_per_iter=8, group_size=2), **sets)
