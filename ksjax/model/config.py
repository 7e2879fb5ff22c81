"""Llama 3 hyper-parameters: the frozen `LlamaConfig`, named presets, and Hugging Face config.json.

The config is a frozen (hashable) dataclass so that it can be a static argument of `jax.jit` and a
field of frozen sampler/trainer dataclasses. It is kept apart from the modules (as in the Flax gemma
example) so that shapes, parameter counts and checkpoint validation need no model instance.

RoPE settings (`rope_theta`, `rope_scaling`) are always read from the checkpoint's config.json
(`from_hf_config`); the presets only mirror what the released checkpoints ship with, so that
`jax.eval_shape` and tests can use them without a download.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ksjax.config_validation import ConfigError

DTYPES = ("float32", "bfloat16")

# The llama3 frequency scaling of Llama 3.1 / 3.2 (as shipped in their config.json).
LLAMA31_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA32_ROPE_SCALING = {**LLAMA31_ROPE_SCALING, "factor": 32.0}

_LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape and numerics of a Llama 3 model.

  `rope_scaling` is None (plain RoPE) or a llama3 scaling dict with the keys of
  `LLAMA31_ROPE_SCALING`. It is stored as a sorted tuple of items so the config stays hashable; read
  it with `rope_scaling_dict`.
  """
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  max_position_embeddings: int = 8192
  rope_theta: float = 500000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  rms_norm_eps: float = 1e-5
  tie_embeddings: bool = False
  param_dtype: str = "float32"
  dtype: str = "float32"
  # The operand dtype of the weight matmuls (q/k/v/o, the MLP, the lm head), accumulated and
  # returned in float32 and then cast to `dtype`; None: `dtype` itself (the plain path). With
  # dtype float32 and matmul_dtype bfloat16 everything else (the residual stream, norms,
  # attention over the cache, softmax) stays float32: on a CPU with bfloat16 matrix units (AMX)
  # XLA runs bfloat16-operand dots with float32 results several times faster than float32 dots,
  # while bfloat16 results, bfloat16 attention and elementwise ops are slower than float32 there
  # (benchmarks/real_model.py --parts=sample,roofline --matmul_dtypes=float32,bfloat16 times
  # both, and transformers in bfloat16). It is TPU's default matmul precision.
  matmul_dtype: str | None = None
  value_head: bool = False
  # Run the decoder blocks as a scan over layers (`Llama.through_layers`), rematerialising each in
  # the backward pass: one block's activations and gathered weights live at a time. The update,
  # the reference forward and the sampler's prefill scan; the decode step stays unrolled.
  remat: bool = False

  def __post_init__(self):
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
    validate(self)

  @property
  def operand_dtype(self) -> str:
    """The dtype the weight matmuls' operands are cast to (`matmul_dtype`, else `dtype`)."""
    return self.matmul_dtype or self.dtype

  @property
  def rope_scaling_dict(self) -> dict[str, Any] | None:
    return None if self.rope_scaling is None else dict(self.rope_scaling)

  @property
  def num_params(self) -> int:
    """Exact parameter count (embedding counted once when tied), computed from the shapes."""
    d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
    block = attn + 3 * d * f + 2 * d
    embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * block + embed + d + (d + 1 if self.value_head else 0)


  def forward_flops(self, rows: int, columns: int, logit_columns: int | None = None) -> int:
    """Model FLOPs of one forward over [rows, columns] tokens, as MFU counts them (PaLM,
    Chowdhery et al. 2022, appendix B): 2 per multiply-add of every weight matmul, the attention
    products over the full [columns, columns] square (as `layers.attend` computes them, masked),
    and the head over `logit_columns` positions (default: all). Norms, softmax and
    rematerialisation are not counted; a forward + backward update is 3 times this. Why not
    XLA's cost analysis: it counts the body of a loop once, whatever its trip count, so the
    chunked head's vocabulary loop (`logprobs.chunked_logprobs`) went uncounted."""
    d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
    weights = d * h * (2 * self.num_heads + 2 * self.num_kv_heads) + 3 * d * f
    attention = 2 * 2 * self.num_heads * h * columns * columns
    logit_columns = columns if logit_columns is None else logit_columns
    return (2 * rows * columns * weights * self.num_layers + rows * attention * self.num_layers
            + 2 * rows * logit_columns * d * self.vocab_size)

