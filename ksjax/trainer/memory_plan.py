"""The memory plan: what each device must hold for a run, before anything is allocated.

A run holds, per device, at all times
  * the parameters of the policy and its AdamW moments (the `TrainState` the update donates);
  * the frozen reference policy (a second copy of the parameters, for the KL metrics and penalty);
  * with asynchronous rollouts (config.max_lag > 0), the sampler's own copy of the parameters
    (`ksjax.trainer.async_rollouts`): on the learner's devices when it shares them, where sampling
    runs beside the learner's phases (reference, update); on its own sub-mesh
    (config.sampler_devices) otherwise, whose devices hold that copy (the sampler's programs are
    planned on the learner's mesh, not on the sub-mesh);
and, one phase at a time,
  * update:   the compiled optimizer step over one mini-batch (gradients, activations of the
              micro-batch, the gathered FSDP weights, the optimizer's temporaries);
  * sampling: the prefill and the decode loop of `ksjax.sampling` over B * n rows, whose largest
              buffers are the KV caches: the prompts' L x [B, K, H, T] (one copy per prompt)
              and the rows' L x [B*n, K, H, N - 1], for keys and as much for values;
  * eval:     the same sampler over eval.batch_prompts * eval.num_samples rows;
  * reference: the reference policy's forward over a rollout's rows (`learner.reference_rows`),
              for the logged KL and the KL penalty: each prompt's KV cache shared by its
              samples, whose own keys and values it holds for every layer.

Under LoRA (config.lora.rank >= 1, `ksjax.model.lora`) the parameters are the frozen base (float,
or QLoRA's int8/int4 values and their scales, as `qwix.quantize` makes them) and the adapters;
the TrainState's parameters, their gradients and AdamW's moments are the adapters' alone (and
PPO's value head's, `lora.trainable_filter`); the reference is the start's adapters on the same
base; the sampler's copy is of the adapters (and, on a sub-mesh of its own, of the base too). The
programs planned are the adapted model's, split as the trainer splits it (`abstract_policy`).

Parameters, optimizer state and KV cache are computed exactly from shapes and shardings
(`jax.eval_shape`, `NamedSharding.shard_shape`). The phases come from the compiled programs
themselves: the trainer's `Updater` step and the sampler's prefill and decode are lowered with
`jax.ShapeDtypeStruct` arguments carrying their shardings and compiled, and
`Compiled.memory_analysis()` gives per-device argument, output, aliased and temporary bytes.
Nothing is allocated, so a 70B model is planned on a laptop.

Depth. With `remat` the update and the reference forward run their decoder blocks as a scan
(`Llama.through_layers`): one compiled block whatever the depth, so each is compiled whole (its
bytes are not affine in depth at small depths: for Llama 3.1 8B on 8 devices, extrapolating from
2 and 4 layers underestimated the compiled 32-layer plan; benchmarks/memory_plan.py prints the
plans). Unrolled programs (the sampler's decode, and its prefill, the update and the reference
forward without remat) take minutes to compile for a 70B model on 256 devices; every decoder block is the
same program, so their bytes are affine in the number of layers, and models deeper than
`EXACT_DEPTH` are compiled at two depths and extrapolated (tested against full compiles). The
probes are an even number of layers apart because XLA's buffer packing of small models alternates
between odd and even depths; a two-layer step averages it out.

The host process. On a CPU backend the devices' memory is the process's own, which also holds the
interpreter, the libraries and the backend before any buffer exists: a plan of this machine's CPU
devices (`plan(..., host=True)`, as `python -m ksjax.tools.plan` without --fake_devices makes it)
counts that too, measured in a fresh child interpreter that imports the trainer and starts the
backend (`host_process_bytes`), and what the process keeps for each program the plan compiles
(the executable and jit's forms of it, beside XLA's buffer assignment), measured by glibc's
malloc across a compile at the model's own depth (`held_since`; not measured where malloc is not
glibc's): every program the plan compiles, and the update at each other micro-batch size that
sparse updates may compile (`sparse.micro_sizes`). The small programs (the zero gradient's step,
the logged metrics') are not counted.
Accelerator plans count device memory alone.

Backend. The bytes are those of the backend the programs are compiled for: the real accelerators
when run on them (the trainer's start-up check), or fake CPU devices (`python -m
ksjax.tools.plan --fake_devices=256` on a workstation). XLA's CPU backend computes bfloat16
matmuls in float32 and schedules without a memory limit, so its temporaries are not those of a
TPU or GPU compile (they are typically larger); the exact parts (parameters, optimizer, KV cache)
do not depend on the backend.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from ksjax import allocator, model
from ksjax.config_validation import ConfigError
from ksjax.model import lora, sharding
from ksjax.run import policy
from ksjax.run import tasks as run_tasks
from ksjax.run.spec import LoraSpec, TrainSpec
from ksjax.sampling import batching
from ksjax.sampling import sampler as sampler_lib
from ksjax.sampling.config import SamplerConfig
from ksjax.trainer import batch as batch_lib
from ksjax.trainer import learner, sparse
from ksjax.trainer import update as update_lib

# Models with at most this many layers are compiled whole; deeper ones at `PROBE_DEPTHS`.
EXACT_DEPTH = 4
PROBE_DEPTHS = (2, 4)
# The longest prompt a plan assumes when the caller does not say (tokens).
DEFAULT_PROMPT_LEN = 512
# What the host-process probe runs: the trainer's imports, the backend started, nothing built.
_HOST_PROBE = ("import jax\nfrom ksjax.tasks import registry\nfrom ksjax.trainer import loop\n"
               "jax.devices()\nprint(next(line.split()[1] for line in open('/proc/self/status') "
               "if line.startswith('VmRSS:')))")
# Fraction of a device's memory a plan may fill: the rest is left to the runtime (its own
# buffers, fragmentation, host transfers).
USABLE_FRACTION = 0.9
GIB = 2**30


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------

def element_bits(dtype: Any) -> int:
  """Bits one element of `dtype` takes on a device. Sub-byte types (QLoRA's int4 base) count
  packed, two to a byte, as XLA counts them in a compiled program's argument bytes
  (`Compiled.memory_analysis()`), so that the held state and the programs' bytes agree (the CPU
  runtime itself stores one int4 per byte). A key (`jax.random.key`) has no bit width of its own:
  its itemsize's."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return 8 * dtype.itemsize
  return jax.dtypes.itemsize_bits(dtype)


