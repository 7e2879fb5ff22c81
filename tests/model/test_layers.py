"""Per-module parity with transformers' Llama modules (levanter's tolerances).

RMSNorm 1e-6, RoPE (cos/sin tables and rotated q, k) 1e-5, attention with a left-padding mask 1e-4,
SwiGLU MLP 1e-5, all float32, on random inputs and random weights copied across.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama as hf_llama  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from ksjax import model  # noqa: E402
from ksjax.model import layers, rope  # noqa: E402

B, T = 2, 9
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}


def _hf_config(kv_heads=2, scaling=None, theta=10000.0):
  return transformers.LlamaConfig(
      vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, rope_theta=theta,
      # transformers edits the dict it is given; pass a copy.
      rope_scaling=dict(scaling) if scaling else None, max_position_embeddings=256, attn_implementation="eager")


def _ours(hf_config):
  return model.from_hf_config(hf_config.to_dict())


def _x(*shape, seed=0):
  return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def _t(x):
  return torch.tensor(np.asarray(x))


def test_rmsnorm():
  hf = hf_llama.LlamaRMSNorm(64, eps=1e-5)
  with torch.no_grad():
    hf.weight.copy_(_t(_x(64, seed=1)))
  ours = layers.RMSNorm(64, 1e-5, "float32")
  ours.scale[...] = jnp.asarray(_x(64, seed=1))
  x = _x(B, T, 64) * 3
  np.testing.assert_allclose(ours(jnp.asarray(x)), hf(_t(x)).detach().numpy(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("scaling,theta", [(None, 10000.0), (SCALING, 500000.0)])
def test_rope_tables_and_rotation(scaling, theta):
  config = _hf_config(scaling=scaling, theta=theta)
  cfg = _ours(config)
  assert cfg.rope_theta == theta and cfg.rope_scaling_dict == scaling
  positions = np.array([np.arange(T) + 200, np.maximum(np.arange(T) - 3, 0)])  # long + padded
  x = _t(_x(B, T, 16))
  cos, sin = hf_llama.LlamaRotaryEmbedding(config)(x, _t(positions))
  inv_freq = rope.inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
  our_cos, our_sin = rope.cos_sin(jnp.asarray(positions), inv_freq)
  np.testing.assert_allclose(our_cos, cos.numpy(), atol=1e-5, rtol=0)
  np.testing.assert_allclose(our_sin, sin.numpy(), atol=1e-5, rtol=0)
  q, k = _x(B, 4, T, 16, seed=2), _x(B, 2, T, 16, seed=3)  # HF layout [B, heads, T, H]
  hq, hk = hf_llama.apply_rotary_pos_emb(_t(q), _t(k), cos, sin)
  to_ours = lambda a: jnp.asarray(a.transpose(0, 2, 1, 3))
  np.testing.assert_allclose(rope.apply(to_ours(q), our_cos, our_sin),
                             hq.numpy().transpose(0, 2, 1, 3), atol=1e-5, rtol=0)
  np.testing.assert_allclose(rope.apply(to_ours(k), our_cos, our_sin),
                             hk.numpy().transpose(0, 2, 1, 3), atol=1e-5, rtol=0)


def test_llama3_scaling_slows_only_low_frequencies():
  plain = rope.inverse_frequencies(64, 500000.0, None)
  scaled = rope.inverse_frequencies(64, 500000.0, tuple(sorted(SCALING.items())))
  assert scaled[0] == plain[0]                              # highest frequency kept
  np.testing.assert_allclose(scaled[-1], plain[-1] / 8.0)   # lowest slowed by `factor`
  assert np.all(scaled <= plain)


def _attention_pair(kv_heads):
  """transformers' LlamaAttention and ours with the same weights, a left-padded batch (row 1
  starts at column 4), its causal mask as both take it, and both rotary tables."""
  config = _hf_config(kv_heads=kv_heads)
  cfg = _ours(config)
  torch.manual_seed(0)
  hf = hf_llama.LlamaAttention(config, layer_idx=0)
  ours = layers.Attention(cfg, nnx.Rngs(0))
  d, n, k, h = 64, 4, kv_heads, 16
  ours.q_proj[...] = jnp.asarray(hf.q_proj.weight.detach().numpy().T.reshape(d, n, h))
  ours.k_proj[...] = jnp.asarray(hf.k_proj.weight.detach().numpy().T.reshape(d, k, h))
  ours.v_proj[...] = jnp.asarray(hf.v_proj.weight.detach().numpy().T.reshape(d, k, h))
  ours.o_proj[...] = jnp.asarray(hf.o_proj.weight.detach().numpy().T.reshape(n, h, d))
  mask = (np.arange(T)[None] >= np.array([[0], [4]])).astype(np.int32)
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  x = _x(B, T, 64)
  cos, sin = hf_llama.LlamaRotaryEmbedding(config)(_t(x), _t(positions))
  allowed = mask[:, None, :].astype(bool) & np.tril(np.ones((T, T), bool))[None]
  additive = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None]
  our_cos, our_sin = rope.cos_sin(jnp.asarray(positions), rope.inverse_frequencies(16, 10000.0))
  run_hf = lambda x_t: hf(x_t, position_embeddings=(cos, sin), attention_mask=_t(additive))[0]
  run_ours = lambda m, x: m(x, our_cos, our_sin, jnp.asarray(allowed))
  return hf, ours, x, mask.astype(bool), run_hf, run_ours


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_attention_with_left_padding(kv_heads):
  hf, ours, x, real, run_hf, run_ours = _attention_pair(kv_heads)
  with torch.no_grad():
    ref = run_hf(_t(x))
  out = run_ours(ours, jnp.asarray(x))
  np.testing.assert_allclose(np.asarray(out)[real], ref.numpy()[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attention_gradients_match_torch_autograd(kv_heads):
  """The hand-written attention backward (`layers._grouped_attention`) and the projections'
  gradients against torch's autograd through LlamaAttention, for a random linear function of
  the real (not left-padding) positions' outputs."""
  hf, ours, x, real, run_hf, run_ours = _attention_pair(kv_heads)
  dy = _x(B, T, 64, seed=1) * real[..., None]
  x_t = _t(x).requires_grad_()
  (run_hf(x_t) * _t(dy)).sum().backward()
  dx, dparams = jax.grad(lambda x, m: (run_ours(m, x) * dy).sum(), argnums=(0, 1))(
      jnp.asarray(x), ours)
  np.testing.assert_allclose(dx, x_t.grad.numpy(), atol=1e-5, rtol=1e-4)
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    want = getattr(hf, name).weight.grad.numpy().T
    np.testing.assert_allclose(np.asarray(getattr(dparams, name)[...]).reshape(want.shape), want,
                               atol=1e-4, rtol=1e-4, err_msg=name)


