"""A study of trainer runs at one CPU budget, not pre-registered: the paper's statements tested
paired by seed, called reproduced by none (experiments/real_model_study.py).

`main(spec, doc)` runs what is missing, seed by seed (every variant of a seed before the next):
  1. each run trained in `<runs_dir>/<run>` (`runs_dir.train`: the spec's config with the
     variant's trainer flags, the seed and the same CPU budget, `max_cpu_minutes`, for every run:
     the runs end at the step that spends it), resumed from its newest checkpoint after a stop;
  2. its last checkpoint evaluated by the eval binary (and the start policy once, as step 0),
     each evaluation's commit appended to `commits.json`;
  3. published to `<out>/<run>/` (step log, config, attempts, evaluation commits, and its end
     record `eval_end.json` last; the start's record to `<out>/start_eval.json`), its
     checkpoints but the last pruned;
  4. the report from the published runs alone (`--partial`: the whole seeds so far): the end
     table, the paper's statements (`statements`) tested paired by seed with Holm's adjustment
     and verdicts that call nothing reproduced, the power the seeds give, each run's final KL
     beside its final pass@k, the matched-step single runs the spec names beside the result, and
     what differs between seeds besides the seed (machines, commits, the sampler's commits between
     them). provenance.json keeps the commit that reported the runs while they are unchanged.

Its records are in the published-run layout of `runs_dir.py` (the study predates the run store);
this adapter reads and writes them where they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ksjax import files
from ksjax.evaluation import statistics
from ksjax.objectives import estimates
from ksjax.run.directory import RunDirectory
from ksjax.studies import analysis
from ksjax.studies import runs_dir as rd
from ksjax.trainer import metrics


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a declaration states."""
  name: str  # in messages: "real_model_study"
  root: str  # the repository
  out: str  # the default output directory, relative to root
  runs: str  # the runs directory's name under <root>/runs
  command: str  # how a reader regenerates the report
  title: str  # the report's first line
  config: str  # the trainer config, configs/<config>.py
  variants: Mapping[str, tuple[str, tuple[str, ...]]]  # name -> (label, trainer flags)
  seeds: tuple[int, ...]
  cpu_minutes: float  # every run's training CPU budget
  num_steps: int  # a ceiling no run should reach
  evaluation: Mapping[str, Any]  # the eval binary's settings
  alpha: float = 0.05  # the statements' test, and the power the report plans with
  power: float = 0.8
  planned_effect: float = 0.06
  matched_step_dir: str = ""  # where the matched-step single runs are, relative to root
  matched_step: tuple[tuple[str, str], ...] = ()  # (label, directory)
  sampler_path: str = "ksjax/sampling"  # whose commits between seeds' commits are listed
  quick_cpu_minutes: float = 0.002  # --quick: the tiny model, seconds per run
  quick_steps: int = 2
  quick_eval: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def per_problem_pass_at_k(held_out_json: str, ks) -> dict[int, np.ndarray]:
  """Held-out pass@k per problem from a trainer's eval_start/eval_end.json, for the k in `ks`
  that its samples per problem allow."""
  with open(held_out_json, encoding="utf-8") as f:
    result = json.load(f)
  correct = np.asarray(result["num_correct"], np.int64)
  return estimates.pass_at_ks(correct, result["num_samples"],
                              [k for k in ks if k <= result["num_samples"]])


def runs_of(variants, seeds) -> list[tuple[str, int]]:
  """Seed-major: every variant of one seed before the next seed."""
  return [(v, s) for s in seeds for v in variants]


def train_overrides(spec: Spec, variant: str, seed: int, quick: bool) -> tuple[str, ...]:
  cpu, steps = ((spec.quick_cpu_minutes, spec.quick_steps) if quick else
                (spec.cpu_minutes, spec.num_steps))
  dynamic = "--config.dynamic_sampling=True" in spec.variants[variant][1]
  return (*spec.variants[variant][1], *(() if dynamic else ("--config.dynamic_sampling=False",)),
          f"--config.seed={seed}", f"--config.max_cpu_minutes={cpu}",
          f"--config.num_steps={steps}", "--config.eval.at_start=False",
          "--config.eval.at_end=False",
          *(rd.flags(rd.QUICK_FIELDS + rd.QUICK_TRAIN) if quick else ()))


def eval_dir(runs_dir: str, name: str) -> str:
  return os.path.join(runs_dir, name, "eval_study")


def evaluate(spec: Spec, runs_dir: str, name: str, *, include_start: bool, quick: bool) -> None:
  """The eval binary on run `name`'s last checkpoint (and its start policy, as step 0)."""
  command = rd.eval_command(os.path.join(runs_dir, name), eval_dir(runs_dir, name),
                            config=rd.QUICK_CONFIG if quick else spec.config,
                            settings={"kl_reference": "start", **spec.evaluation,
                                      **(spec.quick_eval if quick else {})},
                            steps="latest", include_start=include_start,
                            run_fields=rd.QUICK_FIELDS if quick else ())
  print(" ".join(command[1:]), flush=True)
  subprocess.run(command, cwd=spec.root, check=True)
  path = os.path.join(eval_dir(runs_dir, name), "commits.json")
  done = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else []
  files.write_json(path, done + [rd.commit(spec.root)])


def records(runs_dir: str, name: str) -> dict[int, dict]:
  from ksjax.evaluation import results  # pylint: disable=g-import-not-at-top
  return {r["step"]: r for r in results.load_records(eval_dir(runs_dir, name))}


def _evaluated(runs_dir: str, name: str, step: int) -> bool:
  return step in records(runs_dir, name)


