"""gspo_jax.utils.configlib: `--set` parsing by declared type, error messages, JSON round trip,
config files and their variants, the command line (`--config`, `--set`, flags after `--`).

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

from gspo_jax.utils import configlib
from gspo_jax.utils.configlib import ConfigError, apply_overrides, from_dict, to_dict


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
  steps: int = 10              # number of updates
  qk_norm: bool = True
  eps_low: float = 0.2
  eps_high: float = 0.3
  seeds: tuple[int, ...] = (0,)
  max_grad_norm: float | None = 1.0
  aggregation: Literal["token-mean", "seq-mean"] | None = None
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
  with pytest.raises(ConfigError, match=r"^config field 'steps' expects int, got '1\.5'$"):
    _set("steps=1.5")


@pytest.mark.parametrize("raw, want", [("3e-4", 3e-4), ("0.5", 0.5), ("2", 2.0), ("-1E2", -100.0)])
def test_float(raw, want):
  lr = _set(f"lr={raw}").lr
  assert lr == want and type(lr) is float


def test_float_rejects_words():
  with pytest.raises(ConfigError, match=r"'lr' expects float, got 'fast'"):
    _set("lr=fast")


@pytest.mark.parametrize("raw, want", [("true", True), ("True", True), ("TRUE", True),
                                       ("false", False), ("False", False)])
def test_bool_in_any_case(raw, want):
  start = TrainConfig(qk_norm=not want)
  assert apply_overrides(start, [f"qk_norm={raw}"]).qk_norm is want


@pytest.mark.parametrize("raw", ["maybe", "", "2", "yes"])
def test_bool_rejects_other_words(raw):
  with pytest.raises(ConfigError,
                     match=rf"'qk_norm' must be one of 'True', 'False'; got '{raw}'"):
    _set(f"qk_norm={raw}")


def test_str_keeps_the_value_verbatim():
  assert _set("name=a=b c").name == "a=b c"  # only the first '=' splits
  assert _set("name=").name == ""
  assert _set("name=none").name == "none"  # a plain str field has no None


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
  assert _set("loss=GRPO").loss == "grpo"  # any case, as for bools
  with pytest.raises(ConfigError,
                     match=r"^config field 'loss' must be one of 'gspo', 'grpo'; got 'ppo'$"):
    _set("loss=ppo")


def test_optional_literal():
  assert _set("aggregation=seq-mean").aggregation == "seq-mean"
  assert apply_overrides(_set("aggregation=seq-mean"), ["aggregation=none"]).aggregation is None
  with pytest.raises(ConfigError, match="'aggregation' must be one of 'token-mean', 'seq-mean'"):
    _set("aggregation=sum")


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
  assert apply_overrides(base, []) is base


def test_later_override_wins():
  assert _set("steps=1", "steps=2").steps == 2
  assert _set("rollout.group_size=3", "rollout.group_size=5").rollout.group_size == 5


def test_unknown_field_suggests_close_matches():
  with pytest.raises(ConfigError) as info:
    _set("stpes=3")
  assert str(info.value) == (
      "unknown config field 'stpes'; did you mean steps? (fields of TrainConfig: loss, name, "
      "lr, steps, qk_norm, eps_low, eps_high, seeds, max_grad_norm, aggregation, rollout, ref)")


def test_unknown_nested_field_suggests_close_matches():
  with pytest.raises(ConfigError, match=(
      r"^unknown config field 'rollout\.groupsize'; did you mean rollout\.group_size\? "
      r"\(fields of rollout: group_size, max_new_tokens, temperature, stop\)$")):
    _set("rollout.groupsize=8")


def test_unknown_field_under_the_wrong_parent():
  with pytest.raises(ConfigError, match=r"'group_size'; did you mean rollout\.group_size\?"):
    _set("group_size=8")
  with pytest.raises(ConfigError,
                     match=r"'rollut\.temperature'; did you mean rollout\.temperature\?"):
    _set("rollut.temperature=0.5")


def test_path_through_a_scalar_field():
  with pytest.raises(ConfigError, match=r"unknown config field 'steps\.x'; did you mean steps\?"):
    _set("steps.x=1")


def test_wrong_type_names_the_dotted_field():
  with pytest.raises(ConfigError,
                     match=r"^config field 'rollout\.group_size' expects int, got '8\.5'$"):
    _set("rollout.group_size=8.5")


@pytest.mark.parametrize("item", ["loss", "rollout.group_size", "=3"])
def test_override_without_key_value(item):
  with pytest.raises(ConfigError, match="is not of the form dotted.field=value"):
    _set(item)


def test_nested_config_cannot_be_set_from_a_value():
  with pytest.raises(ConfigError, match=(r"'rollout' is a nested RolloutConfig: set its fields, "
                                         r"e\.g\. 'rollout\.group_size=VALUE'; got '8'")):
    _set("rollout=8")
  with pytest.raises(ConfigError, match="or 'ref=none'"):  # an optional one also takes none
    _set("ref=yes")


def test_optional_nested_config():
  on = _set("ref.beta=0.1")  # ref was None: starts from RefConfig defaults
  assert on.ref == RefConfig(beta=0.1)
  assert apply_overrides(on, ["ref=none"]).ref is None
  assert apply_overrides(on, ["ref.update_every=5"]).ref == RefConfig(beta=0.1, update_every=5)
  assert _set("ref=none", "ref.beta=0.2").ref == RefConfig(beta=0.2)  # the later one wins
  assert _set("ref.beta=0.2", "ref=none").ref is None


def test_post_init_runs_after_override():
  with pytest.raises(ConfigError, match=(r"^TrainConfig with rollout\.group_size=0 rejected: "
                                         "group_size must be >= 1; got 0$")) as info:
    _set("rollout.group_size=0")
  assert isinstance(info.value, ValueError)
  assert isinstance(info.value.__cause__, ValueError)
  with pytest.raises(ConfigError, match=r"with eps_low=0\.5 rejected: eps_low \(0\.5\) must be"):
    _set("eps_low=0.5")


def test_overrides_are_validated_together():
  # One at a time, eps_low=0.5 would fail against the old eps_high=0.3.
  cfg = _set("eps_low=0.5", "eps_high=0.6")
  assert (cfg.eps_low, cfg.eps_high) == (0.5, 0.6)


# ---------------------------------------------------------------------------------------
# Dicts and JSON.


def _rich_config() -> TrainConfig:
  return TrainConfig(loss="grpo", seeds=(1, 2, 3), max_grad_norm=None, ref=RefConfig(beta=0.2),
                     aggregation="seq-mean", rollout=RolloutConfig(group_size=8, stop=("a", "b")))


def test_to_dict_is_plain_json():
  d = to_dict(_rich_config())
  assert json.loads(json.dumps(d)) == {**d, "seeds": [1, 2, 3],
                                       "rollout": {**d["rollout"], "stop": ["a", "b"]}}
  assert d["max_grad_norm"] is None and d["ref"] == {"beta": 0.2, "update_every": None}


@pytest.mark.parametrize("cfg", [TrainConfig(), _rich_config(), TrainConfig(seeds=()),
                                 TrainConfig(ref=RefConfig(update_every=3))])
def test_json_round_trip(cfg):
  back = from_dict(TrainConfig, json.loads(json.dumps(to_dict(cfg))))
  assert back == cfg
  assert type(back.seeds) is tuple and type(back.rollout.stop) is tuple


def test_from_dict_missing_keys_take_defaults():
  cfg = from_dict(TrainConfig, {"steps": 3, "rollout": {"group_size": 2}, "lr": 1})
  assert cfg == TrainConfig(steps=3, rollout=RolloutConfig(group_size=2), lr=1.0)
  assert type(cfg.lr) is float


def test_from_dict_names_every_unknown_key():
  with pytest.raises(ConfigError) as info:
    from_dict(TrainConfig, {"foo": 1, "steps": 2, "rollout": {"size": 1}})
  lines = str(info.value).splitlines()
  assert lines[0].startswith("unknown config field 'foo' (fields of TrainConfig: loss, name")
  assert lines[1].startswith("unknown config field 'rollout.size'; did you mean "
                             "rollout.group_size? (fields of rollout: group_size")


@pytest.mark.parametrize("d, message", [
    ({"rollout": {"group_size": "8"}}, "config field 'rollout.group_size' expects int, got '8'"),
    ({"qk_norm": 1}, "config field 'qk_norm' expects bool, got 1"),
    ({"loss": "ppo"}, "config field 'loss' expects one of 'gspo', 'grpo', got 'ppo'"),
    ({"max_grad_norm": "x"}, "config field 'max_grad_norm' expects float or none, got 'x'"),
    ({"seeds": "12"}, "config field 'seeds' expects a list of int, got '12'"),
    ({"ref": {"beta": "x"}}, "config field 'ref.beta' expects float, got 'x'"),
    ({"rollout": 3}, "config field 'rollout' expects a RolloutConfig mapping, got 3"),
    ({"rollout": {"group_size": 0}}, "TrainConfig rejected: group_size must be >= 1; got 0"),
])
def test_from_dict_errors(d, message):
  with pytest.raises(ConfigError) as info:
    from_dict(TrainConfig, d)
  assert str(info.value) == message


def test_from_dict_missing_required_field():
  @dataclasses.dataclass(frozen=True)
  class Needs:
    n: int

  with pytest.raises(ConfigError, match="config field 'n' has no default and is missing"):
    from_dict(Needs, {})
  assert from_dict(Needs, {"n": 2}) == Needs(2)


def test_save_and_load_json(tmp_path):
  path = tmp_path / "config.json"
  configlib.save_json(_rich_config(), str(path))
  assert json.loads(path.read_text())["seeds"] == [1, 2, 3]
  assert configlib.load_json(TrainConfig, str(path)) == _rich_config()
  path.write_text('{"eps_low": 0.9}')
  with pytest.raises(ConfigError, match=rf"TrainConfig from {path} rejected: eps_low \(0\.9\)"):
    configlib.load_json(TrainConfig, str(path))


# ---------------------------------------------------------------------------------------
# Config files and the command line.

_CONFIG_FILE = '''
from __future__ import annotations
import dataclasses

@dataclasses.dataclass(frozen=True)
class FileConfig:
  width: int = 8               # model width
  tags: tuple[str, ...] = ()

def get_config(arg: str | None = None) -> FileConfig:
  if arg == "smoke":
    return FileConfig(width=2)
  if arg is not None:
    raise ValueError(f"unknown variant {arg!r}")
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


def test_load_config_variant(tmp_path):
  path = _write(tmp_path, _CONFIG_FILE)
  assert configlib.load_config(path + ":smoke").width == 2
  with pytest.raises(ConfigError, match=r"get_config\('tiny'\) failed: unknown variant 'tiny'"):
    configlib.load_config(path + ":tiny")
  plain = _write(tmp_path, "def get_config():\n  return 3\n", "plain.py")
  with pytest.raises(ConfigError, match=r"plain\.py: get_config\('smoke'\) failed"):
    configlib.load_config(plain + ":smoke")


def test_load_config_errors(tmp_path):
  with pytest.raises(ConfigError, match="must define a function get_config"):
    configlib.load_config(_write(tmp_path, "CONFIG = 1\n"))
  with pytest.raises(ConfigError, match="config file not found: .*missing.py$"):
    configlib.load_config(str(tmp_path / "missing.py:smoke"))
  with pytest.raises(ConfigError, match="returned int, not a dataclass instance"):
    configlib.load_config(_write(tmp_path, "def get_config():\n  return 3\n", "int.py"))


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="train")
  parser.add_argument("--run-dir")  # the scripts' own flags live beside ours
  return configlib.add_cli_args(parser)


def test_cli_config_file_and_overrides(tmp_path):
  args = _parser().parse_args(["--config", _write(tmp_path, _CONFIG_FILE) + ":smoke",
                               "--set", "tags=a,b", "--run-dir", "r", "--set", "width=4"])
  cfg = configlib.config_from_args(args, TrainConfig)  # the file wins over the factory
  assert (type(cfg).__name__, cfg.width, cfg.tags) == ("FileConfig", 4, ("a", "b"))
  assert args.run_dir == "r"
  with pytest.raises(SystemExit):  # argparse: --set needs a value
    _parser().parse_args(["--set"])


def test_cli_default_factory():
  assert configlib.config_from_args(_parser().parse_args([]), TrainConfig) == TrainConfig()
  args = _parser().parse_args(["--set", "seeds=1,2"])
  assert configlib.config_from_args(args, lambda: TrainConfig(steps=5)) == TrainConfig(
      steps=5, seeds=(1, 2))
  with pytest.raises(ConfigError, match="did you mean steps"):
    configlib.config_from_args(_parser().parse_args(["--set", "step=1"]), TrainConfig)


def test_cli_native_flags_after_double_dash():
  args = _parser().parse_args(["--set", "steps=3", "--set", "loss=grpo", "--", "--steps", "4",
                               "--rollout.group-size", "8", "--seeds", "5", "6",
                               "--max-grad-norm", "None", "--no-qk-norm"])
  cfg = configlib.config_from_args(args, TrainConfig)
  assert cfg == TrainConfig(steps=4, loss="grpo", rollout=RolloutConfig(group_size=8),
                            seeds=(5, 6), max_grad_norm=None, qk_norm=False)


def test_cli_native_errors_are_tyros(capsys):
  args = _parser().parse_args(["--", "--rollout.groupsize", "8"])
  with pytest.raises(SystemExit) as info:
    configlib.config_from_args(args, TrainConfig)
  assert info.value.code == 2 and "--rollout.group-size" in capsys.readouterr().err


def test_cli_help_lists_every_field_with_its_value_and_comment(capsys):
  args = _parser().parse_args(["--set", "steps=7", "--", "--help"])
  with pytest.raises(SystemExit) as info:
    configlib.config_from_args(args, TrainConfig)
  out = " ".join(capsys.readouterr().out.split())  # undo the help's line wrapping
  assert info.value.code == 0
  assert "--steps INT number of updates (default: 7)" in out
  for flag in ("--loss {gspo,grpo}", "--rollout.group-size", "--rollout.stop",
               "--max-grad-norm {None}|FLOAT", "--qk-norm, --no-qk-norm",
               "ref:ref-config"):  # tyro's way to set an optional nested config
    assert flag in out