def test_mlp():
  config = _hf_config()
  torch.manual_seed(1)
  hf = hf_llama.LlamaMLP(config).eval()
  ours = layers.MLP(_ours(config), nnx.Rngs(0))
  for name in ("gate_proj", "up_proj", "down_proj"):
    getattr(ours, name)[...] = jnp.asarray(getattr(hf, name).weight.detach().numpy().T)
  x = _x(B, T, 64)
  with torch.no_grad():
    ref = hf(_t(x)).numpy()
  np.testing.assert_allclose(ours(jnp.asarray(x)), ref, atol=1e-5, rtol=0)


def test_mlp_gradients_match_torch_autograd():
  """`layers.swiglu`'s hand-written backward against torch's autograd through LlamaMLP: the
  input's and all three weights' gradients of a random linear function of the output."""
  config = _hf_config()
  torch.manual_seed(2)
  hf = hf_llama.LlamaMLP(config)
  ours = layers.MLP(_ours(config), nnx.Rngs(0))
  for name in ("gate_proj", "up_proj", "down_proj"):
    getattr(ours, name)[...] = jnp.asarray(getattr(hf, name).weight.detach().numpy().T)
  x, dy = _x(B, T, 64), _x(B, T, 64, seed=1)
  x_t = _t(x).requires_grad_()
  (hf(x_t) * _t(dy)).sum().backward()
  dx, dparams = jax.grad(lambda x, m: (m(x) * dy).sum(), argnums=(0, 1))(jnp.asarray(x), ours)
  np.testing.assert_allclose(dx, x_t.grad.numpy(), atol=1e-5, rtol=1e-5)
  for name in ("gate_proj", "up_proj", "down_proj"):
    np.testing.assert_allclose(getattr(dparams, name)[...],
                               getattr(hf, name).weight.grad.numpy().T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"])
def test_swiglu_backward_equals_autodiff(matmul_dtype):
  """The hand-written backward equals JAX's autodiff of the same forward, also with bfloat16
  operands and float32 accumulation (tests/model/test_matmul_layouts.py checks that case against
  the rounded operands' products at bfloat16's own tolerance)."""
  x, dy = jnp.asarray(_x(B, T, 64)), jnp.asarray(_x(B, T, 64, seed=1))
  ws = [jnp.asarray(_x(*shape, seed=s) * 0.1) for s, shape in
        enumerate([(64, 96), (64, 96), (96, 64)], start=2)]
  if matmul_dtype is None:
    mm = lambda a, w: a @ w
  else:  # `layers.project`'s product, differentiated by JAX
    mm = lambda a, w: jnp.einsum(
        "...d,df->...f", *layers.kernel_operands(a.astype(matmul_dtype), w.astype(matmul_dtype)),
        preferred_element_type=jnp.float32)
  plain = lambda x, g, u, d: mm(jax.nn.silu(mm(x, g)) * mm(x, u), d)
  fused = lambda x, g, u, d: layers.swiglu(x, g, u, d, jnp.float32, matmul_dtype)
  np.testing.assert_array_equal(fused(x, *ws), plain(x, *ws))
  grads = lambda f: jax.grad(lambda *a: (f(*a) * dy).sum(), argnums=(0, 1, 2, 3))(x, *ws)
  tol = 1e-5 if matmul_dtype is None else 2e-2  # bfloat16 operands round each product's inputs
  for got, want in zip(grads(fused), grads(plain)):
    np.testing.assert_allclose(got, want, atol=tol * float(jnp.abs(want).max()), rtol=0)
