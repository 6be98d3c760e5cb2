"""Model configuration: a frozen dataclass and presets (tiny CPU sizes, real Qwen3 shapes)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

DISPATCHES = ("dense", "ragged")
REMATS = ("none", "full", "dots")
# How the model runs, not what it computes: a pretrained run takes these from the user's
# `model` and everything else from the checkpoint (`run.setup`).
EXECUTION_FIELDS = ("remat", "attention_chunk", "attention_block", "moe_dispatch",
                    "matmul_dtype")
MATMUL_DTYPES = ("", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer following Qwen3 (dense and MoE); Llama-style with qk_norm=False.

  Fields use Hugging Face meanings: hidden = hidden_size, mlp_dim = intermediate_size,
  head_dim is explicit (Qwen3-0.6B has 16 x 128 != 1024), moe_mlp_dim =
  moe_intermediate_size, norm_topk_prob renormalises the top-k router weights.
  """
  vocab_size: int
  hidden: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 1e6
  rms_eps: float = 1e-6
  qk_norm: bool = True
  tie_embeddings: bool = False
  # Mixture of experts: num_experts = 0 means dense everywhere.
  num_experts: int = 0
  experts_per_token: int = 0
  moe_mlp_dim: int = 0
  norm_topk_prob: bool = True
  # Positions the model was trained for (Hugging Face max_position_embeddings): prompt +
  # response must fit. None = unchecked (RoPE runs at any position; quality there is not).
  max_positions: int | None = None
  moe_layers: tuple[int, ...] | None = None  # None: every layer is MoE when num_experts > 0
  moe_dispatch: str = "dense"                 # "dense" reference or "ragged" (jax.lax.ragged_dot)
  dtype: str = "float32"                      # activations
  param_dtype: str = "float32"
  # Every matmul's inputs (weights, and attention's q k^T and probabilities x v) rounded to
  # this dtype, products accumulated in float32, forward and backward (`models.matmul`);
  # "" = the activations' dtype. Dense models only.
  matmul_dtype: str = ""
  # Execution only (same function, same parameters up to layout):
  scan_layers: bool = False   # one lax.scan over layers stacked on a leading `layers` axis
  remat: str = "none"         # backward pass: "full" recomputes each layer, "dots" keeps matmuls
  # Teacher-forcing attention over n query positions at a time, each chunk recomputed in the
  # backward: (n x K) scores live instead of (S x K). 0 = all queries at once.
  attention_chunk: int = 0
  # Prompt-shared teacher forcing (`Transformer.extend`) over the responses' causal keys in
  # query blocks of n, each reading only the keys up to its last query: the masked upper
  # triangle's blocks are not computed ((Z + 1) / 2Z of those FLOPs, Z = ceil(T / n)).
  # 0 = one block.
  attention_block: int = 0

  def __post_init__(self):
    for name in ("vocab_size", "hidden", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "mlp_dim"):
      if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
        raise ValueError(f"ModelConfig.{name} must be a positive int; got {getattr(self, name)!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                       f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings; got {self.head_dim}")
    if self.rope_theta <= 0 or self.rms_eps <= 0:
      raise ValueError("ModelConfig.rope_theta and rms_eps must be > 0")
    if self.max_positions is not None and not (isinstance(self.max_positions, int)
                                               and self.max_positions > 0):
      raise ValueError(f"ModelConfig.max_positions must be a positive int or None; "
                       f"got {self.max_positions!r}")
    if self.moe_dispatch not in DISPATCHES:
      raise ValueError(f"ModelConfig.moe_dispatch must be one of {DISPATCHES}; got {self.moe_dispatch!r}")
    if self.num_experts:
      if not 0 < self.experts_per_token <= self.num_experts:
        raise ValueError(f"ModelConfig.experts_per_token must be in [1, num_experts={self.num_experts}]; "
                         f"got {self.experts_per_token}")
      if self.moe_mlp_dim <= 0:
        raise ValueError("ModelConfig.moe_mlp_dim must be > 0 when num_experts > 0")
      if self.moe_layers is not None and not all(0 <= i < self.num_layers for i in self.moe_layers):
        raise ValueError(f"ModelConfig.moe_layers must index layers in [0, {self.num_layers}); "
                         f"got {self.moe_layers}")
    if self.remat not in REMATS:
      raise ValueError(f"ModelConfig.remat must be one of {REMATS}; got {self.remat!r}")
    for name in ("attention_chunk", "attention_block"):
      value = getattr(self, name)
      if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"ModelConfig.{name} must be a non-negative int (0 = off); "
                         f"got {value!r}")
    if self.scan_layers and 0 < self.num_moe_layers < self.num_layers:
      raise ValueError("ModelConfig.scan_layers needs every layer alike: set moe_layers=None "
                       f"(all MoE) or scan_layers=False; got moe_layers={self.moe_layers}")
    if self.matmul_dtype not in MATMUL_DTYPES:
      raise ValueError(f"ModelConfig.matmul_dtype must be one of {MATMUL_DTYPES} (\"\" = the "
                       f"activations' dtype); got {self.matmul_dtype!r}")
    if self.matmul_dtype and self.num_experts:
      raise ValueError("ModelConfig.matmul_dtype is for dense models: an MoE's expert matmuls "
                       "(jax.lax.ragged_dot) have no narrow-input path; set model.dtype="
                       "'bfloat16' to run the whole model in bfloat16 instead")
    for name in ("dtype", "param_dtype"):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError:
        raise ValueError(f"ModelConfig.{name} is not a dtype: {getattr(self, name)!r}") from None

  @property
  def matmul(self):
    """The weight matmuls' input dtype for `models.matmul.einsum`; None (the operands'
    own, as before) when unset or equal to the activations' dtype."""
    if not self.matmul_dtype or jnp.dtype(self.matmul_dtype) == jnp.dtype(self.dtype):
      return None
    return jnp.dtype(self.matmul_dtype)

  def is_moe_layer(self, i: int) -> bool:
    if not self.num_experts:
      return False
    return self.moe_layers is None or i in self.moe_layers

  @property
  def num_moe_layers(self) -> int:
    return sum(self.is_moe_layer(i) for i in range(self.num_layers))


