"""The Llama 3 language model (Flax NNX) and its KV cache.

Two forwards share the same layers:
  * `__call__` / `hidden`: the whole sequence at once (training, scoring, log-probs). Left padding is
    handled by the attention mask; RoPE positions default to cumsum(mask) - 1, so a left-padded
    prompt gets the same positions as the unpadded one.
  * `forward_cached`: the sampler's path. The batch shares one cache write index: a prefill writes
    the (left-padded) prompts to slots [0, T) and every decode step writes one slot. Which slots hold
    real tokens is the caller's `kv_mask`; causality is by slot index.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ksjax.model import layers, rope
from ksjax.model.config import LlamaConfig
from ksjax.model.layers import DecoderLayer, RMSNorm, init_param
from ksjax.model.sharding import constrain

# {"k": L arrays [B, K, H, S], "v": L arrays [B, K, S, H]}: one array per layer, so a decode step
# reads each layer's cache where it lies (slicing a stacked [L, ...] cache copied every layer's
# cache on every step), and writes one slot per layer in place. Keys are slots-last and values
# slots-second-last: the layouts in which both attention products are plain matmuls
# (`DecoderLayer.cached`).
Cache = dict[str, list[jax.Array]]


def default_positions(attention_mask_bt: jax.Array) -> jax.Array:
  """RoPE positions of a left-padded batch: cumsum(mask) - 1, clipped at 0. int32 [B, T]."""
  return jnp.maximum(jnp.cumsum(attention_mask_bt.astype(jnp.int32), axis=-1) - 1, 0)


def init_cache(cfg: LlamaConfig, batch_size: int, max_len: int, dtype=None) -> Cache:
  """An empty KV cache with `max_len` slots per sequence (layout: `Cache`)."""
  layer_caches = [layer_cache(cfg, batch_size, max_len, dtype) for _ in range(cfg.num_layers)]
  return {"k": [k for k, _ in layer_caches], "v": [v for _, v in layer_caches]}


def layer_cache(cfg: LlamaConfig, batch_size: int, max_len: int,
                dtype=None) -> tuple[jax.Array, jax.Array]:
  """One layer's empty keys [B, K, H, S] and values [B, K, S, H] (layout: `Cache`)."""
  b, k, h, s = batch_size, cfg.num_kv_heads, cfg.head_dim, max_len
  dtype = jnp.dtype(dtype or cfg.dtype)
  return jnp.zeros((b, k, h, s), dtype), jnp.zeros((b, k, s, h), dtype)


def head_logits(hidden_btd: jax.Array, w: jax.Array, vocab_axis: int,
                operand_dtype=None, weights_first: bool = False) -> jax.Array:
  """float32 logits [B, T, V'] of hidden states against a head matrix [V', D] (vocab_axis 0) or
  [D, V'] (vocab_axis 1), both operands in `operand_dtype` (default: the hidden states').
  `weights_first` (a [V', D] matrix only): the product with the matrix as the left operand,
  faster at a decode step's few rows (`layers.project_weights_first`)."""
  dtype = hidden_btd.dtype if operand_dtype is None else operand_dtype
  if weights_first:
    if vocab_axis != 0:
      raise ValueError("weights_first takes the head matrix as [V, D] (vocab_axis 0)")
    b, t, d = hidden_btd.shape
    w_h = layers.kernel_operands(w.astype(dtype), hidden_btd.reshape(b * t, d).astype(dtype))
    logits_vm = jnp.einsum("vd,md->vm", *w_h, preferred_element_type=jnp.float32)
    return layers.transposed(logits_vm).reshape(b, t, -1)
  spec = "btd,vd->btv" if vocab_axis == 0 else "btd,dv->btv"
  return jnp.einsum(spec, *layers.kernel_operands(hidden_btd.astype(dtype), w.astype(dtype)),
                    preferred_element_type=jnp.float32)


# The weight matrices every product casts to `LlamaConfig.operand_dtype` first (`layers.project`,
# `head_logits` for an untied head). A tied embedding is not one of them: its lookup reads rows
# in the parameter dtype.
MATMUL_WEIGHTS = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"})


