"""Run metrics: JSON lines (one record per iteration), TensorBoard event files
(tensorboardX, a maintained writer that needs no TensorFlow), and a terminal progress bar
(tqdm). Only process 0 writes, so multi-host runs log once."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax
import numpy as np


def _scalar(v: Any) -> float:
  return float(np.asarray(v))


class MetricsWriter:
  """Writes flat dicts of scalars to <dir>/metrics.jsonl and TensorBoard files in <dir>/tb."""

  def __init__(self, directory: str, *, total: int | None = None, initial: int = 0,
               progress: bool = True):
    self.enabled = jax.process_index() == 0
    self.bar = None
    if not self.enabled:
      return
    os.makedirs(directory, exist_ok=True)
    from tensorboardX import SummaryWriter
    # Unbuffered: each record is one write, and a failed one is cut off again (`write`).
    self.jsonl = open(os.path.join(directory, "metrics.jsonl"), "ab", buffering=0)
    self.tb = SummaryWriter(os.path.join(directory, "tb"))
    if progress:
      from tqdm import tqdm
      self.bar = tqdm(total=total, initial=initial, unit="it", dynamic_ncols=True)

  def write(self, step: int, metrics: dict[str, Any], *, show: tuple[str, ...] = ()) -> None:
    if not self.enabled:
      return
    record = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
    self._append((json.dumps(record, allow_nan=True) + "\n").encode())
    for k, v in record.items():
      if k != "step" and math.isfinite(v):
        self.tb.add_scalar(k, v, step)
    if self.bar is not None:
      self.bar.set_postfix({k: f"{record[k]:.4g}" for k in show if k in record}, refresh=False)
      self.bar.update(1)

  def _append(self, line: bytes) -> None:
    """Write the record whole or not at all: a write that fails part-way (a full disk) is
    truncated back, so the file always parses as JSON lines."""
    start = os.fstat(self.jsonl.fileno()).st_size
    try:
      view = memoryview(line)
      while view:
        view = view[self.jsonl.write(view):]
    except OSError:
      self.jsonl.truncate(start)
      raise

  def print(self, text: str) -> None:
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.write(text)
    else:
      print(text, flush=True)

  def close(self) -> None:
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.close()
    self.jsonl.close()
    self.tb.close()
