"""Config files, command-line overrides and JSON for nested frozen dataclasses.

A config is a frozen `dataclasses.dataclass` whose fields are int, float, bool, str,
`X | None`, `tuple[X, ...]`, `Literal[...]` or another such dataclass. A config file is a
Python file defining `get_config()` that returns one. Nothing here knows any field name:
everything is driven by the declared types (`typing.get_type_hints`, so string
annotations from `from __future__ import annotations` work).

Example:

  cfg = load_config("configs/demo.py")
  cfg = apply_overrides(cfg, ["loss=grpo", "rollout.group_size=8", "seeds=1,2,3"])
  save_json(cfg, "run/config.json")
  assert load_json(type(cfg), "run/config.json") == cfg

  # In a script: python -m my_script --config configs/demo.py --set optim.lr=3e-4
  parser = argparse.ArgumentParser()
  add_cli_args(parser)
  cfg = config_from_args(parser.parse_args(), default_factory=TrainConfig)

Every error about a config (bad file, unknown field, unparsable value, a dataclass's own
`__post_init__` rejecting the result) is a `ConfigError`, a `ValueError` whose message
names the full dotted field.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

_NoneType = type(None)
_NONES = ("none", "null")
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


class ConfigError(ValueError):
  """A config file, override or dict that does not fit the config's dataclasses."""


class _BadValue(Exception):
  """Internal: a value does not fit a type; the caller adds the field name."""


class _Unsupported(Exception):
  """Internal: a declared field type this module cannot parse or convert."""


# ---------------------------------------------------------------------------------------
# Declared types.


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> Mapping[str, Any]:
  """Resolved declared types of the init fields of dataclass `cls`, in field order.

  Fields with `init=False` are left out: neither `replace` nor the constructor accepts them.
  """
  try:
    hints = typing.get_type_hints(cls)
  except Exception as e:  # NameError for an unresolvable string annotation, mostly.
    raise ConfigError(f"cannot resolve the field types of {cls.__qualname__}: {e}") from e
  return types.MappingProxyType(
      {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init})


def _is_union(tp: Any) -> bool:
  return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_optional(tp: Any) -> bool:
  return _is_union(tp) and _NoneType in typing.get_args(tp)


def _is_dataclass_type(tp: Any) -> bool:
  return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _nested_class(tp: Any) -> type | None:
  """The dataclass behind a field typed `DC` or `DC | None`; None for any other type."""
  if _is_dataclass_type(tp):
    return tp
  arms = [a for a in typing.get_args(tp) if a is not _NoneType] if _is_union(tp) else []
  return arms[0] if len(arms) == 1 and _is_dataclass_type(arms[0]) else None


def _describe(tp: Any) -> str:
  """What a value of type `tp` should look like, for error messages."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if _is_union(tp):
    arms = [_describe(a) for a in args if a is not _NoneType]
    return " or ".join(arms + (["none"] if _NoneType in args else []))
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in args)
  if origin is tuple:
    if len(args) == 2 and args[1] is Ellipsis:
      return f"comma-separated {_describe(args[0])} values"
    return f"{len(args)} comma-separated values ({', '.join(_describe(a) for a in args)})"
  if tp is bool:
    return "bool (true/false/yes/no/1/0)"
  if _is_dataclass_type(tp):
    return f"a {tp.__name__} mapping"
  return getattr(tp, "__name__", str(tp))


def _join(prefix: str, name: str) -> str:
  return f"{prefix}.{name}" if prefix else name


def _label(cls: type, prefix: str) -> str:
  """How error messages refer to the dataclass at `prefix` ('' is the top level)."""
  return prefix or cls.__name__


def _unknown_field(cls: type, prefix: str, names: Sequence[str]) -> ConfigError:
  shown = ", ".join(repr(_join(prefix, n)) for n in names)
  valid = ", ".join(_field_types(cls))
  noun = "field" if len(names) == 1 else "fields"
  return ConfigError(f"unknown config {noun} {shown} (fields of {_label(cls, prefix)}: {valid})")


def _build(make: Callable[[], Any], cls: type, prefix: str) -> Any:
  """Runs a constructor or `replace`; a ValueError/TypeError from `__post_init__` becomes a
  ConfigError naming the dataclass, with the original error as `__cause__`."""
  try:
    return make()
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    where = f"config '{prefix}' ({cls.__name__})" if prefix else cls.__name__
    raise ConfigError(f"{where} rejected its values: {e}") from e


# ---------------------------------------------------------------------------------------
# Parsing override strings.


def _parse(tp: Any, raw: str) -> Any:
  """`raw` as a value of declared type `tp`; raises _BadValue or _Unsupported."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if _is_union(tp):
    return _parse_union(args, raw)
  if origin is Literal:
    return _parse_literal(args, raw)
  if origin is tuple:
    return _parse_tuple(args, raw)
  if tp in _SCALAR_PARSERS:
    return _SCALAR_PARSERS[tp](raw)
  raise _Unsupported


