"""Hugging Face checkpoints: load Qwen3, Qwen3-MoE and Llama directories into our
Transformer, and export ours back in the same layout.

Layout (HF stores every projection as (out, in), y = x @ W.T; ours are (in, ...out)):

  HF name (model.layers.i. ...)          HF shape           ours                       our shape
  embed_tokens.weight (no layers.i)      (V, D)             embed                      (V, D)
  self_attn.q_proj.weight                (N*H, D)           layers.i.attn.q            (D, N, H)
  self_attn.{k,v}_proj.weight            (C*H, D)           layers.i.attn.{k,v}        (D, C, H)
  self_attn.o_proj.weight                (D, N*H)           layers.i.attn.o            (N, H, D)
  self_attn.{q,k}_norm.weight            (H,)               layers.i.attn.{q,k}_norm   (H,)
  input_layernorm / post_attention_layernorm                layers.i.attn_norm / mlp_norm
  mlp.{gate,up}_proj.weight              (I, D)             layers.i.mlp.{gate,up}     (D, I)
  mlp.down_proj.weight                   (D, I)             layers.i.mlp.down          (I, D)
  mlp.gate.weight (MoE router)           (E, D)             layers.i.mlp.router        (D, E)
  mlp.experts.e.{gate,up}_proj.weight    (M, D) per e       layers.i.mlp.{gate,up}     (E, D, M)
  mlp.experts.e.down_proj.weight         (D, M) per e       layers.i.mlp.down          (E, M, D)
  norm.weight, lm_head.weight            (D,), (V, D)       final_norm, lm_head        (D,), (D, V)

Tied embeddings: no lm_head.weight in the file. Each tensor is read from a memory map,
converted, and placed directly in its target sharding (`jax.make_array_from_callback`),
one tensor at a time, so a checkpoint is never held whole on one host.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax.models import safetensors_io
from gspo_jax.models.config import EXECUTION_FIELDS, ModelConfig
from gspo_jax.models.transformer import Transformer
from gspo_jax.parallel import sharding as sharding_lib

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "llama": "LlamaForCausalLM"}


class CheckpointError(ValueError):
  """A model directory we cannot load (the message names the file, field or tensor)."""


# ------------------------------------------------------------------------------ config


def _get(hf: dict, *names, default=None):
  """The first of several spellings present (transformers 4.x vs 5.x)."""
  for name in names:
    if name in hf and hf[name] is not None:
      return hf[name]
  return default


def config_from_hf(hf: dict, *, param_dtype: str | None = None, dtype: str | None = None,
                   source: str = "config.json") -> ModelConfig:
  """ModelConfig from a Hugging Face config dict; unsupported options are errors."""
  kind = hf.get("model_type")
  if kind not in ARCHITECTURES:
    raise CheckpointError(f"{source}: model_type {kind!r} is not supported (supported: "
                          f"{sorted(ARCHITECTURES)})")
  rope = hf.get("rope_parameters") or {}
  theta = _get(hf, "rope_theta", default=rope.get("rope_theta", 10000.0))
  scaling = hf.get("rope_scaling") or {}
  types = {rope.get("rope_type"), scaling.get("rope_type"), scaling.get("type")} - {None, "default"}
  rope_type = types.pop() if types else "default"  # any scaled RoPE, in either spelling, is refused
  unsupported = {
      "rope_type": (rope_type, "default"), "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
      "attention_bias": (bool(hf.get("attention_bias", False)), False),
      "mlp_bias": (bool(hf.get("mlp_bias", False)), False),
      "use_sliding_window": (bool(hf.get("use_sliding_window", False)), False)}
  for field, (got, want) in unsupported.items():
    if got != want:
      raise CheckpointError(f"{source}: {field} = {got!r} is not supported (only {want!r})")
  L = hf["num_hidden_layers"]
  stored = _get(hf, "dtype", "torch_dtype", default="float32")
  kw: dict[str, Any] = dict(
      vocab_size=hf["vocab_size"], hidden=hf["hidden_size"], num_layers=L,
      num_heads=hf["num_attention_heads"],
      num_kv_heads=_get(hf, "num_key_value_heads", default=hf["num_attention_heads"]),
      head_dim=_get(hf, "head_dim", default=hf["hidden_size"] // hf["num_attention_heads"]),
      mlp_dim=hf["intermediate_size"], rope_theta=float(theta),
      rms_eps=float(_get(hf, "rms_norm_eps", default=1e-6)), qk_norm=kind.startswith("qwen3"),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_positions=hf.get("max_position_embeddings"),
      param_dtype=param_dtype or stored, dtype=dtype or param_dtype or stored)
  if kind == "qwen3_moe":
    experts = _get(hf, "num_experts", "num_local_experts")
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or [])
    kw.update(num_experts=experts, experts_per_token=hf["num_experts_per_tok"],
              moe_mlp_dim=hf["moe_intermediate_size"],
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
              moe_layers=tuple(i for i in range(L) if i not in dense and (i + 1) % step == 0))
  try:
    return ModelConfig(**kw)
  except ValueError as e:
    raise CheckpointError(f"{source}: {e}") from None


def config_to_hf(cfg: ModelConfig) -> dict:
  """The config.json of our model (written with the transformers 5 spellings)."""
  kind = "qwen3_moe" if cfg.num_experts else ("qwen3" if cfg.qk_norm else "llama")
  if kind == "llama" and cfg.num_experts:
    raise CheckpointError("an MoE model without q/k norm has no Hugging Face architecture here")
  hf = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "dtype": cfg.param_dtype, "max_position_embeddings": cfg.max_positions or 40960}
  if kind == "llama":
    hf["mlp_bias"] = False
  if cfg.num_experts:
    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    hf.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
              moe_intermediate_size=cfg.moe_mlp_dim, norm_topk_prob=cfg.norm_topk_prob,
              decoder_sparse_step=1, mlp_only_layers=[i for i, m in enumerate(moe) if not m])
  return hf


# ------------------------------------------------------------------------------ tensor map


def _attn(name):
  return f"self_attn.{name}.weight"


def tensor_map(cfg: ModelConfig) -> Iterator[tuple[tuple, tuple[str, ...], Callable, Callable]]:
  """(our state path, HF names, to_ours(*hf arrays), to_hf(ours) -> tuple of hf arrays)."""
  D, N, C, H = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  same = (lambda x: x, lambda x: (x,))
  yield ("embed",), ("model.embed_tokens.weight",), *same
  yield ("final_norm", "weight"), ("model.norm.weight",), *same
  if not cfg.tie_embeddings:
    yield ("lm_head",), ("lm_head.weight",), lambda w: w.T, lambda x: (x.T,)
  for i in range(cfg.num_layers):
    pre, ours = f"model.layers.{i}.", ("layers", i)
    yield (*ours, "attn_norm", "weight"), (pre + "input_layernorm.weight",), *same
    yield (*ours, "mlp_norm", "weight"), (pre + "post_attention_layernorm.weight",), *same
    yield ((*ours, "attn", "q"), (pre + _attn("q_proj"),),
           lambda w: w.T.reshape(D, N, H), lambda x: (x.reshape(D, N * H).T,))
    for kv in ("k", "v"):
      yield ((*ours, "attn", kv), (pre + _attn(f"{kv}_proj"),),
             lambda w: w.T.reshape(D, C, H), lambda x: (x.reshape(D, C * H).T,))
    yield ((*ours, "attn", "o"), (pre + _attn("o_proj"),),
           lambda w: w.T.reshape(N, H, D), lambda x: (x.reshape(N * H, D).T,))
    if cfg.qk_norm:
      for qk in ("q_norm", "k_norm"):
        yield (*ours, "attn", qk, "weight"), (pre + _attn(qk),), *same
    if cfg.is_moe_layer(i):
      E = cfg.num_experts
      yield ((*ours, "mlp", "router"), (pre + "mlp.gate.weight",), lambda w: w.T, lambda x: (x.T,))
      for proj in ("gate", "up", "down"):
        names = tuple(f"{pre}mlp.experts.{e}.{proj}_proj.weight" for e in range(E))
        yield ((*ours, "mlp", proj), names,
               lambda *ws: np.stack([w.T for w in ws]), lambda x: tuple(w.T for w in x))
    else:
      for proj in ("gate", "up", "down"):
        yield ((*ours, "mlp", proj), (f"{pre}mlp.{proj}_proj.weight",), lambda w: w.T,
               lambda x: (x.T,))


def stacked_tensor_map(cfg: ModelConfig):
  """`tensor_map` grouped by our state path: (path, stacked, [(HF names, to_ours), ...]).
  Unrolled: one entry per path. Scanned (`cfg.scan_layers`): a layer weight's path drops
  the layer index and lists the L layers' entries in order (`stacked`)."""
  groups: dict[tuple, list] = {}
  unrolled = dataclasses.replace(cfg, scan_layers=False)
  for path, names, to_ours, _ in tensor_map(unrolled):
    key = (path[0], *path[2:]) if cfg.scan_layers and path[0] == "layers" else path
    groups.setdefault(key, []).append((names, to_ours))
  for path, entries in groups.items():
    yield path, cfg.scan_layers and path[0] == "layers", entries


