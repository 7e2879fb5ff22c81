"""Low-rank adapters (LoRA, Hu et al. 2021) and QLoRA (Dettmers et al. 2023) for ksjax's Llama,
with qwix.

`apply(llama, spec, rngs=...)` gives each targeted weight matrix W of every decoder layer (the
attention's q/k/v/o, the MLP's gate/up/down, or both: `LoraSpec.targets`) an adapter A [*in, r],
B [r, *out], and the layer computes x W + (alpha / r) (x A) B (`layers.Projections`). A starts as
qwix's `LoraRule` starts it (He-uniform), B as zeros, so the adapted model computes exactly what
the base does until B moves. With `quantize_base` the frozen base is also quantized by qwix
(`qwix.quantize`: int8 per output channel, or int4 in groups of `INT4_GROUP` inputs) and
dequantized where each product uses it: QLoRA, whose base takes a quarter (int8) or an eighth
(int4) of its float32 bytes.

What qwix provides here and what it does not. The parameter layout is qwix's: adapters are
`nnx.LoRAParam`s named `<weight>_lora_a` / `<weight>_lora_b` on the module that owns the weight,
initialised by `qwix.LoraRule`'s initialisers, and a quantized weight is a `qwix.QArray` of
`nnx.Param`s, dequantized by `qwix.dequantize`. qwix's model-level entry point
(`qwix.apply_lora_to_model` with a `qwix.LoraProvider`) does not serve this model: it intercepts
one method of an NNX model and this one is entered by four (training, log-probs and the sampler
each use their own), and the products it would intercept run inside custom VJPs, which hide the
weights from it and give the adapters no gradient; so the adapters are applied inside ksjax's
projections (`layers.Projections`, which says why in full).

The rest of this module is what a trainer needs around the adapters: `split` (the trainable
adapters apart from the frozen base, so that gradients and an optimizer's state exist for the
adapters only), `adapters_off` (the base itself, as the reference policy: the same arrays, no
second copy), `merge` (W + (alpha / r) A B, a quantized base dequantized first, as a plain
Llama), and adapter-only checkpoints that record the base they belong to (`save`, `load`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import qwix
from flax import nnx

from ksjax import config_validation as cv
from ksjax import errors
from ksjax.model import checkpoint, sharding
from ksjax.model.config import DTYPES
from ksjax.model.layers import Projections
from ksjax.model.llama import Llama
# Declared with the trainer's other config sections (config.lora), read here.
from ksjax.lora_options import LORA_QUANTIZE, LORA_TARGETS, LoraSpec

ATTENTION_WEIGHTS = LORA_TARGETS["attention"]
MLP_WEIGHTS = LORA_TARGETS["mlp"]
TARGETS = LORA_TARGETS
QUANTIZE = LORA_QUANTIZE
_QTYPES = {"int8": jnp.int8, "int4": jnp.int4}
# int4 scales cover groups of this many consecutive inputs of an output channel: QLoRA's
# block size (Dettmers et al. 2023). int8 has one scale per output channel, as qwix's PTQ picks.
INT4_GROUP = 64
DROPOUT_STREAM = "dropout"  # the RNG stream of the adapters' dropout


def rule(spec: LoraSpec) -> qwix.LoraRule:
  """The qwix rule of `spec`'s settings (its initialisers are the adapters')."""
  return qwix.LoraRule(module_path=".*", rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout,
                       weight_qtype=_QTYPES.get(spec.quantize_base))


# ---------------------------------------------------------------------------------------------
# Adapting a model
# ---------------------------------------------------------------------------------------------

def _projections(llama: Llama):
  """(module, the weight names it owns) for every decoder layer's attention and MLP."""
  for layer in llama.layers:
    yield layer.self_attn, ATTENTION_WEIGHTS
    yield layer.mlp, MLP_WEIGHTS


def is_adapted(llama: Llama) -> bool:
  return any(module.lora_scale is not None for module, _ in _projections(llama))


def quantize_weight(w: jax.Array, name: str, quantize_base: str) -> qwix.QArray:
  """`w` quantized by qwix as QLoRA's base: symmetric (absmax), one scale per output channel
  (int8), or per output channel and group of `INT4_GROUP` inputs along the last input axis
  (int4; the other input axes, o_proj's heads, each their own groups; a last input axis that
  `INT4_GROUP` does not divide is one group)."""
  n_in = sharding.INPUT_AXES[name]
  outputs = tuple(range(n_in, w.ndim))
  qtype = _QTYPES[quantize_base]
  if quantize_base == "int8":
    return qwix.quantize(w, qtype, channelwise_axes=outputs)
  last = n_in - 1
  size = w.shape[last]
  group = INT4_GROUP if size % INT4_GROUP == 0 else size
  return qwix.quantize(w, qtype, channelwise_axes=tuple(range(last)) + outputs,
                       tiled_axes={last: group})


