"""The building blocks of a Llama decoder layer: RMSNorm, grouped-query attention, SwiGLU MLP.

Parameters are plain `nnx.Param`s named as in Hugging Face (`q_proj`, `gate_proj`, ...) so that the
checkpoint mapping (hf_io.py) and the partition-spec table (sharding.py, the one place where specs
live) can both refer to parameters by name. Projection kernels keep the head axis separate
(`q_proj`: [D, N, H]) so tensor parallelism splits whole heads. `ksjax.model.lora` may give the
projections low-rank adapters and quantize their weights (`Projections`).

Numerics follow transformers' eager Llama: norms and softmax in float32, everything else in the
compute dtype `cfg.dtype`, parameters stored in `cfg.param_dtype`.

Activations are pinned to their `sharding.ACTIVATION_AXES` with `sharding.constrain` (rows over the
batch axes, heads and MLP columns over tensor); without a mesh set for tracing that is a no-op.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ksjax import machine
from ksjax.model import rope
from ksjax.model.config import LlamaConfig
from ksjax.model.sharding import constrain

_INIT = nnx.initializers.normal(stddev=0.02)  # transformers' initializer_range for Llama
# Queries per attention block: the float32 scores live one [B, N, QUERY_CHUNK, S] block at a time.
QUERY_CHUNK = 256


def init_param(rngs: nnx.Rngs, shape: tuple[int, ...], cfg: LlamaConfig) -> nnx.Param:
  return nnx.Param(_INIT(rngs.params(), shape, jnp.dtype(cfg.param_dtype)))


def project(x: jax.Array, w: jax.Array, dtype: str, matmul_dtype: str | None,
            spec: str | None = None) -> jax.Array:
  """Activations times a weight matrix (`x @ w`, or the einsum `spec`), returned in `dtype`.

  Without a `matmul_dtype` (or with one equal to `dtype`) both operands are cast to `dtype`, the
  plain product. With one, both operands are cast to it and the product is accumulated and
  returned in float32, then cast to `dtype` (see `LlamaConfig.matmul_dtype` for why); a product
  that contracts x's last axis with w's leading one (`spec` None, "btd,dnh->btnh", ...) is then
  one [M, K] x [K, N] matmul with a hand-written backward (`_mixed_matmul`).
  """
  if not _is_mixed(dtype, matmul_dtype):
    w = w.astype(dtype)
    return x @ w if spec is None else jnp.einsum(spec, x, w)
  md = jnp.dtype(matmul_dtype)
  if spec is None or _contracts_last_with_leading(spec, x.ndim, w.ndim):
    k = w.shape[0]
    out_mn = _mixed_matmul(x.reshape(-1, k), w.reshape(k, -1), jnp.dtype(dtype), md)
    return out_mn.reshape(x.shape[:-1] + w.shape[1:])
  out = jnp.einsum(spec, *kernel_operands(x.astype(md), w.astype(md)),
                   preferred_element_type=jnp.float32)
  return out.astype(dtype)


def kernel_operands(*operands: jax.Array) -> tuple[jax.Array, ...]:
  """bfloat16 product operands as the dot should receive them: unchanged, or in float32 on a CPU
  without bfloat16 dot instructions (`machine.lacks_bfloat16_dots`).

  Why: there XLA:CPU emulates a bfloat16 x bfloat16 -> float32 dot, slower than the same
  shape in float32 (benchmarks/bfloat16_dots.py times both). The float32 product of two
  bfloat16 values is exact (8 + 8 significant bits fit float32's 24), so widening the operands
  first and accumulating in float32 computes the same sum of the same products; only the order
  of the summation, which differs between kernels anyway, changes. The rounding to bfloat16, the
  configured precision, is kept."""
  if (jax.default_backend() != "cpu" or not machine.lacks_bfloat16_dots()
      or any(o.dtype != jnp.bfloat16 for o in operands)):
    return operands
  return tuple(o.astype(jnp.float32) for o in operands)


def project_weights_first(x: jax.Array, w_nk: jax.Array, dtype: str,
                          matmul_dtype: str | None) -> jax.Array:
  """`project(x, w)` for a weight w [K, N] given as its transposed copy w_nk [N, K] (w's input
  axes flattened into K, its output axes into N): x [..., K] -> [..., N], the same products in
  the same dtypes, computed as (w_nk x^T)^T with the weight as the left operand.

  Why: at a few rows (a decode step's batch) XLA:CPU's dot library runs [M, K] x [K, N] far
  below its rate, and the same product with the weight on the left several times faster
  (benchmarks/real_model.py --parts=weights_first times both in the decode loop). A transpose of
  w inside the program does not serve: XLA folds it into the dot, which then runs the slow way,
  so the sampler passes transposed copies made once per call (`sampler.weights_first`). The
  result is copied row-major (`transposed`) for the same reason."""
  k = w_nk.shape[1]
  x_mk = x.reshape(-1, k)
  if _is_mixed(dtype, matmul_dtype):
    md = jnp.dtype(matmul_dtype)
    out_nm = jnp.einsum("nk,mk->nm", *kernel_operands(w_nk.astype(md), x_mk.astype(md)),
                        preferred_element_type=jnp.float32)
  else:
    out_nm = jnp.einsum("nk,mk->nm", w_nk.astype(dtype), x_mk.astype(dtype))
  return transposed(out_nm).astype(dtype).reshape(x.shape[:-1] + (w_nk.shape[0],))


def _is_mixed(dtype, matmul_dtype) -> bool:
  """Whether `project` takes `matmul_dtype` operands other than `dtype` (float32 accumulation)."""
  return matmul_dtype is not None and jnp.dtype(matmul_dtype) != jnp.dtype(dtype)


def _contracts_last_with_leading(spec: str, x_ndim: int, w_ndim: int) -> bool:
  """Whether the einsum `spec` is x [..., K] times w [K, ...] -> [..., ...] in operand order."""
  inputs, out = spec.replace(" ", "").split("->")
  xs, ws = inputs.split(",")
  return (len(xs) == x_ndim and len(ws) == w_ndim and "." not in spec and xs[-1] == ws[0]
          and out == xs[:-1] + ws[1:] and len(set(xs + ws)) == len(xs) + len(ws) - 1)


def transposed(x_mk: jax.Array) -> jax.Array:
  """x's last two axes swapped ([..., M, K] -> [..., K, M]) as a row-major copy that XLA:CPU's
  dot library takes as a product's left operand.

  Why not `x.swapaxes(-1, -2)`: XLA:CPU runs a dot on its fast library kernels (YNNPACK, the
  matrix units with bfloat16 operands) only if the left operand contracts its minor axis and
  both operands are row-major. Handed a plain transpose, it either folds it into the dot (the
  left operand contracting its major axis) or gives it a column-major layout, and the dot falls
  back to XLA's own kernel: with bfloat16 operands first converted to float32 (a float32-speed
  product), or, where a loop of one trip had hidden the transpose from that decision, not
  converted at all, and the kernel fails ("Unsupported element type for DotThunk::Execute:
  BF16 x BF16 = F32"). A transpose of a view with one axis split in two, read back as
  [..., K, M], is neither: XLA must write the copy, row-major. jax.lax has no copy with a
  layout, and an optimization barrier keeps the transpose's column-major layout (XLA converts a
  bfloat16 one to float32 besides). Where neither axis splits (both of size 1 or prime) the
  plain transpose is returned; such a product is too thin for the library and runs on XLA's own
  kernel in float32 anyway.
  """
  *batch, m, k = x_mk.shape
  nb = len(batch)
  split = _smallest_factor(k)
  if split is not None:  # [..., M, K/s, s] -> [..., K/s, s, M]
    x = x_mk.reshape(*batch, m, k // split, split)
    return x.transpose(*range(nb), nb + 1, nb + 2, nb).reshape(*batch, k, m)
  split = _smallest_factor(m)
  if split is not None:  # [..., M/s, s, K] -> [..., K, M/s, s]
    x = x_mk.reshape(*batch, m // split, split, k)
    return x.transpose(*range(nb), nb + 2, nb, nb + 1).reshape(*batch, k, m)
  return jnp.swapaxes(x_mk, -1, -2)


def _smallest_factor(n: int) -> int | None:
  """The smallest factor of n other than 1 and n, or None."""
  return next((f for f in range(2, int(n ** 0.5) + 1) if n % f == 0), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mixed_matmul(x_mk: jax.Array, w_kn: jax.Array, dtype: jnp.dtype,
                  matmul_dtype: jnp.dtype) -> jax.Array:
  """x @ w with both operands in `matmul_dtype`, accumulated in float32, returned in `dtype`.

  The backward pass is written by hand (`_mixed_matmul_bwd`) so that both gradient products run
  on XLA:CPU's library kernels with `matmul_dtype` operands (bfloat16 on the matrix units).
  Why not autodiff: it differentiated the product into a float32 cotangent times the bfloat16
  operand, which XLA converts to a float32 x float32 product, and its weight gradient contracts
  the activations' major axis, which XLA's library kernels refuse, so every backward product ran
  on float32 kernels (benchmarks/update_rate.py times both and prints each product alone). The
  residuals are both operands in `matmul_dtype`: the backward casts nothing again, and holds
  bfloat16 activations, half of float32's memory."""
  return _mixed_matmul_fwd(x_mk, w_kn, dtype, matmul_dtype)[0]


def _mixed_matmul_fwd(x_mk, w_kn, dtype, matmul_dtype):
  xm, wm = x_mk.astype(matmul_dtype), w_kn.astype(matmul_dtype)
  out = jnp.dot(*kernel_operands(xm, wm), preferred_element_type=jnp.float32).astype(dtype)
  # Zero-size stand-ins carry the primal dtypes the cotangents must have (a residual must be an
  # array).
  return out, (xm, wm, jnp.zeros(0, x_mk.dtype), jnp.zeros(0, w_kn.dtype))


def _mixed_matmul_bwd(dtype, matmul_dtype, residuals, dout_mn):
  """dx = dy w^T, a [M, N] x [K, N] product (the right operand contracting its minor axis is one
  the library takes), and dw = x^T dy with x^T copied row-major (`transposed`)."""
  xm, wm, x_like, w_like = residuals
  dym = dout_mn.astype(matmul_dtype)
  dx = jnp.einsum("mn,kn->mk", *kernel_operands(dym, wm), preferred_element_type=jnp.float32)
  dw = jnp.dot(*kernel_operands(transposed(xm), dym), preferred_element_type=jnp.float32)
  return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


_mixed_matmul.defvjp(_mixed_matmul_fwd, _mixed_matmul_bwd)


class RMSNorm(nnx.Module):
  """y = scale * x / sqrt(mean(x^2) + eps), the statistics in float32."""

  def __init__(self, dim: int, eps: float, param_dtype: str):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.dtype(param_dtype)))
    self.eps = eps

  def __call__(self, x_btd: jax.Array) -> jax.Array:
    x32 = x_btd.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x_btd.dtype) * normed.astype(x_btd.dtype)


