"""Config fields declared once, as the fields of frozen spec dataclasses.

A spec field carries its type, its default, a one-line meaning and what it accepts; the
ConfigDict that config files start from, the checks a spec makes when it is built (from a config
or in Python) and the reading of a config into specs all come from those declarations, so a
field cannot be added, renamed or re-bounded in one of them and not the others.

  @dataclasses.dataclass(frozen=True)
  class WarmupSpec(Spec, path="sft_warmup"):
    steps: int = field(0, "supervised steps before RL; 0: no warm-up", lo=0)

declares `config.sft_warmup.steps`, an int that is 0 by default, and `WarmupSpec(steps=-1)`
raises the one-line ConfigError of `ksjax.config_validation`: "config.sft_warmup.steps=-1 is out
of range; expected an integer >= 0".

A spec's dataclass fields are of three kinds:

  field(default, meaning, ...)  one config value, at the spec's `path`;
  section(cls, meaning)         a nested ConfigDict of `cls`'s fields, named like the dataclass
                                field that holds it (and `cls`'s path says so too, because a
                                spec made on its own names its fields in its messages);
  group(cls, meaning)           `cls`'s fields at the holder's own level: a concern that gathers
                                config fields without nesting them (the trainer's task, loss...).

In the ConfigDict, a field whose type admits None is a FieldReference of that type (a
`config_dict.placeholder` when its default is None), so that a value of the type can still be set
over None from the command line; any other field is its default value itself.

A check that involves two fields is not a field's: the spec runs it after every field has passed
its own, as a method named after the rule (`SamplingSpec._label_free_needs_two_completions`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from ksjax import config_validation as cv

_META = "ksjax.config_fields"  # the metadata key of a declaration
FIELD, SECTION, GROUP = "field", "section", "group"


@dataclasses.dataclass(frozen=True)
class Declaration:
  """What a dataclass field's metadata holds: its kind, meaning and what it accepts."""
  kind: str
  meaning: str
  lo: float | None = None
  hi: float | None = None
  lo_open: bool = False
  hi_open: bool = False
  # The accepted values, or a function returning them when they live in a module that is slow
  # to import (the objectives, the model): config files load the declarations without jax.
  choices: tuple | Callable[[], tuple] | None = None
  length: int | None = None  # of an integer tuple
  # (config, dotted name) -> the value to hold, raising ConfigError; replaces the check the type
  # and bounds would give, for fields no bound describes.
  check: Callable[[Any, str], Any] | None = None

  def accepted(self) -> tuple | None:
    return self.choices() if callable(self.choices) else self.choices


def field(default: Any, meaning: str, *, lo: float | None = None, hi: float | None = None,
          lo_open: bool = False, hi_open: bool = False,
          choices: tuple | Callable[[], tuple] | None = None, length: int | None = None,
          check: Callable[[Any, str], Any] | None = None) -> Any:
  """One config field: its default, what it means, and its bounds or choices (or `check`)."""
  return dataclasses.field(default=default, metadata={_META: Declaration(
      FIELD, meaning, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, choices=choices,
      length=length, check=check)})


def section(cls: type, meaning: str) -> Any:
  """A nested ConfigDict holding the fields of spec `cls`."""
  return dataclasses.field(default_factory=cls, metadata={_META: Declaration(SECTION, meaning)})


def group(cls: type, meaning: str) -> Any:
  """The fields of spec `cls`, at the level of the spec that holds it."""
  return dataclasses.field(default_factory=cls, metadata={_META: Declaration(GROUP, meaning)})


def unchecked(config: Any, name: str) -> Any:
  """The `check` of a field that only a rule of its spec can check, with the fields it depends
  on."""
  return cv.get(config, name)


