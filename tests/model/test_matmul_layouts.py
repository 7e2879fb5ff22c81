"""The hand-written backward passes of the weight products with bfloat16 operands
(`layers._mixed_matmul`, `layers.swiglu`, the chunked head's `logprobs._chunks_bwd`), and the
row-major transposed copies (`layers.transposed`) that put their products on XLA:CPU's library
kernels.

The float32 arithmetic is checked against JAX's autodiff at float32 tolerances. With bfloat16
operands a backward pass rounds its operands (the cotangent among them) and accumulates in
float32, so it is checked against the float64 products of the same rounded operands, by
tests/support/tolerances.py's derivation; the unrounded float64 products tell what rounding
moves.
"""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ksjax import model
from ksjax.model import layers, logprobs, sharding
from tests.support import tolerances

BF16 = jnp.bfloat16
F32 = jnp.float32


def rounded(x) -> np.ndarray:
  """x with bfloat16's precision, in float64."""
  return np.asarray(jnp.asarray(x, F32).astype(BF16).astype(F32), np.float64)


def f64(x) -> np.ndarray:
  return np.asarray(x, np.float64)


@pytest.mark.parametrize("shape", [(6, 4), (5, 7), (7, 5), (1, 9), (3, 2, 6, 10), (2, 11, 13)])
def test_transposed_swaps_the_last_two_axes(shape):
  x = jnp.arange(np.prod(shape), dtype=F32).reshape(shape)
  np.testing.assert_array_equal(layers.transposed(x), jnp.swapaxes(x, -1, -2))


def _operands(m=48, k=40, n=24, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape), F32) for shape in ((m, k), (k, n), (m, n)))


def test_mixed_matmul_backward_is_autodiffs_with_float32_operands():
  x, w, dy = _operands()
  grads = lambda f: jax.grad(lambda x, w: (f(x, w) * dy).sum(), argnums=(0, 1))(x, w)
  got = grads(lambda x, w: layers._mixed_matmul(x, w, jnp.dtype(F32), jnp.dtype(F32)))
  want = grads(lambda x, w: jnp.dot(x, w, preferred_element_type=F32))
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_project_backward_with_bfloat16_operands_is_the_rounded_operands_product():
  """dx = r(dy) r(w)^T and dw = r(x)^T r(dy), r the rounding to bfloat16, accumulated in float32;
  also through the einsum form the attention projections use ([B, T, D] x [D, N, H])."""
  x, w, dy = _operands(m=2 * 24, k=40, n=6 * 4)
  x_btd, w_dnh, dy_btnh = x.reshape(2, 24, 40), w.reshape(40, 6, 4), dy.reshape(2, 24, 6, 4)
  got = jax.grad(lambda x, w: (layers.project(x, w, F32, "bfloat16", "btd,dnh->btnh")
                               * dy_btnh).sum(), argnums=(0, 1))(x_btd, w_dnh)
  xr, wr, dyr = rounded(x), rounded(w), rounded(dy)
  want = (dyr @ wr.T, xr.T @ dyr)
  unrounded = (f64(dy) @ f64(w).T, f64(x).T @ f64(dy))
  for g, r, u in zip(got, want, unrounded):
    tolerances.assert_same_bfloat16_computation(np.reshape(g, r.shape), r, u, float32_atol=1e-5)


def _swiglu_reference(x, gate, up, down, dy, r):
  """`layers.swiglu`'s gradients (x, gate, up, down) in float64, with `r` applied to every
  product's operands (r = rounded: bfloat16 operands; r = f64: float32 ones)."""
  x, gate, up, down, dy = (f64(a) for a in (x, gate, up, down, dy))
  g, u = r(x) @ r(gate), r(x) @ r(up)
  sig = 1 / (1 + np.exp(-g))
  silu = g * sig
  dhidden = r(dy) @ r(down).T
  dg = dhidden * u * sig * (1 + g * (1 - sig))
  du = dhidden * silu
  return (r(dg) @ r(gate).T + r(du) @ r(up).T, r(x).T @ r(dg), r(x).T @ r(du),
          r(silu * u).T @ r(dy))


def test_swiglu_backward_with_bfloat16_operands_is_the_rounded_operands_product():
  rng = np.random.default_rng(1)
  x, dy = rng.standard_normal((2, 24, 40)), rng.standard_normal((2, 24, 40))
  gate, up, down = (rng.standard_normal(s) * 0.3 for s in ((40, 56), (40, 56), (56, 40)))
  args = [jnp.asarray(a, F32) for a in (x, gate, up, down)]
  got = jax.grad(lambda *a: (layers.swiglu(*a, F32, "bfloat16") * dy).sum(),
                 argnums=(0, 1, 2, 3))(*args)
  m = lambda a: np.reshape(a, (48, -1))
  want = _swiglu_reference(m(x), gate, up, down, m(dy), rounded)
  unrounded = _swiglu_reference(m(x), gate, up, down, m(dy), f64)
  for g, r, u in zip(got, want, unrounded):
    tolerances.assert_same_bfloat16_computation(np.reshape(g, r.shape), r, u, float32_atol=1e-5)