def validate(cfg: LlamaConfig) -> None:
  """Raises ConfigError naming the first field that cannot describe a Llama."""
  for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "intermediate_size", "max_position_embeddings"):
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ConfigError(f"LlamaConfig.{name}={value!r} is not accepted; expected an integer >= 1")
  if cfg.num_heads % cfg.num_kv_heads:
    raise ConfigError(f"LlamaConfig.num_heads={cfg.num_heads} is not a multiple of "
                      f"num_kv_heads={cfg.num_kv_heads}; grouped-query attention needs that")
  if cfg.head_dim % 2:
    raise ConfigError(f"LlamaConfig.head_dim={cfg.head_dim} is odd; rotary embeddings need it even")
  for name in ("param_dtype", "dtype"):
    if getattr(cfg, name) not in DTYPES:
      raise ConfigError(f"LlamaConfig.{name}={getattr(cfg, name)!r} is not accepted; expected one "
                        f"of {', '.join(map(repr, DTYPES))}")
  if cfg.matmul_dtype is not None and cfg.matmul_dtype not in DTYPES:
    raise ConfigError(f"LlamaConfig.matmul_dtype={cfg.matmul_dtype!r} is not accepted; expected "
                      f"None or one of {', '.join(map(repr, DTYPES))}")
  if not (math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0):
    raise ConfigError(f"LlamaConfig.rope_theta={cfg.rope_theta!r} is not accepted; expected > 0")
  if not (math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0):
    raise ConfigError(f"LlamaConfig.rms_norm_eps={cfg.rms_norm_eps!r} is not accepted; expected > 0")
  scaling = cfg.rope_scaling_dict
  if scaling is not None:
    if scaling.get("rope_type") != "llama3":
      raise ConfigError(f"LlamaConfig.rope_scaling={scaling!r} is not accepted; expected None or a "
                        f"llama3 scaling with rope_type='llama3' and keys {_LLAMA3_SCALING_KEYS}")
    missing = [k for k in _LLAMA3_SCALING_KEYS if k not in scaling]
    if missing:
      raise ConfigError(f"LlamaConfig.rope_scaling lacks {missing}; llama3 scaling needs "
                        f"{_LLAMA3_SCALING_KEYS}")
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
      raise ConfigError("LlamaConfig.rope_scaling: high_freq_factor must exceed low_freq_factor")


_PRESETS: dict[str, dict[str, Any]] = {
    # Tests and the CPU default; vocab_size is meant to be replaced by the tokenizer's.
    "tiny": dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=128, max_position_embeddings=2048,
                 rope_theta=10000.0, rms_norm_eps=1e-5, tie_embeddings=True),
    # ~25M parameters (with a 32k vocabulary, tied): the CPU benchmark size.
    "small25m": dict(vocab_size=32000, hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2,
                     head_dim=64, intermediate_size=1024, max_position_embeddings=2048,
                     rope_theta=10000.0, rms_norm_eps=1e-5, tie_embeddings=True),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                        num_kv_heads=8, head_dim=64, intermediate_size=8192,
                        max_position_embeddings=131072, rope_theta=500000.0,
                        rope_scaling=LLAMA32_ROPE_SCALING, tie_embeddings=True),
    "llama3.2-3b": dict(vocab_size=128256, hidden_size=3072, num_layers=28, num_heads=24,
                        num_kv_heads=8, head_dim=128, intermediate_size=8192,
                        max_position_embeddings=131072, rope_theta=500000.0,
                        rope_scaling=LLAMA32_ROPE_SCALING, tie_embeddings=True),
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, intermediate_size=14336,
                        max_position_embeddings=131072, rope_theta=500000.0,
                        rope_scaling=LLAMA31_ROPE_SCALING, tie_embeddings=False),
    "llama3.1-70b": dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                         num_kv_heads=8, head_dim=128, intermediate_size=28672,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling=LLAMA31_ROPE_SCALING, tie_embeddings=False),
}