def run_study(spec: Spec, runs_dir: str, out: str, variants, seeds, *, quick: bool) -> None:
  """Phases 1 and 2: each run trained (or resumed, or skipped) and evaluated, then published to
  `out` (`publish`). A published run is not run again, even where `runs_dir` is gone: a session's
  machine is replaced when it ends, and the committed results are what carries over."""
  for variant, seed in runs_of(variants, seeds):
    name = rd.run_name(variant, seed)
    if published(out, name):
      continue
    rd.train(spec.root, runs_dir, name, rd.QUICK_CONFIG if quick else spec.config,
             train_overrides(spec, variant, seed, quick))
    start = not os.path.isfile(start_path(out)) and not _evaluated(runs_dir, name, 0)
    if start or not _evaluated(runs_dir, name, rd.last_step(runs_dir, name)):
      evaluate(spec, runs_dir, name, include_start=start, quick=quick)
    if _done(runs_dir, name):
      publish(spec, runs_dir, out, name)
      rd.prune_checkpoints(runs_dir, name)


def start_path(out: str) -> str:
  """The start policy's evaluation record (step 0), published with the first evaluated run."""
  return os.path.join(out, "start_eval.json")


def published(out: str, name: str) -> bool:
  """Whether run `name` is in `out`: its step log, config, attempts, evaluation commits and end
  record (written last, so a publication cut short is not taken for one)."""
  return os.path.isfile(os.path.join(out, name, "eval_end.json"))


def publish(spec: Spec, runs_dir: str, out: str, name: str) -> None:
  """Copies a finished, evaluated run's kept files from `runs_dir` to `<out>/<name>` (and the
  start's record to `start_eval.json` once), named without this machine's paths. The study's
  report reads nothing else, so committing `out` after each run keeps it across machines."""
  target = rd.publish_run_files(spec.root, runs_dir, out, name)
  by_step = records(runs_dir, name)
  if 0 in by_step and not os.path.isfile(start_path(out)):
    files.write_json(start_path(out), rd.relative_checkpoint(by_step[0], runs_dir))
  files.write_text(os.path.join(target, "eval_commits.json"),
                   open(os.path.join(eval_dir(runs_dir, name), "commits.json"),
                        encoding="utf-8").read())
  files.write_json(os.path.join(target, "eval_end.json"),
                   rd.relative_checkpoint(by_step[rd.last_step(runs_dir, name)], runs_dir))


def _done(runs_dir: str, name: str) -> bool:
  return (os.path.isdir(RunDirectory(os.path.join(runs_dir, name)).final_dir)
          and os.path.isdir(eval_dir(runs_dir, name))
          and _evaluated(runs_dir, name, rd.last_step(runs_dir, name)))


def _start_record(out: str) -> dict:
  with open(start_path(out), encoding="utf-8") as f:
    return json.load(f)


def _published_rows(out: str, name: str) -> list[dict]:
  return metrics.read_jsonl(os.path.join(out, name, "metrics.jsonl"))


def status(spec: Spec, out: str, variants, seeds) -> str:
  """A markdown table of the runs published so far (in study order): steps, CPU minutes, held-out
  pass@k and KL at the last checkpoint; the start's row first."""
  ks = tuple(k for k in (1, 4, 16, 64) if k in spec.evaluation["ks"])
  lines = ["| run | steps | CPU-min | " + " | ".join(f"pass@{k}" for k in ks) + " | maj@4 | KL |",
           "|" + "---|" * (len(ks) + 5)]
  if os.path.isfile(start_path(out)):
    start = _start_record(out)["metrics"]
    lines.append("| start | 0 | 0 | " + " | ".join(f"{start[f'pass@{k}']:.3f}" for k in ks)
                 + f" | {start['maj@4']:.3f} | 0 |")
  for variant, seed in runs_of(variants, seeds):
    name = rd.run_name(variant, seed)
    if not published(out, name):
      continue
    end = rd.published_json(out, name, "eval_end.json")
    m = end["metrics"]
    cpu = max(r.get("time/cpu_seconds", 0.0) for r in _published_rows(out, name)) / 60
    lines.append(f"| {name} | {end['step']} | {cpu:.1f} | "
                 + " | ".join(f"{m[f'pass@{k}']:.3f}" for k in ks)
                 + f" | {m['maj@4']:.3f} | {m['kl_k3']:.2f} |")
  return "\n".join(lines)


def finished_seeds(out: str, variants, seeds) -> list[int]:
  """The seeds whose every variant has been trained, evaluated and published."""
  return [s for s in seeds if all(published(out, rd.run_name(v, s)) for v in variants)]


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

def collect(out: str, variants, seeds) -> dict:
  """The start's values, and per variant every metric's value per seed at its last checkpoint
  (seed i at index i), with the steps and CPU time each run used. Read from the published runs in
  `out`. Each run was evaluated at its start and its last checkpoint only: no curve between."""
  start = rd.values(_start_record(out))
  final, steps, cpu = {}, {}, {}
  for variant in variants:
    key = f"pg_{variant}"
    for seed in seeds:
      name = rd.run_name(variant, seed)
      record = rd.published_json(out, name, "eval_end.json")
      for metric, value in rd.values(record).items():
        final.setdefault(key, {}).setdefault(metric, []).append(value)
      steps.setdefault(variant, []).append(record["step"])
      cpu.setdefault(variant, []).append(
          max(r.get("time/cpu_seconds", 0.0) for r in _published_rows(out, name)))
  return {"start": start, "final": final, "steps": steps, "cpu_seconds": cpu}


