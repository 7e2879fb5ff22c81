"""A run directory: every path and checkpoint item name of a training run, in one place.

  <workdir>/
    config.json          the trainer config the run started with
    tokenizer/           the task's tokenizer (tokenizer.json)
    start/               the start policy (after the warm-up), a ksjax.model checkpoint (under
                         LoRA, its adapters alone: `ksjax.model.lora.save`): the frozen
                         reference of the KL metrics and penalty
    checkpoints/<step>/  Orbax step directories with the items
                           state   the TrainState (params, opt_state, step, skipped, rng);
                                   under LoRA, params holds what trains (the adapters)
                           data    the data iterator's position (one file per process)
                           config  the config as JSON (under LoRA, with the base's record)
    metrics.jsonl        one line of scalars per logged step
    tensorboard/         the same scalars as TensorBoard events
    eval_start.json      the held-out evaluation of the start policy ...
    eval_end.json        ... and of the final one,
    eval_table.txt       the two side by side
    final/               the last policy, a ksjax.model checkpoint (under LoRA, its adapters)
    eval/<settings>/     the eval binary's results (`python -m ksjax.eval`), one folder per
                         sampling settings

The trainer writes it, the eval binary and the studies read it; none of them spells a name.
"""

from __future__ import annotations

import dataclasses
import os

# The items of a step checkpoint, and the TrainState field holding the policy's parameters.
STATE_ITEM = "state"
DATA_ITEM = "data"
CONFIG_ITEM = "config"
PARAMS_FIELD = "params"
# Under LoRA, the config item records the base the adapters belong to under this key, beside the
# config (`ksjax.model.lora.base_record`): the trainer's resume and the eval binary check it.
LORA_BASE_KEY = "lora_base"

CHECKPOINTS = "checkpoints"


@dataclasses.dataclass(frozen=True)
class RunDirectory:
  """The paths of one run. `steps_dir` is normally `<workdir>/checkpoints`; the eval binary
  also accepts that folder itself (`locate`)."""
  workdir: str
  steps_dir: str = ""

  def __post_init__(self):
    object.__setattr__(self, "workdir", os.path.abspath(self.workdir))
    if not self.steps_dir:
      object.__setattr__(self, "steps_dir", os.path.join(self.workdir, CHECKPOINTS))

  def _path(self, name: str) -> str:
    return os.path.join(self.workdir, name)

  @property
  def config_json(self) -> str:
    return self._path("config.json")

  @property
  def tokenizer_dir(self) -> str:
    return self._path("tokenizer")

  @property
  def start_dir(self) -> str:
    return self._path("start")

  @property
  def final_dir(self) -> str:
    return self._path("final")

  @property
  def metrics_jsonl(self) -> str:
    return self._path("metrics.jsonl")

  @property
  def tensorboard_dir(self) -> str:
    return self._path("tensorboard")

  def held_out_json(self, when: str) -> str:
    """The held-out evaluation at "start" or "end"."""
    if when not in ("start", "end"):
      raise ValueError(f"when={when!r}; expected 'start' or 'end'")
    return self._path(f"eval_{when}.json")

  @property
  def held_out_table(self) -> str:
    return self._path("eval_table.txt")

  def eval_dir(self, name: str) -> str:
    """Where the eval binary puts the results of one set of sampling settings."""
    return os.path.join(self.workdir, "eval", name)

  def step_dir(self, step: int) -> str:
    return os.path.join(self.steps_dir, str(step))

  def state_dir(self, step: int) -> str:
    return os.path.join(self.step_dir(step), STATE_ITEM)

  def has_checkpoints(self) -> bool:
    """Whether any step directory (finished or not) is there."""
    return os.path.isdir(self.steps_dir) and any(
        name.isdigit() for name in os.listdir(self.steps_dir))


def locate(path: str) -> RunDirectory | None:
  """The run at `path`: a run's workdir (holding checkpoints/) or its checkpoints/ folder
  itself; None when `path` is not a directory."""
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    return None
  nested = os.path.join(path, CHECKPOINTS)
  if os.path.isdir(nested):
    return RunDirectory(path, nested)
  return RunDirectory(os.path.dirname(path), path)
