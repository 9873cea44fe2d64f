"""`rllm-async plan`: fit a sim workload to a recorded run, replay candidate settings, recommend one.

The replay is the real trainer on the sim backend's virtual clock (`simulate.run_config`), on the
workload that `fit.py` fits to the record (what it measured and assumed:
`FittedWorkload.measured`, `FittedWorkload.assumed`). Past 400 lines because the candidates, their
replay and the report that compares them to the record share one set of settings, read in one place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rllm_async.backends.sim import ps_rate
from rllm_async.config import Config, ConfigError, load_config
from rllm_async.plan.fit import FittedWorkload, fit_workload
from rllm_async.plan.record import read_workload
from rllm_async.plan.simulate import run_config
from rllm_async.workflows.sim import SimWorkflow


@dataclass(frozen=True)
class Candidate:
    """One setting to replay; mode sync is `pipeline_depth` 0."""

    mode: str
    pipeline_depth: int | Literal["auto"]
    max_staleness: int | None
    stale_policy: str
    max_concurrency: int
    classic: bool = False  # sync only: generate the whole step, then train it

    @property
    def label(self) -> str:
        if self.mode == "sync":
            return "classic sync" if self.classic else "sync"
        k = "none" if self.max_staleness is None else str(self.max_staleness)
        policy = f" {self.stale_policy}" if self.max_staleness is not None else ""
        return f"d={self.pipeline_depth} K={k}{policy}"


def sim_config(f: FittedWorkload, c: Candidate, steps: int, seed: int, quiet: list[str]) -> Config:
    """The sim Config replaying `f` under candidate `c` for `steps` optimizer steps."""
    meta = f.meta
    groups = int(meta["groups_per_step"])
    micro = groups if c.classic else min(int(meta.get("micro_batch_groups", groups)), groups)
    defaults: dict[str, Any] = {
        "mode": c.mode,
        "seed": seed,
        "backend": {
            "name": "sim",
            "slots": c.max_concurrency,
            "rmax": f.rmax,
            "n_half": f.n_half,
            "train_rate": f.train_rate,
            "t_optim": f.t_optim,
            "t_sync": f.t_sync,
            "train_share": f.train_share,
            "sync_share": f.sync_share,
            "learner_share": f.learner_share,
            "len_median": float(np.median(f.lengths)),
            "len_cap": max(f.lengths),
        },
        # The recorded lengths go to the workflow object (see `workflow`), not into the config.
        "workflow": {"cls": "rllm_async.workflows.sim:SimWorkflow", "args": {"seed": seed}},
        "data": {
            "train": {"generator": "rllm_async.workflows.sim:synthetic_tasks", "args": {"n": 4096}}
        },
        "train": {"groups_per_step": groups, "micro_batch_groups": micro, "total_steps": steps},
        "rollout": {
            "group_size": int(meta["group_size"]),
            "max_tokens": max(f.lengths),
            "max_concurrency": c.max_concurrency,
            # Records from before the adaptive limit ran with a fixed one.
            "late_concurrency": meta.get("late_concurrency"),
            "timeout_s": 1e9,
        },
        "coordinator": {
            "pipeline_depth": c.pipeline_depth,
            "max_staleness": c.max_staleness,
            "stale_policy": c.stale_policy,
            "weight_update": "pin" if c.mode == "sync" else meta.get("weight_update", "pin"),
        },
    }
    filtering = [f"algorithm.filter_zero_variance={str(f.filter_rate > 0).lower()}"]
    return load_config(overrides=[*quiet, *filtering], defaults=defaults)


def workflow(f: FittedWorkload, seed: int = 0) -> SimWorkflow:
    """The sim workflow drawing a recorded group per task: its lengths, and its filtering."""
    return SimWorkflow(groups=f.groups, seed=seed, filter_rate=f.filter_rate)


def replay(f: FittedWorkload, c: Candidate, steps: int, seed: int = 0) -> dict[str, Any]:
    """Replay candidate `c` on the fitted workload (`f.for_mode(c.mode)`: on a shared device the
    other mode than the recorded one has speeds of its own); its figures, time per step first."""
    f = f.for_mode(c.mode)
    out = run_config(lambda quiet: sim_config(f, c, steps, seed, quiet), workflow(f, seed))
    n = out["steps"]
    # After the first step, as `fit_workload` measures the recorded run.
    step_s = (out["time_s"] - out["first_step_s"]) / (n - 1) if n > 1 else out["time_s"]
    return {"step_s": step_s, **out}


def candidates(
    f: FittedWorkload,
    depths: Sequence[int | Literal["auto"]] = (1, 2, 4, 8),
    bounds: Sequence[str] = ("none", "d", "2d"),
    policies: Sequence[str] = ("requeue",),
    concurrency: Sequence[float] = (1.0, 0.5),
) -> list[Candidate]:
    """Sync, then async for each depth (or `auto`, the depth controller), bound (none, `d`, `2d`
    or a number; `auto` takes none and numbers), policy and concurrency (fractions of the recorded
    `rollout.max_concurrency`)."""
    base = int(f.meta["max_concurrency"])
    out = [
        Candidate("sync", 0, 0, "requeue", base, classic=True),
        Candidate("sync", 0, 0, "requeue", base),
    ]
    for conc in dict.fromkeys(max(1, round(base * x)) for x in concurrency):
        for d in depths:
            for bound in _bounds(bounds, d):
                for policy in policies if bound is not None else ("requeue",):
                    out.append(Candidate("async", d, bound, policy, conc))
    return out


def _bounds(specs: Sequence[str], d: int | Literal["auto"]) -> list[int | None]:
    """The max_staleness of each bound spec at depth d, once each (`auto` takes no `d` spec)."""
    out: list[int | None] = []
    for spec in specs:
        if spec == "none":
            out.append(None)
        elif spec.endswith("d"):
            if d != "auto":
                out.append(int(spec[:-1] or 1) * d)
        else:
            out.append(int(spec) if d == "auto" else max(d, int(spec)))
    return list(dict.fromkeys(out))


def recorded_candidate(f: FittedWorkload) -> Candidate:
    """The setting the record was made under."""
    m = f.meta
    sync = m["mode"] == "sync"
    return Candidate(
        m["mode"],
        0 if sync else ("auto" if m["pipeline_depth"] == "auto" else int(m["pipeline_depth"])),
        0 if sync else m["max_staleness"],
        m["stale_policy"],
        int(m["max_concurrency"]),
    )


def recommend(
    rows: list[dict[str, Any]], max_waste: float | None, max_staleness: int | None
) -> dict[str, Any] | None:
    """The fastest replayed row within the waste and staleness budget (None if none is)."""
    ok = [
        r
        for r in rows
        if (max_waste is None or r["waste"] <= max_waste)
        and (max_staleness is None or r["staleness_max"] <= max_staleness)
        and r["violations"] == 0
    ]
    return min(ok, key=lambda r: r["step_s"]) if ok else None


def replay_rows(
    f: FittedWorkload, settings: Sequence[Candidate], steps: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Replay each setting on `f`: one row of figures each, with its speedup over the first
    classic sync among them. A setting given twice (the recorded one is often among the
    candidates) is replayed once: the replay is deterministic."""
    rows = []
    classic_s = None
    replayed: dict[Candidate, dict[str, Any]] = {}
    for c in settings:
        out = replayed.get(c)
        if out is None:
            out = replayed[c] = replay(f, c, steps, seed)
        if classic_s is None and c.classic:
            classic_s = out["step_s"]
        rows.append(
            {
                "setting": c.label,
                "mode": c.mode,
                "pipeline_depth": c.pipeline_depth,
                "max_staleness": c.max_staleness,
                "stale_policy": c.stale_policy,
                "max_concurrency": c.max_concurrency,
                "step_s": round(out["step_s"], 4),
                "waste": round(out["waste_steady"], 4),
                "staleness_mean": round(out["staleness_mean"], 3),
                "staleness_p50": out["staleness_p50"],
                "staleness_p90": out["staleness_p90"],
                "staleness_max": out["staleness_max"],
                "violations": out["violations"],
            }
        )
    for r in rows:
        r["speedup"] = round(classic_s / r["step_s"], 3) if classic_s else None
    return rows


