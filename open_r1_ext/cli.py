"""The `open-r1-ext` command: one entry for every user-facing action.

    open-r1-ext train RECIPE [--set SECTION.KEY=VALUE ...] [--server-url URL ...] [--ref-url URL ...]
                             [--server-dir DIR] [--ref-dir DIR]
    open-r1-ext validate [--preflight] RECIPE [RECIPE ...]
    open-r1-ext new-recipe --from RECIPE --model ORG/NAME OUT
    open-r1-ext serve --model-path DIR [--port P ...]        (the built-in server)
    open-r1-ext launch RECIPE [--set ...] [--executor slurm|local] [--dry-run]
    open-r1-ext add-server RUN_DIR [--role server|ref-server] [--resources-index I]
    open-r1-ext status RUN_DIR [--json] [--watch SECONDS]
    open-r1-ext plot RUN_DIR [-o FILE.png]

Each subcommand imports only what it needs, so `validate` answers in seconds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from open_r1_ext.config.arguments import add_recipe_arguments


def cmd_train(args: argparse.Namespace) -> int:
    from open_r1_ext import train

    return train.train_recipe(args.recipe, args.set, args.server_url, args.ref_url, args.server_dir, args.ref_dir)


def cmd_validate(args: argparse.Namespace) -> int:
    """Each recipe as the launchers would take it (schema, values, then the job plan; with `--preflight`, what the
    launchers try before they submit: `launch/preflight.py`); a problem is a `FILE: key: message` line, never a
    traceback."""
    from open_r1_ext.config.recipe import RecipeError, load_recipe
    from open_r1_ext.launch.preflight import preflight, report
    from open_r1_ext.launch.slurm_plan import PlanError, SlurmPlan

    failed = 0
    for path in args.recipes:
        try:
            recipe = load_recipe(path, args.set)
            SlurmPlan(recipe, args.set)
        except RecipeError as err:
            print(err, file=sys.stderr)
            failed += 1
            continue
        except PlanError as err:
            print(f"{path}: {err}", file=sys.stderr)
            failed += 1
            continue
        except Exception as err:  # noqa: BLE001 - validate answers with a line, whatever went wrong
            print(f"{path}: (recipe): could not be checked: {type(err).__name__}: {err}", file=sys.stderr)
            failed += 1
            continue
        print(f"{path}: ok ({recipe.servers.describe()}; {recipe.slurm.trainer.num_processes} trainer process(es))")
        if args.preflight and not report(recipe, preflight(recipe)):
            failed += 1
    return 1 if failed else 0


def cmd_new_recipe(args: argparse.Namespace) -> int:
    """Copy a recipe for another model: the model id and its short name (output dir, sync dir, job name) change;
    comments and everything else stay, for the user to adjust (GPU counts, batch sizes)."""
    from open_r1_ext.config.recipe import RecipeError, load_recipe

    source, out = Path(args.source), Path(args.out)
    if out.exists() and not args.force:  # said before the recipe's schema loads TRL (seconds)
        print(f"{out} exists; pass --force to overwrite", file=sys.stderr)
        return 2
    try:
        recipe = load_recipe(source, check_paths=False)
    except RecipeError as err:
        print(err, file=sys.stderr)
        return 2
    old_model = recipe.model.name_or_path
    old_short, new_short = (name.rstrip("/").split("/")[-1] for name in (old_model, args.model))
    text = source.read_text().replace(old_model, args.model).replace(old_short, new_short)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out} (model {args.model}); adjust its GPUs (slurm.trainer, servers.<role>.resources) and batch "
          f"sizes, then check it with: open-r1-ext validate --preflight {out}")
    return 0


def cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    from open_r1_ext.server import app as serve

    serve.main(rest)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    """The recipe, its plan and its preflight (`launch/preflight.py`) before anything is submitted (or printed, with
    `--dry-run`)."""
    from open_r1_ext.config.recipe import RecipeError, load_recipe
    from open_r1_ext.launch.preflight import launch_refused
    from open_r1_ext.launch.slurm_plan import PlanError, SlurmPlan
    from open_r1_ext.launch.submitit_launcher import EXECUTORS, describe_launch, launch

    try:
        recipe = load_recipe(args.recipe, args.set)
        plan = SlurmPlan(recipe, args.set)
        if launch_refused(recipe):
            return 2
        if args.dry_run:
            print(describe_launch(plan))
            return 0
        return launch(recipe, EXECUTORS[args.executor], args.set)
    except RecipeError as err:
        print(f"{err}\nnothing submitted", file=sys.stderr)
        return 2
    except PlanError as err:
        print(f"{args.recipe}: {err}\nnothing submitted", file=sys.stderr)
        return 2


def cmd_add_server(args: argparse.Namespace) -> int:
    """One more server replica for a running run (an sbatch job that joins the trainer's pool once healthy)."""
    from open_r1_ext.config.recipe import RecipeError
    from open_r1_ext.launch.jobs import LaunchError, add_server
    from open_r1_ext.launch.slurm_plan import PlanError

    try:
        ref = add_server(Path(args.run_dir), args.role, args.resources_index, echo=print)
    except (RecipeError, PlanError, LaunchError) as err:
        print(f"{args.run_dir}: {err}\nnothing submitted", file=sys.stderr)
        return 2
    print(f"{ref} joins the pool of {args.run_dir} once healthy; the run's end cancels it (log: {ref.log})")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from open_r1_ext.launch import run_status

    return run_status.main(args.run_dir, as_json=args.json, watch=args.watch)


def cmd_plot(args: argparse.Namespace) -> int:
    from open_r1_ext.launch import run_plot

    return run_plot.main(args.run_dir, args.output)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="open-r1-ext", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train as a recipe says (starts an embedded built-in server if none is given)")
    train.add_argument("recipe")
    add_recipe_arguments(train, server_urls=True)
    train.set_defaults(func=cmd_train)

    validate = sub.add_parser("validate", help="check recipes; exit status 1 if any is invalid")
    validate.add_argument("recipes", nargs="+")
    validate.add_argument("--preflight", action="store_true",
                          help="also what the launchers try before they submit: the servers' and the trainer's "
                               "interpreters, the accelerate config, the HF cache, the disk, an OpenAI server's reloads")
    add_recipe_arguments(validate)
    validate.set_defaults(func=cmd_validate)

    new = sub.add_parser("new-recipe", help="copy a recipe for another model")
    new.add_argument("--from", dest="source", required=True)
    new.add_argument("--model", required=True, help="hub id (org/name) or local path of the new model")
    new.add_argument("--force", action="store_true")
    new.add_argument("out")
    new.set_defaults(func=cmd_new_recipe)

    launch = sub.add_parser("launch", help="the server job(s) and the trainer job through submitit; cancels the servers at the end")
    launch.add_argument("recipe")
    add_recipe_arguments(launch)
    launch.add_argument("--executor", choices=("slurm", "local"), default="slurm",
                        help="slurm: sbatch jobs; local: the same jobs as processes on this machine")
    launch.add_argument("--dry-run", action="store_true", help="print every job's parameters and commands; submit nothing")
    launch.set_defaults(func=cmd_launch)

    add = sub.add_parser("add-server", help="submit one more server replica for a running run (sbatch); it joins the "
                                            "trainer's pool once healthy")
    add.add_argument("run_dir", help="the run directory (the recipe's trainer.output_dir)")
    add.add_argument("--role", choices=("server", "ref-server"), default="server",
                     help="server: generation (default); ref-server: the reference's own servers")
    add.add_argument("--resources-index", type=int, default=0, metavar="I",
                     help="which entry of the spec's resources list the job gets (default 0)")
    add.set_defaults(func=cmd_add_server)

    status = sub.add_parser("status", help="a run's jobs, servers, progress, last sync and events, from its run directory")
    status.add_argument("run_dir", help="the run directory (the recipe's trainer.output_dir)")
    status.add_argument("--json", action="store_true", help="one JSON object (its keys: docs/protocol.md)")
    status.add_argument("--watch", type=float, metavar="SECONDS", help="again every SECONDS until the run has ended")
    status.set_defaults(func=cmd_status)

    plot = sub.add_parser("plot", help="one PNG of a run: reward, KL, loss, step time, sync time and staleness")
    plot.add_argument("run_dir", help="the run directory (the recipe's trainer.output_dir)")
    plot.add_argument("-o", "--output", metavar="FILE.png", help="where to write it (default: RUN_DIR/plot.png)")
    plot.set_defaults(func=cmd_plot)

    serve = sub.add_parser("serve", help="the built-in server (same flags as python -m open_r1_ext.server)", add_help=False)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "serve":
        return cmd_serve(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