def apply(llama: Llama, spec: LoraSpec, *, rngs: nnx.Rngs) -> Llama:
  """`llama` with adapters on `spec.weights` of every decoder layer, its base quantized when
  `spec.quantize_base` says so; `llama` itself is left as it was. The result shares the arrays it
  keeps as they are; its frozen weights are new ones under QLoRA, and with a `matmul_dtype`
  narrower than the parameters (stored in it: the products read nothing else), so drop `llama`
  to free the float base. A model on a mesh gets
  its new parameters placed by `sharding.partition_spec`. Returns `llama` when LoRA is off.
  Change how the base computes (`model.with_config`: matmul_dtype, remat) before, not after.

  `rngs.params()` draws each A's initial value; `spec.dropout` > 0 adds a dropout per adapted
  module with a stream forked from `rngs`, off until `training`. The adapters are float32.
  """
  if not spec.enabled:
    return llama
  if is_adapted(llama):
    raise ValueError("the model already has adapters; apply LoRA to the base")
  if spec.dropout and llama.cfg.remat:
    raise cv.ConfigError(
        f"config.lora.dropout={spec.dropout} needs model.remat=False: the rematerialised blocks "
        "run as a scan that does not advance the dropout's random stream; expected 0.0 with remat")
  adapted = nnx.merge(*nnx.split(llama))  # new modules over the same arrays
  lora_rule = rule(spec)
  # float32 whatever the base's dtype (qwix would take the base's): the adapters are all that
  # trains, small, and AdamW's small steps on bfloat16 values would round away.
  dtype = jnp.float32
  # A stream of its own name, which `with_dropout_key` reseeds inside a jitted update.
  dropout_rngs = nnx.Rngs(**{DROPOUT_STREAM: rngs.params()}) if spec.dropout else None
  operand = jnp.dtype(llama.cfg.operand_dtype)
  for module, names in _projections(adapted):
    for name in names:
      w = module.weight(name)
      if name in spec.weights:
        n_in = sharding.INPUT_AXES[name]
        a = lora_rule.lora_a_initializer(rngs.params(), (*w.shape[:n_in], spec.rank), dtype)
        b = lora_rule.lora_b_initializer(rngs.params(), (spec.rank, *w.shape[n_in:]), dtype)
        setattr(module, name + "_lora_a", nnx.LoRAParam(a))
        setattr(module, name + "_lora_b", nnx.LoRAParam(b))
      if spec.quantize_base != "none":
        setattr(module, name, jax.tree.map(nnx.Param,
                                           quantize_weight(w, name, spec.quantize_base)))
      elif operand != w.dtype:
        # A frozen weight is only ever read as a matmul operand, cast to `matmul_dtype` by every
        # product (`layers.project`, `layers.swiglu`): stored so, it computes the same bits with
        # half of float32's bytes, and no program holds a cast copy of it.
        setattr(module, name, nnx.Param(w.astype(operand)))
    if any(name in spec.weights for name in names):
      module.lora_scale = spec.scale
      if spec.dropout:
        module.lora_dropout = nnx.Dropout(spec.dropout, deterministic=True,
                                          rng_collection=DROPOUT_STREAM, rngs=dropout_rngs)
  mesh = _mesh(llama)
  return sharding.shard(adapted, mesh) if mesh is not None else adapted


def _mesh(llama: Llama) -> jax.sharding.Mesh | None:
  placed = getattr(llama.embed_tokens[...], "sharding", None)
  return placed.mesh if isinstance(placed, jax.sharding.NamedSharding) else None


def trainable_filter(llama: Llama) -> nnx.filterlib.Filter:
  """What trains under LoRA: the adapters, and PPO's value head where the policy has one (it
  is new, so it cannot be frozen); everything else is the frozen base."""
  if llama.cfg.value_head:
    return nnx.Any(nnx.LoRAParam, nnx.PathContains("value_head"), nnx.PathContains("value_bias"))
  return nnx.LoRAParam