PRESETS = tuple(_PRESETS)


def preset(name: str, **overrides: Any) -> LlamaConfig:
  """The named preset, with any field overridden (e.g. `preset("tiny", vocab_size=1000)`)."""
  if name not in _PRESETS:
    raise ConfigError(f"model preset {name!r} is not known; expected one of "
                      f"{', '.join(map(repr, PRESETS))}")
  return LlamaConfig(**{**_PRESETS[name], **overrides})


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json
# ---------------------------------------------------------------------------------------------

HF_ARCHITECTURES = ("LlamaForCausalLM",)


def from_hf_config(hf: Mapping[str, Any], *, param_dtype: str = "float32",
                   dtype: str | None = None) -> LlamaConfig:
  """Builds a LlamaConfig from a parsed config.json, refusing anything that is not a Llama.

  Accepts both spellings of RoPE settings: `rope_theta` + `rope_scaling` (checkpoints written by
  transformers < 5, including Meta's releases) and `rope_parameters` (transformers >= 5).
  """
  model_type = hf.get("model_type")
  architectures = hf.get("architectures")
  if model_type != "llama":
    raise ConfigError(f"config.json model_type={model_type!r} is not supported; expected 'llama'")
  if architectures is not None and list(architectures) != list(HF_ARCHITECTURES):
    raise ConfigError(f"config.json architectures={architectures!r} is not supported; expected "
                      f"{list(HF_ARCHITECTURES)}")
  for flag in ("attention_bias", "mlp_bias"):
    if hf.get(flag, False):
      raise ConfigError(f"config.json {flag}=true is not supported; Llama 3 has no biases")
  if hf.get("hidden_act", "silu") != "silu":
    raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r} is not supported; "
                      "expected 'silu'")
  required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size")
  missing = [k for k in required if k not in hf]
  if missing:
    raise ConfigError(f"config.json lacks {missing}")

  rope = dict(hf.get("rope_parameters") or {})
  theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
  if not rope:
    rope = dict(hf.get("rope_scaling") or {})
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "default":
    scaling = None
  elif rope_type == "llama3":
    scaling = {"rope_type": "llama3", **{k: rope[k] for k in _LLAMA3_SCALING_KEYS if k in rope}}
  else:
    raise ConfigError(f"config.json rope type {rope_type!r} is not supported; expected 'default' "
                      "or 'llama3'")

  heads = hf["num_attention_heads"]
  return LlamaConfig(
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      intermediate_size=hf["intermediate_size"],
      max_position_embeddings=hf.get("max_position_embeddings", 8192),
      rope_theta=float(theta),
      rope_scaling=scaling,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      param_dtype=param_dtype,
      dtype=dtype or param_dtype,
  )


def to_hf_config(cfg: LlamaConfig, torch_dtype: str | None = None) -> dict[str, Any]:
  """The config.json of `cfg` in the Llama 3 release spelling (read by transformers 4 and 5)."""
  return {
      "architectures": list(HF_ARCHITECTURES),
      "model_type": "llama",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "intermediate_size": cfg.intermediate_size,
      "max_position_embeddings": cfg.max_position_embeddings,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": cfg.rope_scaling_dict,
      "rms_norm_eps": cfg.rms_norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings,
      "hidden_act": "silu",
      "attention_bias": False,
      "mlp_bias": False,
      "torch_dtype": torch_dtype or cfg.param_dtype,
  }