def table(spec: Spec, data: dict, variants, ks) -> str:
  cols = [f"pass@{k}" for k in ks] + ["maj@4", "answer_entropy", "kl"]
  lines = ["| objective | steps | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)]
  lines.append("| start | 0 | " + " | ".join(
      f"{data['start'][c]:.3f}" if c != "kl" else "0" for c in cols) + " |")
  mean_std = analysis.mean_std
  for variant in variants:
    values = data["final"][f"pg_{variant}"]
    cells = [("{:.3f} ± {:.3f}".format(*mean_std(values[c]))) for c in cols]
    steps = data["steps"][variant]
    lines.append(f"| {spec.variants[variant][0]} | {min(steps)}–{max(steps)} | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines)


def figure(spec: Spec, data: dict, variants, ks, path: str) -> None:
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  from ksjax.evaluation import plots  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(5.5, 3.8))
  ax = fig.subplots()
  for i, variant in enumerate(variants):
    values = data["final"][f"pg_{variant}"]
    plots.pass_at_k_curve(ax, ks, [np.mean(values[f"pass@{k}"]) for k in ks],
                          spec.variants[variant][0], color=f"C{i}")
  plots.pass_at_k_curve(ax, ks, [data["start"][f"pass@{k}"] for k in ks], "start",
                        color="black", linestyle="--")
  ax.set_ylabel("held-out pass@k (mean over seeds)")
  ax.legend(fontsize="x-small")
  fig.tight_layout()
  plots.save(fig, path)


def statements(spec: Spec, final: dict, k: int, ks) -> list[dict]:
  """The paper's statements (and one beyond it) that the study's variants can test, each as two
  series of one value per seed, seed i at index i in both: `a_values` for the side the statement
  says is higher and `b_values` for the other. Runs of one seed share the start, the data order
  and the evaluation's sampling seed, so the statements are tested paired by seed (`judge`).

  The statements of experiments/tradeoff.py's `claims` for these variants, less its "more
  KL-efficient" ones: those read pass@k at a common KL off each run's curve, and here every run
  was evaluated at its start and its last checkpoint only (`kl_table` shows what was measured).

  Args:
    final: "pg_<variant>" -> metric -> one value per seed, at the last checkpoint (`collect`).
    k: the training k; ks: the evaluated k.
  """
  mid = max(x for x in ks if x <= 10)
  big = max(ks)
  g = lambda variant: final[f"pg_{variant}"]
  have = lambda *vs: all(f"pg_{v}" in final for v in vs)
  gap = lambda metric: np.asarray(g("pass_at_k")[metric]) - np.asarray(g("mean")[metric])
  out = []

  def add(text, a, b, metric, variants):
    out.append({"claim": text, "a": variants[0], "b": variants[1], "metric": metric,
                "a_values": [float(x) for x in a], "b_values": [float(x) for x in b]})

  if have("pass_at_k", "mean"):
    for kk in sorted({k, mid, big}):
      add(f"training for pass@k raises pass@{kk} more than training for the mean",
          g("pass_at_k")[f"pass@{kk}"], g("mean")[f"pass@{kk}"], f"pass@{kk}",
          ("pass_at_k", "mean"))
    add("training for the mean gives the higher pass@1 (pass@k training pays for its pass@k in "
        "pass@1)", g("mean")["pass@1"], g("pass_at_k")["pass@1"], "pass@1", ("mean", "pass_at_k"))
    add(f"the advantage of pass@k training over mean training grows with test-time k "
        f"(pass@{mid} gap minus pass@1 gap)", gap(f"pass@{mid}"), gap("pass@1"),
        f"pass@{mid} - pass@1 gaps", ("pass_at_k - mean", "pass_at_k - mean"))
    add("training for the mean moves further from the start at the same CPU budget (final KL)",
        g("mean")["kl"], g("pass_at_k")["kl"], "kl", ("mean", "pass_at_k"))
    if have("biased_pass_at_k"):
      labels = {v: spec.variants[v][0] for v in spec.variants}
      for metric in ("pass@1", f"pass@{mid}"):
        lo, hi = ("pass_at_k", "mean") if metric == "pass@1" else ("mean", "pass_at_k")
        add(f"biased pass@k sits between pass@k and the mean on {metric} (above {labels[lo]})",
            g("biased_pass_at_k")[metric], g(lo)[metric], metric, ("biased_pass_at_k", lo))
        add(f"biased pass@k sits between pass@k and the mean on {metric} (below {labels[hi]})",
            g(hi)[metric], g("biased_pass_at_k")[metric], metric, (hi, "biased_pass_at_k"))
    levels = sorted({int(name[5:].split("/")[0]) for name in g("mean")
                     if name.startswith("level")})
    if len(levels) > 1:
      add(f"the pass@k gain over the mean comes from the hard problems (pass@{mid} gap on level "
          f"{levels[-1]} minus level {levels[0]})", gap(f"level{levels[-1]}/pass@{mid}"),
          gap(f"level{levels[0]}/pass@{mid}"), f"level pass@{mid} gaps",
          (f"level {levels[-1]}", f"level {levels[0]}"))
  if have("majority_vote", "mean"):
    add(f"training for majority voting raises maj@{k} more than training for the mean",
        g("majority_vote")[f"maj@{k}"], g("mean")[f"maj@{k}"], f"maj@{k}",
        ("majority_vote", "mean"))
  if have("pass_at_k_dynamic", "pass_at_k"):
    add(f"(beyond the paper) dynamic sampling raises the pass@k objective's pass@{k} at the same "
        f"CPU budget", g("pass_at_k_dynamic")[f"pass@{k}"], g("pass_at_k")[f"pass@{k}"],
        f"pass@{k}", ("pass_at_k_dynamic", "pass_at_k"))
  return out


def _json_number(value):
  """nan and +-inf as None (strict JSON); anything else unchanged."""
  if isinstance(value, float) and not np.isfinite(value):
    return None
  return value


def _p(p: float) -> str:
  """"p = 0.21", two significant digits, or "p < 0.001"."""
  return "p < 0.001" if p < 0.001 else f"p = {p:#.2g}"


def verdict(result: statistics.PairedComparison, p_holm: float | None,
            alpha: float = 0.05) -> str:
  """What the paired test says, in words that call nothing reproduced (the statements were not
  pre-registered): significant at `alpha` or not, in the statement's direction or the opposite,
  and whether it survives Holm's adjustment over the statements."""
  if result.status == statistics.ONE_SEED:
    return "one seed: no paired test"
  if result.status == statistics.CONSTANT:
    if result.difference == 0:
      return "no difference on any seed"
    side = "in the statement's direction" if result.difference > 0 else "opposite in sign"
    return f"the same difference on every seed, {side} (zero spread: no p-value to read)"
  if result.p_value < alpha:
    sign = "" if result.difference > 0 else "opposite sign, "
    holm = "" if p_holm is not None and p_holm < alpha else "; not after Holm's adjustment"
    return (f"{sign}significant at {alpha:g} ({_p(result.p_value)}; not pre-registered{holm})")
  if result.seeds_positive == result.n:
    return f"consistent in sign, not significant ({_p(result.p_value)})"
  if result.seeds_negative == result.n:
    return f"opposite sign on every seed, not significant ({_p(result.p_value)})"
  return (f"mixed signs ({result.seeds_positive} of {result.n} seeds in the statement's "
          f"direction), not significant ({_p(result.p_value)})")


def judge(found: list[dict], alpha: float = 0.05) -> list[dict]:
  """Each statement tested paired by seed (`statistics.paired` on a_values and b_values): adds
  the difference (mean over seeds of a - b), its standard error, t, df, the two-sided p-value,
  the 95% interval, the seeds with a > b (seeds_positive) and a < b, the Holm-adjusted p-value
  over the statements that have one (p_holm), and the verdict."""
  results = [statistics.paired(c["a_values"], c["b_values"]) for c in found]
  tested = [i for i, r in enumerate(results) if np.isfinite(r.p_value)]
  adjusted = (statistics.holm([results[i].p_value for i in tested], alpha).adjusted
              if tested else [])
  p_holm = dict(zip(tested, (float(p) for p in adjusted)))
  for i, (claim, result) in enumerate(zip(found, results)):
    claim.update({name: _json_number(value) for name, value in result.as_dict().items()})
    claim.update({"test": "paired t over seeds, two-sided", "a_mean": float(np.mean(
        claim["a_values"])), "b_mean": float(np.mean(claim["b_values"])),
                  "p_holm": p_holm.get(i), "holm_family": len(tested),
                  "verdict": verdict(result, p_holm.get(i), alpha)})
  return found


def power(spec: Spec, found: list[dict], k: int) -> dict | None:
  """The paired test's reach with these seeds, from the seed-to-seed sd of the pass@k gap
  (pass@k training minus mean training at the training k): the minimum detectable effect at
  `spec.power` and `spec.alpha` with the study's seeds, and the seeds needed for
  `spec.planned_effect`. None where there is no such statement, fewer than two seeds, or no
  spread."""
  text = f"training for pass@k raises pass@{k} more than training for the mean"
  claim = next((c for c in found if c["claim"] == text), None)
  if claim is None or claim["n"] < 2:
    return None
  sd = float(np.std(claim["differences"], ddof=1))
  if not sd > 0:
    return None
  return {"metric": f"pass@{k}", "differences": claim["differences"],
          "sd_of_differences": sd, "n_seeds": claim["n"], "power": spec.power, "alpha": spec.alpha,
          "minimum_detectable_effect": statistics.minimum_detectable_effect(
              sd, claim["n"], spec.power, spec.alpha),
          "effect": spec.planned_effect,
          "seeds_needed": statistics.seeds_needed(spec.planned_effect, sd, spec.power, spec.alpha)}


def kl_table(spec: Spec, data: dict, variants, seeds, k: int) -> str:
  """Each run's final KL to the start beside its final pass@k: all that was measured of KL and
  pass@k together (each run was evaluated at its start and its last checkpoint only)."""
  lines = ["| objective | " + " | ".join(f"seed {s}: KL, pass@{k}" for s in seeds) + " |",
           "|" + "---|" * (len(seeds) + 1)]
  lines.append("| start | " + " | ".join(f"0, {data['start'][f'pass@{k}']:.3f}"
                                         for _ in seeds) + " |")
  for variant in variants:
    values = data["final"][f"pg_{variant}"]
    lines.append(f"| {spec.variants[variant][0]} | " + " | ".join(
        f"{kl:.2f}, {v:.3f}" for kl, v in zip(values["kl"], values[f"pass@{k}"])) + " |")
  return "\n".join(lines)


def matched_step(spec: Spec, ks=(1, 4)) -> list[dict]:
  """The matched-step single runs of experiments/real_model.py (`spec.matched_step`:
  `smollm2_pass_at_k` and `smollm2_mean`, 30 steps, one seed each), where their records are:
  pass@k for `ks` of the pass@k run's end minus the mean run's, paired over the held-out problems
  (not over seeds), with the steps, CPU minutes, KL the trainer logged last, commit and
  micro-batch of each run."""
  rows, results_dir = [], os.path.join(spec.root, spec.matched_step_dir)
  for label, directory in spec.matched_step:
    arms = {arm: os.path.join(results_dir, directory, f"smollm2_{arm}")
            for arm in ("pass_at_k", "mean")}
    if not all(os.path.isfile(os.path.join(d, "eval_end.json")) for d in arms.values()):
      continue
    values = {arm: per_problem_pass_at_k(os.path.join(d, "eval_end.json"), ks)
              for arm, d in arms.items()}
    provenance = json.load(open(os.path.join(results_dir, directory, "provenance.json"),
                                encoding="utf-8"))
    row = {"label": label, "directory": os.path.join("experiments", "results", directory),
           "paired_over": "problems", "comparisons": {}}
    for arm, d in arms.items():
      logged = metrics.read_jsonl(os.path.join(d, "metrics.jsonl"))
      kl = [r for r in logged if "kl/k3" in r]
      cpu = max(r.get("time/cpu_seconds", 0.0) for r in logged) / 60
      config = json.load(open(os.path.join(d, "config.json"), encoding="utf-8"))
      row[arm] = {"steps": max(r["step"] for r in logged),
                  "cpu_minutes": cpu or None,
                  "kl_k3": kl[-1]["kl/k3"] if kl else None,
                  "kl_step": kl[-1]["step"] if kl else None,
                  "commit": provenance["runs"][f"smollm2_{arm}"]["attempts"][-1]["commit"],
                  "micro_batch_size": config.get("micro_batch_size"),
                  "seed": config.get("seed")}
    for kk in ks:
      result = statistics.paired(values["pass_at_k"][kk], values["mean"][kk])
      row["comparisons"][f"pass@{kk}"] = {name: _json_number(value)
                                          for name, value in result.as_dict().items()}
    rows.append(row)
  return rows


def _interval(c: dict) -> str:
  if c["ci_low"] is None:
    return "—"
  return f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]"