CFG = model.preset("tiny")


def _head_reference(h, w_vd, targets, weights, entropy_weight, r):
  """The gradient (h, W [V, D]) of sum(weights * log p[target]) + entropy_weight * sum(H) for
  p = softmax(r(h) r(W)^T), in float64, the backward's products taking r() of their operands
  (r = rounded: bfloat16 operands; r = f64: float32 ones). h's gradient is r() of its product
  too: it is the cotangent of h cast to the operand dtype."""
  h, w_vd = f64(h), f64(w_vd)
  z = r(h) @ r(w_vd).T
  top = z.max(-1, keepdims=True)
  lse = np.log(np.exp(z - top).sum(-1, keepdims=True)) + top
  p = np.exp(z - lse)
  entropy = lse - (p * z).sum(-1, keepdims=True)
  onehot = np.eye(z.shape[-1])[targets]
  dz = (f64(weights)[..., None] * (onehot - p)
        - entropy_weight * p * (z - lse + entropy))  # d log p[t] / dz and dH / dz
  return r(r(dz) @ r(w_vd)), np.einsum("bnv,bnd->vd", r(dz), r(h))


@pytest.mark.parametrize("vocab_axis", [0, 1])
def test_bfloat16_head_gradient_when_its_loops_have_one_trip(vocab_axis):
  """With one sequence chunk and one vocabulary slice (the tiny default model's head: loops XLA
  removes), the bfloat16-operand gradient of `chunked_logprobs` crashed XLA:CPU ("Unsupported
  element type for DotThunk::Execute: BF16 x BF16 = F32": the weight gradient's transposed
  operand, no longer hidden by a loop, was folded into its product). It is the product of the
  rounded operands."""
  rng = np.random.default_rng(0)
  v, d = CFG.vocab_size, CFG.hidden_size
  h = rng.standard_normal((2, 12, d))
  w_vd = rng.standard_normal((v, d)) * 0.3
  targets = rng.integers(0, v, (2, 12))
  weights = rng.standard_normal((2, 12))
  w = w_vd if vocab_axis == 0 else w_vd.T

  def loss(h, w):
    logp, ent = logprobs.chunked_logprobs(h, w, vocab_axis, jnp.asarray(targets, jnp.int32),
                                          seq_chunk=64, vocab_chunk=v, operand_dtype="bfloat16")
    return (jnp.asarray(weights, F32) * logp).sum() + 0.1 * ent.sum()

  dh, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(h, F32), jnp.asarray(w, F32))
  dw_vd = dw if vocab_axis == 0 else dw.T
  want = _head_reference(h, w_vd, targets, weights, 0.1, rounded)
  unrounded = _head_reference(h, w_vd, targets, weights, 0.1, f64)
  for got, r, u in zip((dh, dw_vd), want, unrounded):
    tolerances.assert_same_bfloat16_computation(got, r, u, float32_atol=1e-6)


def _model_gradient(matmul_dtype, seq_chunk, vocab_chunk):
  """The tiny model's parameter gradient of a weighted sum of its token log-probs and
  entropies, each leaf flattened, in one float64 vector."""
  llama = model.Llama(dataclasses.replace(CFG, matmul_dtype=matmul_dtype), rngs=nnx.Rngs(3))
  rng = np.random.RandomState(0)
  tokens = jnp.asarray(rng.randint(0, CFG.vocab_size, (2, 13)), jnp.int32)
  mask = jnp.asarray(np.arange(13)[None] >= np.array([[0], [3]]), jnp.int32)
  weights = jnp.asarray(rng.standard_normal((2, 13)), F32)

  def loss(m):
    logp, ent = model.token_logprobs(m, tokens, mask, seq_chunk=seq_chunk, vocab_chunk=vocab_chunk)
    return (weights * logp).sum() + 0.1 * ent.sum()

  grads = nnx.jit(nnx.grad(loss))(llama)
  return np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in jax.tree.leaves(grads)])