def cast_matmul_weights(state: nnx.State, cfg: LlamaConfig) -> nnx.State:
  """A parameter state with its `MATMUL_WEIGHTS` in `cfg.operand_dtype`; every other leaf as is.

  A model merged with it computes exactly what it computes with `state`: each product casts its
  weight to that dtype anyway, and a cast to a value's own dtype is the value. Why: a program
  given float32 weights casts them on every call (XLA hoists the casts out of a decode loop, not
  out of the program), so a sampler that runs several programs per call (prefill, then a decode
  loop per batch size) can cast once and give them all the result (`sampler.sample`).
  """
  dtype = jnp.dtype(cfg.operand_dtype)
  return nnx.map_state(
      lambda path, leaf: (leaf.replace(leaf[...].astype(dtype))
                          if path[-1] in MATMUL_WEIGHTS and leaf.dtype != dtype else leaf), state)


def with_config(llama: "Llama", **changes) -> "Llama":
  """`llama` under a LlamaConfig with `changes`: the same parameter arrays (not copied, their
  shardings kept) in a module structure built from the new config. For fields that change how
  the model computes but not its parameters (`matmul_dtype`, `remat`): the layers take theirs
  from the config when they are built, so setting `llama.cfg` alone would not reach them."""
  cfg = dataclasses.replace(llama.cfg, **changes)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
  state = nnx.state(llama)
  if {p for p, _ in nnx.to_flat_state(state)} != {p for p, _ in nnx.to_flat_state(abstract)}:
    raise ValueError("with_config takes a plain Llama; give it the base and apply LoRA "
                     "(ksjax.model.lora.apply) to its result")
  return nnx.merge(graphdef, state)


