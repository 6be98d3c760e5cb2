"""Config files, `--set` overrides and JSON for the run's frozen nested dataclasses.

    python -m gspo_jax.train --config configs/addition_tiny.py --set rollout.group_size=8
    python -m gspo_jax.train --config configs/addition_tiny.py:smoke    # its smoke variant
    python -m gspo_jax.train --config configs/addition_tiny.py -- --help  # every field
    python -m gspo_jax.train --config configs/addition_tiny.py -- --rollout.group-size 8

A config file is a Python file whose `get_config(arg=None)` returns a frozen dataclass;
`FILE:ARG` calls `get_config(ARG)` (big_vision's way to pick a variant such as `smoke`).
`--set dotted.field=value` overrides any field, parsed by its declared type; flags after
`--` are tyro's own, applied last. Every error about a config is a `ConfigError` (a
ValueError) naming the full dotted field; an unknown field comes with close matches.

Two libraries do the work, each where it is strongest:
  tyro   the command line. Each `--set` value is parsed by tyro's rules for the field's
         type, the same rules as its native flags (int refuses "8.5", a Literal lists its
         choices, tuples, `X | None`); `-- --help` lists every field with its type, its
         comment and the value it has after --config and --set.
  dacite nested dataclasses from a dict (JSON, and the overridden config), with strict
         type checks that report the dotted path of a wrong value.
Left here is the glue neither offers: comma-separated tuples and none/true/false in any
case for `--set` (the syntax the docs and experiments use), "did you mean" for unknown
fields, and one wording for all errors. Errors in the flags after `--` are tyro's own
(printed, exit status 2), and there an optional nested config is a tyro subcommand.
Tried and not taken: ml_collections (its dataclass flags are absl flags, not argparse,
and fail on the string annotations all our configs use), and either library alone
(dacite parses no strings; tyro builds no dataclass from a dict).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
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

import dacite
import tyro
from tyro.constructors import ConstructorRegistry, PrimitiveTypeInfo

_NoneType = type(None)
_NONES = ("none", "null")


class ConfigError(ValueError):
  """A config file, override or dict that does not fit the config's dataclasses."""


# ---------------------------------------------------------------------------------------
# Declared types.


def _is_union(tp: Any) -> bool:
  return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _without_none(tp: Any) -> Any:
  """`X` for `X | None`; `tp` itself otherwise."""
  arms = [a for a in typing.get_args(tp) if a is not _NoneType] if _is_union(tp) else []
  return arms[0] if len(arms) == 1 and len(typing.get_args(tp)) == 2 else tp


def _nested(tp: Any) -> type | None:
  """The dataclass behind a field typed `DC` or `DC | None`; None for any other type."""
  inner = _without_none(tp)
  return inner if isinstance(inner, type) and dataclasses.is_dataclass(inner) else None


@functools.cache
def _fields(cls: type) -> Mapping[str, Any]:
  """The declared type of every field below dataclass `cls`, by dotted path, nested
  configs and their own fields included (`typing.get_type_hints` resolves the string
  annotations of `from __future__ import annotations`)."""
  hints, out = typing.get_type_hints(cls), {}
  for field in dataclasses.fields(cls):
    out[field.name] = hints[field.name]
    nested = _nested(hints[field.name])
    if nested is not None:
      out.update({f"{field.name}.{k}": v for k, v in _fields(nested).items()})
  return types.MappingProxyType(out)


def _describe(tp: Any) -> str:
  """How an error message names a declared type: 'int', 'float or none', ..."""
  if _is_union(tp):
    arms = [_describe(a) for a in typing.get_args(tp) if a is not _NoneType]
    return " or ".join(arms + (["none"] if _NoneType in typing.get_args(tp) else []))
  if typing.get_origin(tp) is Literal:
    return "one of " + ", ".join(map(repr, typing.get_args(tp)))
  if typing.get_origin(tp) is tuple:
    return f"a list of {_describe(typing.get_args(tp)[0])}"
  if _nested(tp):
    return f"a {tp.__name__} mapping"
  return getattr(tp, "__name__", str(tp))