def split(llama: Llama) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """(graphdef, trainable, frozen): `nnx.merge(graphdef, trainable, frozen)` is `llama`.

  Differentiate with respect to `trainable` alone and initialise the optimizer on it: the base
  then has neither gradients nor optimizer state (AdamW's two moments for the adapters only).
  `frozen` holds the base (quantized where QLoRA quantized it) and any dropout's RNG stream.
  """
  return nnx.split(llama, trainable_filter(llama), ...)


def base_format(spec: LoraSpec, cfg) -> str:
  """How the frozen base of a LoRA run is held, in words: its weight matrices quantized by
  QLoRA, or stored in `cfg`'s matmul operand dtype (`apply`). The trainer's start line and the
  memory plan both print it."""
  if spec.quantize_base != "none":
    return f"weight matrices quantized to {spec.quantize_base}"
  return f"weight matrices in {cfg.operand_dtype}"


def frozen_operands(state: nnx.State, cfg) -> nnx.State:
  """A frozen copy of parameter `state` (concrete or abstract) with every attention and MLP
  weight matrix stored in `cfg`'s matmul operand dtype, the other leaves copied as they are.

  Why: a frozen weight matrix is only ever read as a matmul operand, which every product casts
  to `matmul_dtype` first (`layers.project`, `layers.swiglu`), so stored so it computes the same
  bits in half of float32's bytes, as `apply` stores LoRA's frozen base. The trainer's reference
  policy is such a copy (`loop._start_or_resume`), and the memory plan counts it so. The
  embedding (the tied head's too), norms and value head keep their dtype: the embedding lookup
  and the norms read them as they are."""
  operand = jnp.dtype(cfg.operand_dtype)
  names = set(ATTENTION_WEIGHTS) | set(MLP_WEIGHTS)

  def copy(path, leaf):  # a Variable, or (a pure state's leaf) its value
    value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    cast = str(path[-1]) in names and value.dtype != operand
    if isinstance(value, jax.ShapeDtypeStruct):
      value = jax.ShapeDtypeStruct(value.shape, operand if cast else value.dtype,
                                   sharding=value.sharding)
    else:
      value = value.astype(operand) if cast else jnp.copy(value)
    return leaf.replace(value) if isinstance(leaf, nnx.Variable) else value

  return nnx.map_state(copy, state)


def join(graphdef: nnx.GraphDef, trainable: nnx.State, frozen: nnx.State | None = None, *,
         copy: bool = False) -> Llama:
  """`split`'s inverse: the model of `trainable` and, under LoRA, its `frozen` base (None: the
  trainable state is the whole model, as without LoRA). `copy`: new Variables, for a model whose
  state a traced function changes (LoRA's dropout reseeds its stream)."""
  states = (trainable,) if frozen is None else (trainable, frozen)
  return nnx.merge(graphdef, *states, copy=copy)


def adapters_off(llama: Llama) -> Llama:
  """The base model of an adapted `llama` (QLoRA: the quantized base), over the same arrays: the
  reference policy without a second copy of the weights. Its programs contain no adapter
  products, so it computes what the base computes, bit for bit."""
  return nnx.view(llama, only=Projections, lora=False)


def training(llama: Llama) -> Llama:
  """`llama` with LoRA's dropout on (a view: same arrays). Its forward draws from the dropout's
  RNG stream, which is part of the model's state: a jitted step must return it updated."""
  return nnx.view(llama, only=nnx.Dropout, raise_if_not_found=False, deterministic=False)


def with_dropout_key(llama: Llama, key: jax.Array) -> Llama:
  """`llama` with LoRA's dropout on, its masks drawn from `key`. A jitted update calls it on a
  model it merged inside the program, with a key of its own making, so the masks follow from
  checkpointed state and the dropout's stream (part of the frozen base) is never carried out."""
  view = training(llama)
  nnx.reseed(view, **{DROPOUT_STREAM: key})
  return view


def merged_weight(module: Projections, name: str) -> jax.Array:
  """W + (alpha / r) A B of one weight (its dequantized value where it is quantized), in the
  dtype the weight is stored in, the product formed in float32 at full precision."""
  w = module.weight(name)
  if not module.adapted(name):
    return w
  a = getattr(module, name + "_lora_a")[...].astype(jnp.float32)
  b = getattr(module, name + "_lora_b")[...].astype(jnp.float32)
  rank = a.shape[-1]
  ab = jnp.dot(a.reshape(-1, rank), b.reshape(rank, -1), precision=jax.lax.Precision.HIGHEST)
  return (w.astype(jnp.float32) + module.lora_scale * ab.reshape(w.shape)).astype(w.dtype)


