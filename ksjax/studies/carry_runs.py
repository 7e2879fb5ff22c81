"""`carry.py` for a study in the published-run layout (`registered.py`: the decisive study).

A session's machine goes when the session ends, with the study's runs directory and its
checkpoints (about 1.5 GiB a SmolLM2 run, too large to commit); a matched-steps run took about
two hours on a 2-core AVX2 machine, most of it evaluation, so the run a session was in was lost
whole. `save_runs` (before a session ends) copies, for every unpublished run of the runs
directory with an evaluation record, its training attempts, evaluation calls, step log and every
evaluation record into the carry directory (to be committed), with `carried.json`: the machine,
the commit and a sha256 of each evaluated checkpoint's training state. `restore_runs` (on the
next machine, before the study runs) trains each carried run again with the study's own command
and takes its records back only where the machine description and the commit are the carried
ones, the new step log's training figures (all but times, throughputs, memory and compile
counts) equal the carried log's, and every evaluated checkpoint's training state has the carried
digest: the records then describe these very checkpoints. Otherwise it says why and the study
evaluates the run afresh. Each outcome is appended to `restores.jsonl`, which outlives the
carried files. `seeds_to_run` gives the seeds this machine may run (a seed's arms pair only
within one machine), and `commit_published` commits the published runs and the carry directory,
only those paths, as they finish.

A module of its own rather than part of `carry.py`: it reads the eval binary's records and the
trainer's step logs, which the store layout's carry (imported by every study's command) does not
need to load.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from ksjax import files
from ksjax import machine
from ksjax.evaluation import results
from ksjax.studies import registered
from ksjax.studies import runs_dir as rd
from ksjax.studies.carry import CARRIED
from ksjax.studies.carry import RESTORES
from ksjax.trainer import metrics

RUN_FILES = ("attempts.json", "evaluations.json", "metrics.jsonl")
# Step-log fields that measure the machine rather than the training: they differ between two
# identical runs.
UNSTABLE = ("time/", "throughput/", "memory/", "compile/")
RUNS_DIR = rd.RUNS_DIR


def state_digest(step_dir: str) -> str:
  """sha256 over a checkpoint's training state (`ksjax.studies.trainer_runs.state_digest`)."""
  from ksjax.studies import trainer_runs  # pylint: disable=g-import-not-at-top
  return trainer_runs.state_digest(os.path.join(step_dir, "state"))


def training_figures(rows: list[dict]) -> list[dict]:
  """A step log's rows (`metrics.read_jsonl`) without the fields that measure the machine
  (`UNSTABLE`)."""
  return [{k: v for k, v in row.items() if not k.startswith(UNSTABLE)} for row in rows]


def _under(record: dict, runs_dir: str) -> dict:
  """A carried record (its checkpoint named as published, `runs_dir.relative_checkpoint`)
  with its checkpoint back under this machine's runs directory."""
  record = dict(record)
  if record.get("checkpoint", "").startswith(RUNS_DIR + os.sep):
    record["checkpoint"] = os.path.join(runs_dir, record["checkpoint"][len(RUNS_DIR) + 1:])
  return record


def save_runs(spec, runs_dir: str, carry: str, out: str) -> list[str]:
  """Carries every unpublished run of `runs_dir` that has an evaluation record; drops carried
  runs that are published now. Returns the carried runs' names."""
  here = machine.describe()
  commit = rd.commit(spec.root)
  as_published = rd.relative_checkpoint
  os.makedirs(carry, exist_ok=True)
  for name in sorted(os.listdir(carry)):
    if os.path.isdir(os.path.join(carry, name)) and registered.published(out, name):
      shutil.rmtree(os.path.join(carry, name))
  carried = []
  for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
    run = os.path.join(runs_dir, name)
    evaluations = {which: registered.records(os.path.join(run, which))
                   for which in registered.EVALUATIONS}
    if registered.published(out, name) or not any(evaluations.values()):
      continue
    if not all(os.path.isfile(os.path.join(run, f)) for f in RUN_FILES):
      print(f"{name}: not carried, it lacks one of {', '.join(RUN_FILES)}", flush=True)
      continue
    steps = sorted({step for by_step in evaluations.values() for step in by_step} - {0})
    digests = {}
    for step in steps:
      step_dir = os.path.join(run, "checkpoints", str(step))
      if os.path.isdir(step_dir):
        digests[str(step)] = state_digest(step_dir)
    target = os.path.join(carry, name)
    staging = target + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    for f in RUN_FILES:
      shutil.copyfile(os.path.join(run, f), os.path.join(staging, f))
    for which, by_step in evaluations.items():
      if by_step:
        os.makedirs(os.path.join(staging, which))
      for step, record in by_step.items():
        # A record of a checkpoint whose digest could not be taken cannot be checked later.
        if step and str(step) not in digests:
          continue
        results.save_step(os.path.join(staging, which), as_published(record, runs_dir))
    files.write_json(os.path.join(staging, CARRIED),
                        {"machine": here, "commit": commit, "digests": digests})
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    carried.append(name)
    print(f"{name}: carried the records of steps {steps} ({len(digests)} digests)", flush=True)
  if not carried:
    print(f"nothing to carry: no unpublished run in {runs_dir} has an evaluation record",
          flush=True)
  return carried