def _children(fields: Mapping[str, Any], parent: str) -> dict[str, str]:
  """{name: dotted path} of the fields directly under `parent` ('' = the top level)."""
  return {p.rpartition(".")[2]: p for p in fields if p.rpartition(".")[0] == parent}


def _close_matches(fields: Mapping[str, Any], path: str) -> list[str]:
  """Likely meant: the same name under another parent (`group_size` for
  `rollout.group_size`), a typo in the name (`rollout.groupsize`) or in the parent."""
  parent, _, leaf = path.rpartition(".")
  siblings = _children(fields, parent)
  close = [p for p in fields if p.rpartition(".")[2] == leaf]
  close += [siblings[s] for s in difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.7)]
  close += difflib.get_close_matches(path, fields, n=3, cutoff=0.8)
  near = difflib.get_close_matches(leaf, {p.rpartition(".")[2] for p in fields}, n=3, cutoff=0.8)
  close += [p for p in fields if p.rpartition(".")[2] in near]  # a typo under another parent
  return list(dict.fromkeys(close))[:3]


def _unknown(cls: type, paths: Sequence[str]) -> ConfigError:
  """'unknown config field ...; did you mean ...?', with the fields of its parent."""
  fields, lines = _fields(cls), []
  for path in paths:
    close = _close_matches(fields, path)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    parent = path.rpartition(".")[0]
    owner = parent if _nested(fields.get(parent)) else ""
    lines.append(f"unknown config field '{path}'{hint} (fields of {owner or cls.__name__}: "
                 f"{', '.join(_children(fields, owner))})")
  return ConfigError("\n".join(lines))


def _moved(cls: type, path: str) -> ConfigError | None:
  """'... is now ...' for a field an earlier version had at `path` (`cls.MOVED`: old
  dotted prefix -> new), None for any other path."""
  for old, new in getattr(cls, "MOVED", {}).items():
    if path == old or path.startswith(old + "."):
      now = new + path[len(old):]
      return ConfigError(f"config field '{path}' is now '{now}' (the config groups its "
                         f"fields by concern); set '{now}'")
  return None


# ---------------------------------------------------------------------------------------
# Overrides.


def _choose(choices: Sequence[str], token: str, path: str) -> str:
  if token in choices:
    return token
  # Any case: `share_prompts=true` for tyro's True, as the docs and experiments write it.
  folded = [c for c in choices if c.lower() == token.strip().lower()]
  if len(folded) == 1:
    return folded[0]
  raise ConfigError(f"config field '{path}' must be one of {', '.join(map(repr, choices))}; "
                    f"got {token!r}")


def _parse(tp: Any, raw: str, path: str) -> Any:
  """`raw` as a value of declared type `tp`, by tyro's rules for that type."""
  inner = _without_none(tp)
  if inner is not tp and raw.strip().lower() in _NONES:
    return None
  nested = _nested(tp)
  if nested is not None:
    example = f"'{path}.{dataclasses.fields(nested)[0].name}=VALUE'"
    alternative = f" or '{path}=none'" if inner is not tp else ""
    raise ConfigError(f"config field '{path}' is a nested {nested.__name__}: set its fields, "
                      f"e.g. {example}{alternative}; got {raw!r}")
  spec = ConstructorRegistry.get_primitive_spec(PrimitiveTypeInfo.make(inner, set()))
  if isinstance(spec, Exception):  # tyro returns (not raises) UnsupportedTypeAnnotationError
    raise ConfigError(f"config field '{path}' has type {tp}, which --set cannot parse")
  tokens, what = [raw], _describe(tp)
  if spec.nargs != 1:  # a tuple: comma-separated on the command line ("" = empty)
    tokens = [t.strip() for t in raw.split(",")] if raw.strip() else []
    what = f"comma-separated {_describe(typing.get_args(inner)[0])} values"
  if spec.choices is not None:
    tokens = [_choose(spec.choices, t, path) for t in tokens]
  try:
    return spec.instance_from_str(tokens)
  except ValueError:
    raise ConfigError(f"config field '{path}' expects {what}, got {raw!r}") from None