def merge(llama: Llama) -> Llama:
  """A plain Llama (its config's, no adapters, no quantization) computing what the adapted
  `llama` computes: each adapted weight W + (alpha / r) A B, a quantized base dequantized
  (qwix). With the adapters off (`adapters_off`) it is the base itself, dequantized: the model a
  QLoRA run's reference computes."""
  graphdef, abstract = nnx.split(checkpoint.abstract_model(llama.cfg))
  source = dict(nnx.to_flat_state(nnx.state(llama, nnx.Not(nnx.LoRAParam))))
  flat = {}
  for path, variable in nnx.to_flat_state(abstract):
    if path[0] == "layers" and path[-1] in TARGETS["all"]:
      value = merged_weight(getattr(llama.layers[path[1]], path[2]), path[-1])
    else:
      value = source[path][...]
    flat[path] = variable.replace(value.astype(variable.dtype))  # the config's parameter dtype
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---------------------------------------------------------------------------------------------
# Adapter checkpoints
# ---------------------------------------------------------------------------------------------

META_KEY = "lora"
# What an adapter checkpoint is, for the messages that refuse a directory.
EXPECTED = "expected an adapter checkpoint written by ksjax.model.lora.save"


def base_sha256(path: str) -> str:
  """The sha256 that identifies a base model: a file's own (a GGUF file), or for a directory (a
  Hugging Face directory, an Orbax checkpoint) the sha256 of the list of its files' relative
  paths and sha256s, sorted. The bytes on disk, not the weights: the same weights converted
  again are another base (an Orbax directory records its creation time). Why bytes and not a
  path: a path can be pointed at other weights, and adapters on another base compute nonsense."""
  if os.path.isfile(path):
    with open(path, "rb") as f:
      return hashlib.file_digest(f, "sha256").hexdigest()
  if not os.path.isdir(path):
    raise checkpoint.CheckpointError(f"base model {path!r} does not exist; expected the model the "
                                     "adapters were trained on (a Hugging Face directory, a GGUF "
                                     "file or a ksjax checkpoint)")
  lines = []
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      with open(full, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
      lines.append(f"{os.path.relpath(full, path)}\0{digest}\n")
  return hashlib.sha256("".join(lines).encode()).hexdigest()


def base_record(path: str, dtype: str) -> dict[str, str]:
  """What an adapter checkpoint records of its base: where it was, its name, its sha256
  (`base_sha256`; hash it once per run, not per save) and the dtype it was loaded in (a base
  quantized from bfloat16 weights differs from one quantized from float32 ones)."""
  return {"path": os.path.abspath(path), "name": os.path.basename(os.path.normpath(path)),
          "sha256": base_sha256(path), "dtype": dtype}


def save(path: str, llama: Llama, spec: LoraSpec, base: Mapping[str, str]) -> None:
  """Writes the adapters of `llama` (and nothing of its base) to the new Orbax directory `path`,
  with `spec` and the base's record (`base_record`) in its metadata. Orbax writes under a
  temporary name and renames it when complete, so `path` is whole or absent."""
  if os.path.exists(path):
    raise FileExistsError(f"{path!r} exists; checkpoints are never overwritten")
  adapters = nnx.to_pure_dict(nnx.state(llama, nnx.LoRAParam))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.abspath(path), adapters, custom_metadata={META_KEY: {
      "spec": dataclasses.asdict(spec), "base": dict(base),
      checkpoint.CONFIG_KEY: checkpoint.config_to_json(llama.cfg)}})
  checkpointer.wait_until_finished()


def _adapter_metadata(path: str) -> object:
  """What the Orbax checkpoint at `path` records under META_KEY (None: nothing); CheckpointError,
  one line, for a directory Orbax cannot read."""
  metadata = checkpoint._read(  # pylint: disable=protected-access
      path, lambda: ocp.StandardCheckpointer().metadata(os.path.abspath(path)), EXPECTED)
  custom = metadata.custom_metadata
  return custom.get(META_KEY) if isinstance(custom, Mapping) else None


def is_adapter_checkpoint(path: str) -> bool:
  """Whether `path` is an adapter checkpoint (`save`) rather than a whole model's: its metadata
  has the adapters' record. False for anything else, readable or not, so that a caller's reader
  of whole models reports what is wrong with it."""
  if not os.path.isdir(path):
    return False
  try:
    return _adapter_metadata(path) is not None
  except checkpoint.CheckpointError:
    return False