def _p_cell(p) -> str:
  return "—" if p is None else _p(p)[4 if p >= 0.001 else 2:]


def matched_step_lines(spec: Spec, data: dict, rows: list[dict], seeds) -> list[str]:
  """The section that puts the matched-step single runs beside the equal-CPU result."""
  if not rows or not {"pg_pass_at_k", "pg_mean"} <= set(data["final"]):
    return []
  final = data["final"]
  equal = {m: statistics.paired(final["pg_pass_at_k"][m], final["pg_mean"][m]).as_dict()
           for m in ("pass@1", "pass@4")}
  equal = {m: {n: _json_number(v) for n, v in c.items()} for m, c in equal.items()}
  steps, kl = data["steps"], {v: np.mean(final[f"pg_{v}"]["kl"]) for v in ("pass_at_k", "mean")}
  lines = [
      "## Beside it: the matched-step single runs (30 steps, one seed per objective)", "",
      "The study gives every objective the same CPU budget, so the sparse pass@4 updates take "
      "more steps than the mean's. `experiments/real_model.py` ran the two configs once each "
      "for the same 30 steps. Those are single runs, one seed per objective: their interval and "
      "p are paired over the 32 held-out problems, so they say how sure one can be of these two "
      "checkpoints' difference on these problems, not how the objectives compare from seed to "
      "seed, which is what the study's row is paired over.", "",
      "| result | what it is | steps (pass@k, mean) | paired over | pass@4: pass@k − mean | "
      "95% interval | p | pass@1: pass@k − mean (p) | KL to start (pass@k, mean) |",
      "|---|---|---|---|---|---|---|---|---|"]
  e4, e1 = equal["pass@4"], equal["pass@1"]
  lines.append(
      f"| equal CPU ({spec.cpu_minutes:g} CPU-min), this study | {len(seeds)} seeds per objective, "
      f"seeds paired | {min(steps['pass_at_k'])}–{max(steps['pass_at_k'])}, "
      f"{min(steps['mean'])}–{max(steps['mean'])} | {len(seeds)} seeds | "
      f"{e4['difference']:+.3f} | {_interval(e4)} | {_p_cell(e4['p_value'])} | "
      f"{e1['difference']:+.3f} ({_p_cell(e1['p_value'])}) | {kl['pass_at_k']:.2f}, "
      f"{kl['mean']:.2f} (held-out, mean over seeds) |")
  for row in rows:
    c4, c1 = row["comparisons"]["pass@4"], row["comparisons"]["pass@1"]
    a, b = row["pass_at_k"], row["mean"]
    kls = ("—" if a["kl_k3"] is None or b["kl_k3"] is None else
           f"{a['kl_k3']:.2f}, {b['kl_k3']:.2f} (trainer's log, step {a['kl_step']})")
    lines.append(
        f"| {row['label']} (`{row['directory']}/`) | single runs, one seed each | "
        f"{a['steps']}, {b['steps']} | {c4['n']} problems | {c4['difference']:+.3f} | "
        f"{_interval(c4)} | {_p_cell(c4['p_value'])} | {c1['difference']:+.3f} "
        f"({_p_cell(c1['p_value'])}) | {kls} |")
  lines += ["", "Recomputed here from each run's `eval_end.json` (unbiased pass@k per problem "
            "from its correct counts, `experiments/real_model.py`'s `per_problem_pass_at_k`) and "
            "`statistics.paired` over problems. Of those runs:"]
  for row in rows:
    a, b = row["pass_at_k"], row["mean"]
    cpu = ("CPU time not recorded" if a["cpu_minutes"] is None or b["cpu_minutes"] is None else
           f"{a['cpu_minutes']:.1f} and {b['cpu_minutes']:.1f} CPU-minutes")
    micro = ("" if a["micro_batch_size"] == b["micro_batch_size"] else
             f"; micro-batches of {a['micro_batch_size']} and {b['micro_batch_size']} rows "
             "(the order of a sum only; docs/results.md shows that alone moving a "
             "30-step mean run's pass@4)")
    c4 = row["comparisons"]["pass@4"]
    lines.append(f"- {row['label']}: the pass@k run at {a['commit'][:7]}, the mean run at "
                 f"{b['commit'][:7]}, {cpu}{micro}; the pass@k run ahead on "
                 f"{c4['seeds_positive']} of the {c4['n']} problems' pass@4, behind on "
                 f"{c4['seeds_negative']}.")
  ahead = lambda d: "the pass@k run" if d > 0 else "the mean run" if d < 0 else "neither run"
  single = {ahead(row["comparisons"]["pass@4"]["difference"]) for row in rows}
  lines += [
      "", f"At equal steps {' or '.join(sorted(single))} ends ahead at pass@4 in "
      f"{'each' if len(single) == 1 else 'one or the other'} single pair; at equal CPU, "
      f"{ahead(e4['difference']).replace('run', 'runs')} end ahead on average over the seeds. "
      "Each single pair is one draw of the seed-to-seed spread that the study's row measures "
      "(its per-seed pass@4 gaps: "
      + ", ".join(f"{d:+.3f}" for d in e4["differences"]) + "), so no single pair's p says "
      "anything about that spread, and no test here compares the two budgets. The KLs are not "
      "the same measurement either: the study's is held-out (eval binary, k3 on "
      f"{spec.evaluation['kl_samples']} samples per problem), the single runs' the trainer's, "
      "on its training rollouts.", ""]
  return lines