def tiny(**overrides) -> ModelConfig:
  """~0.3M parameters: unit tests and CPU demos. head_dim * heads != hidden on purpose."""
  base = dict(vocab_size=64, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
              mlp_dim=128, rope_theta=1e4)
  return ModelConfig(**{**base, **overrides})


def tiny_moe(**overrides) -> ModelConfig:
  """tiny() with 4 experts, top-2, in every layer."""
  base = dict(num_experts=4, experts_per_token=2, moe_mlp_dim=32)
  return tiny(**{**base, **overrides})


# The real-model presets compute in bfloat16 and keep float32 master parameters (and so
# float32 Adam moments): RL learning rates (~1e-6) move most weights by less than bfloat16's
# resolution, so a bfloat16 parameter would not change (tests/models/test_model.py shows it).
def qwen3_0_6b(**overrides) -> ModelConfig:
  """Qwen/Qwen3-0.6B shapes (documentation and abstract shape checks)."""
  base = dict(vocab_size=151936, hidden=1024, num_layers=28, num_heads=16, num_kv_heads=8,
              head_dim=128, mlp_dim=3072, rope_theta=1e6, tie_embeddings=True, dtype="bfloat16",
              param_dtype="float32")
  return ModelConfig(**{**base, **overrides})


def qwen3_1_7b(**overrides) -> ModelConfig:
  """Qwen/Qwen3-1.7B shapes (config.json: 28 layers, hidden 2048, 16/8 heads, tied)."""
  return qwen3_0_6b(**{"hidden": 2048, "mlp_dim": 6144, **overrides})


def qwen3_4b(**overrides) -> ModelConfig:
  """Qwen/Qwen3-4B shapes (config.json: 36 layers, hidden 2560, 32/8 heads, tied)."""
  return qwen3_0_6b(**{"hidden": 2560, "num_layers": 36, "num_heads": 32, "mlp_dim": 9728,
                       **overrides})


def qwen3_8b(**overrides) -> ModelConfig:
  """Qwen/Qwen3-8B shapes (config.json: 36 layers, hidden 4096, 32/8 heads, untied)."""
  return qwen3_0_6b(**{"hidden": 4096, "num_layers": 36, "num_heads": 32, "mlp_dim": 12288,
                       "tie_embeddings": False, **overrides})


def qwen3_30b_a3b(**overrides) -> ModelConfig:
  """Qwen/Qwen3-30B-A3B shapes: 48 MoE layers, 128 experts, top-8 (the paper's model)."""
  base = dict(vocab_size=151936, hidden=2048, num_layers=48, num_heads=32, num_kv_heads=4,
              head_dim=128, mlp_dim=6144, rope_theta=1e6, num_experts=128, experts_per_token=8,
              moe_mlp_dim=768, norm_topk_prob=True, moe_dispatch="ragged", dtype="bfloat16",
              param_dtype="float32")
  return ModelConfig(**{**base, **overrides})


PRESETS = {"tiny": tiny, "tiny_moe": tiny_moe, "qwen3_0_6b": qwen3_0_6b,
           "qwen3_1_7b": qwen3_1_7b, "qwen3_4b": qwen3_4b, "qwen3_8b": qwen3_8b,
           "qwen3_30b_a3b": qwen3_30b_a3b}
