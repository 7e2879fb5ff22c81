"""The batch one optimizer step consumes: M micro-batches of m rows, T columns.

The learner builds it on the host from a rollout (`learner.learn`), the `Updater` places it on
the mesh (rows over data x fsdp) and loops the loss over its leading axis, so inside the loss
every array has lost the M axis ([m, T], [m]). The memory plan builds the same structure out of
ShapeDtypeStructs (`abstract`). Which optional fields are present depends on the loss
(`LossSpec`): they are None otherwise, which a pytree carries as no leaves at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from ksjax.model import sharding
from ksjax.run.spec import LossSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MicroBatch:
  """Rows of completions as the loss reads them ([M, m, ...] stacked; [m, ...] in the loss)."""
  tokens: Any                # int32 [M, m, T], prompt (left-padded) then completion
  attention_mask: Any        # bool [M, m, T]
  token_weight: Any          # float32 [M, m, T], c_rt: 0 outside completions and on padding rows
  behaviour_logp: Any        # float32 [M, m, T], the sampler's log-probs
  advantage: Any             # float32 [M, m], the k-sample weight (ppo: the return R_i)
  old_logp: Any = None       # float32 [M, m, T], the learner's before the step (clipped stacks)
  old_value: Any = None      # float32 [M, m], V_old(x) (ppo)
  value_weight: Any = None   # float32 [M, m], the value loss's row weights (ppo)
  ref_logp: Any = None       # float32 [M, m, T], the reference policy's (KL penalty)
  is_weight: Any = None      # float32 [M, m], the row's group-level importance weight

  def arrays(self) -> dict[str, Any]:
    """The present fields by name."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None}

  def shape_key(self) -> tuple:
    """What a compiled program depends on: the present fields and their shapes."""
    return tuple(sorted((name, tuple(v.shape)) for name, v in self.arrays().items()))

  def split(self, micro: int) -> "MicroBatch":
    """[rows, ...] host arrays -> [rows / micro, micro, ...] (rows a multiple of micro)."""
    return jax.tree.map(lambda v: v.reshape(v.shape[0] // micro, micro, *v.shape[1:]), self)

  def place(self, mesh: jax.sharding.Mesh) -> "MicroBatch":
    """On the mesh: rows (axis 1) split over the batch axes data x fsdp."""
    return jax.tree.map(lambda v: jax.device_put(v, row_sharding(mesh, v.ndim)), self)


def row_sharding(mesh: jax.sharding.Mesh, ndim: int) -> NamedSharding:
  """[M, m, ...] micro-batched arrays: rows (axis 1) over the batch axes."""
  return NamedSharding(mesh, P(None, sharding.BATCH, *([None] * (ndim - 2))))


def present_fields(loss: LossSpec) -> tuple[str, ...]:
  """The optional fields a loss reads."""
  out = []
  if loss.clipped:
    out.append("old_logp")
  if loss.algorithm == "ppo":
    out += ["old_value", "value_weight"]
  if loss.kl_coef > 0:
    out.append("ref_logp")
  if loss.group_is:
    out.append("is_weight")
  return tuple(out)


_DTYPES = {"tokens": (jnp.int32, 3), "attention_mask": (jnp.bool_, 3),
           "token_weight": (jnp.float32, 3), "behaviour_logp": (jnp.float32, 3),
           "advantage": (jnp.float32, 2), "old_logp": (jnp.float32, 3),
           "old_value": (jnp.float32, 2), "value_weight": (jnp.float32, 2),
           "ref_logp": (jnp.float32, 3), "is_weight": (jnp.float32, 2)}


def abstract(loss: LossSpec, mesh: jax.sharding.Mesh, *, rows: int, micro: int,
             seq_len: int) -> MicroBatch:
  """ShapeDtypeStructs (with shardings) of the batch of one dense optimizer step."""
  names = ("tokens", "attention_mask", "token_weight", "behaviour_logp", "advantage",
           *present_fields(loss))
  fields = {}
  for name in names:
    dtype, ndim = _DTYPES[name]
    shape = (rows // micro, micro) + (seq_len,) * (ndim - 2)
    fields[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=row_sharding(mesh, ndim))
  return MicroBatch(**fields)