def device_splits(
    f: FittedWorkload,
    devices: int,
    recorded: tuple[int, int],
    steps: int,
    seed: int,
    budget: tuple[float | None, int | None],
    grid: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """For each split of `devices` between generation and training (the record had `recorded`:
    generation's, training's), the fastest candidate within `budget` (max waste, staleness)."""
    out = []
    for gen in range(1, devices):
        train = devices - gen
        split = f.on_devices(gen / recorded[0], train / recorded[1])
        rows = replay_rows(split, candidates(split, **(grid or {})), steps, seed)
        out.append(
            {
                "generation_devices": gen,
                "training_devices": train,
                "best": recommend(rows, *budget),
            }
        )
    return out


def plan(
    run_dir: Path,
    *,
    steps: int | None = None,
    seed: int = 0,
    scale_servers: float = 1.0,
    scale_batch: float = 1.0,
    max_waste: float | None = None,
    max_staleness: int | None = None,
    grid: dict[str, Any] | None = None,
    devices: int | None = None,
    recorded_devices: tuple[int, int] = (1, 1),
    twin: Path | None = None,
) -> dict[str, Any]:
    """Fit, replay the recorded setting and the candidates, recommend one; with `devices`, also
    the best setting for each split of that many devices between generation and training (the
    record's split: `recorded_devices`); with `twin`, a run of the same job in the other mode,
    that mode is replayed from its record (and its recorded setting too). A dict of it all."""
    if twin is not None and devices is not None:
        raise ConfigError(
            "--devices with --twin: a split starts from each side's speed alone, which a "
            "shared device's record models for both modes; plan the split from one record"
        )
    if devices is not None and devices < 2:
        raise ConfigError(f"--devices {devices}: a split needs 2 devices or more")
    if min(recorded_devices) < 1:
        raise ConfigError(
            f"--recorded-devices {recorded_devices[0]}:{recorded_devices[1]}: give the recorded "
            "run's generation and training devices, each 1 or more (1:1 for one shared device)"
        )
    workload = read_workload(run_dir)
    if twin is None:
        f = fit_workload(workload)
    else:
        f = fit_workload(workload, read_workload(twin), f"the twin record {twin}")
    f = f.scaled(scale_servers, scale_batch)
    n = steps if steps is not None else min(60, max(1, len(workload.steps)))
    twin_fit = f.other if twin is not None else None
    recorded_settings = [recorded_candidate(g) for g in (f, twin_fit) if g is not None]
    settings = [*recorded_settings, *candidates(f, **(grid or {}))]
    rows = replay_rows(f, settings, n, seed)
    recorded, table = rows[0], rows[len(recorded_settings) :]
    twin_row = None
    if twin_fit is not None:
        measured = round(twin_fit.measured_step_s, 4)
        twin_row = {**rows[1], "record": str(twin), "measured_step_s": measured}
    splits = None
    if devices is not None:
        budget = (max_waste, max_staleness)
        found = device_splits(f, devices, recorded_devices, n, seed, budget, grid)
        fits = [s for s in found if s["best"] is not None]
        splits = {
            "devices": devices,
            "recorded_devices": list(recorded_devices),
            "splits": found,
            "recommendation": min(fits, key=lambda s: s["best"]["step_s"]) if fits else None,
        }
    peak = ps_rate(int(f.meta["max_concurrency"]), f.rmax, f.n_half)
    other = None
    if f.other is not None and twin is None:
        other = {
            "mode": "sync" if f.meta["mode"] != "sync" else "async",
            "train_tok_s_alone": round(f.other.train_rate, 1),
            "train_share": round(f.other.train_share, 3),
            "learner_share": round(f.other.learner_share, 3),
        }
    return {
        "shared_device": f.shared_device,
        "other_mode": other,
        "fit": {
            "rmax_tok_s": round(f.rmax, 1),
            "n_half": round(f.n_half, 2),
            "decode_tok_s_at_max_concurrency": round(peak, 1),
            "train_tok_s": round(f.train_rate, 1),
            "t_optim_s": round(f.t_optim, 4),
            "t_sync_s": round(f.t_sync, 4),
            "train_share": round(f.train_share, 3),
            "sync_share": round(f.sync_share, 3),
            "len_median": float(np.median(f.lengths)),
            "len_p90": float(np.quantile(f.lengths, 0.9)),
            "len_max": max(f.lengths),
        },
        "steps": n,
        "measured": f.measured,
        "assumed": f.assumed,
        "recorded": {**recorded, "measured_step_s": round(f.measured_step_s, 4)},
        "twin": twin_row,
        "candidates": table,
        "budget": {"max_waste": max_waste, "max_staleness": max_staleness},
        "recommendation": recommend(table, max_waste, max_staleness),
        "device_splits": splits,
    }


def render(result: dict[str, Any]) -> str:
    """The plan as text: the fit, what is measured and assumed, the table, the recommendation."""
    lines = ["fitted workload:"]
    lines += [f"  {k}: {v}" for k, v in result["fit"].items()]
    other = result["other_mode"]
    if other is not None:
        lines.append(
            f"replaying {other['mode']} mode (a device shared by generation and training):"
        )
        lines += [f"  {k}: {v}" for k, v in other.items() if k != "mode"]
    lines += ["measured:"] + [f"  - {m}" for m in result["measured"]]
    lines += ["assumed:"] + [f"  - {a}" for a in result["assumed"]]
    rec = result["recorded"]
    if not math.isnan(rec["measured_step_s"]):
        err = rec["step_s"] / rec["measured_step_s"] - 1
        lines.append(
            f"recorded setting ({rec['setting']}, concurrency {rec['max_concurrency']}): "
            f"measured {rec['measured_step_s']:.3f} s/step, replayed {rec['step_s']:.3f} s/step "
            f"({err:+.1%})"
        )
    twin = result["twin"]
    if twin is not None and not math.isnan(twin["measured_step_s"]):
        err = twin["step_s"] / twin["measured_step_s"] - 1
        lines.append(
            f"twin's recorded setting ({twin['setting']}, concurrency {twin['max_concurrency']}): "
            f"measured {twin['measured_step_s']:.3f} s/step, replayed {twin['step_s']:.3f} s/step "
            f"({err:+.1%})"
        )
    head = "setting", "conc", "s/step", "speedup", "waste", "stale p50/p90/max", "viol"
    lines.append(f"predicted over {result['steps']} steps:")
    lines.append(
        f"  {head[0]:<22} {head[1]:>5} {head[2]:>9} {head[3]:>8} {head[4]:>7}  {head[5]:<18} {head[6]}"
    )
    for r in result["candidates"]:
        stale = f"{r['staleness_p50']}/{r['staleness_p90']}/{r['staleness_max']}"
        lines.append(
            f"  {r['setting']:<22} {r['max_concurrency']:>5} {r['step_s']:>9.3f} "
            f"{r['speedup']:>7.2f}x {r['waste']:>7.2%}  {stale:<18} {r['violations']}"
        )
    budget = result["budget"]
    rec_row = result["recommendation"]
    limits = f"waste <= {budget['max_waste']}, staleness <= {budget['max_staleness']}"
    if rec_row is None:
        lines.append(f"no candidate fits the budget ({limits})")
    else:
        lines.append(
            f"recommended under {limits}: mode={rec_row['mode']} "
            f"coordinator.pipeline_depth={rec_row['pipeline_depth']} "
            f"coordinator.max_staleness={_null(rec_row['max_staleness'])} "
            f"coordinator.stale_policy={rec_row['stale_policy']} "
            f"rollout.max_concurrency={rec_row['max_concurrency']} "
            f"({rec_row['step_s']:.3f} s/step, {rec_row['speedup']}x over classic sync)"
        )
    if result["device_splits"] is not None:
        lines += _render_splits(result["device_splits"], limits)
    return "\n".join(lines)


def _render_splits(splits: dict[str, Any], limits: str) -> list[str]:
    gen, train = splits["recorded_devices"]
    lines = [
        f"{splits['devices']} devices split between generation and training (the record had "
        f"{gen} and {train}; each split on devices of its own):"
    ]
    lines.append(
        f"  {'gen':>4} {'train':>5}  {'best setting':<22} {'conc':>5} {'s/step':>9} {'waste':>7}"
    )
    for s in splits["splits"]:
        best = s["best"]
        if best is None:
            lines.append(f"  {s['generation_devices']:>4} {s['training_devices']:>5}  none fits")
            continue
        lines.append(
            f"  {s['generation_devices']:>4} {s['training_devices']:>5}  {best['setting']:<22} "
            f"{best['max_concurrency']:>5} {best['step_s']:>9.3f} {best['waste']:>7.2%}"
        )
    rec = splits["recommendation"]
    if rec is None:
        lines.append(f"no split has a candidate within the budget ({limits})")
    else:
        lines.append(
            f"recommended split: {rec['generation_devices']} for generation, "
            f"{rec['training_devices']} for training, {rec['best']['setting']} at concurrency "
            f"{rec['best']['max_concurrency']} ({rec['best']['step_s']:.3f} s/step)"
        )
    return lines


def _null(value: int | None) -> str:
    return "null" if value is None else str(value)