def device_bytes(tree: Any) -> int:
  """Bytes one device holds of a pytree of arrays or ShapeDtypeStructs (the largest shard)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.shape
    leaf_sharding = getattr(leaf, "sharding", None)
    if leaf_sharding is not None:
      shape = leaf_sharding.shard_shape(shape)
    total += -(-math.prod(shape) * element_bits(leaf.dtype) // 8)
  return total


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
  """Per-device bytes of one compiled program (`Compiled.memory_analysis()`), and on this
  machine's CPU backend what the process keeps for it (`held_since`)."""
  arguments: int
  outputs: int
  aliased: int   # outputs written into donated arguments
  temps: int     # everything else the program allocates while it runs
  held: int = 0  # the process's, for as long as the program is kept (0: not measured)

  @classmethod
  def of(cls, compiled: jax.stages.Compiled, held: int = 0) -> "ProgramMemory":
    m = compiled.memory_analysis()
    return cls(arguments=int(m.argument_size_in_bytes), outputs=int(m.output_size_in_bytes),
               aliased=int(m.alias_size_in_bytes), temps=int(m.temp_size_in_bytes), held=held)

  @property
  def peak(self) -> int:
    """Bytes live while it runs: arguments, new outputs and temporaries."""
    return self.arguments + self.outputs - self.aliased + self.temps

  def extrapolate(self, other: "ProgramMemory", depths: tuple[int, int],
                  depth: int) -> "ProgramMemory":
    """The affine continuation in depth of `self` (at depths[0]) and `other` (at depths[1])."""
    d0, d1 = depths
    line = lambda a, b: a + (b - a) * (depth - d0) // (d1 - d0)
    return ProgramMemory(*(line(getattr(self, f.name), getattr(other, f.name))
                           for f in dataclasses.fields(self)))


# ---------------------------------------------------------------------------------------------
# What the trainer would build, abstractly
# ---------------------------------------------------------------------------------------------

def vocab_size_of(spec: TrainSpec) -> int:
  """The vocabulary the trainer's model will have: the checkpoint's, else the task tokenizer's."""
  if spec.model.pretrained:
    return policy.policy_config(spec.model, vocab_size=1, value_head=False).vocab_size
  if spec.task.is_synthetic:
    from ksjax.tasks import synthetic  # pylint: disable=g-import-not-at-top
    return synthetic.make_tokenizer().vocab_size
  if spec.task.tokenizer.path:
    return run_tasks.tokenizer(spec.task, spec.model).vocab_size
  return model.preset(spec.model.model.preset).vocab_size


def prompt_len_of(spec: TrainSpec) -> int:
  """The longest prompt a plan assumes: the synthetic task's exactly, else DEFAULT_PROMPT_LEN."""
  if spec.task.is_synthetic:
    from ksjax.tasks import synthetic  # pylint: disable=g-import-not-at-top
    # One token per character, and BOS; the " mod M" suffix is one character longer at M = 100,
    # and a level's problem has one more term than the level before.
    return synthetic.max_prompt_chars(spec.task.synthetic.modulus,
                                      max(spec.task.synthetic.levels)) + 1
  return DEFAULT_PROMPT_LEN


@dataclasses.dataclass(frozen=True)
class AbstractPolicy:
  """The trainer's policy as ShapeDtypeStructs placed by their partition specs, split as the
  trainer splits it (`ksjax.trainer.loop`): `trainable` is what a TrainState's parameters hold
  (every parameter; under LoRA the adapters and PPO's value head, `lora.split`), `frozen` the
  rest (None without LoRA; under LoRA the base, QLoRA's quantized, and any dropout's stream)."""
  graphdef: nnx.GraphDef
  trainable: Any
  frozen: Any = None

  @property
  def params(self) -> Any:
    """Every parameter as one state: what the sampler's programs take (`sampler.sample` splits
    the whole model, adapters and base together)."""
    if self.frozen is None:
      return self.trainable
    return nnx.merge_state(self.trainable, self.frozen)

  def updater(self, spec: TrainSpec, mesh: Any) -> update_lib.Updater:
    """The trainer's Updater for this policy (under LoRA, with the frozen base as its own)."""
    return update_lib.build_updater(spec, self.graphdef, mesh, self.frozen)


@functools.lru_cache(maxsize=4)
def _abstract_split(cfg: model.LlamaConfig, lora_spec: LoraSpec, seed: int):
  """(graphdef, trainable, frozen) of `cfg`'s model adapted by `policy.adapt`, unplaced.

  Cached because under LoRA the trace is slow at depth: every RNG draw of the adapters' set-up
  makes flax ask a tracer for its sharding, and jax's refusal walks the trace to say where the
  tracer came from, so the time grows with the square of the layers (minutes for the 70B model
  on two cores); a plan asks for the same model for its state and its update, and the
  benchmarks for each device count."""
  llama = nnx.eval_shape(
      lambda: policy.adapt(model.Llama(cfg, rngs=nnx.Rngs(0)), lora_spec, seed))
  if lora_spec.enabled:
    return lora.split(llama)
  return (*nnx.split(llama), None)


def abstract_policy(spec: TrainSpec, cfg: model.LlamaConfig, mesh: Any) -> AbstractPolicy:
  """The policy the trainer would build for `spec` with config `cfg` on `mesh`, abstractly:
  `cfg`'s model adapted by `policy.adapt` as config.lora says (itself when LoRA is off)."""
  graphdef, trainable, frozen = _abstract_split(cfg, spec.lora, spec.run.seed)
  place = lambda state: nnx.map_state(
      lambda path, leaf: jax.ShapeDtypeStruct(
          leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, sharding.partition_spec(path))),
      state)
  return AbstractPolicy(graphdef, place(trainable), None if frozen is None else place(frozen))


