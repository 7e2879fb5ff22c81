"""The device mesh and every parameter's partition spec, in one place.

Mesh axes are ("data", "fsdp", "tensor"):
  * data:   pure data parallelism (batch split, parameters replicated);
  * fsdp:   batch split and parameters sharded along the model dimension (gathered per layer);
  * tensor: Megatron tensor parallelism: q/k/v/gate/up column-split (heads, mlp), o/down row-split,
            the embedding and lm head split over the vocabulary.

Each parameter name carries logical axes (`PARAM_AXES`), and so does each kind of activation the
model constrains (`ACTIVATION_AXES`); `LOGICAL_TO_MESH` maps those to mesh axes, and nothing else in
the code base names a mesh axis for a parameter or an activation. `LOGICAL_TO_FIELD` lets a mesh
that cannot divide a dimension be reported by the config field that sets it.

Axis types: the mesh is built with `AxisType.Auto` on purpose. Under `Explicit` axes (jax's default
for `make_mesh` in 0.10) every einsum whose operands disagree, e.g. x[B@fsdp, D] @ W[D@fsdp, F@tensor]
in FSDP, must be resolved by hand with `out_sharding=`/`reshard`, which would thread mesh knowledge
through every layer. With Auto axes the model code stays mesh-agnostic: `jax.jit` receives explicit
in/out shardings (parameters by spec, batch over data x fsdp) and the partitioner inserts the FSDP
all-gathers and tensor-parallel reductions.

Activations. Left alone, the partitioner may resolve x[B@fsdp, T, D] @ W[D@fsdp, F] by keeping the
weight sharded and the rows whole, so that every device computes every row of the micro-batch (it
does for Llama-sized widths: f32[m, T, F] MLP activations on each device). `constrain` pins the
hidden states, heads and MLP activations to their `ACTIVATION_AXES` (rows over data x fsdp; heads,
MLP columns and the hidden states' sequence over tensor), which makes it gather the weight
instead: the FSDP pattern. As in flax's `with_logical_constraint`, the constraints are no-ops
unless a mesh is set for tracing (`jax.sharding.use_abstract_mesh(mesh.abstract_mesh)` inside the
jitted function, or `jax.set_mesh` around the jit), so the model runs unchanged on one device, in
the parity tests and in programs that do not set one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from absl import logging
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from ksjax.config_validation import ConfigError
from ksjax.model.config import LlamaConfig

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # the mesh axes a batch dimension is split over

# Parameter name (last path element) -> logical axis of each dimension.
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed_tokens": ("vocab", "embed"),       # [V, D]
    "lm_head": ("embed", "vocab"),            # [D, V]
    "q_proj": ("embed", "heads", None),       # [D, N, H]
    "k_proj": ("embed", "kv_heads", None),    # [D, K, H]
    "v_proj": ("embed", "kv_heads", None),    # [D, K, H]
    "o_proj": ("heads", None, "embed"),       # [N, H, D]
    "gate_proj": ("embed", "mlp"),            # [D, F]
    "up_proj": ("embed", "mlp"),              # [D, F]
    "down_proj": ("mlp", "embed"),            # [F, D]
    "scale": ("embed",),                      # [D] RMSNorm
    "value_head": ("embed",),                 # [D]
    "value_bias": (),                         # []
}

# How many leading axes of each weight matrix are its input (contracted) axes; the rest are its
# output axes. A low-rank adapter of a weight (`ksjax.model.lora`, qwix's names) is
# `<name>_lora_a` [*input axes, rank] and `<name>_lora_b` [rank, *output axes], each split as the
# weight's axes it keeps (the rank axis replicated); a quantized weight (QLoRA's base, a
# `qwix.QArray`) is `<name>/qvalue`, split as the weight, and `<name>/scale`, split as the weight's
# output axes (its input axes hold one scale per group, and are replicated).
INPUT_AXES: dict[str, int] = {
    "q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2,
    "gate_proj": 1, "up_proj": 1, "down_proj": 1, "lm_head": 1,
}
_LORA_SUFFIXES = ("_lora_a", "_lora_b")
# An RNG stream's key and counter (LoRA's dropout, `nnx.Dropout`): scalars, replicated.
_RNG_LEAVES = ("key", "count")

# Activation kind (named by its shape letters) -> logical axis of each dimension. Hidden states
# (the residual stream, norms, block inputs) are split along the sequence over tensor: Megatron's
# sequence parallelism. The all-reduce after the row-split o/down matmuls becomes a
# reduce-scatter, an all-gather precedes the column-split q/k/v/gate/up matmuls (the same traffic),
# and the block inputs the backward pass keeps (one [B, T, D] per layer under remat) are 1/tensor
# per device instead of replicated.
ACTIVATION_AXES: dict[str, tuple[str | None, ...]] = {
    "btd": ("batch", "length", None),          # hidden states, block inputs and outputs
    "btnh": ("batch", None, "heads", None),    # queries, attention outputs
    "btkh": ("batch", None, "kv_heads", None),  # keys, values
    "btf": ("batch", None, "mlp"),             # SwiGLU activations
    "btv": ("batch", None, "vocab"),           # logits
}

LOGICAL_TO_MESH: dict[str, str | tuple[str, ...]] = {
    "batch": BATCH,
    "length": "tensor",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "embed": "fsdp",
}

LOGICAL_TO_FIELD: dict[str, str] = {
    "vocab": "vocab_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "mlp": "intermediate_size",
    "embed": "hidden_size",
}


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A ("data", "fsdp", "tensor") mesh; one entry may be -1 meaning "all remaining devices".

  A mesh smaller than the device count uses the first devices (with a warning), so that e.g.
  (1, 1, 1) runs unsharded on a machine with several devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = tuple(int(s) for s in shape)
  if len(shape) != 3 or any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
    raise ConfigError(f"mesh={shape!r} is not accepted; expected three positive sizes for "
                      f"{AXES}, at most one of them -1")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if len(devices) % known:
      raise ConfigError(f"mesh={shape!r}: {len(devices)} devices are not divisible by {known}")
    shape = tuple(len(devices) // known if s == -1 else s for s in shape)
  if math.prod(shape) > len(devices):
    raise ConfigError(f"mesh={shape!r} needs {math.prod(shape)} devices; there are {len(devices)}")
  if math.prod(shape) < len(devices):
    logging.warning("mesh %s uses %d of the %d devices", shape, math.prod(shape), len(devices))
    devices = devices[:math.prod(shape)]
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def param_name(path: Sequence) -> str:
  """The parameter name of a state path, e.g. ('layers', 0, 'self_attn', 'q_proj') -> 'q_proj'."""
  return str(path[-1])


def logical_axes(path: Sequence) -> tuple[str | None, ...]:
  """The logical axes of the parameter at `path` (`PARAM_AXES`, and the adapters, quantized
  weights and RNG streams of a LoRA model as `INPUT_AXES` says)."""
  name = param_name(path)
  parent = str(path[-2]) if len(path) > 1 else ""
  if name.endswith(_LORA_SUFFIXES) and name[:-len("_lora_a")] in INPUT_AXES:
    weight = name[:-len("_lora_a")]
    n_in = INPUT_AXES[weight]
    axes = PARAM_AXES[weight]
    return axes[:n_in] + (None,) if name.endswith("_lora_a") else (None,) + axes[n_in:]
  if parent in INPUT_AXES and name in ("qvalue", "scale", "zero_point"):
    axes = PARAM_AXES[parent]
    return axes if name == "qvalue" else (None,) * INPUT_AXES[parent] + axes[INPUT_AXES[parent]:]
  if name in _RNG_LEAVES and "rngs" in map(str, path):
    return ()
  if name not in PARAM_AXES:
    raise KeyError(f"parameter {'.'.join(map(str, path))} has no entry in sharding.PARAM_AXES")
  return PARAM_AXES[name]


def partition_spec(path: Sequence) -> P:
  """The PartitionSpec of the parameter at `path`."""
  return P(*(LOGICAL_TO_MESH.get(a) if a else None for a in logical_axes(path)))


def activation_spec(kind: str) -> P:
  """The PartitionSpec of an activation of `kind` (a key of ACTIVATION_AXES, e.g. "btd")."""
  return P(*(LOGICAL_TO_MESH[a] if a else None for a in ACTIVATION_AXES[kind]))


def constrain(x: jax.Array, kind: str) -> jax.Array:
  """`x` constrained to the sharding of activation `kind` under the tracing mesh; unchanged when
  no mesh is set (see the module docstring)."""
  if jax.sharding.get_abstract_mesh().empty:
    return x
  return jax.lax.with_sharding_constraint(x, activation_spec(kind))


def axis_size(logical: str) -> int:
  """How many ways the tracing mesh splits the `logical` axis (1 when no mesh is set)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  axes = LOGICAL_TO_MESH[logical]
  return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def check_divisible(cfg: LlamaConfig, mesh: jax.sharding.Mesh) -> None:
  """Raises ConfigError naming the config field a mesh axis does not divide."""
  for logical, field in LOGICAL_TO_FIELD.items():
    axis = LOGICAL_TO_MESH[logical]
    size = mesh.shape[axis]
    value = getattr(cfg, field)
    if value % size:
      raise ConfigError(f"mesh axis {axis!r} of size {size} does not divide "
                        f"LlamaConfig.{field}={value}; choose a mesh whose {axis} size divides it")


