"""Reading and writing safetensors files with numpy memory maps (lazy, bfloat16-aware).

Format: an 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the
raw little-endian tensor bytes (offsets relative to the end of the header).

Written here rather than taken from the `safetensors` package: its numpy API cannot read
bfloat16 (the dtype real checkpoints ship in) and its flax API places each tensor whole on
one device. A memory map reads a tensor only when it is used, so a checkpoint is never
held in host memory at once.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
          "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
          "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsError(ValueError):
  """A missing, corrupt or inconsistent safetensors file (the message names file and tensor)."""


def read_header(path: str) -> tuple[dict, int]:
  """(header dict without __metadata__, byte offset where the data starts)."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise SafetensorsError(f"{path}: truncated (no header length)")
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8:
      raise SafetensorsError(f"{path}: header length {n} exceeds the file size {size}")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise SafetensorsError(f"{path}: corrupt header ({e})") from None
  header.pop("__metadata__", None)
  data_size = size - 8 - n
  for name, info in header.items():
    if info.get("dtype") not in DTYPES:
      raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
    begin, end = info["data_offsets"]
    want = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(DTYPES[info["dtype"]]).itemsize
    if end - begin != want:
      raise SafetensorsError(f"{path}: tensor {name!r} of shape {info['shape']} needs {want} bytes, "
                             f"its offsets span {end - begin}")
    if end > data_size:
      raise SafetensorsError(f"{path}: tensor {name!r} ends at byte {end}, past the end of the "
                             f"data ({data_size} bytes): the file is truncated")
  return header, 8 + n


class Checkpoint:
  """The tensors of a Hugging Face model directory: `model.safetensors`, or the shards named
  by `model.safetensors.index.json`. `tensor(name)` is a read-only memory map."""

  def __init__(self, directory: str):
    self.directory = directory
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(directory, SINGLE)):
      files = [SINGLE]
    else:
      raise SafetensorsError(f"{directory}: no {SINGLE} or {INDEX}")
    self._where: dict[str, tuple[str, dict, int]] = {}
    for name in files:
      path = os.path.join(directory, name)
      if not os.path.exists(path):
        raise SafetensorsError(f"{directory}: {name} is listed in {INDEX} but missing")
      header, start = read_header(path)
      for tensor, info in header.items():
        self._where[tensor] = (path, info, start)

  def names(self) -> list[str]:
    return sorted(self._where)

  def tensor(self, name: str) -> np.ndarray:
    path, info, start = self._lookup(name)
    begin, _ = info["data_offsets"]
    shape = tuple(info["shape"])
    if not np.prod(shape, dtype=np.int64):
      return np.zeros(shape, DTYPES[info["dtype"]])
    return np.memmap(path, dtype=DTYPES[info["dtype"]], mode="r", offset=start + begin,
                     shape=shape)

  def _lookup(self, name: str):
    if name not in self._where:
      raise SafetensorsError(f"{self.directory}: no tensor {name!r} in the checkpoint")
    return self._where[name]


def write(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
          ) -> None:
  """Write one safetensors file (tensors in name order, 8-byte aligned header)."""
  header, offset, order = {}, 0, sorted(tensors)
  for name in order:
    arr = np.asarray(tensors[name])
    if arr.dtype not in _NAMES:
      raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {arr.dtype}")
    header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
  header["__metadata__"] = dict(metadata or {"format": "pt"})
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name in order:
      f.write(np.ascontiguousarray(tensors[name]).tobytes())  # little-endian hosts (x86, Arm)


def write_sharded(directory: str, tensors: Iterable[tuple[str, np.ndarray]],
                  max_shard_bytes: int = 5 * 2**30) -> list[str]:
  """Write tensors to `model-0000i-of-0000n.safetensors` shards of at most `max_shard_bytes`
  (one file, `model.safetensors`, when they fit) plus the index. Returns the file names."""
  shards, current, size = [], {}, 0
  for name, arr in tensors:
    if current and size + arr.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = arr
    size += arr.nbytes
  shards.append(current)
  if len(shards) == 1:
    write(os.path.join(directory, SINGLE), shards[0])
    return [SINGLE]
  names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map, total = {}, 0
  for fname, shard in zip(names, shards):
    write(os.path.join(directory, fname), shard)
    for name, arr in shard.items():
      weight_map[name] = fname
      total += arr.nbytes
  with open(os.path.join(directory, INDEX), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
              f, indent=2)
  return names + [INDEX]
