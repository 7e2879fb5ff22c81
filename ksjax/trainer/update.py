"""The jitted update: loss, gradient accumulation over micro-batches, optimizer, non-finite skip.

One call of `Updater.step` is one optimizer step on one mini-batch of completions, laid out as
[M, m, T]: M micro-batches of m rows, of which the first `count` are run, a loop that sums
gradients (its trip count an argument, so the number of rows kept changes no shape;
`ksjax.trainer.sparse.layout`). Why a loop and not `optax.MultiSteps`: the losses are sums over tokens with weights normalised over
the whole mini-batch (`losses.token_weights`), so the mini-batch gradient is exactly the *sum* of
the micro-batch gradients; the loop computes it in one compiled call, with one host round trip per
optimizer step, no gradient buffer inside the optimizer state (so checkpoints do not carry one),
and the finiteness check sees the whole accumulated gradient before anything is applied.

Non-finite steps. `optax.apply_if_finite` checks only the gradient and, after
`max_consecutive_errors` bad steps, lets a non-finite update through; here a non-finite loss or
gradient never reaches the parameters or the optimizer state: the step's new state is discarded
(`jnp.where` on every leaf) and `TrainState.skipped` counts it.

The value model (PPO) is the policy's own trunk with a scalar head (`LlamaConfig.value_head`),
read at the prompt's last token: V(x) depends on the prompt only, as in the paper's appendix, so it
is computed from the prompt columns alone (a forward over P of the T columns). A separate critic
would double the parameters and the optimizer state (at 70B, another 70B model) and its forward;
the shared trunk costs one d-vector. Its value-loss gradient reaches the trunk, scaled by
`value_coef`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ksjax import model
from ksjax.model import logprobs, lora
from ksjax.run.spec import LossSpec, TrainSpec
from ksjax.trainer import batch as batch_lib
from ksjax.trainer import losses
from ksjax.trainer.batch import MicroBatch, row_sharding

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  """Everything an update changes, and the run's random key (checkpointed together)."""
  params: nnx.State
  opt_state: Any
  step: jax.Array      # int32 [], optimizer steps taken (skipped ones included)
  skipped: jax.Array   # int32 [], steps whose loss or gradient was not finite
  rng: jax.Array       # key [], the run's random stream (sampling seeds, minibatch order)


def prompt_values(llama: model.Llama, tokens_rt: jax.Array, mask_rt: jax.Array,
                  prompt_len: int) -> jax.Array:
  """V(x) per row, float32 [R]: the value head at the last prompt column (prompts are left-padded
  to `prompt_len`, so that column is every row's last prompt token)."""
  hidden_rpd = llama.hidden(tokens_rt[:, :prompt_len], attention_mask=mask_rt[:, :prompt_len])
  return llama.value(hidden_rpd[:, -1:])[:, 0]


def completion_logprobs(llama: model.Llama, tokens_rt: jax.Array, mask_rt: jax.Array,
                        temperature: float, prompt_len: int, group: int = 1) -> jax.Array:
  """Per-token log-probs [R, T] of the rows' completions (0 in the first `prompt_len` columns):
  `group` > 1, the rows come in blocks of `group` continuing one prompt (`sparse.shared`), each
  prompt run once (`logprobs.continuation_logprobs`); else each row whole."""
  if group > 1:
    logp_rn = logprobs.continuation_logprobs(llama, tokens_rt, mask_rt, prompt_len, group,
                                             temperature)
    return jnp.concatenate([jnp.zeros((logp_rn.shape[0], prompt_len), jnp.float32), logp_rn],
                           axis=1)
  return model.token_logprobs(llama, tokens_rt, mask_rt, temperature, start=prompt_len)[0]


def shares_prompts(loss: LossSpec, dropout: bool) -> bool:
  """Whether an update may run a group's prompt once for its rows (`LossSpec.shares_prompts`):
  not under LoRA's dropout (`dropout`), where a shared prompt would share its masks between the
  rows, not the same gradient's distribution. The learner (`Updater.shares_prompts`) and the
  memory plan decide by this one rule."""
  return loss.shares_prompts and not dropout


