"""Rotary position embeddings, half-split as in Hugging Face, with the llama3 frequency scaling.

Half-split means the rotated pairs are (x[i], x[i + head_dim/2]) rather than neighbours (x[2i],
x[2i+1]). Hugging Face checkpoints store q/k projections in this layout, so importing them needs only
a transpose and a reshape, never a permutation of rows.

Everything is computed in float32 in the same order of operations as transformers
(`_compute_llama3_parameters`, `LlamaRotaryEmbedding.forward`, `apply_rotary_pos_emb`), which is what
the 1e-5 parity test relies on.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@functools.lru_cache(maxsize=16)
def inverse_frequencies(head_dim: int, theta: float,
                        scaling: tuple[tuple[str, Any], ...] | None = None) -> np.ndarray:
  """float32 [head_dim/2] rotation speeds; `scaling` is None or llama3 rope_scaling items.

  `scaling` is given as sorted (key, value) items (as stored in LlamaConfig) so results can be
  cached per config.
  """
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
  if scaling is None:
    return inv_freq
  scaling = dict(scaling)
  factor = scaling["factor"]
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_context = scaling["original_max_position_embeddings"]
  low_freq_wavelen = old_context / low
  high_freq_wavelen = old_context / high
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths (low frequencies) are slowed by `factor`; short ones are kept; in between the
  # two are blended linearly in 1/wavelength.
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  smooth = (old_context / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def cos_sin(positions_bt: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """float32 cos and sin tables [B, T, head_dim] for integer positions [B, T]."""
  freqs_btf = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  emb_bth = jnp.concatenate([freqs_btf, freqs_btf], axis=-1)
  return jnp.cos(emb_bth), jnp.sin(emb_bth)


def apply(x_btnh: jax.Array, cos_bth: jax.Array, sin_bth: jax.Array) -> jax.Array:
  """Rotates q or k [B, T, heads, head_dim] (any float dtype; the result keeps it)."""
  half = x_btnh.shape[-1] // 2
  rotated = jnp.concatenate([-x_btnh[..., half:], x_btnh[..., :half]], axis=-1)
  cos, sin = cos_bth[:, :, None, :], sin_bth[:, :, None, :]
  return (x_btnh * cos.astype(x_btnh.dtype) + rotated * sin.astype(x_btnh.dtype))