# ---------------------------------------------------------------------------------------------
# Compiling the programs
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shapes:
  """The sizes a plan is made for (derived from the config and the longest prompt)."""
  prompt_len: int          # T_p, the sampler's bucketed prompt length
  update_rows: int         # rows per optimizer step (one mini-batch)
  micro_batch: int         # rows per gradient micro-batch, a multiple of the batch shards
  sample_prompts: int      # prompts per sampler call after the sampler's bucketing
  samples: int             # n
  max_new_tokens: int
  eval_prompts: int
  eval_samples: int
  eval_max_new_tokens: int


def plan_shapes(spec: TrainSpec, mesh: jax.sharding.Mesh, prompt_len: int) -> Shapes:
  shards = sharding.batch_shards(mesh)
  spec.check_mesh(shards)
  # As `ksjax.trainer.learner.learn` lays out a dense mini-batch.
  rows = spec.minibatch_rows
  micro = -(-min(rows, spec.loss.micro_batch_size) // shards) * shards
  s, h = spec.sampling, spec.eval
  return Shapes(
      prompt_len=batching.bucket_length(prompt_len), update_rows=-(-rows // micro) * micro,
      micro_batch=micro,
      sample_prompts=batching.bucket_prompt_batch(s.batch_prompts, s.n, shards),
      samples=s.n, max_new_tokens=s.max_new_tokens,
      eval_prompts=batching.bucket_prompt_batch(h.batch_prompts, h.num_samples, shards),
      eval_samples=h.num_samples, eval_max_new_tokens=h.max_new_tokens)


def dense_share(spec: TrainSpec, mesh: jax.sharding.Mesh, shapes: Shapes) -> int:
  """The rows per prompt of a dense mini-batch's update (`learner.row_layout` of every row: the
  `group` of `Updater.step`), 1 where each row runs its own prompt."""
  rows = spec.minibatch_rows
  if not update_lib.shares_prompts(spec.loss, spec.lora.drops_out):
    return 1
  selection = sparse.shared(np.arange(rows), rows, spec.sampling.n, sharding.batch_shards(mesh),
                            rows, spec.loss.micro_batch_size, shapes.prompt_len,
                            shapes.max_new_tokens)
  return selection.share if selection else 1


def compile_update(spec: TrainSpec, cfg: model.LlamaConfig, mesh: jax.sharding.Mesh,
                   shapes: Shapes, measure: bool = False, micro: int | None = None,
                   group: int | None = None) -> ProgramMemory:
  """Memory of the trainer's optimizer step for one mini-batch, compiled without allocating;
  with `measure`, also what the compiled program holds in this process (`held_since`). `micro`:
  micro-batches of that many rows (a sparse update's smaller one), not the dense layout's;
  `group`: rows per prompt (`Updater.step`), default the dense layout's (`dense_share`)."""
  policy_shapes = abstract_policy(spec, cfg, mesh)
  updater = policy_shapes.updater(spec, mesh)
  state = updater.abstract_state(policy_shapes.trainable)
  micro = shapes.micro_batch if micro is None else micro
  group = dense_share(spec, mesh, shapes) if group is None else group
  rows = -(-spec.minibatch_rows // micro) * micro  # as `sparse.layout` pads a mini-batch
  batch = batch_lib.abstract(spec.loss, mesh, rows=rows, micro=micro,
                             seq_len=shapes.prompt_len + shapes.max_new_tokens)
  step = updater.step_program(state, batch, shapes.prompt_len, group)
  return _compiled(lambda: step.lower(state, batch), measure)


def compile_reference(spec: TrainSpec, cfg: model.LlamaConfig, mesh: jax.sharding.Mesh,
                      shapes: Shapes, measure: bool = False) -> ProgramMemory:
  """Memory of the reference policy's forward over one rollout (`learner.reference_rows`: its
  layout, its program), compiled without allocating; with `measure`, also what the compiled
  program holds in this process (`held_since`). Its arguments are the reference's parameters
  (`lora.frozen_operands`, as the trainer keeps them), the frozen base under LoRA, and the
  rows' tokens and mask."""
  policy_shapes = abstract_policy(spec, cfg, mesh)
  updater = policy_shapes.updater(spec, mesh)
  selection, group = learner.reference_layout(spec.sampling.rows, spec.sampling.n,
                                              sharding.batch_shards(mesh),
                                              spec.loss.micro_batch_size)
  shape = (len(selection.rows) // selection.micro, selection.micro,
           shapes.prompt_len + shapes.max_new_tokens)
  program = updater.forward_program(shape, prompt_len=shapes.prompt_len, group=group)
  rows = batch_lib.row_sharding(mesh, len(shape))
  args = (lora.frozen_operands(policy_shapes.trainable, cfg), updater.frozen,
          jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows),
          jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=rows),
          jax.ShapeDtypeStruct((), jnp.int32))
  return _compiled(lambda: program.lower(*args), measure)


def compile_sampler(spec: TrainSpec, cfg: model.LlamaConfig, mesh: jax.sharding.Mesh, *,
                    prompts: int, samples: int, prompt_len: int,
                    max_new_tokens: int,
                    measure: bool = False) -> tuple[ProgramMemory, ProgramMemory]:
  """Memory of the sampler's prefill and decode programs for one call, compiled abstractly; with
  `measure`, also what each compiled program holds in this process (`held_since`).

  They are compiled on the parameters as held, not on `sampler.operand_params`'s cast copy that
  `sampler.sample` gives them: a program given the held weights casts them itself (its
  temporaries hold the cast copy, hoisted out of the decode loop), so its peak counts the held
  parameters and the copy, as the sampler's call holds both."""
  held = abstract_policy(spec, cfg, mesh)
  graphdef, params = held.graphdef, held.params
  shapes = sampler_lib.Shapes(prompts, samples, prompt_len)
  prefill, decode = sampler_lib.programs(graphdef, SamplerConfig(max_new_tokens=max_new_tokens),
                                         mesh, shapes)
  prompt_sharding = sampler_lib.prompt_shardings(mesh, prompts).mask_pt  # as `sampler.sample`
  tokens = jax.ShapeDtypeStruct((prompts, prompt_len), jnp.int32, sharding=prompt_sharding)
  mask = jax.ShapeDtypeStruct((prompts, prompt_len), jnp.bool_, sharding=prompt_sharding)
  args = (params, tokens, mask, jax.ShapeDtypeStruct((), jnp.int32),
          jax.ShapeDtypeStruct((), jnp.uint32))
  prompt, state = jax.eval_shape(prefill, *args)
  prompt = placed(prompt, sampler_lib.prompt_shardings(mesh, prompts))
  state = placed(state, sampler_lib.state_shardings(mesh))
  stop_at = jax.ShapeDtypeStruct((), jnp.int32)
  return (_compiled(lambda: prefill.lower(*args), measure),
          _compiled(lambda: decode.lower(params, prompt, state, stop_at), measure))


def _compiled(lower, measure: bool) -> ProgramMemory:
  """The memory of the program `lower()` lowers, compiled; with `measure`, also what it holds in
  this process from its tracing on (`held_since`)."""
  before = allocated_now() if measure else None
  return ProgramMemory.of(lower().compile(), held_since(before))


def allocated_now() -> int | None:
  """`allocator.allocated_bytes()` after garbage collections, so that no object dropped before
  (a compiled program in a reference cycle) is freed inside a measurement: repeated while one
  finds garbage, since the finalizers a collection runs can leave more."""
  for _ in range(4):
    if not gc.collect():
      break
  return allocator.allocated_bytes()


def held_since(before: int | None) -> int:
  """Bytes the C allocator holds now beyond `before` (`allocated_now()` before a program was
  traced, lowered and compiled), the compiled program still alive: what the process keeps for
  the program for as long as it is kept, which in a run is to its end (jit caches every program
  it compiles). On XLA's CPU backend that is the executable (its code, its thunks, the HLO they
  run) and jit's traced and lowered forms, none of it in `memory_analysis`. Not run: what a first
  call adds (the kernel library's per-operation state) was a few MiB at 2 and 4 layers of
  SmolLM2's update (docs/benchmarks.md, "A run's peak memory"). 0 where this process's malloc
  is not glibc's (`before` is None). What the process's other threads free meanwhile comes off
  it (a few MiB at most); a program this process compiled before is found in jit's caches and
  adds nothing."""
  if before is None:
    return 0
  return max(0, allocated_now() - before)


def kv_cache_bytes(cfg: model.LlamaConfig, mesh: jax.sharding.Mesh, *, prompts: int,
                   samples: int, prompt_len: int, max_new_tokens: int) -> int:
  """Per-device bytes of the sampler's KV caches for `prompts` prompts x `samples`: the prompts'
  (one copy per prompt, `sampler.PromptCache`) and the rows' own of their generated tokens."""
  new_slots = sampler_lib.new_slots(SamplerConfig(max_new_tokens=max_new_tokens))
  prompt = jax.eval_shape(lambda: model.init_cache(cfg, prompts, prompt_len))
  rows = jax.eval_shape(lambda: model.init_cache(cfg, prompts * samples, new_slots))
  return (device_bytes(placed(prompt, sampler_lib.prompt_shardings(mesh, prompts).cache))
          + device_bytes(placed(rows, sharding.cache_sharding(mesh))))


def placed(shapes: Any, shardings: Any) -> Any:
  """`shapes` (ShapeDtypeStructs) with the shardings of `shardings`, a prefix of their tree (as
  jit's out_shardings may be: the cache sharding is one sharding for all of a kind's layers)."""
  return jax.tree.map(
      lambda s, sub: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  sub), shardings, shapes)