def read_metadata(path: str) -> tuple[LoraSpec, dict[str, str]]:
  """(spec, base record) of the adapter checkpoint at `path`; CheckpointError, one line, for a
  directory that is not one."""
  if not os.path.isdir(path):
    raise checkpoint.CheckpointError(f"adapter checkpoint {path!r} does not exist; {EXPECTED}")
  meta = _adapter_metadata(path)
  base = meta.get("base") if isinstance(meta, Mapping) else None
  if not isinstance(base, Mapping) or not {"path", "name", "sha256", "dtype"} <= set(base):
    raise checkpoint.CheckpointError(f"{path!r} has no adapter metadata; {EXPECTED}")
  try:
    spec = LoraSpec(**meta["spec"])
  except (TypeError, cv.ConfigError) as e:
    raise checkpoint.CheckpointError(f"{path!r} records LoRA settings ksjax cannot take "
                                     f"({errors.one_line(e)}); {EXPECTED}") from None
  return spec, {k: str(v) for k, v in base.items()}


def load_base(path: str, mesh: jax.sharding.Mesh | None = None,
              dtype: str = "float32") -> Llama:
  """The base model at `path`, whichever of ksjax's model files it is: a GGUF file, a Hugging
  Face directory (config.json + safetensors) or a ksjax Orbax checkpoint."""
  from ksjax.model import gguf_io, hf_io  # pylint: disable=import-outside-toplevel
  if os.path.isfile(path):
    return gguf_io.load_gguf(path, mesh, dtype=dtype)[0]
  if os.path.isfile(os.path.join(path, "config.json")):
    return hf_io.load_hf(path, mesh, dtype=dtype)[0]
  return checkpoint.load(path, mesh, dtype=dtype)[0]


def load(path: str, *, base: str | None = None,
         mesh: jax.sharding.Mesh | None = None) -> tuple[Llama, LoraSpec]:
  """(the adapted model, its spec) from the adapter checkpoint at `path` and its base: the one it
  records, or `base` (a copy moved elsewhere). Refuses, before reading any weight, a base whose
  sha256 is not the recorded one: adapters belong to the weights they were trained on."""
  spec, record = read_metadata(path)
  base_path = base or record["path"]
  digest = base_sha256(base_path)
  if digest != record["sha256"]:
    raise checkpoint.CheckpointError(
        f"{path!r} holds adapters for the base {record['name']!r} (sha256 "
        f"{record['sha256'][:16]}), but {base_path!r} has sha256 {digest[:16]}; expected the "
        "base the adapters were trained on")
  if record["dtype"] not in DTYPES:
    raise checkpoint.CheckpointError(f"{path!r} records base dtype {record['dtype']!r}; {EXPECTED}")
  llama = load_base(base_path, mesh, record["dtype"])
  adapted = apply(llama, spec, rngs=nnx.Rngs(0))
  restore(path, adapted)
  return adapted, spec


def restore(path: str, llama: Llama) -> None:
  """Reads the adapters at `path` into the adapted `llama` (in place), each placed as
  `llama`'s own adapter is; CheckpointError naming the first adapter missing or misshapen."""
  checkpointer = ocp.StandardCheckpointer()
  stored = checkpoint._read(  # pylint: disable=protected-access
      path, lambda: checkpointer.metadata(os.path.abspath(path)).item_metadata, EXPECTED)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        nnx.to_pure_dict(nnx.state(llama, nnx.LoRAParam)))
  try:
    checkpoint._check_matches(  # pylint: disable=protected-access
        target, dict(stored) if stored is not None else {})
  except checkpoint.CheckpointError as e:
    raise checkpoint.CheckpointError(f"adapter checkpoint {path!r}: {e}; the adapters of the "
                                     "LoRA settings it records were expected") from None
  restored = checkpoint._read(  # pylint: disable=protected-access
      path, lambda: checkpointer.restore(os.path.abspath(path), target), EXPECTED)
  state = nnx.state(llama, nnx.LoRAParam)
  nnx.replace_by_pure_dict(state, restored)
  nnx.update(llama, state)


__all__ = ["LoraSpec", "TARGETS", "QUANTIZE", "INT4_GROUP", "rule", "apply",
           "is_adapted", "quantize_weight", "trainable_filter", "split", "join", "adapters_off",
           "base_format", "frozen_operands",
           "training", "merged_weight", "merge", "base_sha256", "base_record", "save",
           "is_adapter_checkpoint", "read_metadata", "load_base", "load", "restore"]
