"""Exports of a LoRA run: the merged model as a Hugging Face directory, and the adapters as a
PEFT adapter directory that `peft.PeftModel.from_pretrained(base, directory)` loads onto the
Hugging Face base.

    python -m gspo_jax.lora.adapters.export --run runs/addition_tiny_lora --merged out/merged
    python -m gspo_jax.lora.adapters.export --run runs/x --peft out/adapter --base-model Qwen/Qwen3-0.6B

PEFT's layout (`peft.tuners.lora`): for a projection y = x W^T of HF shape (O, I), a LoRA
layer adds (alpha / r) * x A^T B^T with `lora_A.weight` (r, I) and `lora_B.weight` (O, r),
named `base_model.model.<HF module>.lora_{A,B}.weight`. Ours are A (I..., r) and
B (r, O...) in the weight's own axis order (`gspo_jax.lora.adapters`), and the HF projections
flatten those axes in the same order (`models.hf.tensor_map`), so lora_A = A flattened and
transposed, lora_B = B flattened and transposed.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np
from flax import nnx

from gspo_jax.lora import adapters as lora
from gspo_jax.models import hf, safetensors_io
from gspo_jax.parallel import sharding

# Our target -> its Hugging Face module inside a decoder layer.
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}


def merged_params(run):
  """The policy's parameters with the adapters merged in (`lora.merge`, one jitted program;
  the arrays keep the base's shardings)."""
  merge = jax.jit(lambda base, adapters: lora.merge(base, adapters, run.frozen.scale),
                  out_shardings=run.frozen.layout.state.params)
  return merge(run.frozen.params, run.state.params)


def save_merged(run, directory: str) -> list[str]:
  """The merged policy as a Hugging Face directory (`models.hf.save`): loads with
  `hf.load`, `python -m gspo_jax.generate` and transformers, no adapter code needed."""
  return hf.save(nnx.merge(run.graphdef, merged_params(run)), directory)


def peft_tensors(adapters, cfg) -> dict[str, np.ndarray]:
  """PEFT's tensors of `adapters` (an unrolled or scanned model's): {name: array}."""
  out = {}
  for path, var in nnx.to_flat_state(adapters):
    value = np.asarray(jax.device_get(_gathered(var.get_value())))
    *weight, part = path
    target = next(t for t, (where, _) in lora.TARGETS.items() if where == tuple(weight[-2:]))
    layers = ([(weight[1], value)] if isinstance(weight[1], int)
              else list(enumerate(value)))  # scanned: the leading axis is the layer
    for i, x in layers:
      name = f"base_model.model.model.layers.{i}.{HF_MODULES[target]}"
      if part == lora.A:   # (I..., r) -> (r, I)
        out[f"{name}.lora_A.weight"] = np.ascontiguousarray(x.reshape(-1, x.shape[-1]).T)
      else:                # (r, O...) -> (O, r)
        out[f"{name}.lora_B.weight"] = np.ascontiguousarray(x.reshape(x.shape[0], -1).T)
  return out


def _gathered(x):
  if not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(x, tiled=True)
  return x


def peft_config(cfg, base_model: str) -> dict:
  """adapter_config.json: PEFT's LoraConfig for `cfg.lora` (scale lora_alpha / r, as ours)."""
  lc = cfg.lora
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
          "r": lc.rank, "lora_alpha": lc.alpha, "lora_dropout": lc.dropout,
          "target_modules": sorted(HF_MODULES[t].split(".")[1] for t in lc.targets),
          "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
          "inference_mode": True, "modules_to_save": None, "init_lora_weights": True}


def save_peft(run, directory: str, base_model: str) -> list[str]:
  """adapter_model.safetensors + adapter_config.json of the run's adapters, for the Hugging
  Face base `base_model` (a hub name or directory: `pretrained`, or `save_base`'s export).
  Multi-host: every process calls it (the gathers are collective); process 0 writes."""
  tensors = peft_tensors(run.state.params, run.cfg)
  if jax.process_index() == 0:
    os.makedirs(directory, exist_ok=True)
    safetensors_io.write(os.path.join(directory, "adapter_model.safetensors"), tensors)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
      json.dump(peft_config(run.cfg, base_model), f, indent=2)
  sharding.barrier("peft-save")
  return ["adapter_model.safetensors", "adapter_config.json"]


def save_base(run, directory: str) -> list[str]:
  """The frozen base as a Hugging Face directory: what a PEFT adapter of a run whose base
  is its cold start (not a `pretrained` directory) loads onto."""
  return hf.save(nnx.merge(run.graphdef, run.frozen.weights()), directory)


def main(argv=None):
  parser = argparse.ArgumentParser(description="export a LoRA run: merged HF model, PEFT adapter")
  parser.add_argument("--run", required=True, help="the run directory")
  parser.add_argument("--step", type=int, default=None, help="default: the newest checkpoint")
  parser.add_argument("--merged", default=None, help="write the merged model here")
  parser.add_argument("--peft", default=None, help="write the PEFT adapter directory here")
  parser.add_argument("--base-model", default=None,
                      help="the adapter's base for --peft (default: the run's `pretrained`; a "
                      "run whose base is its cold start writes that base to <peft>/base)")
  args = parser.parse_args(argv)
  if not (args.merged or args.peft):
    raise SystemExit("lora_export: give --merged DIR and/or --peft DIR")
  from gspo_jax.train.run import load_run
  run = load_run(args.run, args.step)
  if run.frozen is None:
    raise SystemExit(f"lora_export: {args.run} is not a LoRA run (lora.rank = 0)")
  if args.merged:
    save_merged(run, args.merged)
    print(f"merged model written to {args.merged}")
  if args.peft:
    base = args.base_model or run.cfg.pretrained
    if not base:
      base = os.path.join(args.peft, "base")
      save_base(run, base)
    save_peft(run, args.peft, base)
    print(f"PEFT adapter written to {args.peft} (base: {base})")


if __name__ == "__main__":
  main()
