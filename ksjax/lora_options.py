"""The options of low-rank adapters (LoRA) and QLoRA's quantized base: `config.lora`.

They sit below both their readers: `ksjax.run.spec` reads a run's config into `LoraSpec`, and
`ksjax.model.lora` applies one to a Llama. Kept apart from `ksjax.model` because importing that
package loads jax, and config files must load without it (`tests/run/test_spec.py`); kept out of
`ksjax.run` because the model sits below the run layer (`tests/run/test_layers.py`).
"""

from __future__ import annotations

import dataclasses

from ksjax import config_fields as cf
from ksjax.config_fields import field
from ksjax.config_validation import ConfigError

# The weight matrices low-rank adapters may target (`ksjax.model.lora`): qwix's module names.
LORA_TARGETS = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
LORA_QUANTIZE = ("none", "int8", "int4")


@dataclasses.dataclass(frozen=True)
class LoraSpec(cf.Spec, path="lora"):
  """Low-rank adapters (LoRA) on the policy's weight matrices, and QLoRA's quantized base
  (`ksjax.model.lora`): only the adapters train, the base stays frozen. Off while rank is 0."""
  rank: int = field(0, "the adapters' rank r; 0: no adapters (full fine-tuning)", lo=0)
  alpha: float = field(16.0, "the adapters' product is scaled by alpha / rank", lo=0.0,
                       lo_open=True)
  dropout: float = field(0.0, "dropout on the adapters' inputs in the update", lo=0.0, hi=1.0,
                         hi_open=True)
  targets: str = field("all", "the weights adapted: attention (q/k/v/o), mlp (gate/up/down) or "
                       "all", choices=tuple(LORA_TARGETS))
  quantize_base: str = field("none", "the frozen base's format: none, or int8/int4 (QLoRA)",
                             choices=LORA_QUANTIZE)

  def __post_init__(self):
    super().__post_init__()
    self._a_quantized_base_needs_adapters()

  def _a_quantized_base_needs_adapters(self):
    if self.quantize_base != "none" and not self.rank:
      raise ConfigError(f"config.lora.quantize_base={self.quantize_base!r} needs "
                        "config.lora.rank >= 1 (QLoRA trains adapters on the quantized base); "
                        "expected 'none' while LoRA is off")

  @property
  def enabled(self) -> bool:
    return bool(self.rank)

  @property
  def drops_out(self) -> bool:
    """Whether the update draws dropout masks on the adapters' inputs."""
    return self.enabled and self.dropout > 0

  @property
  def scale(self) -> float:
    """alpha / rank: what the adapters' product is multiplied by."""
    return self.alpha / self.rank

  @property
  def weights(self) -> tuple[str, ...]:
    """The names of the weight matrices that get adapters."""
    return LORA_TARGETS[self.targets]