class Llama(nnx.Module):
  """Llama 3 / 3.1 / 3.2 causal language model, optionally with a scalar value head."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = init_param(rngs, (cfg.vocab_size, cfg.hidden_size), cfg)  # [V, D]
    self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = init_param(rngs, (cfg.hidden_size, cfg.vocab_size), cfg)  # [D, V]
    if cfg.value_head:
      self.value_head = init_param(rngs, (cfg.hidden_size,), cfg)  # [D]
      self.value_bias = nnx.Param(jnp.zeros((), jnp.dtype(cfg.param_dtype)))

  def cos_sin(self, positions_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    inv_freq = rope.inverse_frequencies(self.cfg.head_dim, self.cfg.rope_theta,
                                        self.cfg.rope_scaling)
    return rope.cos_sin(positions_bt, inv_freq)

  def rope_table(self, length: int) -> tuple[jax.Array, jax.Array]:
    """The cos and sin of positions 0 .. length - 1, float32 [length, head_dim] each: a decode
    loop computes them once, before the loop, and each step takes its rows' positions from them
    (`forward_shared(..., rope_table=)`).

    Why: XLA:CPU fuses the cos and sin of `cos_sin` into each consumer, the q and k rotation of
    every layer, so a step computing them from its positions evaluates the transcendentals
    2 x layers times (benchmarks/real_model.py --parts=profile shows those fusions' share of a
    decode step). A gather from a table is cheap to duplicate. The
    values are those of `cos_sin` (the same float32 operations on the same positions).
    `jax.lax.optimization_barrier` does not serve: XLA:CPU removes it before fusion."""
    cos, sin = self.cos_sin(jnp.arange(length, dtype=jnp.int32)[None])
    return cos[0], sin[0]

  # -- pieces ----------------------------------------------------------------------------------

  def embed(self, tokens_bt: jax.Array) -> jax.Array:
    return constrain(jnp.take(self.embed_tokens[...], tokens_bt, axis=0).astype(self.cfg.dtype),
                     "btd")

  def head_weight(self) -> tuple[jax.Array, int]:
    """The lm-head matrix and its vocabulary axis: the embedding [V, D] (axis 0) when tied, else
    `lm_head` [D, V] (axis 1). Never transposed, so no [V, D]-sized copy is made."""
    if self.cfg.tie_embeddings:
      return self.embed_tokens[...], 0
    return self.lm_head[...], 1

  def logits(self, hidden_btd: jax.Array, head_t: jax.Array | None = None,
             weights_first: bool = False) -> jax.Array:
    """float32 [B, T, V] from final hidden states. `weights_first`: the head's product with the
    matrix on the left (`head_logits`), the untied head given as its transposed copy `head_t`
    [V, D] (a tied one is [V, D] already)."""
    w, vocab_axis = (head_t, 0) if head_t is not None else self.head_weight()
    return constrain(head_logits(hidden_btd, w, vocab_axis, self.cfg.operand_dtype,
                                 weights_first and vocab_axis == 0), "btv")

  def value(self, hidden_btd: jax.Array) -> jax.Array:
    """float32 [B, T] scalar values (PPO critic); needs cfg.value_head."""
    if not self.cfg.value_head:
      raise ValueError("Llama.value needs LlamaConfig.value_head=True")
    v = jnp.einsum("btd,d->bt", hidden_btd, self.value_head[...].astype(self.cfg.dtype),
                   preferred_element_type=jnp.float32)
    return v + self.value_bias[...].astype(jnp.float32)

  # -- full-sequence forward -------------------------------------------------------------------

  def hidden(self, tokens_bt: jax.Array, attention_mask: jax.Array | None = None,
             positions: jax.Array | None = None) -> jax.Array:
    """Final-normed hidden states [B, T, D] (compute dtype), before the lm head."""
    b, t = tokens_bt.shape
    mask_bt = (jnp.ones((b, t), bool) if attention_mask is None
               else attention_mask.astype(bool))
    causal_tt = jnp.tril(jnp.ones((t, t), bool))
    mask_btt = mask_bt[:, None, :] & causal_tt[None]
    if positions is None:
      # Default positions are below T: the rotations by lookup in a table of 0 .. T - 1
      # (`rope_table`). Computed from the positions, cos and sin would be evaluated again in every
      # layer's q and k rotation, once per head, forward and backward (XLA fuses them into each
      # consumer, the layout copies into [B, K, G*T, H] among them); at SmolLM2's shape that was
      # the largest of a forward's costs outside its matmuls (benchmarks/update_rate.py).
      positions_bt = default_positions(mask_bt)
      cos, sin = (table[positions_bt] for table in self.rope_table(t))
    else:
      cos, sin = self.cos_sin(positions)
    x_btd = self.embed(tokens_bt)
    x_btd, _ = self.through_layers(lambda layer, x: (layer(x, cos, sin, mask_btt), None), x_btd)
    return self.norm(x_btd)

  def through_layers(self, block, carry):
    """`carry, out = block(layer, carry)` for each decoder layer in turn: unrolled, or with
    `cfg.remat` as one `lax.scan` over the layers' stacked parameters, each block
    rematerialised in a backward pass. Returns the last carry and the outputs, each leaf a list
    of one array per layer (as `Cache`).

    Why a scan: unrolled, the blocks' FSDP all-gathers depend only on the parameters, so XLA may
    issue all of them up front and hold every layer's gathered weights (and their full-size
    gradients) at once; in a scan, each iteration gathers its own block's weights, so one
    block's weights and activations are live at a time and the backward pass keeps only each
    block's input [L, B, T, D]. The parameters stay a list of layers (checkpoints, Hugging Face
    import, sharding and the KV-cache path are unchanged); stacking them costs one copy of this
    device's parameter shards, split like the parameters (FSDP), not gathered, and splitting the
    scan's stacked outputs into one array per layer costs a copy of them.
    """
    if not self.cfg.remat:
      outs = []
      for layer in self.layers:
        carry, out = block(layer, carry)
        outs.append(out)
      return carry, jax.tree.map(lambda *xs: list(xs), *outs)
    graphdef, _ = nnx.split(self.layers[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(l) for l in self.layers))

    def step(carry, layer_state):
      return block(nnx.merge(graphdef, layer_state), carry)

    carry, ys = jax.lax.scan(jax.checkpoint(step, prevent_cse=False), carry, stacked)
    return carry, jax.tree.map(lambda y: list(y), ys)

  def __call__(self, tokens_bt: jax.Array, attention_mask: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    """int32 tokens [B, T] -> float32 logits [B, T, V]."""
    return self.logits(self.hidden(tokens_bt, attention_mask, positions))

  # -- cached forward (sampling) ---------------------------------------------------------------

  def forward_cached(self, tokens_bt: jax.Array, positions_bt: jax.Array, cache: Cache,
                     cache_index: jax.Array, kv_mask_bs: jax.Array) -> tuple[jax.Array, Cache]:
    """Writes tokens to cache slots [cache_index, cache_index + T) and returns their logits.

    Query t of row b attends slot j iff kv_mask[b, j] and j <= cache_index + t. Returns float32
    logits [B, T, V] and the updated cache (donate the old one under jit).
    """
    hidden_btd, cache = self.hidden_cached(tokens_bt, positions_bt, cache, cache_index, kv_mask_bs)
    return self.logits(hidden_btd), cache

  def forward_shared(self, token_b: jax.Array, position_b: jax.Array, prompt: Cache,
                     prompt_mask_ps: jax.Array, cache: Cache, cache_index: jax.Array,
                     kv_mask_bs: jax.Array,
                     rope_table: tuple[jax.Array, jax.Array] | None = None,
                     weights_t: dict | None = None) -> tuple[jax.Array, Cache]:
    """One decode step over a shared prompt cache (`layers.attend_shared_prompt`).

    `prompt` holds the keys and values of P prompts (layout `Cache`, S = the prompt length),
    valid where prompt_mask[p, t]; rows p * n .. p * n + n - 1 continue prompt p (n = B / P).
    `cache` holds each row's generated tokens; `token_b` (int32 [B], at RoPE position
    `position_b`) is written to its slot `cache_index`, and row b attends its prompt and its
    slots where kv_mask[b, s] (the caller switches the written slot on). Returns float32 logits
    [B, V] and the rows' cache (donate the old one under jit); the prompt cache is only read.
    `rope_table` (`rope_table(L)`, every position < L) gives the rotations by lookup.
    `weights_t`: transposed copies of the matrices (`sampler.weights_first`: {"layers": one
    `DecoderLayer.cached_shared` tree a layer, "lm_head": the untied head's or None}), the step's
    products then taken with the weights on the left; None: as the training forward takes them.
    """
    if rope_table is None:
      cos, sin = self.cos_sin(position_b[:, None])
    else:
      cos, sin = (table[position_b][:, None] for table in rope_table)
    x_btd = self.embed(token_b[:, None])
    keys, values = [], []
    mask_bs = kv_mask_bs.astype(bool)
    layers_t = [None] * len(self.layers) if weights_t is None else weights_t["layers"]
    for layer, pk, pv, k_bkhs, v_bksh, layer_t in zip(self.layers, prompt["k"], prompt["v"],
                                                      cache["k"], cache["v"], layers_t):
      x_btd, k_bkhs, v_bksh = layer.cached_shared(x_btd, cos, sin, pk, pv, prompt_mask_ps,
                                                  k_bkhs, v_bksh, mask_bs, cache_index, layer_t)
      keys.append(k_bkhs)
      values.append(v_bksh)
    head_t = None if weights_t is None else weights_t.get("lm_head")
    logits_btv = self.logits(self.norm(x_btd), head_t, weights_first=weights_t is not None)
    return logits_btv[:, 0], {"k": keys, "v": values}

  def hidden_cached(self, tokens_bt: jax.Array, positions_bt: jax.Array, cache: Cache,
                    cache_index: jax.Array, kv_mask_bs: jax.Array) -> tuple[jax.Array, Cache]:
    """`forward_cached` before the lm head: final-normed hidden states [B, T, D] and the cache.

    A prefill needs the logits of the last prompt position only; taking them from these hidden
    states avoids forming [B, T, V] (XLA does not slice the lm-head matmul by itself).
    """
    mask_bts = slot_mask(kv_mask_bs, cache_index, tokens_bt.shape[1])
    cos, sin = self.cos_sin(positions_bt)
    x_btd = self.embed(tokens_bt)
    keys, values = [], []
    for layer, k_bkhs, v_bksh in zip(self.layers, cache["k"], cache["v"]):
      x_btd, k_bkhs, v_bksh = layer.cached(x_btd, cos, sin, mask_bts, k_bkhs, v_bksh, cache_index)
      keys.append(k_bkhs)
      values.append(v_bksh)
    return self.norm(x_btd), {"k": keys, "v": values}

  def prefill(self, tokens_bt: jax.Array, positions_bt: jax.Array, kv_mask_bt: jax.Array
              ) -> tuple[jax.Array, Cache]:
    """`hidden_cached` of the tokens into an empty cache of T slots: final-normed hidden states
    [B, T, D] and the cache (in `cfg.dtype`, as `init_cache`'s). Each layer makes its own cache,
    and with `cfg.remat` the layers run as a scan (`through_layers`), so one layer's gathered
    weights are live at a time, not every layer's (unrolled, XLA:CPU gathers them all up front;
    docs/scaling.md); the scan's stacked cache is split into one array per layer (a copy)."""
    b, t = tokens_bt.shape
    mask_bts = slot_mask(kv_mask_bt, 0, t)
    cos, sin = self.cos_sin(positions_bt)

    def block(layer, x_btd):
      k_bkhs, v_bksh = layer_cache(self.cfg, b, t)
      x_btd, k_bkhs, v_bksh = layer.cached(x_btd, cos, sin, mask_bts, k_bkhs, v_bksh,
                                           jnp.int32(0))
      return x_btd, {"k": k_bkhs, "v": v_bksh}

    x_btd, cache = self.through_layers(block, self.embed(tokens_bt))
    return self.norm(x_btd), cache

  def hidden_continuations(self, prompt_pt: jax.Array, positions_pt: jax.Array,
                           pmask_pt: jax.Array, completion_bn: jax.Array, positions_bn: jax.Array,
                           mask_bs: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """Final-normed hidden states of P prompts [P, T, D] and of their rows' completions
    [B, N, D], B = P * group, row b continuing prompt b // group: the values of `hidden_cached`
    of the prompts into a cache of T + N slots (kv mask `pmask`), then of the completions at slot
    T over that cache repeated to the rows (kv mask `mask_bs` [B, T + N]), computed layer by
    layer instead of pass by pass.

    Why layer by layer: run as two passes over the layers, a program uses each layer's weights
    in both, so it keeps every layer's FSDP-gathered weights and every layer's prompt cache from
    the first pass to the second (all the model's at once; docs/scaling.md has the figures).
    Here a layer runs its prompts and then their completions, and only that layer's cache, and
    its copy repeated to the rows, exist while it runs; with `cfg.remat` the layers run as a
    scan (`through_layers`), so only that layer's gathered weights do too (unrolled, XLA:CPU
    gathers every layer's up front).
    """
    p, t = prompt_pt.shape
    n = completion_bn.shape[1]
    repeat = lambda x: jnp.repeat(x, group, axis=0)
    kv_mask_ps = jnp.concatenate([pmask_pt.astype(bool), jnp.zeros((p, n), bool)], axis=1)
    prompt_mask, completion_mask = slot_mask(kv_mask_ps, 0, t), slot_mask(mask_bs, t, n)
    (cos_p, sin_p), (cos_b, sin_b) = self.cos_sin(positions_pt), self.cos_sin(positions_bn)

    def block(layer, carry):
      x_ptd, x_bnd = carry
      k_pkhs, v_pksh = layer_cache(self.cfg, p, t + n)
      x_ptd, k_pkhs, v_pksh = layer.cached(x_ptd, cos_p, sin_p, prompt_mask, k_pkhs, v_pksh,
                                           jnp.int32(0))
      x_bnd, _, _ = layer.cached(x_bnd, cos_b, sin_b, completion_mask, repeat(k_pkhs),
                                 repeat(v_pksh), jnp.int32(t))
      return (x_ptd, x_bnd), None

    (x_ptd, x_bnd), _ = self.through_layers(block, (self.embed(prompt_pt),
                                                    self.embed(completion_bn)))
    return self.norm(x_ptd), self.norm(x_bnd)


def slot_mask(kv_mask_bs: jax.Array, cache_index, t: int) -> jax.Array:
  """bool [B, T, S]: query t (at cache slot cache_index + t) sees slot s iff kv_mask[b, s] and
  s <= cache_index + t (causality by slot index)."""
  slot_s = jnp.arange(kv_mask_bs.shape[-1])
  query_slot_t = cache_index + jnp.arange(t)
  return kv_mask_bs.astype(bool)[:, None, :] & (slot_s[None, :] <= query_slot_t[:, None])[None]
