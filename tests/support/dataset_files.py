"""Small files in the published formats of MATH, MATH-500, HARP, CodeContests and TACO.

Each writer fills a manual directory laid out as `ksjax.tasks.data` expects and returns, per
split, the records the dataset's reader yields for it (what a built dataset must hold).
"""

import json
import os
import shutil

from ksjax.tasks import code_data, math_data

MATH_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "math")


def write_jsonl(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _code_contests_row(name, n_tests):
  tests = {"input": [f"{i} {i}\n" for i in range(n_tests)],
           "output": [f"{2 * i}\n" for i in range(n_tests)]}
  return {"name": name, "description": f"Print twice the number ({name}).", "public_tests": tests,
          "private_tests": {"input": [], "output": []}, "generated_tests": None,
          "time_limit": {"seconds": 1, "nanos": 0}, "memory_limit_bytes": 1 << 28,
          "difficulty": 1, "source": 2, "input_file": "", "output_file": "",
          "solutions": {"language": [3], "solution": ["print(2 * int(input().split()[0]))"]}}


def _taco_row(question, n_tests):
  lines = [f"{i}\n" for i in range(n_tests)]
  spec = {"inputs": lines, "outputs": lines}
  return {"question": question, "input_output": json.dumps(spec), "starter_code": "",
          "difficulty": "EASY", "solutions": json.dumps(["print(input())"]),
          "time_limit": "1 second", "memory_limit": "256 megabytes"}


def math_files(manual):
  shutil.copytree(os.path.join(MATH_FIXTURES, "MATH"), manual)
  return {split: [r for r in math_data.read_math_dir(str(manual)) if r["split"] == split]
          for split in ("train", "test")}


def math500_files(manual):
  manual.mkdir()
  shutil.copy(os.path.join(MATH_FIXTURES, "math500.jsonl"), manual / "test.jsonl")
  return {"test": list(math_data.read_math500_jsonl(str(manual / "test.jsonl")))}


def harp_files(manual):
  manual.mkdir()
  shutil.copy(os.path.join(MATH_FIXTURES, "harp.jsonl"), manual / "HARP.jsonl")
  return {"train": list(math_data.read_harp_jsonl(str(manual / "HARP.jsonl")))}


def code_contests_files(manual, *, shard_prefixes=False):
  """A directory per split, or with `shard_prefixes` Hugging Face's layout: the shards
  `<split>-00000-of-00002.jsonl`... side by side in the manual directory, no `<split>` path."""
  for split, names in (("train", ["1_A", "1_B", "2_A"]), ("valid", ["3_A"]), ("test", ["4_A"])):
    # Two shards of the train split; 1_B has too few tests and is dropped by the reader.
    shards = [names[:1], names[1:]] if split == "train" else [names]
    for shard, rows in enumerate(shards):
      name = f"{split}-{shard:05d}-of-{len(shards):05d}.jsonl"
      write_jsonl(manual / name if shard_prefixes else manual / split / name,
                  [_code_contests_row(n, 2 if n == "1_B" else 5) for n in rows])
  return {split: list(code_data.read_code_contests(str(manual / split)))
          for split in ("train", "valid", "test")}


def taco_files(manual):
  write_jsonl(manual / "train" / "data.jsonl", [_taco_row(f"Echo {i}.", 5) for i in range(3)])
  write_jsonl(manual / "test" / "data.jsonl", [_taco_row("Echo.", 6), _taco_row("Few.", 1)])
  return {split: list(code_data.read_taco(str(manual / split))) for split in ("train", "test")}


WRITERS = {"math": math_files, "math500": math500_files, "harp": harp_files,
           "code_contests": code_contests_files, "taco": taco_files}