@pytest.mark.slow  # three compilations of the whole model's gradient, about 20 s
def test_bfloat16_update_of_the_tiny_model_when_the_head_loops_have_one_trip():
  """The tiny default model's update with bfloat16 operands (the crash of
  `python -m ksjax.main --config=configs/pass_at_k.py --config.model.matmul_dtype=bfloat16`):
  every layer's hand-written backward and the head's, against the same computation with the
  head cut into many trips."""
  one_trip = _model_gradient("bfloat16", seq_chunk=64, vocab_chunk=CFG.vocab_size)
  many_trips = _model_gradient("bfloat16", seq_chunk=5, vocab_chunk=96)
  unrounded = _model_gradient(None, seq_chunk=5, vocab_chunk=96)
  assert np.all(np.isfinite(one_trip))
  tolerances.assert_same_bfloat16_computation(one_trip, many_trips, unrounded, float32_atol=1e-6)


@pytest.mark.slow  # three compilations of the whole model's gradient, one on 8 devices: ~25 s
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 8, 1)])
def test_bfloat16_gradients_on_a_mesh_match_unsharded(shape):
  """The reshapes and row-major transposed copies of the bfloat16 backward passes under the
  Updater's shardings (rows over data x fsdp, heads, MLP columns and the head's vocabulary over
  tensor): the same computation as on one device, up to the summation order."""
  cfg = dataclasses.replace(CFG, tie_embeddings=False)
  rng = np.random.RandomState(0)
  tokens = jnp.asarray(rng.randint(0, cfg.vocab_size, (8, 10)), jnp.int32)
  mask = jnp.asarray(np.arange(10)[None] >= rng.randint(0, 9, (8, 1)), jnp.int32)
  weights = jnp.asarray(rng.standard_normal((8, 10)), F32)

  def loss(m, t, k):
    logp, ent = model.token_logprobs(m, t, k, seq_chunk=4, vocab_chunk=96)
    return (weights * logp).sum() + 0.1 * ent.sum()

  flat = lambda g: np.concatenate([np.ravel(np.asarray(x, np.float64))
                                   for x in jax.tree.leaves(g)])
  new = lambda md: model.Llama(dataclasses.replace(cfg, matmul_dtype=md), rngs=nnx.Rngs(3))
  want = flat(nnx.jit(nnx.grad(loss))(new("bfloat16"), tokens, mask))
  unrounded = flat(nnx.jit(nnx.grad(loss))(new(None), tokens, mask))
  mesh = model.make_mesh(shape)
  data = sharding.batch_sharding(mesh)

  def on_mesh(m, t, k):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return nnx.grad(loss)(m, t, k)

  got = flat(nnx.jit(on_mesh)(model.shard(new("bfloat16"), mesh), jax.device_put(tokens, data),
                              jax.device_put(mask, data)))
  tolerances.assert_same_bfloat16_computation(got, want, unrounded, float32_atol=1e-5)


@pytest.mark.parametrize("lacks", [True, False])
def test_bfloat16_products_widen_their_operands_only_on_cpus_without_bfloat16_dots(
    monkeypatch, lacks):
  """`layers.kernel_operands`: on a CPU without bfloat16 dot instructions every bfloat16 product
  of `project` (forward and both gradients) and of the head runs on float32 operands, elsewhere on
  bfloat16 ones; either way it is the product of the bfloat16-rounded operands, accumulated in
  float32 (checked against float64 at bfloat16 tolerances)."""
  monkeypatch.setitem(layers.machine._LACKS_BF16_DOTS, "/proc/cpuinfo", lacks)
  x, w, dy = _operands(m=32, k=64, n=16)
  f = lambda x, w: layers.project(x, w, "float32", "bfloat16")
  loss = lambda x, w: (f(x, w) * dy).sum()
  grad = jax.grad(loss, argnums=(0, 1))
  dtypes = [d for fn, args in ((grad, (x, w)), (f, (x, w)), (
      lambda h, w: model.llama.head_logits(h, w, 1, "bfloat16"), (x[None], w)))
            for d in _dot_operand_dtypes(jax.make_jaxpr(fn)(*args).jaxpr)]
  assert len(dtypes) >= 5  # forward, two gradients, forward again, head
  widened = lacks and jax.default_backend() == "cpu"
  assert set(dtypes) == {"float32" if widened else "bfloat16"}, dtypes
  rx, rw, rdy = rounded(x), rounded(w), rounded(dy)
  np.testing.assert_allclose(f(x, w), rx @ rw, rtol=1e-5, atol=1e-5)
  gx, gw = grad(x, w)
  np.testing.assert_allclose(gx, rdy @ rw.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gw, rx.T @ rdy, rtol=1e-5, atol=1e-5)


def _dot_operand_dtypes(jaxpr) -> list[str]:
  """The operand dtypes of every dot_general in a jaxpr, sub-jaxprs (custom VJPs) included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out += [str(v.aval.dtype) for v in eqn.invars]
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out += _dot_operand_dtypes(sub)
  return out
