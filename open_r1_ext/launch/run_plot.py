"""`open-r1-ext plot RUN_DIR [-o FILE.png]`: one PNG of a run, drawn with matplotlib from its run directory.

Six panels over the steps: reward (mean and spread, and each reward function's mean, labelled when it gave every
completion the same score), KL, loss, the step time (stacked areas of the trainer's `timing/*` parts when it logs
them, else each step's wall time), the weight sync's parts (dump, waiting for the reload, waiting for the seal), and
the staleness of each batch; with dynamic sampling a seventh, the groups per generation batch (generated, kept,
filtered) and its rounds. Reads the same files as `status` (`run_status.run_metrics`, rollouts.jsonl); imports
no TRL."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from open_r1_ext.launch.run_status import DYNAMIC_SAMPLING_METRICS, read_jsonl, run_metrics

# The trainer's step-time parts (`trainer/step_timing.py`: disjoint, seconds per step) that make up a weight sync.
SYNC_PARTS = ("timing/dump", "timing/reload_wait", "timing/seal_wait")
PANELS = ("reward", "KL", "loss", "step time (s)", "weight sync (s)", "staleness (steps)")
SAMPLING_PANEL = "dynamic sampling (groups)"  # drawn only for a run that logs `dynamic_sampling/*`
FIGSIZE, DPI = (12, 9), 100  # 1200 x 900 pixels; 3 inches (300 pixels) taller with the dynamic sampling panel


def series(steps: list[dict], key: str) -> tuple[list[int], list[float]]:
    """`(steps, values)` of the logged steps that have `key`."""
    points = [(s["step"], s[key]) for s in steps if isinstance(s.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def flat_rewards(steps: list[dict]) -> dict[str, float]:
    """The reward functions that gave every completion of every logged step the same score (`rewards/<name>/std` 0
    throughout, the mean one value), with that score. The plot says so beside the flat line: it is no plotting error,
    and GRPO learns nothing from such a reward (its advantages are all 0)."""
    names = sorted({k.split("/")[1] for s in steps for k in s if k.startswith("rewards/") and k.endswith("/mean")})
    flat = {}
    for name in names:
        _, mean = series(steps, f"rewards/{name}/mean")
        _, spread = series(steps, f"rewards/{name}/std")
        if len(mean) > 1 and len(spread) == len(mean) and not any(spread) and len(set(mean)) == 1:
            flat[name] = mean[0]
    return flat


def parts(steps: list[dict], keys) -> dict[str, tuple[list[int], list[float]]]:
    """The `timing/<part>` series among `keys` that were ever non-zero, by part name."""
    found = {key.removeprefix("timing/"): series(steps, key) for key in keys}
    return {name: xy for name, xy in found.items() if any(xy[1])}


def step_times(steps: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """The step-time breakdown: the trainer's `timing/*` parts and what `step_wall_time` has beyond them (`other`),
    else, for a trainer that does not time its parts, the wall time between two logged steps (a gap across a
    restart left out)."""
    keys = [k for k in dict.fromkeys(k for s in steps for k in s) if k.startswith("timing/")]
    if keys:
        breakdown = parts(steps, keys)
        x, wall = series(steps, "step_wall_time")
        if x and all(len(xy[0]) == len(x) for xy in breakdown.values()):
            summed = [sum(xy[1][i] for xy in breakdown.values()) for i in range(len(x))]
            breakdown["other"] = (x, [max(0.0, w - t) for w, t in zip(wall, summed)])
        return breakdown
    timed = [s for s in steps if "time" in s]
    pairs = [(b["step"], (b["time"] - a["time"]) / (b["step"] - a["step"]))
             for a, b in zip(timed, timed[1:]) if b["step"] > a["step"] and b["time"] > a["time"]]
    if not pairs:
        return {}
    typical = sorted(p[1] for p in pairs)[len(pairs) // 2]
    pairs = [p for p in pairs if p[1] < 20 * typical]  # a resume's downtime is not a step
    return {"wall time per step": ([p[0] for p in pairs], [p[1] for p in pairs])}


def plot_run(run_dir: Path, out: Path) -> list[str]:
    """Draw the run's PNG to `out`; returns the titles of the panels that have data (the others say "no data")."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a login node
    import matplotlib.pyplot as plt

    steps, _ = run_metrics(run_dir)
    if not steps:
        raise FileNotFoundError(f"{run_dir}: no logged step yet (no {run_dir}/metrics.jsonl or checkpoint "
                                "trainer_state.json); plot again once the trainer has logged a step")
    titles = PANELS + ((SAMPLING_PANEL,) if any("dynamic_sampling/groups_generated" in s for s in steps) else ())
    rows = (len(titles) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(FIGSIZE[0], FIGSIZE[1] * rows / 3), dpi=DPI, sharex=True)
    panels = dict(zip(titles, axes.flat))
    for unused in axes.flat[len(titles):]:
        unused.axis("off")
    drawn = []

    def draw(title: str, lines: dict[str, tuple[list[int], list[float]]], stacked: bool = False) -> None:
        ax = panels[title]
        ax.set_title(title)
        ax.grid(alpha=0.3)
        lines = {label: xy for label, xy in lines.items() if xy[0]}
        if not lines:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
            return
        drawn.append(title)
        if stacked and len({tuple(x) for x, _ in lines.values()}) == 1:
            x = next(iter(lines.values()))[0]
            ax.stackplot(x, *[y for _, y in lines.values()], labels=list(lines), alpha=0.8)
        else:
            for label, (x, y) in lines.items():
                ax.plot(x, y, label=label, marker="." if len(x) < 30 else None)
        if len(lines) > 1 or stacked:
            ax.legend(fontsize="small", loc="best")

    x, mean = series(steps, "reward")
    _, spread = series(steps, "reward_std")
    per_function = {k.split("/")[1]: series(steps, k) for k in sorted({k for s in steps for k in s})
                    if k.startswith("rewards/") and k.endswith("/mean")}
    draw("reward", {"mean": (x, mean), **per_function})
    for name, score in flat_rewards(steps).items():
        panels["reward"].annotate(f"{name}: {score:g} for every completion (no learning signal)",
                                  xy=(per_function[name][0][-1], score), xytext=(0, 3), textcoords="offset points",
                                  ha="right", va="bottom", fontsize="small")
    if x and len(spread) == len(mean):
        panels["reward"].fill_between(x, [m - s for m, s in zip(mean, spread)], [m + s for m, s in zip(mean, spread)],
                                      alpha=0.2, label="± std")
        panels["reward"].legend(fontsize="small", loc="best")
    draw("KL", {"kl": series(steps, "kl")})
    draw("loss", {"loss": series(steps, "loss")})
    draw("step time (s)", step_times(steps), stacked=True)
    draw("weight sync (s)", parts(steps, SYNC_PARTS), stacked=True)
    rollouts = [r for r in read_jsonl(run_dir / "rollouts.jsonl") if not r.get("dropped")]  # trained ones
    draw("staleness (steps)", {"staleness": ([r["step"] for r in rollouts], [r["staleness"] for r in rollouts])})
    panels["staleness (steps)"].set_ylim(-0.2, max([1] + [r["staleness"] for r in rollouts]) + 0.5)
    panels["staleness (steps)"].yaxis.get_major_locator().set_params(integer=True)
    if SAMPLING_PANEL in panels:
        draw(SAMPLING_PANEL, {name.replace("groups_", ""): series(steps, f"dynamic_sampling/{name}")
                              for name in DYNAMIC_SAMPLING_METRICS if name != "informative_share"})
    for ax in list(panels.values())[-2:]:  # each column's lowest panel
        ax.set_xlabel("step")
        ax.tick_params(labelbottom=True)
    fig.suptitle(f"{run_dir.resolve().name}: step {steps[-1]['step']}/{steps[-1].get('max_steps') or '?'}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return drawn


def main(run_dir: str, output: Optional[str] = None) -> int:
    path = Path(run_dir)
    if not path.is_dir():
        print(f"{run_dir}: no such run directory (a recipe's trainer.output_dir)", file=sys.stderr)
        return 2
    out = Path(output) if output else path / "plot.png"
    try:
        drawn = plot_run(path, out)
    except FileNotFoundError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"wrote {out}; panels: {', '.join(drawn)}")
    return 0
