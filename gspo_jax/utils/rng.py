"""Every random stream of a run, named in one place.

Device streams derive from the run's key (`TrainState.key = jax.random.key(seed)`) and the
iteration, so a resumed run draws exactly what an uninterrupted one would:

  "sample"     the rollout's sampling noise at iteration `step`
  "minibatch"  the order of the rows (or groups) split into minibatches at `step`

Initialisers that draw once per run (LoRA's adapters) take `init_key(seed, stream)`.

Host streams (numpy) seed the parts of a run that happen in Python: the task tokenizer's
training corpus, the cold start's demonstration batches and its accuracy probe. The data
order of the rollouts is the task's own (`Task.train_batch(seed, step, n)`).

In multi-host runs every process derives the same streams (the same seed and step); each
then feeds only its own rows.
"""

from __future__ import annotations

import jax
import numpy as np

Array = jax.Array

# fold_in(key, 2 * step + offset): one integer per (iteration, stream), never reused.
DEVICE_STREAMS = {"sample": 0, "minibatch": 1}
HOST_STREAMS = {"tokenizer_corpus": 31_337, "sft_batches": 10_000_019, "sft_probe": 4_242_424}


def device_key(key: Array, step, stream: str) -> Array:
  """The key of `stream` at iteration `step` (an int or a traced int32 scalar)."""
  return jax.random.fold_in(key, len(DEVICE_STREAMS) * step + DEVICE_STREAMS[stream])


# Folded into key(seed) under 2**32 - 1 (the device streams' fold_in at iteration 2**31 - 1,
# never reached), then the stream's number.
INIT_STREAMS = {"lora_adapters": 0}


def init_key(seed: int, stream: str) -> Array:
  """The key of a once-per-run initialiser `stream` of the run with this seed."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 2**32 - 1),
                            INIT_STREAMS[stream])


def host_rng(seed: int, stream: str) -> np.random.Generator:
  """A numpy generator for a host-side stream of the run with this seed."""
  return np.random.default_rng([seed, HOST_STREAMS[stream]])