def _arm_and_seed(d, name: str) -> tuple[str, int] | None:
  for arm, seed in registered.runs_of(d, list(d.arms), list(d.seeds)):
    if rd.run_name(arm, seed) == name:
      return arm, seed
  return None


def restore_runs(spec, runs_dir: str, carry: str, out: str) -> dict[str, str]:
  """Trains each carried run again and takes its records back where they describe the same
  checkpoints. Returns {run: what happened}."""
  d = registered.design(spec, spec.load_registration())
  here = machine.describe()
  commit = rd.commit(spec.root)
  outcome = {}
  for name in sorted(os.listdir(carry)) if os.path.isdir(carry) else []:
    source = os.path.join(carry, name)
    if not os.path.isfile(os.path.join(source, CARRIED)):
      continue
    info = json.load(open(os.path.join(source, CARRIED), encoding="utf-8"))
    run = os.path.join(runs_dir, name)
    which = _arm_and_seed(d, name)
    if registered.published(out, name):
      outcome[name] = "published already"
    elif which is None:
      outcome[name] = "not a run of the registered study"
    elif info["machine"] != here or info["commit"] != commit:
      outcome[name] = (f"carried from {info['machine']!r} at {info['commit'][:7]}, this is "
                       f"{here!r} at {commit[:7]}: left for the runner to run afresh")
    elif os.path.exists(run):
      outcome[name] = f"{run} exists: left as it is"
    else:
      outcome[name] = _retrain_and_check(spec, d, which, name, source, runs_dir, info)
    print(f"{name}: {outcome[name]}", flush=True)
    # Kept when the run is published and its carried files go: what was taken back, and why.
    with open(os.path.join(carry, RESTORES), "a", encoding="utf-8") as f:
      f.write(json.dumps({"run": name, "outcome": outcome[name], "machine": here,
                          "commit": commit, "carried": info}) + "\n")
  return outcome


def _retrain_and_check(spec, d, which, name, source, runs_dir, info) -> str:
  arm, seed = which
  run = os.path.join(runs_dir, name)
  os.makedirs(run)
  # The carried attempts first: the runner's training call appends this machine's.
  shutil.copyfile(os.path.join(source, "attempts.json"), os.path.join(run, "attempts.json"))
  rd.train(spec.root, runs_dir, name, d.config, registered.train_overrides(d, arm, seed))
  trained, carried = (training_figures(metrics.read_jsonl(os.path.join(where, "metrics.jsonl")))
                      for where in (run, source))
  if trained != carried:
    return "trained again, but its step log differs from the carried one: records left out"
  for step, digest in info["digests"].items():
    step_dir = os.path.join(run, "checkpoints", step)
    if not os.path.isdir(step_dir) or state_digest(step_dir) != digest:
      return (f"trained again, but step {step}'s training state differs from the carried one: "
              "records left out")
  restored = 0
  for which_eval in registered.EVALUATIONS:
    records = registered.records(os.path.join(source, which_eval))
    if records:
      os.makedirs(os.path.join(run, which_eval), exist_ok=True)
    for record in records.values():
      results.save_step(os.path.join(run, which_eval), _under(record, runs_dir))
      restored += 1
  shutil.copyfile(os.path.join(source, "evaluations.json"),
                  os.path.join(run, "evaluations.json"))
  return (f"trained again with the same step log and training state at steps "
          f"{sorted(map(int, info['digests']))}: {restored} records restored")


