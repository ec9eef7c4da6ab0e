"""The command-line options that configure a run, shared by every command that takes a recipe (`open-r1-ext`'s
subcommands, `python -m open_r1_ext.train`, the job runtime `python -m open_r1_ext.launch.jobs`): recipe overrides
(`--set`, read by `recipe.load_recipe`) and, for training, the servers' URLs and address directories.
"""

from __future__ import annotations

import argparse


def add_recipe_arguments(parser: argparse.ArgumentParser, server_urls: bool = False) -> None:
    """The recipe options every command shares: `--set`, and with `server_urls` the servers' URLs (training)."""
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe value, e.g. --set trainer.max_steps=5 (repeatable)")
    if server_urls:
        parser.add_argument("--server-url", action="append", metavar="URL",
                            help="generation server (and the reference's, with reference: generation); repeat it for a "
                                 "pool of replicas")
        parser.add_argument("--ref-url", action="append", metavar="URL",
                            help="reference server, when the reference has servers of its own (repeatable)")
        parser.add_argument("--server-dir", metavar="DIR",
                            help="address directory of the generation replicas (<name>.addr files, one host:port "
                                 "each): a pool they join and leave")
        parser.add_argument("--ref-dir", metavar="DIR",
                            help="address directory of the reference's replicas, when it has servers of its own")