def sampler_caches(cfg: model.LlamaConfig, mesh: Any, shapes: Shapes) -> tuple[int, int]:
  """Per-device KV-cache bytes of the training sampler's and the evaluation sampler's calls."""
  return (kv_cache_bytes(cfg, mesh, prompts=shapes.sample_prompts, samples=shapes.samples,
                         prompt_len=shapes.prompt_len, max_new_tokens=shapes.max_new_tokens),
          kv_cache_bytes(cfg, mesh, prompts=shapes.eval_prompts, samples=shapes.eval_samples,
                         prompt_len=shapes.prompt_len, max_new_tokens=shapes.eval_max_new_tokens))


def _by_depth(fn, cfg: model.LlamaConfig, scanned: bool = False, measure: bool = False):
  """fn(cfg, measure) for the model's depth: compiled whole (shallow models, or a program that
  `scanned` its layers), or at PROBE_DEPTHS and extrapolated. With `measure`, what the programs
  hold (`ProgramMemory.held`) is measured on a compile at the model's own depth: the whole one
  where there is one (compiling it again would find jit's cached executable and measure nothing),
  else one more compile, since the held bytes grow faster than affinely at the probes' depths."""
  if scanned or cfg.num_layers <= EXACT_DEPTH:
    return fn(cfg, measure)
  low, high = (fn(dataclasses.replace(cfg, num_layers=d), False) for d in PROBE_DEPTHS)
  tupled = isinstance(low, tuple)
  low, high = (low, high) if tupled else ((low,), (high,))
  memory = tuple(a.extrapolate(b, PROBE_DEPTHS, cfg.num_layers) for a, b in zip(low, high))
  if measure:
    full = fn(cfg, True)
    memory = tuple(dataclasses.replace(m, held=f.held)
                   for m, f in zip(memory, full if tupled else (full,)))
  return memory if tupled else memory[0]


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Per-device bytes of a run on a mesh. See the module docstring."""
  model: model.LlamaConfig
  mesh: dict[str, int]
  platform: str            # the backend the programs were compiled for
  shapes: Shapes
  params: int              # the policy's parameters
  optimizer: int           # AdamW's moments (and its step counters)
  reference: int           # the frozen reference policy
  update: ProgramMemory    # one optimizer step (arguments: the TrainState and the batch)
  kv_cache: int            # the training sampler's KV cache (inside prefill/decode outputs)
  prefill: ProgramMemory
  decode: ProgramMemory
  eval_kv_cache: int
  eval_prefill: ProgramMemory
  eval_decode: ProgramMemory
  extrapolated: bool       # the sampler's programs (and the update without remat) compiled at
                           # PROBE_DEPTHS and extrapolated to the model's depth
  sampler_params: int = 0  # the asynchronous sampler's parameter copy (on its own devices, or
                           # on the learner's when sampler_shared)
  sampler_shared: bool = False
  frozen: int = 0          # of `params`, the frozen base under LoRA (0 without)
  lora: LoraSpec = LoraSpec()  # the adapters' settings (rank 0: none)
  host: int = 0            # the process before any buffer, on this machine's CPU backend (0:
                           # not counted; `host_process_bytes`)
  reference_forward: ProgramMemory | None = None  # the reference's forward over a rollout
  sparse_updates: tuple[ProgramMemory, ...] = ()  # the update at sparse updates' smaller
                           # micro-batches: compiled for what they hold (`held`) alone
  weights_t: int = 0       # the sampler's transposed weight copies (`sampler.weights_first`) in
  eval_weights_t: int = 0  # a training and an evaluation call, 0 where the call makes none

  @property
  def programs(self) -> int:
    """What the process keeps for the programs the plan compiled (`ProgramMemory.held`; 0 where
    not measured): each counted once, held from its first compile to the run's end, so in every
    phase."""
    unique = {id(p): p for p in (self.update, self.prefill, self.decode, self.eval_prefill,
                                 self.eval_decode, self.reference_forward, *self.sparse_updates)
              if p is not None}
    return sum(p.held for p in unique.values())

  @property
  def phases(self) -> dict[str, int]:
    """Peak bytes of each phase: what is held throughout plus the phase's program."""
    sampler_held = self.optimizer + self.reference  # the parameters are the programs' argument
    sampling = max(self.prefill.peak, self.decode.peak)
    phases = {
        "update": self.reference + self.update.peak,
        "sampling": sampler_held + sampling + self.weights_t,
        "eval": sampler_held + max(self.eval_prefill.peak, self.eval_decode.peak)
                + self.eval_weights_t,
    }
    if self.reference_forward is not None:
      phases["reference"] = self.params + self.optimizer + self.reference + self.reference_rows
    if self.sampler_params and self.sampler_shared:  # its copy; its programs beside the update
      for learner_phase in ("update", "reference"):  # (the learner's phases, sampling ahead)
        if learner_phase in phases:
          phases[learner_phase] += sampling - self.params + self.sampler_params
      phases["sampling"] += self.sampler_params
    elif self.sampler_params:  # its own devices: the copy and the sampler's programs
      phases["sampler devices"] = sampling - self.params + self.sampler_params
    return {name: held + self.host + self.programs for name, held in phases.items()}

  @property
  def peak(self) -> int:
    return max(self.phases.values())

  @property
  def reference_rows(self) -> int:
    """The reference forward's bytes beyond its parameters (the reference's, and under LoRA the
    frozen base the policy holds): the rows, log-probs and temporaries (KV cache, and the weights
    the program gathers; docs/scaling.md)."""
    if self.reference_forward is None:
      return 0
    return self.reference_forward.peak - self.reference - self.frozen

  @property
  def update_activations(self) -> int:
    """The update's bytes beyond the TrainState it is given: batch, gradients, activations."""
    return self.update.peak - self.params - self.optimizer

  def table(self, device_memory: Sequence[int] = ()) -> str:
    """A human-readable per-device breakdown; with device sizes, whether it fits each."""
    gib = _gib
    s = self.shapes
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
    extrapolated = ""
    if self.extrapolated:
      programs = "sampler programs" if self.model.remat else "programs"
      extrapolated = f"; {programs} extrapolated in depth from {PROBE_DEPTHS}"
    sampler_other = max(self.prefill.peak, self.decode.peak) - self.params - self.kv_cache
    lines = [
        f"model: {self.model.num_params / 1e9:.2f}B parameters, {self.model.num_layers} layers, "
        f"{self.model.param_dtype}, remat={self.model.remat}",
        *lora_lines(self.lora, self.model),
        f"mesh: {mesh} ({math.prod(self.mesh.values())} {self.platform} devices"
        f"{extrapolated})",
        f"update: {s.update_rows} rows per optimizer step in micro-batches of {s.micro_batch}, "
        f"sequence {s.prompt_len} + {s.max_new_tokens}",
        f"sampling: {s.sample_prompts} prompts x {s.samples} samples; eval {s.eval_prompts} x "
        f"{s.eval_samples}, {s.eval_max_new_tokens} new tokens",
        "per device:",
        *state_lines(StateBytes(self.params, self.optimizer, self.reference, self.frozen),
                     self.lora),
        *([f"  sampler's parameter copy  {gib(self.sampler_params)}"
           + (" (its own devices)" if not self.sampler_shared else "")]
          if self.sampler_params else []),
        f"  update: batch, gradients, activations {gib(self.update_activations)}",
        f"  sampler KV cache          {gib(self.kv_cache)}",
        *([f"  sampler weight copies     {gib(self.weights_t)} (transposed, for few rows; "
           f"eval {gib(self.eval_weights_t).strip()})"]
          if self.weights_t or self.eval_weights_t else []),
        f"  sampler, other than cache {gib(sampler_other)}",
        f"  eval KV cache             {gib(self.eval_kv_cache)}",
        *([f"  reference forward         {gib(self.reference_rows)} (a rollout's rows and the "
           "forward's temporaries: KV cache, gathered weights)"]
          if self.reference_forward is not None else []),
        *([f"  host process              {gib(self.host)} (interpreter, libraries, CPU "
           "backend; in every phase)"] if self.host else []),
        *([f"  compiled programs         {gib(self.programs)} (executables, jit's caches; "
           "in every phase)"] if self.programs else []),
    ]
    lines += [f"  peak of {name:<17} {gib(b)}" for name, b in self.phases.items()]
    lines.append(f"  peak                      {gib(self.peak)}")
    for size in device_memory:
      verdict = "fits" if self.peak <= USABLE_FRACTION * size else "does NOT fit"
      lines.append(f"  on a {size / 1e9:g} GB device: {verdict} ({self.peak / size:.0%} of it)")
    return "\n".join(lines)