def _put(tree: dict, path: str, value: Any) -> None:
  """Sets `path` in the nested dict `tree`; a later value replaces an earlier one."""
  *parents, leaf = path.split(".")
  node = tree
  for name in parents:
    if node.get(name) is None:  # an optional nested config that is unset: its defaults
      node[name] = {}
    node = node[name]
  node[leaf] = value


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
  """A copy of dataclass `cfg` with `dotted.field=value` overrides applied.

  Values are parsed by the field's declared type (tyro's rules): bool takes true/false in
  any case, int refuses "1.5", float takes "3e-4", Literal fields one of their members,
  `X | None` also none/null, tuples comma-separated values ("" = empty). A later override
  of a field wins. Setting a field inside an unset optional nested config starts it from
  its class defaults. The config is rebuilt once, after all overrides, so each
  `__post_init__` sees the final values together.

  Raises:
    ConfigError: an override without '=', an unknown field (with close matches), a value
      that does not parse, a nested config set from a value, or a `__post_init__` check.
  """
  if not overrides:
    return cfg
  cls, tree = type(cfg), to_dict(cfg)
  for item in overrides:
    path, sep, raw = item.partition("=")
    path = path.strip()
    if not sep or not path:
      raise ConfigError(f"override {item!r} is not of the form dotted.field=value")
    path = getattr(cls, "ALIASES", {}).get(path, path)
    if path not in _fields(cls):
      raise _moved(cls, path) or _unknown(cls, [path])
    _put(tree, path, _parse(_fields(cls)[path], raw, path))
  return _build(cls, tree, f"{cls.__name__} with {' '.join(overrides)}")


# ---------------------------------------------------------------------------------------
# Dicts and JSON.


def _as_float(value: Any) -> Any:
  return float(value) if type(value) is int else value  # JSON may write 1.0 as 1


# strict: a key that is no field is an error (checked first, below, to name its path).
_DACITE = dacite.Config(strict=True, type_hooks={float: _as_float})


def _tuples(value: Any) -> Any:
  """JSON lists as tuples: config fields hold tuples, never lists."""
  if isinstance(value, Mapping):
    return {k: _tuples(v) for k, v in value.items()}
  return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _unknown_keys(fields: Mapping[str, Any], d: Mapping, prefix: str = ""):
  for key, value in d.items():
    path = prefix + str(key)
    if path not in fields:
      yield path
    elif isinstance(value, Mapping) and _nested(fields[path]):
      yield from _unknown_keys(fields, value, path + ".")


def _build(cls: type, d: Any, what: str) -> Any:
  """Dataclass `cls` from the nested dict `d`; `what` names it in a rejection."""
  if not isinstance(d, Mapping):
    raise ConfigError(f"{what}: expected a mapping of config fields, got {type(d).__name__}")
  unknown = list(_unknown_keys(_fields(cls), d))
  if unknown:
    raise _unknown(cls, unknown)
  try:
    return dacite.from_dict(cls, _tuples(d), _DACITE)
  except dacite.WrongTypeError as e:
    value = functools.reduce(lambda node, k: node[k], e.field_path.split("."), d)  # as given
    raise ConfigError(f"config field '{e.field_path}' expects {_describe(e.field_type)}, "
                      f"got {value!r}") from None
  except dacite.MissingValueError as e:
    raise ConfigError(f"{what}: config field '{e.field_path}' has no default and is "
                      "missing") from None
  except (ValueError, TypeError) as e:  # a dataclass's own __post_init__ check
    raise ConfigError(f"{what} rejected: {e}") from e


def to_dict(cfg: Any) -> dict:
  """Dataclass `cfg` as a JSON-ready dict: nested dataclasses as dicts (tuples as tuples,
  which JSON writes as lists)."""
  return dataclasses.asdict(cfg)