def _parse_union(args: tuple, raw: str) -> Any:
  # none/null means None only where None is allowed; for Optional[str] it wins over "none".
  if _NoneType in args and raw.strip().lower() in _NONES:
    return None
  for arm in args:
    if arm is not _NoneType:
      try:
        return _parse(arm, raw)
      except _BadValue:
        pass
  raise _BadValue


def _parse_literal(args: tuple, raw: str) -> Any:
  for member in args:
    try:
      if member == _parse(type(member), raw):  # str members: exact, case-sensitive match
        return member
    except (_BadValue, _Unsupported):
      pass
  raise _BadValue


def _parse_tuple(args: tuple, raw: str) -> tuple:
  items = [s.strip() for s in raw.split(",")] if raw.strip() else []
  if len(args) == 2 and args[1] is Ellipsis:
    return tuple(_parse(args[0], s) for s in items)
  if len(items) != len(args):
    raise _BadValue
  return tuple(_parse(a, s) for a, s in zip(args, items))


def _parse_bool(raw: str) -> bool:
  try:
    return _BOOLS[raw.strip().lower()]
  except KeyError:
    raise _BadValue from None


def _parse_with(fn: Callable[[str], Any]) -> Callable[[str], Any]:
  def parse(raw: str) -> Any:
    try:
      return fn(raw)
    except ValueError:
      raise _BadValue from None
  return parse


# int("1.5") and int("1e3") fail, as they should; float accepts "3e-4" and "2".
_SCALAR_PARSERS = {bool: _parse_bool, int: _parse_with(int), float: _parse_with(float),
                   str: lambda raw: raw}


def _parse_field(tp: Any, raw: str, where: str) -> Any:
  try:
    return _parse(tp, raw)
  except _BadValue:
    raise ConfigError(
        f"config field '{where}' expects {_describe(tp)}, got {raw!r}") from None
  except _Unsupported:
    raise ConfigError(f"config field '{where}' has type {tp}, "
                      "which overrides cannot set") from None


# ---------------------------------------------------------------------------------------
# Overrides.


def _split_override(item: str) -> tuple[str, str]:
  key, sep, raw = item.partition("=")
  if not sep or not key.strip():
    raise ConfigError(f"override {item!r} is not of the form dotted.field=value")
  return key.strip(), raw


def _resolve(cls: type, path: str) -> Any:
  """Declared type of the field at dotted `path` below dataclass `cls`."""
  parts, owner, tp = path.split("."), cls, None
  for i, name in enumerate(parts):
    prefix = ".".join(parts[:i])
    if owner is None:
      raise ConfigError(f"config field '{prefix}' is not a nested config, "
                        f"so '{path}' does not exist")
    if name not in _field_types(owner):
      raise _unknown_field(owner, prefix, [name])
    tp = _field_types(owner)[name]
    owner = _nested_class(tp)
  return tp


def _parse_override(cls: type, item: str) -> tuple[str, Any]:
  """(dotted path, parsed value) of one `path=value` override against dataclass `cls`."""
  path, raw = _split_override(item)
  tp = _resolve(cls, path)
  nested = _nested_class(tp)
  if nested is None:
    return path, _parse_field(tp, raw, path)
  if _is_optional(tp) and raw.strip().lower() in _NONES:
    return path, None
  example = f"{path}.{next(iter(_field_types(nested)), 'FIELD')}=VALUE"
  alternative = f" or '{path}=none'" if _is_optional(tp) else ""
  raise ConfigError(f"config field '{path}' is a nested {nested.__name__} and cannot be set "
                    f"from {raw!r}; set its fields, e.g. '{example}'{alternative}")