def _gib(b: int) -> str:
  return f"{b / GIB:10.2f} GiB"


def lora_lines(lora_spec: LoraSpec, cfg: model.LlamaConfig) -> list[str]:
  """The plan's line saying what trains under LoRA (none without)."""
  if not lora_spec.enabled:
    return []
  trains = "the adapters and the value head train" if cfg.value_head else "the adapters train"
  return [f"LoRA: rank {lora_spec.rank}, alpha {lora_spec.alpha:g}, on {lora_spec.targets} "
          f"weights; {trains}, the base is frozen ({lora.base_format(lora_spec, cfg)})"]


def state_lines(held: "StateBytes", lora_spec: LoraSpec) -> list[str]:
  """The plan's per-device lines of the state a run holds throughout (`MemoryPlan.table` and
  the plan tool's exact parts print the same)."""
  lines = [f"  parameters                {_gib(held.params)}"]
  if lora_spec.enabled:
    lines += [f"    frozen base             {_gib(held.frozen)}",
              f"    trained                 {_gib(held.params - held.frozen)}"]
  return lines + [f"  optimizer state (AdamW)   {_gib(held.optimizer)}",
                  f"  reference policy          {_gib(held.reference)}"]


@dataclasses.dataclass(frozen=True)
class StateBytes:
  """Per-device bytes of what a run holds throughout."""
  params: int      # the policy's parameters (under LoRA, the frozen base and the adapters)
  optimizer: int   # AdamW's two moments (in the trained parameters' dtype) and step counters
  reference: int   # the frozen reference policy: a copy of the trained parameters, its weight
                   # matrices in the matmul operand dtype (`lora.frozen_operands`)
  frozen: int = 0  # of `params`, the frozen base under LoRA (0 without)


