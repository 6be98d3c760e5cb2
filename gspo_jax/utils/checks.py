"""Argument checks shared by the public functions.

Shapes, dtypes and static hyperparameters are checked at trace time, so they also
hold under `jax.jit`. Value checks (a mask that is 0/1, token ids in range, finite
rewards) need concrete data: they run when the array is concrete (eager calls, numpy
input) and are skipped for tracers, where the caller is expected to have validated the
data upstream (the training loop checks rewards on the host).
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x: Any) -> bool:
  """True when `x` holds data this process can read now: not a tracer inside jit/vmap/grad,
  and not a multi-host global array with rows on other processes."""
  if isinstance(x, jax.core.Tracer):
    return False
  return not isinstance(x, jax.Array) or x.is_fully_addressable


def check_rank(fn: str, name: str, x: Any, rank: int, dims: str) -> None:
  if np.ndim(x) != rank:
    raise ValueError(
        f"{fn}: {name} must have shape ({dims}), rank {rank}; got shape {np.shape(x)}")


def check_shape(fn: str, name: str, x: Any, shape: tuple[int, ...], like: str) -> None:
  if tuple(np.shape(x)) != tuple(shape):
    raise ValueError(
        f"{fn}: {name} must have shape {tuple(shape)} (like {like}); got {tuple(np.shape(x))}")


def check_float(fn: str, name: str, x: Any) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(f"{fn}: {name} must be a floating-point array; got dtype {x.dtype}")


def check_mask(fn: str, name: str, mask: Any) -> None:
  """A mask is bool, or numeric with values in {0, 1}."""
  dtype = np.dtype(mask.dtype)
  if dtype == np.bool_ or not is_concrete(mask):
    return
  values = np.asarray(mask)
  bad = (values != 0) & (values != 1)
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"{fn}: {name} must contain only 0 and 1 (or be bool); found {values[where]!r} "
        f"at index {where}")


def check_token_arrays(fn: str, mask_BxT: Any, **arrays: Any) -> None:
  """The first of `arrays` (e.g. logp_BxT=...) is a float (B, T) array; the others are float
  arrays of its shape; mask_BxT is a 0/1 mask of its shape."""
  (first, x), *others = arrays.items()
  check_rank(fn, first, x, 2, "B, T")
  check_float(fn, first, x)
  for name, y in others:
    check_shape(fn, name, y, np.shape(x), first)
    check_float(fn, name, y)
  check_shape(fn, "mask_BxT", mask_BxT, np.shape(x), first)
  check_mask(fn, "mask_BxT", mask_BxT)


def check_rows_or_tokens(fn: str, name: str, x: Any, shape_BxT: tuple[int, int],
                         like: str) -> None:
  """x has shape (B,) (one value per row) or (B, T) (one per token)."""
  if np.ndim(x) == 1:
    check_shape(fn, name, x, tuple(shape_BxT[:1]), f"{like}.shape[:1]")
  else:
    check_shape(fn, name, x, tuple(shape_BxT), f"{like}, or (B,)")


def check_positive(fn: str, name: str, value: Any) -> None:
  """Python/numpy scalars must be > 0; traced scalars (schedules) pass unchecked."""
  if isinstance(value, numbers.Number) or (is_concrete(value) and np.ndim(value) == 0):
    if not float(value) > 0:
      raise ValueError(f"{fn}: {name} must be > 0; got {value!r}")


def check_choice(fn: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(f"{fn}: {name} must be one of {choices}; got {value!r}")


def check_token_ids(fn: str, name: str, tokens: Any, vocab: int) -> None:
  if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(f"{fn}: {name} must hold integer token ids; got dtype {tokens.dtype}")
  if is_concrete(tokens):
    values = np.asarray(tokens)
    if values.size and (values.min() < 0 or values.max() >= vocab):
      raise ValueError(
          f"{fn}: {name} must lie in [0, {vocab}) (the vocabulary size); "
          f"got min {values.min()}, max {values.max()}")