def from_dict(cls: type, d: Mapping[str, Any]) -> Any:
  """Inverse of `to_dict`: `from_dict(type(c), json.loads(json.dumps(to_dict(c)))) == c`.

  Missing keys take the dataclass defaults, lists become tuples, an int is accepted for a
  float; everything else must have its declared type. A dict saved by an earlier version
  is first brought up to date by `cls.migrate(d)` when the class has one.

  Raises:
    ConfigError: unknown keys (each with close matches), a missing required field, a value
      of the wrong type, or a `__post_init__` check.
  """
  return _build(cls, _migrate(cls, d), cls.__name__)


def _migrate(cls: type, d: Any) -> Any:
  migrate = getattr(cls, "migrate", None)
  return migrate(d) if migrate is not None and isinstance(d, Mapping) else d


def save_json(cfg: Any, path: str) -> None:
  """Writes `to_dict(cfg)` to `path` as indented JSON."""
  with open(path, "w") as f:
    json.dump(to_dict(cfg), f, indent=2)
    f.write("\n")


def load_json(cls: type, path: str) -> Any:
  """Reads a config of dataclass type `cls` written by `save_json`."""
  with open(path) as f:
    return _build(cls, _migrate(cls, json.load(f)), f"{cls.__name__} from {path}")


# ---------------------------------------------------------------------------------------
# Config files and the command line.


def load_config(path: str) -> Any:
  """The dataclass from the Python config file at `path`: `get_config()`, or
  `get_config(ARG)` for `path` = `FILE:ARG` (e.g. `configs/addition_tiny.py:smoke`).

  The file is imported under a private module name registered in `sys.modules`, so that
  dataclasses it defines (string annotations included) resolve their field types.

  Raises:
    ConfigError: the file does not exist, has no callable `get_config`, `get_config`
      refuses ARG (TypeError or ValueError), or returns no dataclass instance.
  """
  file, arg = path, None
  if not os.path.isfile(path) and ":" in path:
    file, _, arg = path.rpartition(":")
  if not os.path.isfile(file):
    raise ConfigError(f"config file not found: {file}")
  name = "_gspo_config_" + re.sub(r"\W", "_", os.path.abspath(file))
  spec = importlib.util.spec_from_file_location(name, file)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  get_config = getattr(module, "get_config", None)
  if not callable(get_config):
    raise ConfigError(f"config file {file} must define a function get_config()")
  try:
    cfg = get_config(arg) if arg else get_config()
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config file {file}: get_config({arg!r}) failed: {e}") from e
  if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
    raise ConfigError(f"get_config() in {file} returned {type(cfg).__name__}, "
                      "not a dataclass instance")
  return cfg


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """Adds `--config FILE[:ARG]`, repeatable `--set FIELD=VALUE` and, after `--`, tyro's
  flags for the config fields to `parser`; returns it."""
  parser.add_argument("--config", metavar="FILE[:ARG]", default=None,
                      help="Python file whose get_config() returns the config; FILE:ARG calls "
                           "get_config(ARG), e.g. configs/addition_tiny.py:smoke")
  parser.add_argument("--set", metavar="FIELD=VALUE", action="append", default=[],
                      help="override a config field, e.g. rollout.group_size=8 (repeatable; "
                           "a later one wins)")
  parser.add_argument("config_flags", nargs="*", metavar="-- FLAG",
                      help="after --, config fields as flags, applied last, e.g. -- --loss "
                           "grpo --rollout.group-size 8; '-- --help' lists every field with "
                           "its value and comment")
  return parser


def config_from_args(args: argparse.Namespace, default_factory: Callable[[], Any]) -> Any:
  """The `--config` file's config (or `default_factory()`), then the `--set` overrides,
  then the flags after `--` (tyro: its errors and `--help` print and exit, as tyro does)."""
  cfg = load_config(args.config) if args.config else default_factory()
  cfg = apply_overrides(cfg, args.set or ())
  if args.config_flags:
    prog = os.path.basename(sys.argv[0]) + (f" --config {args.config}" if args.config else "")
    cfg = tyro.cli(type(cfg), default=cfg, args=args.config_flags, prog=prog + " --",
                   description="Config fields; defaults are the values after --config and --set.")
  return cfg