def loss_and_metrics(llama: model.Llama, mb: MicroBatch, cfg: LossSpec, temperature: float,
                     prompt_len: int, group: int = 1) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The weighted-sum loss of one micro-batch ([m, T] and [m] fields, see `MicroBatch`) and
  metric sums (added up over micro-batches). For ppo `advantage` holds the return R_i; the
  advantage is R_i - V_old(x). Log-probs are taken at the sampling `temperature`, so that they
  describe the distribution the completions were drawn from. `group`: as `completion_logprobs`
  (ppo's values read each row's prompt: 1 only)."""
  if group > 1 and cfg.algorithm == "ppo":
    raise ValueError("ppo's value loss reads each row's prompt; expected group=1")
  logp_rt = completion_logprobs(llama, mb.tokens, mb.attention_mask, temperature, prompt_len,
                                group)
  weight_rt = mb.token_weight
  on_rt = (weight_rt > 0).astype(jnp.float32)
  metrics = {"tokens": on_rt.sum()}
  if cfg.algorithm == "pg":
    is_rt = _is_weight(mb, logp_rt, cfg)
    loss_rt = losses.policy_gradient(logp_rt, mb.advantage, is_rt)
    # How far the learner now is from the sampler (on-policy: their numerical mismatch).
    log_ratio_rt = jax.lax.stop_gradient(logp_rt) - mb.behaviour_logp
  else:
    is_rt = _is_weight(mb, mb.old_logp, cfg)
    advantage_r = mb.advantage
    if cfg.algorithm == "ppo":
      advantage_r = advantage_r - mb.old_value
    loss_rt, clipped_rt = losses.clipped_surrogate(logp_rt, mb.old_logp, advantage_r, is_rt,
                                                   cfg.clip_eps)
    metrics["clipped_tokens"] = (clipped_rt * on_rt).sum()
    log_ratio_rt = mb.old_logp - mb.behaviour_logp  # the learner-sampler mismatch
  pg_loss = (weight_rt * loss_rt).sum()
  metrics["pg_loss"] = pg_loss
  metrics["is_weight_sum"] = (is_rt * on_rt).sum()
  metrics["is_weight_max"] = (is_rt * on_rt).max()  # a "_max" metric: maxed, not summed
  if cfg.group_is:
    metrics["is_truncated_tokens"] = ((mb.is_weight[:, None] >= cfg.is_cap) * on_rt).sum()
  elif cfg.is_cap is not None:
    metrics["is_truncated_tokens"] = ((log_ratio_rt > jnp.log(cfg.is_cap)) * on_rt).sum()
  metrics["log_ratio_abs_sum"] = (jnp.abs(log_ratio_rt) * on_rt).sum()
  loss = pg_loss
  if cfg.algorithm == "ppo":
    values_r = prompt_values(llama, mb.tokens, mb.attention_mask, prompt_len)
    vloss_r, vclipped_r = losses.clipped_value_loss(values_r, mb.old_value, mb.advantage,
                                                    cfg.value_clip)
    value_loss = (mb.value_weight * vloss_r).sum()
    metrics["value_loss"] = value_loss
    metrics["value_clipped"] = (vclipped_r * (mb.value_weight > 0)).sum()
    metrics["value_rows"] = (mb.value_weight > 0).sum().astype(jnp.float32)
    loss = loss + cfg.value_coef * value_loss
  if cfg.kl_coef > 0:
    kl_rt = losses.kl_per_token(logp_rt, mb.ref_logp, cfg.kl_estimator)
    kl_loss = (weight_rt * kl_rt).sum()
    metrics["kl_loss"] = kl_loss
    loss = loss + cfg.kl_coef * kl_loss
  metrics["loss"] = loss
  return loss, metrics


def _is_weight(mb: MicroBatch, logp_rt: jax.Array, cfg: LossSpec) -> jax.Array:
  """The truncated importance weights [m, T]: the row's group weight (`LossSpec.group_is`,
  computed by the learner), else min(exp(logp - behaviour), is_cap) per token."""
  if cfg.group_is:
    return jnp.broadcast_to(mb.is_weight[:, None], logp_rt.shape)
  return losses.truncated_is_weight(logp_rt, mb.behaviour_logp, cfg.is_cap)


def add_metrics(sums: dict, metrics: dict) -> dict:
  """Metric sums over micro-batches (or optimizer steps): added, but maxed for "*_max"."""
  return {name: (jnp.maximum if name.endswith("_max") else jnp.add)(sums[name], value)
          for name, value in metrics.items()}


def _optimizer_step(optimizer: optax.GradientTransformation, state: TrainState, grads: Any,
                    sums: dict) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step on a step's summed gradient, kept only where its loss and gradient are
  finite (else counted as skipped); returns the new state and the metric sums with grad_norm and
  finite (0/1)."""
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = TrainState(params=keep(params, state.params),
                         opt_state=keep(opt_state, state.opt_state),
                         step=state.step + 1, skipped=state.skipped + (~finite).astype(jnp.int32),
                         rng=state.rng)
  return new_state, {**sums, "grad_norm": grad_norm, "finite": finite.astype(jnp.float32)}