def _git_commits(root: str, commit: str, exclude, paths) -> list[tuple[str, str]] | None:
  """(short hash, first sentence of the message) of the commits reachable from `commit` and not
  from any of `exclude`, touching `paths`; None where git cannot answer (no history here)."""
  try:
    out = subprocess.run(["git", "log", "--format=%h %s", commit, "--not", *exclude, "--",
                          *paths], cwd=root, capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return None
  commits = []
  for line in out.splitlines():
    short, _, subject = line.partition(" ")
    sentence = subject.split(". ")[0].split("; ")[0].rstrip(".")
    if len(sentence) > 200:
      sentence = sentence[:200].rsplit(" ", 1)[0] + " ..."
    commits.append((short, sentence))
  return commits


def _start_run(out: str, names: list[str]) -> str:
  """The run the start was evaluated with: named by its record's checkpoint path, else the first
  run in study order (the one `run_study` evaluates it with)."""
  checkpoint = _start_record(out).get("checkpoint", "")
  parts = checkpoint.split("/")
  return parts[1] if len(parts) > 1 and parts[1] in names else names[0]


def seed_differences(spec: Spec, out: str, variants, seeds, provenance: dict, steps: dict
                     ) -> list[str]:
  """The section that says what differs between the seeds besides the seed: each seed's
  machines, training commits (and the sampler's commits between them) and evaluation commits,
  and where the start was evaluated. Empty where every seed shares them."""
  def of(seed):  # in study order
    names = [rd.run_name(v, seed) for v in variants]
    return {"machines": list(dict.fromkeys(a.get("machine", "unrecorded") for n in names
                                           for a in provenance["runs"][n])),
            "commits": list(dict.fromkeys(a["commit"] for n in names
                                          for a in provenance["runs"][n])),
            "evaluations": list(dict.fromkeys(c for n in names
                                              for c in provenance["evaluations"][n]))}
  seen = {seed: of(seed) for seed in seeds}
  first = seeds[0]
  changed = [s for s in seeds[1:] if seen[s] != seen[first]]
  if not changed:
    return []
  alike = [s for s in seeds if seen[s] == seen[first]]
  ref = f"seed{'s' if len(alike) > 1 else ''} {' and '.join(map(str, alike))}"
  quoted = lambda machines: "; ".join(f"“{m}”" for m in machines)
  names = [rd.run_name(v, s) for v, s in runs_of(variants, seeds)]
  start_run = _start_run(out, names)
  start = {"machines": sorted({a.get("machine", "unrecorded")
                               for a in provenance["runs"][start_run]}),
           "evaluations": provenance["evaluations"][start_run]}
  short = lambda commits: ", ".join(c[:7] for c in commits)
  lines = [f"## What changed for seed{'s' if len(changed) > 1 else ''} "
           f"{', '.join(map(str, changed))}", "",
           f"Besides the seed, seed{'s' if len(changed) > 1 else ''} "
           f"{', '.join(map(str, changed))} differ{'' if len(changed) > 1 else 's'} from {ref} "
           "in:", ""]
  for seed in changed:
    now, before = seen[seed], seen[first]
    if now["machines"] != before["machines"]:
      lines.append(
          f"- **The machine** (seed {seed}): {quoted(now['machines'])}, where {ref} ran on "
          f"{quoted(before['machines'])}. XLA:CPU's numerics and the steps a CPU "
          "budget buys depend on it; steps per objective, seeds in order: "
          + "; ".join(f"{spec.variants[v][0]} {', '.join(map(str, steps[v]))}" for v in variants)
          + ".")
    if now["commits"] != before["commits"]:
      lines.append(f"- **The code** (seed {seed}): trained at {short(now['commits'])}, {ref} "
                   f"at {short(before['commits'])}.")
      path, what = spec.sampler_path, ("the sampler, which draws the training rollouts and the "
                                  "evaluation's samples")
      listed = {c: _git_commits(spec.root, c, before["commits"], [path]) for c in now["commits"]}
      if any(v is None for v in listed.values()):
        lines.append(f"  `git log {short(before['commits'])}..<commit> -- {path}` ({what}): no "
                     "git history here to list them.")
      else:
        union = list(dict.fromkeys(x for v in listed.values() for x in v))
        ranges = "; ".join(f"`git log --oneline {before['commits'][0][:7]}..{c[:7]} -- {path}`"
                           f": {len(v)} commit{'' if len(v) == 1 else 's'}"
                           for c, v in listed.items())
        lines.append(f"  Between them {path} ({what}) changed: {ranges}.")
        lines += [f"  - {h} {text}" for h, text in union]
        if union:
          lines.append(f"  The study did not check whether these change the samples on this "
                       f"model, so seed {seed}'s differences from {ref} cannot be put down "
                       "to the machine alone.")
    if now["evaluations"] != before["evaluations"]:
      lines.append(f"- **The evaluations** (seed {seed}): its runs' end records were evaluated "
                   f"at {short(now['evaluations'])} on its own machine, {ref}'s at "
                   f"{short(before['evaluations'])} on theirs.")
    unlike = [what for what, differs in (
        (f"not on seed {seed}'s machine", start["machines"] != now["machines"]),
        (f"not with seed {seed}'s code", start["evaluations"] != now["evaluations"])) if differs]
    if unlike:
      lines.append(
          f"- **The start** (step 0) was evaluated once, with {start_run}, at "
          f"{short(start['evaluations'])} on {quoted(start['machines'])}: "
          + " and ".join(unlike)
          + f". No statement above reads the start (they compare the runs' ends, and each "
          f"run's KL is measured against the start's weights within its own end evaluation); "
          f"the start row of the tables, and any change from it for seed {seed}, mix the change "
          "of machine and code into the change from training.")
  return lines + [""]


def report(spec: Spec, out: str, variants, seeds, *, quick: bool, partial: bool) -> None:
  """`<out>/README.md`, `summary.json`, `provenance.json` and the figure, from the published runs
  of `seeds`."""
  ks = spec.quick_eval["ks"] if quick else spec.evaluation["ks"]
  k = 4
  data = collect(out, variants, seeds)
  found = judge(statements(spec, data["final"], k, ks), spec.alpha)
  reach = power(spec, found, k)
  matched = [] if quick else matched_step(spec)
  names = [rd.run_name(v, s) for v, s in runs_of(variants, seeds)]
  provenance = {
      "commit": rd.commit(spec.root),
      "runs": {name: rd.published_json(out, name, "attempts.json") for name in names},
      "evaluations": {name: rd.published_json(out, name, "eval_commits.json") for name in names}}
  # A regeneration from the same published runs keeps the commit that reported them (#64): the
  # report's commit changes only when its runs do.
  old = os.path.join(out, "provenance.json")
  if os.path.exists(old):
    with open(old, encoding="utf-8") as f:
      before = json.load(f)
    if {k: before.get(k) for k in ("runs", "evaluations")} == {
        k: provenance[k] for k in ("runs", "evaluations")} and before.get("commit"):
      provenance["commit"] = before["commit"]
  os.makedirs(out, exist_ok=True)
  files.write_json(os.path.join(out, "provenance.json"), provenance)
  files.write_json(os.path.join(out, "summary.json"),
                   {"seeds": list(seeds), "variants": list(variants), "partial": partial,
                    "cpu_minutes": spec.quick_cpu_minutes if quick else spec.cpu_minutes,
                    "eval": {**spec.evaluation, **(spec.quick_eval if quick else {})},
                    "pre_registered": False, "alpha": spec.alpha, "claims": found, "power": reach,
                    "matched_step": matched, **data})
  figure(spec, data, variants, ks, os.path.join(out, "pass_at_k_vs_k.png"))
  commits = sorted({a["commit"][:7] for runs in provenance["runs"].values() for a in runs})
  # Runs published before attempts named their machine were all trained on one machine with
  # AMX-BF16 (experiments/results/real_model_study/STATUS.md).
  machines = {seed: sorted({a.get("machine", "unrecorded") for v in variants
                            for a in provenance["runs"][rd.run_name(v, seed)]}) for seed in seeds}
  n = spec.evaluation["num_samples"] if not quick else spec.quick_eval["num_samples"]
  df = len(seeds) - 1
  tested = found[0]["holm_family"] if found else 0
  lines = [
      f"# {spec.title}", "",
      f"Produced by `{spec.command}"
      + (" --quick" if quick else "") + (" --partial" if partial else "") + "`"
      + f", trained at commit(s) {', '.join(commits)}"
      + ("" if quick else ", every run from a clean tree") + ".", "",
      "Machines (XLA:CPU's numbers and the steps a CPU budget buys depend on them): "
      + "; ".join(f"seed {seed}: {', '.join(m)}" for seed, m in machines.items()) + ".", "",
      *(["**Partial:** the seeds below are those finished so far; the study continues with the "
         "same command.", ""] if partial else []),
      f"Setup: `configs/{rd.QUICK_CONFIG if quick else spec.config}.py` with each objective, "
      f"seeds {', '.join(map(str, seeds))}, the same budget of "
      f"{spec.quick_cpu_minutes if quick else spec.cpu_minutes:g} CPU-minutes of training for "
      "every run; "
      f"each run's last checkpoint and the start evaluated by the eval binary on every held-out "
      f"problem with {n} samples at temperature 1 (the same sampling seed for all). KL: to the "
      "start, per completion (k3), on the held-out samples.", "",
      "## Held-out, at the end of each run (mean ± std over seeds)", "",
      table(spec, data, variants, ks), "",
      "Steps: the range over seeds of the steps each run reached within its CPU budget.", "",
      "## The paper's statements, tested paired by seed (not pre-registered)", "",
      "**None of these statements was pre-registered**: no test, level or number of seeds was "
      "fixed for them before the runs, and this test was chosen after the results were seen. "
      "Read every p-value as exploratory; no statement is called reproduced.", "",
      "Each statement compares a first value with a second on each seed (the runs of one seed "
      "share the start, the data order and the evaluation's sampling seed). "
      + (f"Difference: the mean over the {len(seeds)} seeds of first − second. 95% interval: "
         f"Student's t with {df} degree{'' if df == 1 else 's'} of freedom. p: the two-sided "
         f"paired t-test (`ksjax/evaluation/statistics.py`, `paired`); Holm: p adjusted over "
         f"the {tested} statements tested (Holm–Bonferroni). Seeds: on how many seeds first > "
         "second." if df else
         "With one seed there is no spread over seeds to test against: each row gives that "
         "seed's difference, first − second, and nothing more."), "",
      "| statement | first | second | difference | 95% interval | p | p, Holm | seeds first > "
      "second | verdict |",
      "|---|---|---|---|---|---|---|---|---|"]
  for c in found:
    lines.append(f"| {c['claim']} | {c['a_mean']:.3f} | {c['b_mean']:.3f} | "
                 f"{c['difference']:+.3f} | {_interval(c)} | {_p_cell(c['p_value'])} | "
                 f"{_p_cell(c['p_holm'])} | {c['seeds_positive']} of {c['n']} | "
                 f"{c['verdict']} |")
  lines.append("")
  if reach:
    lines += [
        f"## What {reach['n_seeds']} seeds can detect", "",
        f"The per-seed {reach['metric']} gap of pass@k training over mean training ("
        + ", ".join(f"{d:+.3f}" for d in reach["differences"])
        + f") has a between-seed sd of {reach['sd_of_differences']:.3f}. At that sd the paired "
        f"t-test with {reach['n_seeds']} seeds (two-sided, α = {spec.alpha:g}) detects a true gap "
        f"with {spec.power:.0%} power only from {reach['minimum_detectable_effect']:.3f} up "
        f"(minimum detectable effect, `statistics.minimum_detectable_effect`), and detecting a "
        f"gap of {spec.planned_effect:g} with {spec.power:.0%} power needs "
        f"{reach['seeds_needed']} seeds "
        "(`statistics.seeds_needed`). So a statement that is not significant here speaks "
        "against gaps of about that minimum size or larger, not against smaller ones.", ""]
  lines += [
      f"## Final KL and final pass@{k}, per run (no KL curve was measured)", "",
      "Each run was evaluated at the start and at its last checkpoint only, so pass@k at a "
      "common KL is not known for any run: nothing between the two points was measured. (An "
      "earlier version of this report drew a straight line from the start to each run's end and "
      f"compared pass@{k} read off it at one KL; that statement is withdrawn.) What was "
      f"measured, side by side (KL: held-out, k3, to the start; the start's is 0 by definition, "
      f"{data['start']['kl']:.3f} measured against itself):", "",
      kl_table(spec, data, variants, seeds, k), "",
      *matched_step_lines(spec, data, matched, seeds),
      *seed_differences(spec, out, variants, seeds, provenance, data["steps"]),
      "Figure: `pass_at_k_vs_k.png`; every number: `summary.json`; per run: its step log, config "
      "and end evaluation record in `<run>/`."]
  files.write_text(os.path.join(out, "README.md"), "\n".join(lines) + "\n")
  if reach:
    print(f"{reach['metric']} gap (pass@k - mean) per seed: "
          + ", ".join(f"{d:+.3f}" for d in reach["differences"])
          + f"; between-seed sd {reach['sd_of_differences']:.4f}; minimum detectable effect with "
          f"{reach['n_seeds']} seeds ({spec.power:.0%} power, alpha {spec.alpha:g}): "
          f"{reach['minimum_detectable_effect']:.4f}; seeds needed for {spec.planned_effect:g}: "
          f"{reach['seeds_needed']}", flush=True)
  print(f"wrote {out}", flush=True)


def arguments(spec: Spec, doc: str, argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog=spec.command, description=doc.split("\n")[0])
  parser.add_argument("--out", default=os.path.join(spec.root, spec.out))
  parser.add_argument("--runs_dir", default=os.path.join(spec.root, "runs", spec.runs))
  parser.add_argument("--seeds", default=",".join(map(str, spec.seeds)))
  parser.add_argument("--variants", default=",".join(spec.variants))
  parser.add_argument("--partial", action="store_true",
                      help="report the seeds finished so far, without running anything")
  parser.add_argument("--status", action="store_true",
                      help="print the runs finished so far, writes and runs nothing")
  parser.add_argument("--quick", action="store_true", help="the tiny model (a smoke run)")
  return parser.parse_args(argv)


def main(spec: Spec, doc: str, argv=None) -> None:
  """The study's command: run what is missing, seed by seed, then report. A registration or a
  record that cannot be read is one line and exit status 1."""
  rd.in_one_line(spec.name, _main, spec, doc, argv)


def _main(spec: Spec, doc: str, argv=None) -> None:
  args = arguments(spec, doc, argv)
  variants = args.variants.split(",")
  bad = [v for v in variants if v not in spec.variants]
  try:
    seeds = [int(s) for s in args.seeds.split(",")]
  except ValueError:
    seeds = None
  if bad or not seeds:
    raise SystemExit(f"{spec.name}: --variants={args.variants!r} --seeds={args.seeds!r} are "
                     f"not accepted; expected variants among {', '.join(spec.variants)} and "
                     "integer seeds")
  runs_dir, out = os.path.abspath(args.runs_dir), os.path.abspath(args.out)
  if args.status:
    print(status(spec, out, variants, seeds))
    return
  if args.partial:
    done = finished_seeds(out, variants, seeds)
    if not done:
      raise SystemExit(f"{spec.name}: no seed has finished every variant yet; nothing to report")
    report(spec, out, variants, done, quick=args.quick, partial=done != seeds)
    return
  if rd.dirty(spec.root) and not args.quick:
    raise SystemExit(f"{spec.name}: the tree has uncommitted changes to tracked files; commit "
                     "them first (the results must name the commit they ran at)")
  started = time.time()
  run_study(spec, runs_dir, out, variants, seeds, quick=args.quick)
  report(spec, out, variants, seeds, quick=args.quick, partial=False)
  print(f"study done ({(time.time() - started) / 60:.1f} min in this invocation)", flush=True)
