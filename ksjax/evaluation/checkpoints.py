"""Reading a training run's checkpoints without touching them: steps, shapes, parameters.

The trainer (`ksjax.trainer.checkpointing`) writes `<workdir>/checkpoints/<step>/` with the items
"state" (a TrainState: params, opt_state, step, skipped, rng), "data" and "config". Evaluation
needs only the parameters, so it restores `state.params` alone (Orbax's partial restore), each
array straight onto its sharding on the evaluation mesh: the optimizer state, twice the
parameters' size under Adam, is never read.

Why not the trainer's `Checkpointer`: it opens a CheckpointManager that creates the directory,
removes temporary step directories and moves unreadable steps aside, which are the right things
for the process that owns the run and the wrong ones for a second process following it while it
trains. Here every access is a read: the step list comes from Orbax's listing of finalized step
directories (a save in progress is a temporary directory and is not listed).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from ksjax import model
from ksjax.model import checkpoint as model_checkpoint
from ksjax.model import sharding

RUN_CHECKPOINTS = "checkpoints"  # <workdir>/checkpoints, where the trainer puts its steps
STATE_ITEM = "state"  # the trainer's TrainState item ...
PARAMS_FIELD = "params"  # ... and its field holding the policy's parameters


class CheckpointInputError(ValueError):
  """The checkpoint directory, or a checkpoint in it, is not what evaluation can read."""


@dataclasses.dataclass(frozen=True)
class RunDirectory:
  """Where a run's step directories are (`steps_dir`) and the run's own directory (`run_dir`,
  where evaluation results go)."""
  run_dir: str
  steps_dir: str


def locate(path: str) -> RunDirectory:
  """A run's workdir (holding checkpoints/) or the checkpoints directory itself."""
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise CheckpointInputError(f"config.checkpoint_dir={path!r} does not exist or is not a "
                               "directory; expected a training run's workdir or its "
                               f"{RUN_CHECKPOINTS}/ directory")
  nested = os.path.join(path, RUN_CHECKPOINTS)
  if os.path.isdir(nested):
    return RunDirectory(run_dir=path, steps_dir=nested)
  return RunDirectory(run_dir=os.path.dirname(path), steps_dir=path)


def steps(run: RunDirectory) -> list[int]:
  """The finalized checkpoint steps, ascending."""
  return sorted(ocp.utils.checkpoint_steps(run.steps_dir))


def state_dir(run: RunDirectory, step: int) -> str:
  return os.path.join(run.steps_dir, str(step), STATE_ITEM)


def abstract_policy(cfg: model.LlamaConfig, mesh: jax.sharding.Mesh) -> tuple[nnx.GraphDef,
                                                                             nnx.State]:
  """The policy's graph and its parameters as ShapeDtypeStructs carrying their mesh shardings."""
  sharding.check_divisible(cfg, mesh)
  graphdef, state = nnx.split(model_checkpoint.abstract_model(cfg))
  shardings = sharding.state_shardings(state, mesh)
  target = jax.tree.map(
      lambda variable, s: variable.replace(
          jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=s)),
      state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return graphdef, target


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  """Parameter name ("layers.0.mlp.up_proj") -> shape, from a state or Orbax's metadata tree."""
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
  out = {}
  for path, leaf in flat:
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if keys and keys[-1] == "value":  # nnx.Variable's own level
      keys = keys[:-1]
    out[".".join(keys)] = tuple(leaf.shape)
  return out


def check_shapes(run: RunDirectory, step: int, target: nnx.State, what: str) -> None:
  """One clear error for the first parameter that the checkpoint lacks, has in another shape,
  or has in excess of the model `what` describes."""
  path = state_dir(run, step)
  try:
    stored = ocp.PyTreeCheckpointHandler().metadata(epath.Path(path))
  except (FileNotFoundError, ValueError, KeyError, OSError) as e:
    raise CheckpointInputError(f"checkpoint {path!r} cannot be read ({type(e).__name__}: "
                               f"{str(e)[:200]}); expected a ksjax trainer checkpoint") from None
  if stored is None or PARAMS_FIELD not in stored:
    raise CheckpointInputError(f"checkpoint {path!r} holds no {PARAMS_FIELD!r}; expected a ksjax "
                               "trainer checkpoint")
  have = _shapes(dict(stored[PARAMS_FIELD]))
  want = _shapes(target)
  where = f"checkpoint step {step} in {run.steps_dir}"
  for name, shape in want.items():
    if name not in have:
      raise CheckpointInputError(f"{where} lacks parameter {name!r} of {what}; expected a "
                                 "checkpoint of that model (evaluate with the run's config)")
    if have[name] != shape:
      raise CheckpointInputError(f"{where} has parameter {name!r} of shape {have[name]}; {what} "
                                 f"implies {shape} (evaluate with the run's config)")
  extra = sorted(set(have) - set(want))
  if extra:
    raise CheckpointInputError(f"{where} has parameter {extra[0]!r}, which {what} lacks "
                               "(evaluate with the run's config)")


def restore_policy(run: RunDirectory, step: int, graphdef: nnx.GraphDef,
                   target: nnx.State) -> model.Llama:
  """The policy at `step`, its parameters restored onto the shardings `target` carries."""
  item = {PARAMS_FIELD: target}
  # The item's handler itself, not a Checkpointer: the trainer's step-level metadata sits one
  # directory up, and a Checkpointer would warn that the item directory lacks it.
  restored = ocp.PyTreeCheckpointHandler().restore(
      epath.Path(state_dir(run, step)),
      args=ocp.args.PyTreeRestore(item=item,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=True))
  return nnx.merge(graphdef, restored[PARAMS_FIELD])