def _insert(tree: dict, path: str, value: Any) -> None:
  """Puts `value` at `path` in a nested dict; a later leaf replaces an earlier one."""
  *parents, leaf = path.split(".")
  node = tree
  for i, name in enumerate(parents):
    node = node.setdefault(name, {})
    if not isinstance(node, dict):
      raise ConfigError(f"overrides set both '{'.'.join(parents[:i + 1])}' and '{path}'")
  if isinstance(node.get(leaf), dict):
    raise ConfigError(f"overrides set both '{path}' and fields inside it")
  node[leaf] = value


def _rebuild(obj: Any, tree: dict, prefix: str) -> Any:
  """`obj` with the changes in `tree`, nested dataclasses first, one `replace` per level."""
  changes = {}
  for name, node in tree.items():
    where = _join(prefix, name)
    if isinstance(node, dict):  # parsed values are never dicts: this is a nested config
      child = getattr(obj, name)
      if child is None:  # `ref.beta=0.1` on `ref: RefConfig | None = None` starts from defaults
        cls = _nested_class(_field_types(type(obj))[name])
        child = _build(cls, cls, where)
      node = _rebuild(child, node, where)
    changes[name] = node
  return _build(lambda: dataclasses.replace(obj, **changes), type(obj), prefix)


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
  """A copy of dataclass `cfg` with `dotted.field=value` overrides applied.

  Values are parsed by the field's declared type: bool takes true/false/yes/no/1/0 (any
  case); int rejects "1.5"; float takes "3e-4"; `X | None` takes none/null; Literal
  members must match exactly; tuples are comma-separated ("" is the empty tuple). A later
  override of the same field wins. Setting a field inside an Optional nested config that
  is None starts that config from its class defaults.

  All overrides are parsed first and then applied together, one `dataclasses.replace`
  per touched dataclass (innermost first), so `__post_init__` of each touched dataclass
  and its parents sees the final values, never a half-applied state.

  Raises:
    ConfigError: for an override without '=', an unknown field (the message lists the
      valid ones), a value that does not parse, a nested config set from a scalar, or a
      ValueError/TypeError raised by a `__post_init__` (wrapped; the original is the
      ConfigError's `__cause__`).
  """
  tree = {}
  for item in overrides:
    path, value = _parse_override(type(cfg), item)
    _insert(tree, path, value)
  return _rebuild(cfg, tree, "")


# ---------------------------------------------------------------------------------------
# Dicts and JSON.


def _to_json(value: Any) -> Any:
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return to_dict(value)
  if isinstance(value, (tuple, list)):
    return [_to_json(v) for v in value]
  return value


