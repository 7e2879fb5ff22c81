"""Datasets on disk and the grain pipeline that feeds prompts to the trainer.

Building (once, offline). One TFDS builder per dataset turns local files in the published
format into array_record shards (`tensorflow-datasets` without TensorFlow) of examples
`{"id": Text, "record": Text}`, where `record` is the JSON of the normalized record that the
dataset's reader yields (`ksjax.tasks.math_data`, `ksjax.tasks.code_data`) or, for "synthetic",
the embedded task's records. The examples stay this plain on purpose: every dataset shares one
feature spec, the task decides what a record means (`Task.prompt_from_record`), and nothing
the readers add is lost. Building never touches the network: the files come from a manual
directory, `try_download_gcs=False`, and tfds's download directory is a temporary one that is
removed afterwards. A missing input is one `DataError` naming the expected path and format,
raised before anything is written; the command line prints it as one line and exits with
status 2 (`ksjax.errors`).

  python -m ksjax.tasks.data --dataset=math --manual_dir=path/to/MATH --data_dir=path/to/built

Reading (every run). `load_records` opens a built split as a random-access grain `MapDataset`
of decoded records; `batch_iterator` turns it (or any sequence, e.g. `task.prompts("train")`)
into an endless stream of batches:

  records --map(transform)--> shuffle(seed, reshuffled each epoch) --> repeat
          --> batch(B / P) --> take every P-th batch starting at process p

so that the P local batches of step t are, in process order, exactly the global batch of step
t of a single-process run with the same seed: a run's data does not depend on how many hosts
read it. Each process reads only its own records. The iterator is a `grain.DatasetIterator`;
its state (`get_state()`/`set_state()`, a few integers) goes into Orbax checkpoints through
grain's handler:

  manager.save(step, args=ocp.args.Composite(
      data=grain.checkpoint.CheckpointSave(iterator), ...))
  manager.restore(step, args=ocp.args.Composite(
      data=grain.checkpoint.CheckpointRestore(fresh_iterator), ...))

and a restored iterator continues with exactly the elements the saved one would have produced.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import tempfile
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grain
import tensorflow_datasets as tfds

from ksjax.tasks import synthetic
from ksjax.tasks.records import input_exists
from ksjax.tasks.base import DataError

_FEATURES = {"id": tfds.features.Text(), "record": tfds.features.Text()}


class _Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """What ksjax's builders share: a version, the {"id", "record"} features and no code path.

  Our builders keep no checksums file beside their code. Saying so (code_path = None) also
  skips tfds 4.9.10's code-path lookup, which imports the undeclared package
  `importlib_resources` on Python >= 3.9 (tensorflow/datasets#11212).
  """

  VERSION = tfds.core.Version("1.0.0")
  code_path = None
  DESCRIPTION: str
  HOMEPAGE: str = ""

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(builder=self, description=self.DESCRIPTION,
                                 homepage=self.HOMEPAGE,
                                 features=tfds.features.FeaturesDict(_FEATURES))


def _examples(records: Iterator[Mapping[str, Any]], source: str) -> Iterator[tuple[str, dict]]:
  """(key, example) pairs for TFDS from normalized records; ids must be unique strings."""
  seen: set[str] = set()
  for record in records:
    record_id = record.get("id") if isinstance(record, Mapping) else None
    if not isinstance(record_id, str) or not record_id:
      raise DataError(f"{source}: a record has no string 'id': {str(record)[:200]}")
    if record_id in seen:
      raise DataError(f"{source}: id {record_id!r} occurs twice; ids must be unique within a split")
    seen.add(record_id)
    try:
      text = json.dumps(record, ensure_ascii=False, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
      raise DataError(f"{source}: record {record_id!r} is not JSON-serializable: {e}") from e
    yield record_id, {"id": record_id, "record": text}


def _resolve(reference: str) -> Any:
  """The object a "module:name" reference names (imported on first use)."""
  module, name = reference.split(":")
  return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class LocalFiles:
  """Where a dataset's published files are and how to read them.

  Attributes:
    name: the dataset's name (its directory under `data_dir`).
    reader: "module:function" of a function path -> Iterator[normalized record dict]. Readers
      and their format descriptions are imported only when needed (they bring their own
      dependencies).
    format: "module:NAME" of the reader's description of the accepted format.
    splits: split -> file, directory or shard prefix (`train` for `train-*`), relative to the
      manual directory.
    split_field: if set, the reader reads the whole manual directory and a split keeps the
      records whose `split_field` names it (MATH: ids relative to the MATH root, "test/algebra/
      1.json", are how MATH-500 names the same problems).
    homepage: where the published files come from.
  """
  name: str
  reader: str
  format: str
  splits: Mapping[str, str]
  split_field: str | None = None
  homepage: str = ""

  @property
  def layout(self) -> str:
    return ", ".join(f"{split}: <manual_dir>/{path}" for split, path in self.splits.items())


LOCAL_DATASETS = (
    LocalFiles("math", "ksjax.tasks.math_data:read_math_dir",
               "ksjax.tasks.math_data:MATH_DIR_FORMAT", {"train": "train", "test": "test"},
               split_field="split", homepage="https://github.com/hendrycks/math"),
    LocalFiles("math500", "ksjax.tasks.math_data:read_math500_jsonl",
               "ksjax.tasks.math_data:MATH500_FORMAT", {"test": "test.jsonl"},
               homepage="https://huggingface.co/datasets/HuggingFaceH4/MATH-500"),
    # The paper trains on all of HARP.
    LocalFiles("harp", "ksjax.tasks.math_data:read_harp_jsonl",
               "ksjax.tasks.math_data:HARP_FORMAT", {"train": "HARP.jsonl"},
               homepage="https://github.com/aadityasingh/HARP"),
    LocalFiles("code_contests", "ksjax.tasks.code_data:read_code_contests",
               "ksjax.tasks.code_data:CODE_CONTESTS_FORMAT",
               {"train": "train", "valid": "valid", "test": "test"},
               homepage="https://github.com/google-deepmind/code_contests"),
    LocalFiles("taco", "ksjax.tasks.code_data:read_taco", "ksjax.tasks.code_data:TACO_FORMAT",
               {"train": "train", "test": "test"},
               homepage="https://huggingface.co/datasets/BAAI/TACO"),
)


class LocalFilesBuilder(_Builder, skip_registration=True):
  """Builds a dataset from files in a manual directory through its reader; subclasses set
  SOURCE (`local_files_builder` makes one per entry of LOCAL_DATASETS)."""

  SOURCE: LocalFiles

  def __init_subclass__(cls, **kwargs):
    cls.name = cls.SOURCE.name
    super().__init_subclass__(**kwargs)
    cls.MANUAL_DOWNLOAD_INSTRUCTIONS = (
        f"Place the published files in the manual directory ({cls.SOURCE.layout}).")
    cls.DESCRIPTION = f"{cls.name} from local files, read by {cls.SOURCE.reader}."
    cls.HOMEPAGE = cls.SOURCE.homepage

  @classmethod
  def check_manual_dir(cls, manual_dir: str | os.PathLike | None) -> dict[str, str]:
    """The path of every split, or DataError naming the first missing one and the format.

    A split's path may be a file, a directory or the prefix of shards beside it (`train` for
    `train-00000-of-00002.parquet`); which files it holds and whether they parse is the reader's
    to decide (`ksjax.tasks.records`).
    """
    source = cls.SOURCE
    if manual_dir is None:
      raise DataError(f"dataset {cls.name!r} is built from local files; pass manual_dir, a "
                      f"directory holding {source.layout}; expected {_resolve(source.format)}")
    paths = {split: os.path.join(os.fspath(manual_dir), relative)
             for split, relative in source.splits.items()}
    for path in paths.values():
      if not input_exists(path):  # as the readers resolve it, shard prefixes included
        raise DataError(f"dataset {cls.name!r}: {path} does not exist; expected "
                        f"{_resolve(source.format)} ({source.layout})")
    return paths

  def _split_generators(self, dl_manager):
    paths = self.check_manual_dir(dl_manager.manual_dir)
    return {split: self._generate_examples(os.fspath(dl_manager.manual_dir), split, path)
            for split, path in paths.items()}

  def _generate_examples(self, manual_dir: str, split: str, path: str):
    reader, field = _resolve(self.SOURCE.reader), self.SOURCE.split_field
    if field is None:
      return _examples(reader(path), source=f"{self.name} ({path})")
    records = (r for r in reader(manual_dir) if r.get(field) == split)
    return _examples(records, source=f"{self.name} ({path})")


def local_files_builder(source: LocalFiles) -> type[LocalFilesBuilder]:
  """The TFDS builder class of `source` (not registered in tfds's global registry)."""
  return types.new_class(f"LocalFilesBuilder_{source.name}", (LocalFilesBuilder,),
                         {"skip_registration": True}, lambda ns: ns.update(SOURCE=source))


@dataclasses.dataclass(eq=False)
class SyntheticConfig(tfds.core.BuilderConfig):
  """The generation parameters of `ksjax.tasks.synthetic.SyntheticTask`; the config's name
  encodes them, so differently generated datasets never share a directory."""
  seed: int = 0
  train_per_level: int = 800
  test_per_level: int = 60
  num_solutions: int = 4
  modulus: int = synthetic.DEFAULT_MODULUS

  def __post_init__(self):
    synthetic.check_modulus(self.modulus)  # the task's check and message, before any build

  @classmethod
  def make(cls, **options) -> "SyntheticConfig":
    fields = {f.name for f in dataclasses.fields(cls)} - {
        f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}
    unknown = set(options) - fields
    if unknown:
      raise ValueError(f"synthetic dataset options {sorted(unknown)} are not accepted; expected "
                       f"some of {sorted(fields)}")
    values = {name: options.get(name, getattr(cls, name)) for name in sorted(fields)}
    # The default modulus is left out of the name: datasets built before the option existed
    # (all modulo 10) keep their directory, and other moduli get their own.
    named = {k: v for k, v in values.items()
             if not (k == "modulus" and v == synthetic.DEFAULT_MODULUS)}
    return cls(name="_".join(f"{k}{v}" for k, v in named.items()), **values)


class SyntheticBuilder(_Builder, skip_registration=True):
  """The embedded task's splits, generated (no input files)."""

  name = "synthetic"
  DESCRIPTION = ("ksjax's embedded task: signed digit chains modulo M, 10 by default "
                 "(ksjax.tasks.synthetic).")

  def _split_generators(self, dl_manager):
    config = self.builder_config
    task = synthetic.SyntheticTask(seed=config.seed, train_per_level=config.train_per_level,
                                   test_per_level=config.test_per_level,
                                   num_solutions=config.num_solutions, modulus=config.modulus)
    return {split: self._generate_examples(task, split) for split in synthetic.SPLITS}

  def _generate_examples(self, task, split: str):
    return _examples(task.records(split), source=f"synthetic ({split})")


BUILDERS: dict[str, type[tfds.core.GeneratorBasedBuilder]] = {
    "synthetic": SyntheticBuilder, **{s.name: local_files_builder(s) for s in LOCAL_DATASETS}}


def make_builder(name: str, *, data_dir: str | os.PathLike, **options) -> tfds.core.DatasetBuilder:
  """The builder of dataset `name` rooted at `data_dir` (built or not)."""
  if name not in BUILDERS:
    raise ValueError(f"dataset {name!r} is not accepted; expected one of {', '.join(BUILDERS)}")
  if name == "synthetic":
    return SyntheticBuilder(data_dir=os.fspath(data_dir), config=SyntheticConfig.make(**options),
                            file_format="array_record")
  if options:
    raise ValueError(f"dataset {name!r} takes no options; got {sorted(options)}")
  return BUILDERS[name](data_dir=os.fspath(data_dir), file_format="array_record")


def build(name: str, *, data_dir: str | os.PathLike, manual_dir: str | os.PathLike | None = None,
          overwrite: bool = False, **options) -> tfds.core.DatasetBuilder:
  """Builds dataset `name` into `data_dir` (array_record) from `manual_dir`; returns its builder.

  An already built dataset is reused unless `overwrite`. `options` are the synthetic task's
  generation parameters (see `SyntheticConfig`).
  """
  builder = make_builder(name, data_dir=data_dir, **options)
  if isinstance(builder, LocalFilesBuilder):
    builder.check_manual_dir(manual_dir)  # before tfds writes anything
  mode = (tfds.download.GenerateMode.REUSE_CACHE_IF_EXISTS if overwrite
          else tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS)
  with tempfile.TemporaryDirectory(prefix="ksjax_tfds_downloads_") as download_dir:
    builder.download_and_prepare(
        download_dir=download_dir,
        download_config=tfds.download.DownloadConfig(
            manual_dir=None if manual_dir is None else os.fspath(manual_dir),
            download_mode=mode, try_download_gcs=False))
  return builder


def _prepared(name: str, data_dir: str | os.PathLike, options) -> tfds.core.DatasetBuilder:
  builder = make_builder(name, data_dir=data_dir, **options)
  if not builder.is_prepared():
    raise DataError(f"dataset {name!r} is not built at {builder.data_path}; expected TFDS "
                    f"array_record files there: build it with ksjax.tasks.data.build({name!r}, "
                    f"data_dir=..., manual_dir=...) or `python -m ksjax.tasks.data`")
  return builder


def built_splits(name: str, *, data_dir: str | os.PathLike, **options) -> tuple[str, ...]:
  """The splits of a built dataset, sorted."""
  return tuple(sorted(_prepared(name, data_dir, options).info.splits))


def load_records(name: str, split: str, *, data_dir: str | os.PathLike,
                 **options) -> grain.MapDataset:
  """A built split as a random-access MapDataset of normalized record dicts."""
  builder = _prepared(name, data_dir, options)
  if split not in builder.info.splits:
    raise DataError(f"dataset {name!r} at {builder.data_path} has no split {split!r}; it has "
                    f"{', '.join(sorted(builder.info.splits))}")
  return grain.MapDataset.source(builder.as_data_source(split)).map(_decode)


def _decode(example: Mapping[str, Any]) -> dict[str, Any]:
  return json.loads(example["record"])


def batch_iterator(source: grain.MapDataset | Sequence[Any], *, batch_size: int, seed: int,
                   shuffle: bool = True, num_epochs: int | None = None,
                   shard_options: grain.sharding.ShardOptions | None = None,
                   transform: Callable[[Any], Any] | None = None,
                   read_options: grain.ReadOptions | None = None) -> grain.DatasetIterator:
  """This process's batches (lists of `batch_size / shard_count` elements) of `source`.

  Args:
    source: records (`load_records`) or any sequence, e.g. `task.prompts("train")`.
    batch_size: the global batch size, divisible by the number of shards.
    seed: the shuffle seed; every epoch is reshuffled deterministically from it.
    shuffle: False keeps the source order (evaluation).
    num_epochs: None repeats forever; otherwise the stream ends after that many epochs, the
      incomplete last batch and any batches that not every shard would get dropped, so all
      processes take the same number of steps.
    shard_options: this process's shard; by default the JAX process index and count.
    transform: applied to each element before batching (e.g. `task.prompt_from_record`).
    read_options: grain's threading and prefetch; a small default suited to prompt records.

  Returns:
    An iterator over lists; `get_state()`/`set_state()` save and restore its position.
  """
  shard = shard_options or grain.sharding.ShardByJaxProcess(drop_remainder=True)
  if batch_size < 1 or batch_size % shard.shard_count:
    raise ValueError(f"batch_size={batch_size} is not accepted; expected a positive multiple of "
                     f"the number of data shards (processes), {shard.shard_count}")
  local_batch = batch_size // shard.shard_count
  dataset = source if isinstance(source, grain.MapDataset) else grain.MapDataset.source(source)
  if len(dataset) == 0:
    raise DataError("the data source is empty")
  if transform is not None:
    dataset = dataset.map(transform)
  if shuffle:
    dataset = dataset.shuffle(seed=seed)
  dataset = dataset.repeat(num_epochs).batch(local_batch, drop_remainder=True, batch_fn=list)
  if num_epochs is not None:
    dataset = dataset[:len(dataset) - len(dataset) % shard.shard_count]
  dataset = dataset[shard.shard_index::shard.shard_count]
  read_options = read_options or grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
  return iter(dataset.to_iter_dataset(read_options))


def main(argv: Sequence[str]) -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  del argv
  values = flags.FLAGS
  builder = build(values.dataset, data_dir=values.data_dir, manual_dir=values.manual_dir,
                  overwrite=values.overwrite)
  for split, info in builder.info.splits.items():
    print(f"{builder.name}/{split}: {info.num_examples} examples in {builder.data_path}")


if __name__ == "__main__":
  from absl import app, flags  # pylint: disable=g-import-not-at-top,g-multiple-import

  from ksjax import errors  # pylint: disable=g-import-not-at-top
  flags.DEFINE_enum("dataset", None, list(BUILDERS), "The dataset to build.", required=True)
  flags.DEFINE_string("data_dir", None, "Where the built dataset goes.", required=True)
  flags.DEFINE_string("manual_dir", None, "The directory holding the published files.")
  flags.DEFINE_bool("overwrite", False, "Rebuild even if a built copy exists.")
  app.run(errors.boundary("ksjax.tasks.data", main))