def state_shardings(state: nnx.State, mesh: jax.sharding.Mesh) -> nnx.State:
  """NamedShardings for every leaf of a parameter state (abstract or concrete)."""
  return nnx.map_state(lambda path, _: NamedSharding(mesh, partition_spec(path)), state)


def batch_shards(mesh: jax.sharding.Mesh) -> int:
  """The number of shards a batch's rows are split over: the product of the mesh's BATCH axes."""
  return math.prod(mesh.shape[a] for a in BATCH)


def batch_sharding(mesh: jax.sharding.Mesh, ndim: int = 2) -> NamedSharding:
  """Sharding of a [B, ...] batch array: batch over data x fsdp, the rest replicated."""
  return NamedSharding(mesh, P(BATCH, *([None] * (ndim - 1))))


def cache_sharding(mesh: jax.sharding.Mesh) -> dict[str, NamedSharding]:
  """Sharding of a KV cache {"k", "v"} (a prefix of its tree: one sharding for every layer's
  array): keys [B@data*fsdp, K@tensor, H, S], values [B@data*fsdp, K@tensor, S, H]."""
  s = NamedSharding(mesh, P(BATCH, "tensor", None, None))
  return {"k": s, "v": s}


def shard(llama: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
  """Places every parameter of `llama` by its partition spec (in place; also returned)."""
  check_divisible(llama.cfg, mesh)
  state = nnx.state(llama)
  nnx.update(llama, jax.device_put(state, state_shardings(state, mesh)))
  return llama


def sharded_forward(llama: nnx.Module, mesh: jax.sharding.Mesh):
  """A jitted full forward `fn(tokens_bt, attention_mask_bt) -> logits_btv` with explicit
  shardings: parameters by spec, batch over data x fsdp, logits [B@batch, T, V@tensor], and the
  activations constrained on `mesh`."""
  return sharded_apply(llama, mesh, lambda m, tokens_bt, mask_bt: m(tokens_bt,
                                                                     attention_mask=mask_bt),
                        P(BATCH, None, "tensor"))


def sharded_apply(llama: nnx.Module, mesh: jax.sharding.Mesh, apply, out_spec: P):
  """`fn(tokens_bt, mask_bt) -> apply(llama, tokens_bt, mask_bt)`, jitted with the parameters
  sharded by spec, the batch over data x fsdp and the output as `out_spec` says; `fn.lower`
  lowers it for the same arguments."""
  graphdef, state = nnx.split(llama)
  shardings = state_shardings(state, mesh)
  data = batch_sharding(mesh)

  def forward(state, tokens_bt, mask_bt):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return apply(nnx.merge(graphdef, state), tokens_bt, mask_bt)

  jitted = jax.jit(forward, in_shardings=(shardings, data, data),
                   out_shardings=NamedSharding(mesh, out_spec))
  fn = lambda tokens_bt, mask_bt: jitted(state, tokens_bt, mask_bt)
  fn.lower = lambda tokens_bt, mask_bt: jitted.lower(state, tokens_bt, mask_bt)
  return fn


def per_device_bytes(state: nnx.State) -> dict[jax.Device, int]:
  """Bytes of parameter shards held by each device."""
  out: dict[jax.Device, int] = {}
  for leaf in jax.tree.leaves(state):
    for shard_ in leaf.addressable_shards:
      out[shard_.device] = out.get(shard_.device, 0) + shard_.data.nbytes
  return out


__all__ = ["AXES", "BATCH", "PARAM_AXES", "INPUT_AXES", "ACTIVATION_AXES", "LOGICAL_TO_MESH",
           "make_mesh", "logical_axes", "partition_spec", "activation_spec", "constrain",
           "axis_size", "check_divisible", "state_shardings", "batch_shards", "batch_sharding",
           "cache_sharding", "shard", "sharded_forward", "per_device_bytes"]