# ------------------------------------------------------------------------------ load / save


def read_config(directory: str) -> dict:
  path = os.path.join(directory, "config.json")
  if not os.path.exists(path):
    raise CheckpointError(f"{directory}: no config.json (is this a Hugging Face model directory?)")
  with open(path) as f:
    return json.load(f)


def model_config(directory: str, *, param_dtype: str | None = None, dtype: str | None = None,
                 execution: dict[str, Any] | None = None,
                 scan_layers: bool = False) -> ModelConfig:
  """The ModelConfig `load` builds for `directory` (its arguments as there), without
  reading any weight."""
  cfg = config_from_hf(read_config(directory), param_dtype=param_dtype, dtype=dtype,
                       source=os.path.join(directory, "config.json"))
  unknown = set(execution or {}) - set(EXECUTION_FIELDS)
  if unknown:
    raise ValueError(f"hf.load: execution takes {EXECUTION_FIELDS}; got {sorted(unknown)}")
  return dataclasses.replace(cfg, **(execution or {}), scan_layers=scan_layers)


def load(directory: str, *, mesh=None, param_dtype: str | None = None,
         dtype: str | None = None, execution: dict[str, Any] | None = None,
         scan_layers: bool = False) -> Transformer:
  """Our Transformer with the weights of a Hugging Face directory.

  Args:
    directory: holds config.json and model.safetensors (or shards + index).
    mesh: place each parameter directly in its sharding (`sharding.PARAM_RULES`); None =
      the default device.
    param_dtype, dtype: override the stored dtype (bf16 checkpoints stay bf16 by default).
    execution: values of `config.EXECUTION_FIELDS` (remat, attention_chunk, moe_dispatch,
      matmul_dtype) to run the model with; they change no parameter.
    scan_layers: load into the scanned model (`ModelConfig.scan_layers`): each weight of
      the L layers stacked on a leading `layers` axis (`stacked_tensor_map`); one stacked
      weight at a time is held on the host.
  """
  cfg = model_config(directory, param_dtype=param_dtype, dtype=dtype, execution=execution,
                     scan_layers=scan_layers)
  ckpt = safetensors_io.Checkpoint(directory)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  targets = (sharding_lib.param_shardings(abstract, mesh) if mesh is not None else None)
  flat = dict(nnx.to_flat_state(abstract))
  shard_flat = dict(nnx.to_flat_state(targets)) if targets is not None else {}
  used = set()

  def convert(names, to_ours, want_shape, path, dtype):
    arrays = [ckpt.tensor(n) for n in names]
    used.update(names)
    try:
      value = np.asarray(to_ours(*arrays), dtype=dtype)
    except ValueError as e:
      raise CheckpointError(f"{directory}: tensor {names[0]!r} has shape {arrays[0].shape}, which "
                            f"does not fit the config ({e})") from None
    if value.shape != want_shape:
      raise CheckpointError(f"{directory}: tensor {names[0]!r} has shape {arrays[0].shape}; the "
                            f"config implies {want_shape} for {'.'.join(map(str, path))}")
    return value

  for path, stacked, entries in stacked_tensor_map(cfg):
    var = flat[path]
    want = var.get_value()
    if stacked:  # the scanned model's weight: layer i's tensor at [i]
      value = np.stack([convert(names, to_ours, want.shape[1:], (*path, i), want.dtype)
                        for i, (names, to_ours) in enumerate(entries)])
    else:
      value = convert(*entries[0], want.shape, path, want.dtype)
    if path in shard_flat:
      target = shard_flat[path].get_value()
      array = jax.make_array_from_callback(value.shape, target, lambda idx, v=value: v[idx])
    else:
      array = jnp.asarray(value)
    flat[path] = var.replace(array)
  extra = [n for n in ckpt.names() if n not in used and "rotary_emb" not in n]
  if extra:
    raise CheckpointError(f"{directory}: tensors the config does not explain: {extra[:5]}"
                          f"{' ...' if len(extra) > 5 else ''}")
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save(model: Transformer, directory: str, *, max_shard_bytes: int = 5 * 2**30) -> list[str]:
  """Write `model` as a Hugging Face directory (config.json + safetensors). Multi-host:
  every process calls it; process 0 gathers each tensor and writes."""
  cfg = model.cfg
  flat = dict(nnx.to_flat_state(nnx.state(model)))

  def tensors():
    for path, names, _, to_hf in tensor_map(dataclasses.replace(cfg, scan_layers=False)):
      if cfg.scan_layers and path[0] == "layers":  # layer i of the stacked weight
        value = flat[(path[0], *path[2:])].get_value()[path[1]]
      else:
        value = flat[path].get_value()
      if not value.is_fully_addressable:
        from jax.experimental import multihost_utils
        value = multihost_utils.process_allgather(value, tiled=True)
      for name, arr in zip(names, to_hf(np.asarray(value))):
        yield name, np.ascontiguousarray(arr)

  files = []
  if jax.process_index() == 0:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
      json.dump(config_to_hf(cfg), f, indent=2)
    files = ["config.json", *safetensors_io.write_sharded(directory, tensors(), max_shard_bytes)]
  else:
    for _ in tensors():  # the gathers are collective: every process takes part
      pass
  sharding_lib.barrier("hf-save")
  return files