def abstract_mesh(shape: Sequence[int], num_devices: int) -> jax.sharding.AbstractMesh:
  """A device-free ("data", "fsdp", "tensor") mesh of `shape` (one entry may be -1: the rest of
  `num_devices`), enough for the exact parts of a plan (shardings' shard shapes)."""
  shape = tuple(int(s) for s in shape)
  known = math.prod(s for s in shape if s != -1)
  if num_devices % known:
    raise ConfigError(f"config.mesh={shape!r} does not divide {num_devices} devices")
  shape = tuple(num_devices // known if s == -1 else s for s in shape)
  return jax.sharding.AbstractMesh(shape, sharding.AXES,
                                   axis_types=(jax.sharding.AxisType.Auto,) * 3)


def resolve(spec: TrainSpec, devices: Sequence[jax.Device] | int | None = None,
            vocab_size: int | None = None) -> tuple[model.LlamaConfig, Any]:
  """The model config and mesh a run of `spec` would have; ConfigError if they do not fit.

  `devices` may be a device count: the mesh is then abstract (exact parts only, no compiling).
  """
  if isinstance(devices, int):
    mesh = abstract_mesh(spec.run.mesh, devices)
  else:
    mesh = sharding.make_mesh(spec.run.mesh, devices)
  cfg = policy.policy_config(spec.model, vocab_size or vocab_size_of(spec),
                             value_head=spec.loss.value_head)
  sharding.check_divisible(cfg, mesh)
  return cfg, mesh


def state_bytes(spec: TrainSpec, cfg: model.LlamaConfig, mesh: jax.sharding.Mesh) -> StateBytes:
  """Parameters, optimizer state and reference per device, exactly, from shapes and shardings.

  The optimizer's state is initialised on what trains (`AbstractPolicy.trainable`), and the
  reference is a copy of it, its weight matrices in the matmul operand dtype
  (`lora.frozen_operands`): under LoRA the start's adapters, on the base the policy holds
  (`loop._start_or_resume`)."""
  held = abstract_policy(spec, cfg, mesh)
  state = held.updater(spec, mesh).abstract_state(held.trainable)
  trained, frozen = device_bytes(held.trainable), device_bytes(held.frozen)
  reference = device_bytes(lora.frozen_operands(held.trainable, cfg))
  return StateBytes(params=trained + frozen, optimizer=device_bytes(state.opt_state),
                    reference=reference, frozen=frozen)


def sampler_copy_bytes(spec: TrainSpec, cfg: model.LlamaConfig, mesh: Any) -> int:
  """Per-device bytes of the asynchronous sampler's parameter copy (0 in lockstep): on the
  learner's mesh, or on the sampler's own sub-mesh (config.sampler_mesh over sampler_devices).

  It copies what the update changes (a TrainState's parameters; under LoRA the adapters); under
  LoRA on a sub-mesh of its own it also holds a copy of the frozen base, placed there once
  (`loop._sampler_policy`), while on the learner's devices it shares the learner's base."""
  s = spec.sampling
  if not s.max_lag:
    return 0
  if s.sampler_devices:
    held = abstract_policy(spec, cfg, abstract_mesh(s.sampler_mesh, s.sampler_devices))
    return device_bytes(held.trainable) + device_bytes(held.frozen)
  return device_bytes(abstract_policy(spec, cfg, mesh).trainable)


def host_process_bytes() -> int:
  """The resident memory of a fresh interpreter that has imported the trainer and started the
  JAX backend (this interpreter, its environment), measured in a child process: what a run's
  process holds before its first buffer. 0 where it cannot be read (no /proc: not Linux)."""
  try:
    done = subprocess.run([sys.executable, "-c", _HOST_PROBE], capture_output=True, text=True,
                          check=True, timeout=300)
    return int(done.stdout.split()[-1]) * 1024  # VmRSS is in kB
  except (OSError, subprocess.SubprocessError, ValueError, IndexError):
    return 0


def plan(spec: TrainSpec, *, devices: Sequence[jax.Device] | None = None,
         prompt_len: int | None = None, vocab_size: int | None = None,
         host: bool = False) -> MemoryPlan:
  """The memory plan of a run on `devices` (default: all), without allocating the model.

  Args:
    spec: the run (`ksjax.run.spec.from_config` of a trainer config).
    devices: the devices of the mesh `spec.run.mesh` (fake CPU devices plan for hardware one
      does not have).
    prompt_len: the longest prompt, in tokens; default `prompt_len_of(spec)`.
    vocab_size: the tokenizer's vocabulary; default: as the trainer would find it.
    host: on a CPU backend, count the host process (`host_process_bytes`) in every phase: for
      a plan of this machine's CPU devices, not of fake devices standing in for accelerators.

  Raises:
    ConfigError if the config is invalid, or the mesh cannot divide the model or the batch.
  """
  prompt_len = prompt_len_of(spec) if prompt_len is None else prompt_len
  if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
    raise ConfigError(f"prompt_len={prompt_len!r} is not accepted; expected an integer >= 1")
  cfg, mesh = resolve(spec, devices, vocab_size)
  shapes = plan_shapes(spec, mesh, prompt_len)
  held = state_bytes(spec, cfg, mesh)
  cpu_host = host and mesh.devices.flat[0].platform == "cpu"
  # On this machine's CPU devices what the process keeps for each compiled program is the
  # devices' memory too. It is measured at the model's own depth: it grows faster than affinely
  # at small depths, so the probes' line underestimated it (docs/benchmarks.md).
  measure = cpu_host and allocator.allocated_bytes() is not None
  update = _by_depth(lambda c, m: compile_update(spec, c, mesh, shapes, measure=m), cfg,
                     scanned=cfg.remat, measure=measure)
  reference_forward = _by_depth(lambda c, m: compile_reference(spec, c, mesh, shapes, measure=m),
                                cfg, scanned=cfg.remat, measure=measure)
  # A sparse update's smaller micro-batches need less than the dense one: compiled only for what
  # the process keeps for them, at the model's depth.
  smaller = [m for m in sparse.micro_sizes(spec.minibatch_rows, sharding.batch_shards(mesh),
                                           spec.loss.sparse_min_rows, spec.loss.micro_batch_size)
             if m != shapes.micro_batch] if measure and spec.loss.use_sparse else []
  # Where the dense layout shares prompts, sparse steps whose kept rows share too few may run the
  # dense micro-batch a prompt per row: a program of its own.
  if measure and spec.loss.use_sparse and dense_share(spec, mesh, shapes) > 1:
    smaller.append(shapes.micro_batch)
  sparse_updates = tuple(compile_update(spec, cfg, mesh, shapes, measure=True, micro=m, group=1)
                         for m in smaller)

  @functools.cache  # evaluation often samples the training shapes: compile those once
  def sampler(prompts: int, samples: int, new: int) -> tuple[ProgramMemory, ProgramMemory]:
    return _by_depth(lambda c, m: compile_sampler(
        spec, c, mesh, prompts=prompts, samples=samples, prompt_len=shapes.prompt_len,
        max_new_tokens=new, measure=m), cfg, measure=measure)

  prefill, decode = sampler(shapes.sample_prompts, shapes.samples, shapes.max_new_tokens)
  eval_prefill, eval_decode = sampler(shapes.eval_prompts, shapes.eval_samples,
                                      shapes.eval_max_new_tokens)
  train_cache, eval_cache = sampler_caches(cfg, mesh, shapes)
  weights_t, eval_weights_t = weights_first_bytes(
      spec, cfg, mesh, [(shapes.sample_prompts * shapes.samples, shapes.max_new_tokens),
                        (shapes.eval_prompts * shapes.eval_samples, shapes.eval_max_new_tokens)])
  return MemoryPlan(
      model=cfg, mesh=dict(mesh.shape), platform=mesh.devices.flat[0].platform, shapes=shapes,
      params=held.params, optimizer=held.optimizer, reference=held.reference, update=update,
      kv_cache=train_cache, prefill=prefill, decode=decode, eval_kv_cache=eval_cache,
      eval_prefill=eval_prefill, eval_decode=eval_decode,
      extrapolated=cfg.num_layers > EXACT_DEPTH, sampler_params=sampler_copy_bytes(spec, cfg, mesh),
      sampler_shared=not spec.sampling.sampler_devices, frozen=held.frozen,
      lora=spec.lora,
      host=host_process_bytes() if cpu_host else 0, reference_forward=reference_forward,
      sparse_updates=sparse_updates,
      weights_t=weights_t, eval_weights_t=eval_weights_t)


def weights_first_bytes(spec: TrainSpec, cfg: model.LlamaConfig, mesh: Any,
                        calls: Sequence[tuple[int, int]]) -> list[int]:
  """For each sampler call's (rows, max_new_tokens), the per-device bytes of the transposed
  weight copies it makes of the policy's parameters (`sampler.weights_first`), 0 where it makes
  none (`sampler.weights_first_applies`). The copies do not depend on the call, so the abstract
  policy is built once, and only if some call makes them."""
  applies = [sampler_lib.weights_first_applies(SamplerConfig(max_new_tokens=n), mesh, rows)
             for rows, n in calls]
  if not any(applies):
    return [0] * len(calls)
  copies = device_bytes(jax.eval_shape(functools.partial(sampler_lib.weights_first, cfg=cfg),
                                       abstract_policy(spec, cfg, mesh).params))
  return [copies if a else 0 for a in applies]


# ---------------------------------------------------------------------------------------------
# The start-up check
# ---------------------------------------------------------------------------------------------

def device_memory_bytes(device: jax.Device | None = None) -> int | None:
  """The memory the runtime lets one device use, or None where it does not say (CPU)."""
  device = device or jax.local_devices()[0]
  try:
    stats = device.memory_stats()
  except (NotImplementedError, jax.errors.JaxRuntimeError):
    return None
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def advice(memory_plan: MemoryPlan, device_memory: int) -> list[str]:
  """What to change so that the plan fits, most effective first, each with the bytes it saves."""
  p, s = memory_plan, memory_plan.shapes
  budget = USABLE_FRACTION * device_memory
  over = p.peak - budget
  out = []
  mesh = p.mesh
  devices = math.prod(mesh.values())
  state = p.params + p.optimizer + p.reference
  if mesh["fsdp"] < devices:
    share = mesh["fsdp"] / devices
    out.append(f"more fsdp: config.mesh=(1, {devices // mesh['tensor']}, {mesh['tensor']}) "
               f"shards parameters, optimizer state and reference over all devices (saves "
               f"{state * (1 - share * mesh['tensor']) / GIB:.1f} GiB of the {state / GIB:.1f} "
               "GiB they take)")
  if p.model.param_dtype == "float32":
    out.append(f"bfloat16: config.model.dtype='bfloat16' halves parameters, optimizer state, "
               f"reference and activations (saves about {p.peak / 2 / GIB:.1f} GiB)")
  if not p.lora.enabled:
    out.append(f"LoRA: config.lora.rank=16 trains low-rank adapters on a frozen base, so the "
               f"base has no AdamW moments or gradients and the reference is the base itself "
               f"(saves most of the optimizer state and the reference, "
               f"{(p.optimizer + p.reference) / GIB:.1f} GiB, and the base's gradients in the "
               "update; configs/smollm2_pass_at_k_lora.py is one)")
  elif p.lora.quantize_base != "int4":
    out.append(f"QLoRA: config.lora.quantize_base='int4' stores the frozen base "
               f"({p.frozen / GIB:.1f} GiB now) as 4-bit integers with a scale per 64 values")
  phase = max(p.phases, key=p.phases.get)
  if phase == "update":
    per_row = p.update_activations / s.micro_batch
    if s.micro_batch > 1:
      smaller = max(1, s.micro_batch // 2)
      out.append(f"smaller micro-batch: config.micro_batch_size={smaller} (now {s.micro_batch}; "
                 f"the update's batch and activations take {p.update_activations / GIB:.1f} "
                 f"GiB, about {per_row / GIB:.2f} GiB per row)")
  if phase == "reference":
    out.append(f"smaller micro-batch: config.micro_batch_size (now {s.micro_batch}): the "
               f"reference forward runs micro-batches of whole groups of {s.samples} samples; "
               f"its rows and temporaries (KV cache, gathered weights) take "
               f"{p.reference_rows / GIB:.1f} GiB")
  if phase in ("update", "reference") and not p.model.remat:
    out.append("config.model.remat=True: scan the decoder blocks (and rematerialise each in the "
               "update), so one block's activations and gathered weights are live, not all of "
               "them")
  if phase in ("sampling", "eval"):
    cache = p.kv_cache if phase == "sampling" else p.eval_kv_cache
    field = "batch_prompts" if phase == "sampling" else "eval.batch_prompts"
    out.append(f"fewer prompts per sampler call: config.{field} (the {phase} KV cache takes "
               f"{cache / GIB:.1f} GiB)")
  out.append(f"shorter context: config.max_new_tokens (now {s.max_new_tokens}) or shorter "
             f"prompts (planned for {s.prompt_len} tokens)")
  if over > state:
    out.append(f"more devices: the state alone needs {state / GIB:.1f} GiB per device on "
               f"{devices}")
  return out


def check(memory_plan: MemoryPlan, device_memory: int | None = None) -> MemoryPlan:
  """Returns the plan if it fits in USABLE_FRACTION of `device_memory` (default: what the
  runtime reports; unchecked when neither is known, as on CPU); else raises ConfigError saying
  what to change."""
  if device_memory is None:
    device_memory = device_memory_bytes()
  if device_memory is None or memory_plan.peak <= USABLE_FRACTION * device_memory:
    return memory_plan
  phase = max(memory_plan.phases, key=memory_plan.phases.get)
  raise ConfigError(
      f"config does not fit: it needs {memory_plan.peak / GIB:.1f} GiB per device at its "
      f"{phase} peak, and a device has {device_memory / GIB:.1f} GiB ({USABLE_FRACTION:.0%} "
      "usable); change one of: " + "; ".join(advice(memory_plan, device_memory)))


def check_fits(spec: TrainSpec, device_memory: int | None = None,
               **plan_args) -> MemoryPlan | None:
  """Plans a run and raises ConfigError, saying what to change, if it cannot fit.

  The trainer calls this at start-up, before it allocates anything.

  Args:
    spec: the run.
    device_memory: bytes one device has; default: what the runtime reports. When neither is
      known (CPU), nothing is planned and None is returned.
    **plan_args: passed to `plan` (devices, prompt_len, vocab_size).

  Returns:
    The plan, when it fits in USABLE_FRACTION of `device_memory`.
  """
  if device_memory is None:
    device_memory = device_memory_bytes()
  if device_memory is None:
    return None
  return check(plan(spec, **plan_args), device_memory)


__all__ = ["AbstractPolicy", "MemoryPlan", "ProgramMemory", "Shapes", "StateBytes",
           "abstract_mesh", "abstract_policy", "check", "check_fits", "device_bytes",
           "device_memory_bytes", "element_bits", "kv_cache_bytes", "lora_lines", "plan",
           "prompt_len_of", "resolve", "sampler_caches", "state_bytes", "state_lines",
           "vocab_size_of"]