def attend(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
           mask_bts: jax.Array) -> jax.Array:
  """Grouped-query softmax attention; query t sees key s iff mask[b, t, s]. Returns [B, T, N, H].

  The N query heads are grouped onto the K key/value heads without repeating k and v: the G = N/K
  queries of a group and their T positions are stacked into one M = G*T axis, so both products are
  batched matmuls over (b, k). Keys are laid out [B, K, H, S], so the scores are a plain matmul on
  XLA's CPU dot (under autodiff the [B, K, S, H] layout made the backward pass several times
  slower; the backward is written by hand, `_grouped_attention`, and picks its own operand
  layouts; accelerators choose their own layouts). A query row with no visible key (a left-padding
  position) gets a uniform average; its output is never used, and no gradient flows through it.
  """
  return attend_bkhs(q_btnh, k_bskh.transpose(0, 2, 3, 1), v_bskh.transpose(0, 2, 3, 1), mask_bts)


def attend_bkhs(q_btnh: jax.Array, k_bkhs: jax.Array, v_bkhs: jax.Array, mask_bts: jax.Array,
                query_chunk: int = QUERY_CHUNK, v_layout: str = "bkhs") -> jax.Array:
  """`attend` with keys already laid out [B, K, H, S], as the KV cache stores them, and values
  [B, K, H, S] or, with v_layout="bksh", [B, K, S, H] (the cache's value layout; see `cached`).

  Memory-efficient: the queries are taken `query_chunk` at a time (`lax.map`), each block's
  scores and softmax rematerialised in the backward pass (`jax.checkpoint`), so no float32
  [B, N, T, S] tensor is live in the forward or the backward pass, only one [B, N, query_chunk, S]
  block. Every query row still sees all S keys in one softmax, so the values are those of the
  dense computation (`attend_dense`), not an online-softmax approximation of them.

  Why not a library kernel: `jax.nn.dot_product_attention` with implementation="cudnn" takes
  causal masks and right-padded lengths but not a left-padding mask (valid keys [pad_b, t]), and
  implementation="xla" forms the dense [B, N, T, S] scores; the Pallas flash/splash kernels are
  TPU/GPU only (splash would express the mask with segment ids). This blocked form runs on every
  backend, and the tests (on CPU) compare it with the dense one.
  """
  b, t, n, h = q_btnh.shape
  if t <= query_chunk:
    return attend_dense(q_btnh, k_bkhs, v_bkhs, mask_bts, v_layout)
  s = k_bkhs.shape[3]
  c = query_chunk
  chunks = -(-t // c)
  pad = chunks * c - t  # padded query rows see no key; their (uniform) outputs are cut off below
  q_cbqnh = jnp.pad(q_btnh, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, chunks, c, n, h)
  mask_cbqs = jnp.pad(mask_bts, ((0, 0), (0, pad), (0, 0))).reshape(b, chunks, c, s)

  @jax.checkpoint
  def block(args):
    q_bqnh, m_bqs = args
    return attend_dense(constrain(q_bqnh, "btnh"), k_bkhs, v_bkhs, m_bqs, v_layout)

  out_cbqnh = jax.lax.map(block, (q_cbqnh.swapaxes(0, 1), mask_cbqs.swapaxes(0, 1)))
  return out_cbqnh.swapaxes(0, 1).reshape(b, chunks * c, n, h)[:, :t]


def attend_dense(q_btnh: jax.Array, k_bkhs: jax.Array, v_bkhs: jax.Array,
                 mask_bts: jax.Array, v_layout: str = "bkhs") -> jax.Array:
  """`attend_bkhs` in one piece: forms the float32 scores [B, K, G*T, S] of all queries at once."""
  if v_layout not in ("bkhs", "bksh"):
    raise ValueError(f"v_layout={v_layout!r} is not accepted; expected 'bkhs' or 'bksh'")
  b, t, n, h = q_btnh.shape
  k = k_bkhs.shape[1]
  g = n // k
  q_bkmh = q_btnh.reshape(b, t, k, g, h).transpose(0, 2, 3, 1, 4).reshape(b, k, g * t, h)
  out_bkmh = _grouped_attention(q_bkmh, k_bkhs, v_bkhs, mask_bts, v_layout)
  return out_bkmh.reshape(b, k, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_attention(q_bkmh, k_bkhs, v, mask_bts, v_layout):
  """softmax(q k / sqrt(H), where mask) v per (b, k) with the G query heads of a group and their
  T positions stacked in M = G*T; v is [B, K, H, S] or [B, K, S, H] (`v_layout`).

  The backward pass is written by hand (`_grouped_attention_bwd`). Why not autodiff: on XLA's
  CPU backend it transposed the [B, K, M, S] probabilities and score gradients into copies for
  the key and value gradients, and took the softmax's gradient in two passes with a reduction
  over S, so a layer's attention ran well below its MLP's FLOP rate
  (benchmarks/real_model.py --parts=train times the update). Here every product is a plain per-(b, k) matmul whose transposed operand is a [M, H] or [S, H]
  one, and the softmax's gradient is one fused pass, P (dP - rowsum(dO o O)), as in
  FlashAttention (Dao et al., 2022)."""
  return _grouped_attention_fwd(q_bkmh, k_bkhs, v, mask_bts, v_layout)[0]


def _grouped_attention_fwd(q_bkmh, k_bkhs, v, mask_bts, v_layout):
  b, kh, m, h = q_bkmh.shape
  t, s = mask_bts.shape[1], k_bkhs.shape[3]
  scores = jnp.einsum("bkmh,bkhs->bkms", q_bkmh, k_bkhs, preferred_element_type=jnp.float32)
  scores_bkgts = scores.reshape(b, kh, m // t, t, s) * (h ** -0.5)
  scores_bkgts = jnp.where(mask_bts[:, None, None], scores_bkgts, jnp.finfo(jnp.float32).min)
  probs_bkms = jax.nn.softmax(scores_bkgts, axis=-1).reshape(b, kh, m, s)
  out_bkmh = jnp.einsum(f"bkms,{v_layout}->bkmh", probs_bkms.astype(v.dtype), v)
  return out_bkmh, (q_bkmh, k_bkhs, v, mask_bts, probs_bkms, out_bkmh)


def _grouped_attention_bwd(v_layout, residuals, dout_bkmh):
  q_bkmh, k_bkhs, v, mask_bts, probs_bkms, out_bkmh = residuals
  b, kh, m, h = q_bkmh.shape
  t, s = mask_bts.shape[1:]
  f32 = jnp.float32
  v_bkhs = v if v_layout == "bkhs" else v.swapaxes(2, 3)
  dprobs = jnp.einsum("bkmh,bkhs->bkms", dout_bkmh, v_bkhs, preferred_element_type=f32)
  rowsum_bkm = (dout_bkmh.astype(f32) * out_bkmh.astype(f32)).sum(-1)
  dscores = probs_bkms * (dprobs - rowsum_bkm[..., None]) * (h ** -0.5)
  # A query that sees no key has uniform probabilities, but its scores are constants (the
  # forward's `where`): no gradient flows to q or k through them.
  dscores = jnp.where(mask_bts[:, None, None], dscores.reshape(b, kh, m // t, t, s), 0.0)
  dscores = dscores.reshape(b, kh, m, s)
  dq = jnp.einsum("bkms,bksh->bkmh", dscores.astype(q_bkmh.dtype), k_bkhs.swapaxes(2, 3),
                  preferred_element_type=f32)
  dk_bkhs = jnp.einsum("bkhm,bkms->bkhs", q_bkmh.swapaxes(2, 3), dscores.astype(q_bkmh.dtype),
                       preferred_element_type=f32)
  dv_bkhs = jnp.einsum("bkhm,bkms->bkhs", dout_bkmh.swapaxes(2, 3), probs_bkms.astype(v.dtype),
                       preferred_element_type=f32)
  dv = dv_bkhs if v_layout == "bkhs" else dv_bkhs.swapaxes(2, 3)
  return dq.astype(q_bkmh.dtype), dk_bkhs.astype(k_bkhs.dtype), dv.astype(v.dtype), None


_grouped_attention.defvjp(_grouped_attention_fwd, _grouped_attention_bwd)


def attend_shared_prompt(q_btnh: jax.Array, pk_pkhs: jax.Array, pv_pksh: jax.Array,
                         pmask_ps: jax.Array, k_bkhs: jax.Array, v_bksh: jax.Array,
                         mask_bs: jax.Array) -> jax.Array:
  """One decode query per row over a prompt cache shared by groups of rows, and each row's own
  cache of generated tokens, in one softmax. Returns [B, 1, N, H].

  Rows come in P groups of n = B / P consecutive rows (row p * n + j is sample j of prompt p) that
  share one prompt: its keys [P, K, H, T] and values [P, K, T, H], valid where pmask[p, t]. Each
  row's own keys [B, K, H, S] and values [B, K, S, H] hold the tokens it generated, valid where
  mask[b, s]. Query b sees both; the value is that of attending one concatenated cache (the
  softmax over the union of both key sets, its max and sum taken over both parts).

  Why: in k-sample training every prompt has n samples (and evaluation 64), so a cache with a
  copy of the prompt per row reads the prompt's keys and values n times per step, and at long
  prompts that traffic dominates a decode step. Here each group's n * G queries meet its prompt
  in one [n * G, H] x [H, T] matmul per (p, k): the prompt is read once per group, and its cache
  is n times smaller. n = 1 (P = B) is a per-row prompt cache. The same idea as Hydragen
  (Juravsky et al., 2024) and vLLM's cascade attention; neither is a JAX library for CPU/TPU.
  """
  b, t, n_heads, h = q_btnh.shape
  if t != 1:
    raise ValueError(f"attend_shared_prompt takes one query per row, got {t}")
  p, kh = pk_pkhs.shape[0], pk_pkhs.shape[1]
  g, n = n_heads // kh, b // p
  scale = h ** -0.5
  neg = jnp.finfo(jnp.float32).min
  q_bkgh = q_btnh.reshape(b, kh, g, h)
  q_pkmh = q_bkgh.reshape(p, n, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(p, kh, n * g, h)
  # Scores, float32: the prompt's [P, K, n*G, T], the row's own [B, K, G, S].
  sp = jnp.einsum("pkmh,pkhs->pkms", q_pkmh, pk_pkhs, preferred_element_type=jnp.float32)
  sp = jnp.where(pmask_ps[:, None, None, :], sp * scale, neg)
  so = jnp.einsum("bkgh,bkhs->bkgs", q_bkgh, k_bkhs, preferred_element_type=jnp.float32)
  so = jnp.where(mask_bs[:, None, None, :], so * scale, neg)
  to_rows = lambda x_pkm: x_pkm.reshape(p, kh, n, g).transpose(0, 2, 1, 3).reshape(b, kh, g)
  to_groups = lambda x_bkg: x_bkg.reshape(p, n, kh, g).transpose(0, 2, 1, 3).reshape(p, kh, n * g)
  top_bkg = jnp.maximum(to_rows(sp.max(-1)), so.max(-1))
  ep = jnp.exp(sp - to_groups(top_bkg)[..., None])
  eo = jnp.exp(so - top_bkg[..., None])
  total_bkg = to_rows(ep.sum(-1)) + eo.sum(-1)
  op = jnp.einsum("pkms,pksh->pkmh", ep.astype(pv_pksh.dtype), pv_pksh)
  op_bkgh = op.reshape(p, kh, n, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, g, h)
  oo_bkgh = jnp.einsum("bkgs,bksh->bkgh", eo.astype(v_bksh.dtype), v_bksh)
  out_bkgh = (op_bkgh + oo_bkgh) / total_bkg[..., None].astype(op_bkgh.dtype)
  return out_bkgh.reshape(b, 1, n_heads, h)


class Projections(nnx.Module):
  """What Attention and MLP share: their weight matrices, which `ksjax.model.lora` may have
  replaced by qwix-quantized ones (QLoRA's frozen base) and given low-rank adapters.

  A weight `w` is an `nnx.Param`, or a `qwix.QArray` of `nnx.Param`s (int8 or int4 values and
  their scales) that `product` dequantizes where it is used. Its adapter, when it has one, is the
  pair `w_lora_a` [*in, r] and `w_lora_b` [r, *out] (`nnx.LoRAParam`s, qwix's names), and the
  product becomes x w + lora_scale * (x A) B: the frozen product as `project` computes it, plus the
  adapter's two thin products. At initialisation B = 0, so the adapter adds exact zeros and the
  model computes what the base computes, bit for bit.

  Why the adapters are applied here and not by qwix's interception (`qwix.LoraProvider`, which
  adds the same x A B to every `jnp.einsum`/`lax.dot_general` on a weight): qwix intercepts one
  method of an NNX model, and this model is entered by four (`hidden` for training and log-probs,
  `hidden_cached` and `forward_shared` for the sampler, `__call__`); and the products it would
  intercept run inside custom VJPs (`swiglu` always, `_mixed_matmul` under `matmul_dtype`), whose
  traced weights qwix cannot trace back to their parameters and whose hand-written backward
  passes give an adapter closed over inside them no gradient (jax refuses it as a leaked tracer).
  qwix still provides the quantization (`qwix.quantize`, `qwix.dequantize`), and the adapters
  are laid out as qwix lays them out (`nnx.LoRAParam`s, its names, its initialisers;
  `ksjax.model.lora`).
  """

  # alpha / rank of this module's adapters, set by `lora.apply`; None: it has none.
  lora_scale: float | None = None
  # False in the view `lora.adapters_off` returns: the frozen base (the reference policy).
  lora_enabled: bool = True

  def set_view(self, lora: bool | None = None):
    """`nnx.view(model, lora=False)`: the adapters off (`lora.adapters_off`)."""
    if lora is not None:
      self.lora_enabled = lora

  def adapted(self, name: str) -> bool:
    """Whether weight `name` has an adapter, switched on."""
    return (self.lora_scale is not None and self.lora_enabled
            and hasattr(self, name + "_lora_a"))

  def quantized(self, name: str) -> bool:
    """Whether weight `name` is a quantized one (a qwix QArray, not a Param)."""
    return not isinstance(getattr(self, name), nnx.Variable)

  def weight(self, name: str) -> jax.Array:
    """Weight `name` as an array: its parameter's value, or its quantized value dequantized."""
    w = getattr(self, name)
    return w[...] if isinstance(w, nnx.Variable) else _dequantized(_values(w))

  def product(self, name: str, x: jax.Array, spec: str | None = None,
              shape: tuple[int, ...] | None = None,
              weight_t: jax.Array | None = None) -> jax.Array:
    """x times weight `name` (as `project` computes it, the weight reshaped to `shape` if given),
    plus its adapter's product when it has one switched on. `weight_t`: the weight's transposed
    copy [N, K] (`sampler.weights_first`), multiplied by `project_weights_first` instead; only
    for a `spec` that contracts x's last axis with the weight's leading ones.

    A quantized weight is dequantized where it is used, so that one layer's float weights exist
    at a time (what QLoRA keeps is the quantized base): inside a rematerialised region, so that
    the backward pass recomputes them instead of keeping every layer's from the forward pass; and
    behind an optimization barrier with the layer's input. Why the barrier: the dequantization
    depends on the parameters alone, and XLA hoists such work out of a loop, here the update's
    loop over micro-batches (and the sampler's decode loop), which then holds every layer's float
    weights for the whole step (benchmarks/lora_update.py prints the compiled step's bytes)."""
    def frozen(x, w):
      return project(x, w if shape is None else w.reshape(shape), self.dtype, self.matmul_dtype,
                     spec)

    def dequantized_product(x, q):
      x, q = jax.lax.optimization_barrier((x, q))
      return frozen(x, _dequantized(q))

    if weight_t is not None:
      out_axes = tuple((getattr(self, name).shape if shape is None else shape)[1:])
      y = project_weights_first(x, weight_t, self.dtype, self.matmul_dtype)
      y = y.reshape(x.shape[:-1] + out_axes)
    elif self.quantized(name):
      y = jax.checkpoint(dequantized_product, policy=jax.checkpoint_policies.nothing_saveable)(
          x, _values(getattr(self, name)))
    else:
      y = frozen(x, self.weight(name))
    if not self.adapted(name):
      return y
    return y + self.adapter_product(name, x).reshape(y.shape)

  def adapter_product(self, name: str, x: jax.Array) -> jax.Array:
    """lora_scale * (x A) B for weight `name`'s adapter, x [..., K] (K: the weight's input axes
    together) -> [..., N] (N: its output axes together). Both products as `project` computes the
    weight's (in `matmul_dtype` where it is set); the adapter's input goes through LoRA's dropout
    where `lora.apply` added one (`lora_dropout`, off outside `lora.training`)."""
    a = getattr(self, name + "_lora_a")[...]
    b = getattr(self, name + "_lora_b")[...]
    rank = a.shape[-1]
    if hasattr(self, "lora_dropout"):
      x = self.lora_dropout(x)
    xa = project(x, a.reshape(-1, rank), self.dtype, self.matmul_dtype)
    delta = project(xa, b.reshape(rank, -1), self.dtype, self.matmul_dtype)
    return delta * jnp.asarray(self.lora_scale, delta.dtype)


def _values(tree):
  """A tree of nnx Variables (a quantized weight's QArray) with each Variable's value."""
  return jax.tree.map(lambda v: v[...], tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _dequantized(q) -> jax.Array:
  # Imported here: only a quantized base needs qwix, and every program imports this module.
  import qwix  # pylint: disable=import-outside-toplevel
  return qwix.dequantize(q)


class Attention(Projections):
  """Grouped-query self-attention with half-split RoPE and an optional KV cache."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_proj = init_param(rngs, (d, n, h), cfg)  # [D, N, H]
    self.k_proj = init_param(rngs, (d, k, h), cfg)  # [D, K, H]
    self.v_proj = init_param(rngs, (d, k, h), cfg)  # [D, K, H]
    self.o_proj = init_param(rngs, (n, h, d), cfg)  # [N, H, D]
    self.dtype = jnp.dtype(cfg.dtype)
    self.matmul_dtype = cfg.matmul_dtype

  def qkv(self, x_btd: jax.Array, cos_bth: jax.Array, sin_bth: jax.Array,
          weights_t: dict[str, jax.Array] | None = None):
    """Rotated queries [B, T, N, H] and keys [B, T, K, H], and values [B, T, K, H].
    `weights_t`: transposed copies of the weights by name (`Projections.product`), or None."""
    t = weights_t or {}
    q = constrain(self.product("q_proj", x_btd, "btd,dnh->btnh", weight_t=t.get("q_proj")),
                  "btnh")
    k = constrain(self.product("k_proj", x_btd, "btd,dkh->btkh", weight_t=t.get("k_proj")),
                  "btkh")
    v = constrain(self.product("v_proj", x_btd, "btd,dkh->btkh", weight_t=t.get("v_proj")),
                  "btkh")
    return rope.apply(q, cos_bth, sin_bth), rope.apply(k, cos_bth, sin_bth), v

  def out(self, attn_btnh: jax.Array, weight_t: jax.Array | None = None) -> jax.Array:
    """o_proj over the heads as one [B, T, N*H] x [N*H, D] matmul. Both reshapes are free (the
    head axis is the major one of both operands). Why not the einsum "btnh,nhd->btd": XLA's CPU
    backend lowered its two contracting axes as (h, n), so every call transposed the activations
    and, in the decode loop, copied each layer's [N, H, D] weight at every step
    (benchmarks/real_model.py --parts=profile shows the copies; --parts=roofline times the decode
    step against its matmuls)."""
    attn_btnh = constrain(attn_btnh, "btnh")
    b, t, n, h = attn_btnh.shape
    out_btd = self.product("o_proj", attn_btnh.reshape(b, t, n * h),
                           shape=(n * h, self.o_proj.shape[-1]), weight_t=weight_t)
    return constrain(out_btd, "btd")

  def __call__(self, x_btd, cos_bth, sin_bth, mask_btt) -> jax.Array:
    q, k, v = self.qkv(x_btd, cos_bth, sin_bth)
    return self.out(attend(q, k, v, mask_btt))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def swiglu(x_btd: jax.Array, gate_df: jax.Array, up_df: jax.Array, down_fd: jax.Array,
           dtype, matmul_dtype: str | None) -> jax.Array:
  """down(silu(x @ gate) * (x @ up)), each product as `project` computes it, the [B, T, F]
  activations pinned to their "btf" axes.

  The backward pass is written by hand (`_swiglu_bwd`). Why not autodiff: for each weight's
  gradient XLA's CPU backend transposed the [B*T, F] activation gradient into a copy before the
  product, and differentiated silu as x * sigmoid(x) in three elementwise passes
  (benchmarks/real_model.py --parts=train times the update). Here every weight gradient is a plain
  [D, B*T] x [B*T, F] or [F, B*T] x [B*T, D] product whose transposed operand is the narrow
  one ([B*T, D], 2.7 times smaller at SmolLM2's widths) or a result, and silu's derivative is
  one fused pass. With a lower `matmul_dtype` every product takes operands in it, the transposed
  ones copied row-major (`transposed`), as `_mixed_matmul` does and for the same reason. The
  residuals are x and both [B, T, F] pre-activations."""
  return _swiglu_fwd(x_btd, gate_df, up_df, down_fd, dtype, matmul_dtype)[0]


def _swiglu_fwd(x_btd, gate_df, up_df, down_fd, dtype, matmul_dtype):
  g_btf = constrain(project(x_btd, gate_df, dtype, matmul_dtype), "btf")
  u_btf = constrain(project(x_btd, up_df, dtype, matmul_dtype), "btf")
  hidden_btf = constrain(jax.nn.silu(g_btf) * u_btf, "btf")
  y_btd = constrain(project(hidden_btf, down_fd, dtype, matmul_dtype), "btd")
  return y_btd, (x_btd, gate_df, up_df, down_fd, g_btf, u_btf)


def _swiglu_bwd(dtype, matmul_dtype, residuals, dy_btd):
  x_btd, gate_df, up_df, down_fd, g_btf, u_btf = residuals
  b, t, d = x_btd.shape
  f = g_btf.shape[-1]
  if _is_mixed(dtype, matmul_dtype):
    # Operands cast before they are transposed (half the bytes to copy), each transposed operand
    # a row-major copy (`transposed`) for the library kernels.
    md = jnp.dtype(matmul_dtype)
    mm = lambda spec, a, w: jnp.einsum(spec, *kernel_operands(a.astype(md), w.astype(md)),
                                       preferred_element_type=jnp.float32).astype(dtype)
    tr = lambda a_mk: transposed(a_mk.astype(md))
    # A product's transpose, copied: XLA rewrites a plain transpose of a product into the product
    # of the transposed operands, the layout `transposed` keeps it from.
    tr_out = transposed
  else:
    mm = lambda spec, a, w: project(a, w, dtype, matmul_dtype, spec)
    tr = tr_out = lambda a_mk: a_mk.T
  g_mf, u_mf = g_btf.reshape(b * t, f), u_btf.reshape(b * t, f)
  sig_mf = jax.nn.sigmoid(g_mf)
  silu_mf = g_mf * sig_mf
  dy_md = dy_btd.reshape(b * t, d).astype(dtype)
  dhidden_mf = mm("md,fd->mf", dy_md, down_fd)
  # d down = hidden^T dy, formed as (dy^T hidden)^T: the transposes are of [B*T, D] and [D, F].
  ddown_fd = tr_out(mm("dm,mf->df", tr(dy_md), silu_mf * u_mf))
  # d silu(g) / dg = sigmoid(g) (1 + g (1 - sigmoid(g))).
  dg_mf = dhidden_mf * u_mf * sig_mf * (1 + g_mf * (1 - sig_mf))
  du_mf = dhidden_mf * silu_mf
  x_dm = tr(x_btd.reshape(b * t, d))
  dgate_df, dup_df = mm("dm,mf->df", x_dm, dg_mf), mm("dm,mf->df", x_dm, du_mf)
  dx_md = mm("mf,df->md", dg_mf, gate_df) + mm("mf,df->md", du_mf, up_df)
  return (dx_md.reshape(b, t, d).astype(x_btd.dtype), dgate_df.astype(gate_df.dtype),
          dup_df.astype(up_df.dtype), ddown_fd.astype(down_fd.dtype))


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _silu_times(g_btf: jax.Array, u_btf: jax.Array) -> jax.Array:
  return jax.nn.silu(g_btf) * u_btf


class MLP(Projections):
  """SwiGLU: down(silu(gate(x)) * up(x)) (`swiglu`)."""

  WEIGHTS = ("gate_proj", "up_proj", "down_proj")

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = init_param(rngs, (d, f), cfg)  # [D, F]
    self.up_proj = init_param(rngs, (d, f), cfg)    # [D, F]
    self.down_proj = init_param(rngs, (f, d), cfg)  # [F, D]
    self.dtype = jnp.dtype(cfg.dtype)
    self.matmul_dtype = cfg.matmul_dtype

  def __call__(self, x_btd: jax.Array,
               weights_t: dict[str, jax.Array] | None = None) -> jax.Array:
    """`weights_t`: transposed copies of the weights by name (`Projections.product`), for a
    forward pass that is not differentiated (the sampler's decode step), or None."""
    if not weights_t and not any(self.quantized(n) or self.adapted(n) for n in self.WEIGHTS):
      return swiglu(x_btd, self.gate_proj[...], self.up_proj[...], self.down_proj[...],
                    self.dtype, self.matmul_dtype)
    return self.adapted_swiglu(x_btd, weights_t)

  def adapted_swiglu(self, x_btd: jax.Array,
                     weights_t: dict[str, jax.Array] | None = None) -> jax.Array:
    """`swiglu`'s forward, op for op, with each product a `Projections.product` (a quantized
    weight dequantized, an adapter's product added), differentiated by jax.

    Why not `swiglu`: its hand-written backward returns the gradients of its four arguments and
    no others, so an adapter applied inside it would get none, and its residuals would hold a
    quantized base's dequantized weights. Under LoRA the frozen weights need no gradient, and
    the weight-gradient products that backward was written to lay out (`_swiglu_bwd`) are not
    formed at all."""
    t = weights_t or {}
    g_btf = constrain(self.product("gate_proj", x_btd, weight_t=t.get("gate_proj")), "btf")
    u_btf = constrain(self.product("up_proj", x_btd, weight_t=t.get("up_proj")), "btf")
    # silu(g) * u recomputed in the backward pass from g and u, as `_swiglu_bwd` does. jax saves
    # g and u either way, but differentiated through, the compiled update held one more [B, T, F]
    # float32 array per layer (benchmarks/lora_update.py prints the compiled step's temporaries;
    # the figures are in docs/benchmarks.md).
    hidden_btf = constrain(jax.checkpoint(_silu_times)(g_btf, u_btf), "btf")
    return constrain(self.product("down_proj", hidden_btf, weight_t=t.get("down_proj")), "btd")


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_btd, cos_bth, sin_bth, mask_btt) -> jax.Array:
    x_btd = constrain(x_btd, "btd")
    x_btd = x_btd + self.self_attn(self.input_layernorm(x_btd), cos_bth, sin_bth, mask_btt)
    return constrain(x_btd + self.mlp(self.post_attention_layernorm(x_btd)), "btd")

  def cached(self, x_btd, cos_bth, sin_bth, mask_bts, k_bkhs, v_bksh, cache_index):
    """One step with this layer's KV cache: keys [B, K, H, S], values [B, K, S, H]. Writes the
    new keys and values at slots [cache_index, +T) in place (no copy of the cache under donation)
    and attends over all S slots. Returns x and both caches.

    Why two layouts: with keys slots-last and values slots-second-last, both products of a decode
    step (scores q.k over H, then p.v over S) are plain [M, H] x [H, S] and [M, S] x [S, H]
    matmuls per (b, k), which run at the machine's memory bandwidth; with values [B, K, H, S] the
    p.v product contracts both operands' minor axes and runs several times slower on XLA's CPU
    backend (benchmarks/real_model.py --parts=roofline). The training path (`attend`) is unaffected."""
    return self._cached_step(
        x_btd, cos_bth, sin_bth, k_bkhs, v_bksh, cache_index,
        lambda q, keys, values: attend_bkhs(q, keys, values, mask_bts, v_layout="bksh"))

  def cached_shared(self, x_btd, cos_bth, sin_bth, prompt_k, prompt_v, prompt_mask_ps, k_bkhs,
                    v_bksh, mask_bs, cache_index, weights_t=None):
    """`cached` for one token per row with the prompt's keys and values shared by groups of rows
    (`attend_shared_prompt`): writes the new key and value at slot `cache_index` of the rows'
    own caches and attends over the prompt and the rows' valid slots. `weights_t`: this layer's
    transposed weight copies ({"self_attn": {name: w_t}, "mlp": {...}}, `sampler.weights_first`)
    or None."""
    return self._cached_step(
        x_btd, cos_bth, sin_bth, k_bkhs, v_bksh, cache_index,
        lambda q, keys, values: attend_shared_prompt(
            q, prompt_k.astype(q.dtype), prompt_v.astype(q.dtype), prompt_mask_ps, keys, values,
            mask_bs), weights_t)

  def _cached_step(self, x_btd, cos_bth, sin_bth, k_bkhs, v_bksh, cache_index, attend_fn,
                   weights_t=None):
    """The block with a KV cache: queries, keys and values of x; the keys and values written at
    slots [cache_index, +T) in place; attention by `attend_fn(q, keys, values)` (the caches in
    the compute dtype); then the residual and the MLP. Returns x and both caches."""
    attn_t, mlp_t = (weights_t or {}).get("self_attn"), (weights_t or {}).get("mlp")
    q, k, v = self.self_attn.qkv(self.input_layernorm(x_btd), cos_bth, sin_bth, attn_t)
    k_bkhs = jax.lax.dynamic_update_slice(
        k_bkhs, k.transpose(0, 2, 3, 1).astype(k_bkhs.dtype), (0, 0, 0, cache_index))
    v_bksh = jax.lax.dynamic_update_slice(
        v_bksh, v.transpose(0, 2, 1, 3).astype(v_bksh.dtype), (0, 0, cache_index, 0))
    attn = attend_fn(q, k_bkhs.astype(q.dtype), v_bksh.astype(q.dtype))
    x_btd = x_btd + self.self_attn.out(attn, (attn_t or {}).get("o_proj"))
    x_btd = x_btd + self.mlp(self.post_attention_layernorm(x_btd), mlp_t)
    return x_btd, k_bkhs, v_bksh