def seeds_here(spec, carry: str, out: str) -> tuple[list[int], dict[int, str]]:
  """The registered seeds this machine may run, in the study's order: those none of whose runs
  was published or carried from a machine of another description (a seed's arms pair only
  within one machine, and sessions are lent machines of more than one kind); and {seed: why}
  for the others."""
  d = registered.design(spec, spec.load_registration())
  here = machine.describe()
  allowed, why = [], {}
  for seed in d.seeds:
    elsewhere = set(registered.seed_machines(out, d, seed))
    for arm in d.arms:
      info = os.path.join(carry, rd.run_name(arm, seed), CARRIED)
      if os.path.isfile(info):
        elsewhere.add(json.load(open(info, encoding="utf-8"))["machine"])
    elsewhere.discard(here)
    if elsewhere:
      why[seed] = f"its runs so far ran on {', '.join(sorted(elsewhere))}"
    else:
      allowed.append(seed)
  return allowed, why


def seeds_to_run(spec, carry: str, out: str) -> tuple[list[int], dict[int, str]]:
  """The runner's `--seeds` here, in order, and {seed: why} for each registered seed left out or
  run here though begun elsewhere: `seeds_here`'s seeds; then, once every one of them is whole
  (this machine has nothing else to run), the seeds begun elsewhere that are not yet whole.

  Why the second part: machines of a kind are lent by chance, and a seed begun on a kind that no
  longer comes would keep the study from ever having every registered run published, the decision
  rule's condition for a verdict. Its remaining runs then train and evaluate here, and the report
  leaves the seed out of each statement that pairs one of them with a run of the seed made
  elsewhere (the registration's pairing rule); statements between two runs made here keep it.
  Decided before any run of seeds 8-11 was seen, from the order alone, never from results."""
  d = registered.design(spec, spec.load_registration())
  allowed, why = seeds_here(spec, carry, out)
  every = list(d.arms)
  if registered.finished_seeds(d, out, every, allowed) != allowed:
    return allowed, why
  begun = [s for s in why if s not in registered.finished_seeds(d, out, every, [s])]
  for seed in begun:
    why[seed] += (": nothing else is left for this machine, so its remaining runs run here, "
                  "and the report leaves it out of each statement that pairs them with those")
  return allowed + begun, why


def _git(repo: str, *args: str) -> str:
  done = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=False)
  if done.returncode:
    raise SystemExit(f"carry: git {' '.join(args)} failed in {repo}: "
                     f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
  return done.stdout


def commit_published(spec, carry: str, out: str) -> list[str]:
  """Commits, in the repository that holds `out`, every published run (and the start) that is
  not committed yet, with the carry directory's changes; only those paths, whatever else is
  staged. Returns the runs committed.

  Why: the runner publishes into the main checkout, but a session that is cut off before its
  own commit leaves its runs uncommitted there, and a machine that is not lent again takes them
  with it. Called in a loop beside the runner, each run is committed as it finishes."""
  repo = _git(out, "rev-parse", "--show-toplevel").strip()
  d = registered.design(spec, spec.load_registration())
  names = [rd.run_name(arm, seed)
           for arm, seed in registered.runs_of(d, list(d.arms), list(d.seeds))]
  paths = [os.path.join(out, n) for n in names if registered.published(out, n)]
  paths += [p for p in (os.path.join(out, "start"), carry) if os.path.exists(p)]
  changed = [p for p in paths
             if _git(repo, "status", "--porcelain", "--untracked-files=all", "--", p).strip()]
  if not changed:
    print("nothing to commit: every published run is committed", flush=True)
    return []
  runs = [os.path.basename(p) for p in changed if p != carry]
  machines = sorted({m for p in changed if p != carry and os.path.basename(p) in names
                     for m in json.load(open(os.path.join(p, "published.json"),
                                             encoding="utf-8"))["machines"]})
  done = sum(registered.published(out, n) for n in names)
  message = (f"{spec.name}: {', '.join(runs) or 'the carried records'} published at "
             f"{rd.commit(spec.root)[:7]}"
             + (f" on {', '.join(machines)}" if machines else "")
             + f" ({done} of {len(names)} registered runs), committed as it finished")
  _git(repo, "add", "--all", "--", *changed)
  _git(repo, "commit", "-q", "-m", message, "--", *changed)
  print(message, flush=True)
  return runs