def to_dict(cfg: Any) -> dict:
  """Plain JSON-ready dict of dataclass `cfg`: nested dataclasses become dicts, tuples
  lists. Only init fields are written, since only they can be passed back."""
  if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
    raise TypeError(f"to_dict expects a dataclass instance, got {type(cfg).__name__}")
  return {f.name: _to_json(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}


def _convert(tp: Any, value: Any) -> Any:
  """JSON `value` as declared type `tp`; raises _BadValue or _Unsupported."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if _is_union(tp):
    return _convert_union(args, value)
  if origin is Literal:
    if any(value == m and type(value) is type(m) for m in args):
      return value
    raise _BadValue
  if origin is tuple:
    return _convert_tuple(args, value)
  if tp in _SCALAR_CHECKS:
    if not _SCALAR_CHECKS[tp](value):
      raise _BadValue
    return float(value) if tp is float else value  # JSON may write 1.0 as 1
  raise _Unsupported


def _convert_union(args: tuple, value: Any) -> Any:
  if value is None and _NoneType in args:
    return None
  for arm in args:
    if arm is not _NoneType:
      try:
        return _convert(arm, value)
      except _BadValue:
        pass
  raise _BadValue


def _convert_tuple(args: tuple, value: Any) -> tuple:
  if not isinstance(value, (list, tuple)):
    raise _BadValue
  if len(args) == 2 and args[1] is Ellipsis:
    return tuple(_convert(args[0], v) for v in value)
  if len(value) != len(args):
    raise _BadValue
  return tuple(_convert(a, v) for a, v in zip(args, value))


_SCALAR_CHECKS = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def _from_json(tp: Any, value: Any, where: str) -> Any:
  nested = _nested_class(tp)
  if nested is not None and not (value is None and _is_optional(tp)):
    return _from_dict(nested, value, where)
  try:
    return _convert(tp, value)
  except _BadValue:
    raise ConfigError(f"config field '{where}' expects {_describe(tp)}, got {value!r}") from None
  except _Unsupported:
    raise ConfigError(f"config field '{where}' has type {tp}, "
                      "which from_dict cannot rebuild") from None


def _missing_required(cls: type, given: Mapping) -> list[str]:
  return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in given
          and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _from_dict(cls: type, d: Any, prefix: str) -> Any:
  if not isinstance(d, Mapping):
    raise ConfigError(f"config '{_label(cls, prefix)}' expects a mapping of its fields, "
                      f"got {type(d).__name__}")
  types_ = _field_types(cls)
  unknown = [k for k in d if k not in types_]
  if unknown:
    raise _unknown_field(cls, prefix, unknown)
  missing = _missing_required(cls, d)
  if missing:
    raise ConfigError(f"config '{_label(cls, prefix)}' is missing required field(s) "
                      + ", ".join(repr(_join(prefix, m)) for m in missing))
  kwargs = {k: _from_json(types_[k], v, _join(prefix, k)) for k, v in d.items()}
  return _build(lambda: cls(**kwargs), cls, prefix)


def from_dict(cls: type, d: Mapping[str, Any]) -> Any:
  """Inverse of `to_dict`: `from_dict(type(c), json.loads(json.dumps(to_dict(c)))) == c`.

  Missing keys take the dataclass defaults; lists become tuples; nested dicts become the
  declared nested dataclass. Values are type-checked (an int is accepted for a float).

  Raises:
    ConfigError: for unknown keys (all named), a missing required field, a value of the
      wrong type, or a ValueError/TypeError from a `__post_init__` (wrapped, as in
      `apply_overrides`).
  """
  if not _is_dataclass_type(cls):
    raise TypeError(f"from_dict expects a dataclass type, got {cls!r}")
  return _from_dict(cls, d, "")


def save_json(cfg: Any, path: str) -> None:
  """Writes `to_dict(cfg)` to `path` as indented JSON."""
  with open(path, "w") as f:
    json.dump(to_dict(cfg), f, indent=2)
    f.write("\n")


def load_json(cls: type, path: str) -> Any:
  """Reads a config of dataclass type `cls` written by `save_json`."""
  with open(path) as f:
    return from_dict(cls, json.load(f))


# ---------------------------------------------------------------------------------------
# Config files and the command line.


def load_config(path: str) -> Any:
  """The dataclass returned by `get_config()` of the Python file at `path`.

  The file is imported under a private module name registered in `sys.modules`, so that
  dataclasses it defines (string annotations included) resolve their field types.

  Raises:
    ConfigError: if the file does not exist, defines no callable `get_config`, or
      `get_config()` returns something other than a dataclass instance.
  """
  if not os.path.isfile(path):
    raise ConfigError(f"config file not found: {path}")
  name = "_gspo_config_" + re.sub(r"\W", "_", os.path.abspath(path))
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  get_config = getattr(module, "get_config", None)
  if not callable(get_config):
    raise ConfigError(f"config file {path} must define a function get_config()")
  cfg = get_config()
  if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
    raise ConfigError(f"get_config() in {path} returned {type(cfg).__name__}, "
                      "not a dataclass instance")
  return cfg


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """Adds `--config PATH` and repeatable `--set KEY=VALUE` to `parser`; returns it."""
  parser.add_argument("--config", metavar="PATH", default=None,
                      help="Python file whose get_config() returns the config")
  parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                      help="override a config field, e.g. rollout.group_size=8 (repeatable)")
  return parser


def config_from_args(args: argparse.Namespace, default_factory: Callable[[], Any]) -> Any:
  """The `--config` file's config (or `default_factory()`), with `--set` overrides applied."""
  cfg = load_config(args.config) if args.config else default_factory()
  return apply_overrides(cfg, args.set or ())