class Updater:
  """Compiled update and forward-only programs for one model structure, optimizer, loss and
  mesh. `build_updater` makes the trainer's; the supervised warm-up makes its own from the same
  class (a weight-1 policy-gradient loss is the token-weighted log-likelihood).

  Programs are compiled once per distinct batch shape: per micro-batch size, whatever the number
  of rows kept (`ksjax.trainer.sparse.layout`).
  """

  def __init__(self, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
               loss: LossSpec, mesh: jax.sharding.Mesh, *, temperature: float = 1.0,
               frozen: nnx.State | None = None, dropout: bool = False):
    self.graphdef = graphdef
    # Under LoRA (`ksjax.model.lora.split`) the parameters a TrainState holds are the adapters
    # alone and `frozen` is the base: every program takes it as an argument (a closed-over array
    # would be copied into the program as a constant), never differentiated or donated.
    self.frozen = frozen
    # LoRA's dropout on the adapters' inputs in the update (not in forward-only programs): its
    # mask is drawn from the run's key and the optimizer step (`_dropout_key`), so a resumed run
    # draws the masks an uninterrupted one draws.
    self.dropout = dropout
    self.optimizer = optimizer
    self.loss = loss
    self.temperature = temperature
    self.mesh = mesh
    self._replicated = NamedSharding(mesh, P())
    self._steps: dict[Any, Callable] = {}
    self._forwards: dict[Any, Callable] = {}
    self._zero_step: Callable | None = None

  @property
  def shares_prompts(self) -> bool:
    """Whether this update may run a group's prompt once for its rows (`shares_prompts`)."""
    return shares_prompts(self.loss, self.dropout)

  def policy(self, params: nnx.State):
    """The model these parameters (a TrainState's) make: with the frozen base under LoRA."""
    return lora.join(self.graphdef, params, self.frozen)

  # -- state -----------------------------------------------------------------------------------

  def state_shardings(self, params: nnx.State) -> TrainState:
    """NamedShardings of a TrainState built on `params` (placed by `model.shard`)."""
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    abstract_opt = jax.eval_shape(self.optimizer.init, params)
    opt_shardings = optax.tree_map_params(
        self.optimizer, lambda _, s: s, abstract_opt, param_shardings,
        transform_non_params=lambda _: self._replicated)
    rep = self._replicated
    return TrainState(params=param_shardings, opt_state=opt_shardings, step=rep, skipped=rep,
                      rng=rep)

  def init_state(self, params: nnx.State, rng: jax.Array) -> TrainState:
    """A fresh TrainState (step 0) around `params`, every leaf placed by its sharding."""
    shardings = self.state_shardings(params)

    def init(params, rng):
      return TrainState(params=params, opt_state=self.optimizer.init(params),
                        step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32), rng=rng)

    return jax.jit(init, out_shardings=shardings)(params, rng)

  def abstract_state(self, params: nnx.State) -> TrainState:
    """ShapeDtypeStructs (with shardings) of a TrainState, the target for restoring one."""
    shardings = self.state_shardings(params)
    abstract = jax.eval_shape(
        lambda p: TrainState(params=p, opt_state=self.optimizer.init(p),
                             step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32),
                             rng=jax.random.key(0)), params)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)

  @property
  def batch_shards(self) -> int:
    """Devices the rows of a micro-batch are split over (data x fsdp)."""
    return model.sharding.batch_shards(self.mesh)

  def place_rows(self, array_mm: Any) -> jax.Array:
    """One [M, m, ...] host array on the mesh, rows split over data x fsdp."""
    return jax.device_put(array_mm, row_sharding(self.mesh, array_mm.ndim))

  def place(self, batch: MicroBatch) -> MicroBatch:
    """Puts a host batch of [M, m, ...] arrays on the mesh, rows split over data x fsdp."""
    return batch.place(self.mesh)

  # -- programs --------------------------------------------------------------------------------

  def step(self, state: TrainState, batch: MicroBatch, prompt_len: int,
           count: int | None = None, group: int = 1) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on the first `count` micro-batches of a placed [M, m, ...] batch (None:
    all M; the rest are never read); returns the new state (the old one is donated) and metric
    sums: the micro-batch sums plus grad_norm and finite (0/1). `group` > 1: each micro-batch's
    rows come in blocks of `group` continuing one prompt, run once (`sparse.shared`)."""
    num_micro = jax.tree.leaves(batch)[0].shape[0]
    count = num_micro if count is None else count
    if not 1 <= count <= num_micro:
      raise ValueError(f"count={count} micro-batches of a batch of {num_micro}")
    return self.step_program(state, batch, prompt_len, group)(state, batch, count)

  def step_program(self, state: TrainState, batch: MicroBatch, prompt_len: int, group: int = 1):
    """The jitted update for this batch shape and `group`, called as (state, batch, count)
    (built once per shape, whatever the count; `.lower(state, batch)` it to inspect the
    compiled program, e.g. its FLOP count)."""
    micro = jax.tree.leaves(batch)[0].shape[1]
    if micro % group:
      raise ValueError(f"micro-batches of {micro} rows do not hold whole blocks of {group}")
    key = (prompt_len, group, batch.shape_key())
    if key not in self._steps:
      self._steps[key] = self._build_step(state, batch, prompt_len, group)
    return self._steps[key]

  def zero_step(self, state: TrainState) -> tuple[TrainState, dict[str, jax.Array]]:
    """The optimizer step of a sparse mini-batch none of whose rows has a non-zero weight.

    With sparse updates every loss term is a row's weight times its terms (`LossSpec.use_sparse`
    rules out the value loss and the KL penalty), so such a step's gradient is exactly zero: its
    forward and backward over padding rows would compute nothing but zeros. This program gives
    `_optimizer_step` zero gradients and zero metric sums instead (AdamW still moves the weights
    by its moments and the schedule advances, as in the padded step), so it reports what the
    padded step reports. One program for every such step, whatever the batch shape."""
    if not self.loss.use_sparse:
      raise ValueError("zero_step is the sparse update's: a dense loss term reads every row")
    if self._zero_step is None:
      shards = self.batch_shards
      # The loss's metric names and shapes, traced on a two-token batch (nothing is computed).
      mb = batch_lib.abstract(self.loss, self.mesh, rows=shards, micro=shards, seq_len=2)
      sums = jax.eval_shape(lambda p, b, f: self._micro_loss(
          p, jax.tree.map(lambda x: x[0], b), f, prompt_len=1)[1], state.params, mb, self.frozen)

      def update(state: TrainState):
        return _optimizer_step(self.optimizer, state,
                               jax.tree.map(jnp.zeros_like, state.params),
                               jax.tree.map(jnp.zeros_like, sums))

      shardings = jax.tree.map(lambda x: x.sharding, state)
      self._zero_step = jax.jit(update, in_shardings=(shardings,),
                                out_shardings=(shardings, self._replicated), donate_argnums=(0,))
    return self._zero_step(state)

  def _micro_loss(self, params, mb: MicroBatch, frozen, prompt_len: int, group: int = 1,
                  dropout_key: jax.Array | None = None):
    """`loss_and_metrics` of one micro-batch, with the mesh's activation shardings (and LoRA's
    dropout drawn from `dropout_key` when there is one)."""
    # With dropout the merged model's RNG stream is reseeded in this trace: its Variables must be
    # this trace's own (copy=True), not the frozen state's, which was made outside it.
    llama = lora.join(self.graphdef, params, frozen, copy=dropout_key is not None)
    if dropout_key is not None:
      llama = lora.with_dropout_key(llama, dropout_key)
    with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
      return loss_and_metrics(llama, mb, self.loss, self.temperature, prompt_len, group)

  def _dropout_key(self, state: TrainState, micro: jax.Array | int) -> jax.Array | None:
    """The key of LoRA's dropout masks in micro-batch `micro` of this optimizer step: the run's
    key as the update receives it (checkpointed; an update never advances it) folded with the
    optimizer step count and the micro-batch, so no two micro-batches share masks; None without
    dropout."""
    if not self.dropout:
      return None
    return jax.random.fold_in(jax.random.fold_in(state.rng, state.step), micro)

  def _build_step(self, state: TrainState, batch, prompt_len: int, group: int):
    micro_loss = functools.partial(self._micro_loss, prompt_len=prompt_len, group=group)
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def update(state: TrainState, batch, count, frozen):
      first_mb = jax.tree.map(lambda x: x[0], batch)
      num_micro = jax.tree.leaves(batch)[0].shape[0]
      if num_micro == 1:  # one micro-batch: nothing to accumulate
        (_, sums), grads = grad_fn(state.params, first_mb, frozen,
                                   dropout_key=self._dropout_key(state, 0))
        return _optimizer_step(self.optimizer, state, grads, sums)

      def accumulate(index, carry):
        grads, sums = carry
        mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), batch)
        (_, metrics), g = grad_fn(state.params, mb, frozen,
                                  dropout_key=self._dropout_key(state, index))
        return jax.tree.map(jnp.add, grads, g), add_metrics(sums, metrics)

      zero_metrics = jax.tree.map(
          jnp.zeros_like, jax.eval_shape(lambda: micro_loss(state.params, first_mb, frozen)[1]))
      zero_grads = jax.tree.map(jnp.zeros_like, state.params)
      # A loop whose trip count is an argument (a while loop, not a scan over all M): the batch
      # is laid out for the mini-batch's every row, and only its first `count` micro-batches hold
      # kept rows (`sparse.layout`), so one program serves every count.
      grads, sums = jax.lax.fori_loop(0, count, accumulate, (zero_grads, zero_metrics))
      return _optimizer_step(self.optimizer, state, grads, sums)

    shardings = jax.tree.map(lambda x: x.sharding, state)
    batch_shardings = jax.tree.map(lambda v: v.sharding, batch)
    frozen_shardings = jax.tree.map(lambda x: x.sharding, self.frozen)
    step = jax.jit(update,
                   in_shardings=(shardings, batch_shardings, self._replicated, frozen_shardings),
                   out_shardings=(shardings, self._replicated), donate_argnums=(0,))
    return _WithFrozen(step, self)

  def forward(self, params: nnx.State, tokens_mmt: jax.Array, mask_mmt: jax.Array, *,
              values: bool = False, prompt_len: int = 0, count: int | None = None,
              group: int = 1) -> dict[str, jax.Array]:
    """Forward only, micro-batch by micro-batch over the first `count` of the M (None: all):
    per-token log-probs [M, m, T] of `tokens_mmt` at the loss temperature (0 in the first
    `prompt_len` columns: the head runs on the completions' alone), and with `values` the prompt
    values V(x) [M, m]; zeros in the micro-batches not run.

    `group` > 1: each micro-batch is whole groups of `group` rows that share their prompt (a
    rollout's layout), so each prompt runs once and its rows' completions over its KV cache
    (`logprobs.continuation_logprobs`, equal within float32 rounding): the reference forward,
    whose 4 samples per prompt ran the prompt 4 times."""
    count = tokens_mmt.shape[0] if count is None else count
    program = self.forward_program(tokens_mmt.shape, values=values, prompt_len=prompt_len,
                                   group=group)
    return program(params, self.frozen, tokens_mmt, mask_mmt, np.int32(count))

  def forward_program(self, shape: tuple[int, ...], *, values: bool = False, prompt_len: int = 0,
                      group: int = 1):
    """`forward`'s jitted program for [M, m, T] tokens, called as (params, frozen, tokens_mmt,
    mask_mmt, count); one per shape and options, kept for the Updater's life (the memory plan
    lowers it abstractly)."""
    num_micro, micro = shape[:2]
    group = 1 if values or prompt_len < 1 else group
    if micro % group:
      raise ValueError(f"micro-batches of {micro} rows do not hold whole groups of {group}")
    key = (values, prompt_len, group, tuple(shape))
    if key not in self._forwards:
      graphdef, temperature = self.graphdef, self.temperature

      def fwd(params, frozen, tokens_mmt, mask_mmt, count):
        def one(tokens_rt, mask_rt):
          llama = lora.join(graphdef, params, frozen)
          with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):  # activation shardings
            out = {"logp": completion_logprobs(llama, tokens_rt, mask_rt, temperature,
                                               prompt_len, group)}
            if values:
              out["value"] = prompt_values(llama, tokens_rt, mask_rt, prompt_len)
          return out

        # As the update's loop: a trip count read at run time, one program for every count.
        shapes = jax.eval_shape(one, tokens_mmt[0], mask_mmt[0])
        outputs = jax.tree.map(lambda s: jnp.zeros((num_micro, *s.shape), s.dtype), shapes)

        def body(index, outputs):
          take = lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False)
          out = one(take(tokens_mmt), take(mask_mmt))
          return jax.tree.map(lambda o, v: jax.lax.dynamic_update_index_in_dim(o, v, index, 0),
                              outputs, out)

        return jax.lax.fori_loop(0, count, body, outputs)

      self._forwards[key] = jax.jit(fwd)
    return self._forwards[key]


class _WithFrozen:
  """A jitted update called as (state, batch, count), the frozen base passed as its last
  argument (`Updater.frozen`); `.lower(state, batch)` lowers it the same way (for every count)."""

  def __init__(self, jitted, updater: Updater):
    self._jitted, self._updater = jitted, updater

  def __call__(self, state, batch, count):
    return self._jitted(state, batch, np.int32(count), self._updater.frozen)

  def lower(self, state, batch):
    count = jax.ShapeDtypeStruct((), jnp.int32)
    return self._jitted.lower(state, batch, count, self._updater.frozen)


def build_updater(spec: TrainSpec, graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh,
                  frozen: nnx.State | None = None) -> Updater:
  """The update program of a run: its loss, its optimizer, on its mesh (under LoRA, with the
  frozen base `frozen`). The one builder the trainer, the memory plan, the tests and the
  benchmarks use."""
  return Updater(graphdef, spec.optimizer.build(), spec.loss, mesh,
                 temperature=spec.sampling.temperature, frozen=frozen,
                 dropout=spec.lora.drops_out)