class Spec:
  """The base of a frozen spec dataclass: it checks every field against its declaration when it
  is made. Its class keyword `path`, held as `PATH`, is the dotted config section of its fields
  ("" for the top level): `class WarmupSpec(Spec, path="sft_warmup")`."""
  PATH: ClassVar[str] = ""

  def __init_subclass__(cls, path: str = "", **kwargs):
    super().__init_subclass__(**kwargs)
    cls.PATH = path

  def __post_init__(self):
    for f in dataclasses.fields(self):
      declared = declaration(f)
      if declared is not None and declared.kind == FIELD:
        value = getattr(self, f.name)
        held = _check(type(self), f, declared, value)
        if held is not value:
          object.__setattr__(self, f.name, held)

  def values(self) -> dict[str, Any]:
    """{field: value} of this spec's own dataclass fields (not nested)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def declaration(f: dataclasses.Field) -> Declaration | None:
  return f.metadata.get(_META)


def dotted(path: str, name: str) -> str:
  return f"{path}.{name}" if path else name


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def value_type(cls: type, name: str) -> tuple[Any, bool]:
  """(type, nullable) of field `name` of `cls`: `int | None` gives (int, True)."""
  hint = _hints(cls)[name]
  args = typing.get_args(hint)
  if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
    rest = [a for a in args if a is not type(None)]
    return (rest[0] if len(rest) == 1 else Any), True
  return hint, False


def _is_int_tuple(hint: Any) -> bool:
  args = typing.get_args(hint)
  return typing.get_origin(hint) is tuple and bool(args) and all(
      a is int or a is Ellipsis for a in args)


def _check(cls: type, f: dataclasses.Field, declared: Declaration, value: Any) -> Any:
  """The value a spec holds for field `f`, checked against its declaration (ConfigError)."""
  name = dotted(cls.PATH, f.name)
  view: dict = {}
  node = view
  *parents, leaf = name.split(".")
  for part in parents:
    node = node.setdefault(part, {})
  node[leaf] = value  # the messages of `ksjax.config_validation` name the dotted field
  if declared.check is not None:
    return declared.check(view, name)
  hint, nullable = value_type(cls, f.name)
  if value is None and nullable:
    return None
  bounds = {"lo": declared.lo, "hi": declared.hi}
  if declared.choices is not None:
    cv.choice(view, name, declared.accepted())
  elif hint is bool:
    cv.boolean(view, name)
  elif hint is int:
    cv.integer(view, name, **bounds)
  elif hint is float:
    cv.real(view, name, lo_open=declared.lo_open, hi_open=declared.hi_open, **bounds)
  elif hint is str:
    cv.string(view, name, allow_none=nullable)
  elif _is_int_tuple(hint):
    return cv.int_tuple(view, name, length=declared.length, lo=declared.lo)
  else:
    raise TypeError(f"{cls.__name__}.{f.name}: no check for type {hint}; declare its check=")
  return value


def leaves(cls: type, path: str | None = None) -> Iterator[tuple[str, type, dataclasses.Field]]:
  """(dotted config name, spec class, dataclass field) of every config field under spec `cls`,
  through its sections and groups."""
  path = cls.PATH if path is None else path
  for f in dataclasses.fields(cls):
    declared = declaration(f)
    if declared is None:
      continue
    if declared.kind == FIELD:
      yield dotted(path, f.name), cls, f
      continue
    inner = f.default_factory
    inner_path = dotted(path, f.name) if declared.kind == SECTION else path
    if inner.PATH != inner_path:
      raise TypeError(f"{cls.__name__}.{f.name} holds {inner.__name__}, whose path is "
                      f"{inner.PATH!r}; expected {inner_path!r}")
    yield from leaves(inner, inner_path)


def config_dict(cls: type) -> Any:
  """A ConfigDict of every field under spec `cls`, each at its default."""
  # Imported here: the tasks declare their options with this module and never need a ConfigDict.
  import ml_collections  # pylint: disable=g-import-not-at-top
  from ml_collections import config_dict as cd  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict()
  for name, owner, f in leaves(cls):
    *parents, leaf = name.split(".")
    node = config
    for part in parents:
      if part not in node:
        node[part] = ml_collections.ConfigDict()
      node = node[part]
    hint, nullable = value_type(owner, f.name)
    if nullable and hint is not Any:
      kind = typing.get_origin(hint) or hint
      node[leaf] = cd.FieldReference(f.default, field_type=kind)
    else:
      node[leaf] = f.default
  return config


def describe(cls: type) -> str:
  """Every field under spec `cls`, one a line: `name = default  # meaning`."""
  return "\n".join(f"{name} = {f.default!r}  # {declaration(f).meaning}"
                   for name, _, f in leaves(cls))


def read(cls: type, config: Any, **extra: Any) -> Any:
  """Spec `cls` built from `config`'s fields (its sections and groups too); `extra` gives its
  dataclass fields that are not config fields."""
  values = dict(extra)
  for f in dataclasses.fields(cls):
    declared = declaration(f)
    if declared is None:
      continue
    if declared.kind == FIELD:
      values[f.name] = cv.get(config, dotted(cls.PATH, f.name))
    else:
      values[f.name] = read(f.default_factory, config)
  return cls(**values)
