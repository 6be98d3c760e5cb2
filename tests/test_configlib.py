"""gspo_jax.configlib: override parsing by declared type, errors, JSON round trip, files, CLI.

The configs below use string annotations (`from __future__ import annotations`), as the
project's configs do, so every test also checks that declared types are resolved.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from typing import Literal

import pytest

from gspo_jax import configlib
from gspo_jax.configlib import ConfigError, apply_overrides, from_dict, to_dict


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  group_size: int = 4
  max_new_tokens: int = 16
  temperature: float = 1.0
  stop: tuple[str, ...] = ("</s>",)

  def __post_init__(self):
    if self.group_size < 1:
      raise ValueError(f"group_size must be >= 1; got {self.group_size}")


@dataclasses.dataclass(frozen=True)
class RefConfig:
  beta: float = 0.04
  update_every: int | None = None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  loss: Literal["gspo", "grpo"] = "gspo"
  name: str = "run"
  lr: float = 1e-5
  steps: int = 10
  qk_norm: bool = True
  eps_low: float = 0.2
  eps_high: float = 0.3
  seeds: tuple[int, ...] = (0,)
  max_grad_norm: float | None = 1.0
  rollout: RolloutConfig = RolloutConfig()
  ref: RefConfig | None = None

  def __post_init__(self):
    if self.eps_low > self.eps_high:
      raise ValueError(f"eps_low ({self.eps_low}) must be <= eps_high ({self.eps_high})")


def _set(*overrides: str) -> TrainConfig:
  return apply_overrides(TrainConfig(), overrides)


# ---------------------------------------------------------------------------------------
# Parsing by declared type.


def test_int():
  assert _set("steps=25").steps == 25
  assert _set("steps=-3").steps == -3
  with pytest.raises(ConfigError, match=r"config field 'steps' expects int, got '1\.5'"):
    _set("steps=1.5")


@pytest.mark.parametrize("raw, want", [("3e-4", 3e-4), ("0.5", 0.5), ("2", 2.0), ("-1E2", -100.0)])
def test_float(raw, want):
  lr = _set(f"lr={raw}").lr
  assert lr == want and type(lr) is float


def test_float_rejects_words():
  with pytest.raises(ConfigError, match=r"'lr' expects float, got 'fast'"):
    _set("lr=fast")


@pytest.mark.parametrize("raw, want", [("true", True), ("True", True), ("YES", True), ("1", True),
                                       ("false", False), ("No", False), ("0", False)])
def test_bool_spellings(raw, want):
  start = TrainConfig(qk_norm=not want)
  assert apply_overrides(start, [f"qk_norm={raw}"]).qk_norm is want


@pytest.mark.parametrize("raw", ["maybe", "", "2", "on"])
def test_bool_rejects_other_words(raw):
  with pytest.raises(ConfigError, match=r"'qk_norm' expects bool \(true/false"):
    _set(f"qk_norm={raw}")


def test_str_keeps_the_value_verbatim():
  assert _set("name=a=b c").name == "a=b c"  # only the first '=' splits
  assert _set("name=").name == ""


@pytest.mark.parametrize("raw", ["none", "None", "NULL"])
def test_optional_none(raw):
  assert _set(f"max_grad_norm={raw}").max_grad_norm is None


def test_optional_value_and_rejection():
  cfg = apply_overrides(TrainConfig(max_grad_norm=None), ["max_grad_norm=0.5"])
  assert cfg.max_grad_norm == 0.5
  with pytest.raises(ConfigError, match=r"'max_grad_norm' expects float or none, got 'big'"):
    _set("max_grad_norm=big")


def test_tuple_of_ints():
  assert _set("seeds=1,2,3").seeds == (1, 2, 3)
  assert _set("seeds= 4 , 5").seeds == (4, 5)
  assert _set("seeds=7").seeds == (7,)
  assert _set("seeds=").seeds == ()
  with pytest.raises(ConfigError, match=r"'seeds' expects comma-separated int values, got '1,x'"):
    _set("seeds=1,x")


def test_tuple_of_strs():
  cfg = _set("rollout.stop=</s>, <|im_end|>")
  assert cfg.rollout.stop == ("</s>", "<|im_end|>")


def test_literal():
  assert _set("loss=grpo").loss == "grpo"
  with pytest.raises(ConfigError, match=r"'loss' expects one of 'gspo', 'grpo', got 'ppo'"):
    _set("loss=ppo")
  with pytest.raises(ConfigError, match="got 'GRPO'"):  # members match exactly
    _set("loss=GRPO")


# ---------------------------------------------------------------------------------------
# Paths, errors and validation.


def test_nested_dotted_paths():
  cfg = _set("rollout.group_size=8", "rollout.temperature=0.7", "loss=grpo")
  assert cfg.rollout == RolloutConfig(group_size=8, temperature=0.7)
  assert cfg.loss == "grpo" and cfg.rollout.max_new_tokens == 16


def test_overrides_do_not_touch_the_input():
  base = TrainConfig()
  out = apply_overrides(base, ["rollout.group_size=8"])
  assert base == TrainConfig() and out.rollout.group_size == 8
  assert apply_overrides(base, []) == base


def test_later_override_wins():
  assert _set("steps=1", "steps=2").steps == 2


def test_unknown_top_level_field_lists_valid_names():
  with pytest.raises(ConfigError) as info:
    _set("stpes=3")
  msg = str(info.value)
  assert "unknown config field 'stpes'" in msg
  assert "fields of TrainConfig: loss, name, lr, steps, qk_norm" in msg


def test_unknown_nested_field_lists_valid_names():
  with pytest.raises(ConfigError, match=(
      r"unknown config field 'rollout\.groupsize' \(fields of rollout: "
      r"group_size, max_new_tokens, temperature, stop\)")):
    _set("rollout.groupsize=8")


def test_path_through_a_scalar_field():
  with pytest.raises(ConfigError, match=r"'steps' is not a nested config, so 'steps\.x'"):
    _set("steps.x=1")


def test_wrong_type_names_the_dotted_field():
  with pytest.raises(ConfigError,
                     match=r"config field 'rollout\.group_size' expects int, got '8\.5'"):
    _set("rollout.group_size=8.5")


@pytest.mark.parametrize("item", ["loss", "rollout.group_size", "=3"])
def test_override_without_key_value(item):
  with pytest.raises(ConfigError, match="is not of the form dotted.field=value"):
    _set(item)


def test_nested_config_cannot_be_set_from_a_scalar():
  with pytest.raises(ConfigError,
                     match=r"'rollout' is a nested RolloutConfig .* 'rollout\.group_size=VALUE'"):
    _set("rollout=8")
  # An Optional nested config accepts none, and says so.
  with pytest.raises(ConfigError, match="or 'ref=none'"):
    _set("ref=yes")


def test_optional_nested_config():
  on = _set("ref.beta=0.1")  # ref was None: starts from RefConfig defaults
  assert on.ref == RefConfig(beta=0.1)
  assert apply_overrides(on, ["ref=none"]).ref is None
  assert apply_overrides(on, ["ref.update_every=5"]).ref == RefConfig(beta=0.1, update_every=5)
  with pytest.raises(ConfigError, match="overrides set both 'ref' and 'ref.beta'"):
    _set("ref=none", "ref.beta=0.1")
  with pytest.raises(ConfigError, match="overrides set both 'ref' and fields inside it"):
    _set("ref.beta=0.1", "ref=none")


def test_post_init_runs_after_override():
  with pytest.raises(ConfigError, match=r"config 'rollout' \(RolloutConfig\) rejected its values: "
                                        "group_size must be >= 1; got 0") as info:
    _set("rollout.group_size=0")
  assert isinstance(info.value, ValueError)
  assert isinstance(info.value.__cause__, ValueError)
  with pytest.raises(ConfigError, match=r"TrainConfig rejected its values: eps_low \(0\.5\)"):
    _set("eps_low=0.5")


def test_overrides_are_validated_together():
  # One at a time, eps_low=0.5 would fail against the old eps_high=0.3.
  cfg = _set("eps_low=0.5", "eps_high=0.6")
  assert (cfg.eps_low, cfg.eps_high) == (0.5, 0.6)


# ---------------------------------------------------------------------------------------
# Dicts and JSON.


def _rich_config() -> TrainConfig:
  return TrainConfig(loss="grpo", seeds=(1, 2, 3), max_grad_norm=None, ref=RefConfig(beta=0.2),
                     rollout=RolloutConfig(group_size=8, stop=("a", "b")))


def test_to_dict_is_plain_json():
  d = to_dict(_rich_config())
  assert d["seeds"] == [1, 2, 3] and d["rollout"]["stop"] == ["a", "b"]
  assert d["max_grad_norm"] is None and d["ref"] == {"beta": 0.2, "update_every": None}
  assert json.loads(json.dumps(d)) == d


@pytest.mark.parametrize("cfg", [TrainConfig(), _rich_config(), TrainConfig(seeds=())])
def test_json_round_trip(cfg):
  back = from_dict(TrainConfig, json.loads(json.dumps(to_dict(cfg))))
  assert back == cfg
  assert type(back.seeds) is tuple and type(back.rollout.stop) is tuple


def test_from_dict_missing_keys_take_defaults():
  cfg = from_dict(TrainConfig, {"steps": 3, "rollout": {"group_size": 2}, "lr": 1})
  assert cfg == TrainConfig(steps=3, rollout=RolloutConfig(group_size=2), lr=1.0)
  assert type(cfg.lr) is float


def test_from_dict_rejects_unknown_keys():
  with pytest.raises(ConfigError,
                     match=r"unknown config fields 'foo', 'bar' \(fields of TrainConfig: loss"):
    from_dict(TrainConfig, {"foo": 1, "steps": 2, "bar": 3})
  with pytest.raises(ConfigError,
                     match=r"unknown config field 'rollout\.size' \(fields of rollout:"):
    from_dict(TrainConfig, {"rollout": {"size": 1}})


def test_from_dict_checks_types_and_validation():
  with pytest.raises(ConfigError, match=r"'rollout\.group_size' expects int, got '8'"):
    from_dict(TrainConfig, {"rollout": {"group_size": "8"}})
  with pytest.raises(ConfigError, match=r"'qk_norm' expects bool"):
    from_dict(TrainConfig, {"qk_norm": 1})
  with pytest.raises(ConfigError, match=r"'loss' expects one of 'gspo', 'grpo', got 'ppo'"):
    from_dict(TrainConfig, {"loss": "ppo"})
  with pytest.raises(ConfigError, match="config 'rollout' expects a mapping"):
    from_dict(TrainConfig, {"rollout": 3})
  with pytest.raises(ConfigError, match="group_size must be >= 1"):
    from_dict(TrainConfig, {"rollout": {"group_size": 0}})


def test_from_dict_missing_required_field():
  @dataclasses.dataclass(frozen=True)
  class Needs:
    n: int

  with pytest.raises(ConfigError, match="missing required field"):
    from_dict(Needs, {})
  assert from_dict(Needs, {"n": 2}) == Needs(2)


def test_save_and_load_json(tmp_path):
  path = tmp_path / "config.json"
  configlib.save_json(_rich_config(), str(path))
  assert json.loads(path.read_text())["seeds"] == [1, 2, 3]
  assert configlib.load_json(TrainConfig, str(path)) == _rich_config()


# ---------------------------------------------------------------------------------------
# Config files and the command line.

_CONFIG_FILE = '''
from __future__ import annotations
import dataclasses

@dataclasses.dataclass(frozen=True)
class FileConfig:
  width: int = 8
  tags: tuple[str, ...] = ()

def get_config() -> FileConfig:
  return FileConfig(width=32)
'''


def _write(tmp_path, text: str, name: str = "cfg.py") -> str:
  path = tmp_path / name
  path.write_text(textwrap.dedent(text))
  return str(path)


def test_load_config_from_a_python_file(tmp_path):
  cfg = configlib.load_config(_write(tmp_path, _CONFIG_FILE))
  assert type(cfg).__name__ == "FileConfig" and cfg.width == 32
  # The file's own string annotations resolve, so overrides work on its dataclasses.
  assert apply_overrides(cfg, ["tags=x,y", "width=4"]) == type(cfg)(width=4, tags=("x", "y"))


def test_load_config_errors(tmp_path):
  with pytest.raises(ConfigError, match="must define a function get_config"):
    configlib.load_config(_write(tmp_path, "CONFIG = 1\n"))
  with pytest.raises(ConfigError, match="config file not found"):
    configlib.load_config(str(tmp_path / "missing.py"))
  with pytest.raises(ConfigError, match="returned int, not a dataclass instance"):
    configlib.load_config(_write(tmp_path, "def get_config():\n  return 3\n", "int.py"))


def test_cli_args(tmp_path):
  parser = configlib.add_cli_args(argparse.ArgumentParser())
  args = parser.parse_args(["--config", _write(tmp_path, _CONFIG_FILE), "--set", "tags=a,b",
                            "--set", "width=4"])
  cfg = configlib.config_from_args(args, TrainConfig)  # the file wins over the factory
  assert (type(cfg).__name__, cfg.width, cfg.tags) == ("FileConfig", 4, ("a", "b"))
  with pytest.raises(SystemExit):  # argparse: --set needs a value
    parser.parse_args(["--set"])


def test_cli_args_default_factory():
  parser = configlib.add_cli_args(argparse.ArgumentParser())
  assert configlib.config_from_args(parser.parse_args([]), TrainConfig) == TrainConfig()
  args = parser.parse_args(["--set", "seeds=1,2"])
  assert configlib.config_from_args(args, lambda: TrainConfig(steps=5)) == TrainConfig(
      steps=5, seeds=(1, 2))
