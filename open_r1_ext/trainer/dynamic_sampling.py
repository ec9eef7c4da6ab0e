"""DAPO's dynamic sampling for `RemoteGRPOTrainer` (`dynamic_sampling`): each generation batch is sampled and scored
in rounds through TRL's own `_generate` and `_calculate_rewards`, groups whose rewards do not spread are dropped, and
prompts drawn from the training set refill the batch; TRL then scores the kept groups (`take_sampled`, `take_rewards`),
so its reference and policy log-probs are computed for them alone. Every process decides on all processes' groups.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import random
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterator, Optional

import torch
from accelerate.utils import gather_object
from torch.utils.data import IterableDataset
from trl.trainer.utils import nanstd

logger = logging.getLogger(__name__)
STATE_FILE = "dynamic_sampling.json"  # in a checkpoint: the informative share the next batch's oversampling follows


@dataclass
class SampledGroup:
    """One prompt's group as TRL's `_generate` gave it (each field one entry per completion) with its rewards (one row
    per completion, one column per reward function) and whether they spread."""

    rows: list[dict]
    prompt_ids: list
    completion_ids: list
    completions: list
    logprobs: Optional[list]
    tool_mask: Optional[list]
    extra_fields: list[dict]
    extra_logs: dict[str, list]
    rewards: torch.Tensor
    informative: bool


class DynamicSampling:
    """Fills a generation batch with informative groups (see the module docstring and `RemoteGRPOConfig`).

    Args:
        trainer (`RemoteGRPOTrainer`): generates and scores (its TRL hooks), and is read for its settings, data,
            step, processes and metrics.
    """

    def __init__(self, trainer):
        args = trainer.args
        self.trainer = trainer
        self.max_rounds = args.dynamic_sampling_max_rounds
        self.max_oversampling = args.dynamic_sampling_max_oversampling
        self.min_std = args.dynamic_sampling_min_std
        names = list(trainer.reward_func_names)
        if args.dynamic_sampling_reward is not None and args.dynamic_sampling_reward not in names:
            raise ValueError(f"dynamic_sampling_reward={args.dynamic_sampling_reward!r} names no reward function of "
                             f"this run: choose one of {', '.join(names)}, or leave it unset (the weighted sum)")
        self.reward_column = names.index(args.dynamic_sampling_reward) if args.dynamic_sampling_reward else None
        if trainer.tools or trainer.environment_factories is not None:
            raise ValueError("dynamic_sampling=True with tools or an environment_factory: the rounds that refill a "
                             "batch sample single-turn completions only; set dynamic_sampling=False")
        if trainer.train_dataset is None or isinstance(trainer.train_dataset, IterableDataset) or not hasattr(
                trainer.train_dataset, "__getitem__"):
            raise ValueError("dynamic_sampling=True needs a map-style training set (a datasets.Dataset, not an "
                             "IterableDataset): the prompts that refill a batch are drawn from it by index")
        self.informative_share = 1.0  # of the last batch's groups generated: its inverse is the next oversampling
        self._sampled: Optional[tuple[list, tuple]] = None  # the kept batch, for TRL's `_generate`
        self._rewards: Optional[torch.Tensor] = None  # its rewards, for TRL's `_calculate_rewards`
        self._ahead: deque[tuple[str, list[dict]]] = deque()  # (a batch read ahead, its oversampled rows): `ahead`
        self._in_flight_refills: Optional[Iterator[dict]] = None  # with `in_flight_updates`: `_draw_in_flight`
        self._warned = False

    # ------------------------------------------------------------------ the batch
    def fill(self, inputs: list[dict]) -> list[dict]:
        """This process's rows of a full generation batch of informative groups, for the data loader's `inputs` (TRL's
        layout: each example `num_generations` times); their completions and rewards wait for TRL's hooks."""
        trainer = self.trainer
        size = trainer.num_generations
        processes, rank = trainer.accelerator.num_processes, trainer.accelerator.process_index
        local_groups = len(inputs) // size
        needed = local_groups * processes
        prompts = [row["prompt"] for row in inputs[::size]]
        in_flight = trainer.remote_generation if trainer.args.in_flight_updates else None
        if in_flight is not None:  # the batch's groups completed in flight, and so did the refills an extra round
            # takes (`keep_refills` below)
            pool = self._sample(inputs)
            next_round = partial(in_flight.refill_batch, draw=self._draw_in_flight)
        else:  # one request for the batch and its oversampling (with async generation, sent when the batch was read
            # ahead: `ahead`), the data loader's groups first in the pool
            oversampled = self._take_ahead(prompts)
            refills = self._refills(prompts + [row["prompt"] for row in (oversampled or [])[::size]])
            if oversampled is None:
                oversampled = self._refill(refills, self._oversampled_groups(local_groups))
            sampled = self._sample(inputs + oversampled)
            chunk = len(sampled) // processes
            pool = [g for r in range(processes) for g in sampled[r * chunk:r * chunk + local_groups]] + [
                g for r in range(processes) for g in sampled[r * chunk + local_groups:(r + 1) * chunk]]
            next_round = partial(self._refill, refills)
        rounds = 0
        while (found := sum(g.informative for g in pool)) < needed and rounds < self.max_rounds:
            rounds += 1
            pool += self._sample(next_round(self._round_groups(needed - found, found / len(pool), local_groups)))
        informative = [g for g in pool if g.informative]
        kept = informative[:needed]
        chosen = kept + [g for g in pool if not g.informative][:needed - len(kept)]
        if len(kept) < needed:
            self._warn_short(len(kept), needed, rounds)
        self.informative_share = len(informative) / len(pool)
        if in_flight is not None:  # the refills the next batch's extra rounds are likely to take, generated meanwhile
            in_flight.keep_refills(self._oversampled_groups(local_groups), self._draw_in_flight)
        metrics = trainer._metrics["train"]
        for name, value in (("groups_generated", len(pool)), ("groups_kept", len(kept)),
                            ("groups_filtered", len(pool) - len(informative)), ("rounds", 1 + rounds),
                            ("informative_share", len(kept) / needed)):
            metrics[f"dynamic_sampling/{name}"].append(float(value))
        mine = chosen[rank * local_groups:(rank + 1) * local_groups]
        self._hand_to_trl(chosen, mine)
        return [row for g in mine for row in g.rows]

    def ahead(self, batch: list[dict]) -> list[dict]:
        """With `async_generation`, for a generation batch read ahead (TRL's rows): the oversampled rows to generate
        with it in one request, as many as `fill` would ask for now (the informative share known when it is read),
        drawn in an order seeded by the batch's prompts (a resumed run that reads the batch again draws the same);
        `fill` takes them with the batch."""
        size = self.trainer.num_generations
        prompts = [row["prompt"] for row in batch[::size]]
        digest = _digest(prompts)
        rows = self._refill(self._refills(prompts, salt=digest), self._oversampled_groups(len(batch) // size))
        self._ahead.append((digest, rows))
        return rows

    def take_sampled(self, prompts: list) -> Optional[tuple]:
        """TRL's `_generate` output for the batch `fill` formed (None if it formed none)."""
        if self._sampled is None:
            return None
        (kept_prompts, output), self._sampled = self._sampled, None
        if kept_prompts != prompts:
            raise RuntimeError("dynamic_sampling: TRL asked for other prompts than those of the batch it was handed "
                               "(this trl version does not fit RemoteGRPOTrainer; set dynamic_sampling=False)")
        return output

    def take_rewards(self) -> Optional[torch.Tensor]:
        """The rewards of every process's kept groups, as TRL's `_calculate_rewards` returns them (gathered)."""
        rewards, self._rewards = self._rewards, None
        return rewards

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, checkpoint_dir: str) -> None:
        """Keep the oversampling's estimate with a checkpoint (the same on every process: the main one writes it)."""
        if self.trainer.accelerator.is_main_process:
            (Path(checkpoint_dir) / STATE_FILE).write_text(json.dumps({"informative_share": self.informative_share}))

    def resume_from(self, checkpoint_dir: str) -> None:
        """Resuming from `checkpoint_dir`: oversample as the interrupted run would have (one saved without dynamic
        sampling starts at none)."""
        saved = Path(checkpoint_dir) / STATE_FILE
        if saved.is_file():
            self.informative_share = float(json.loads(saved.read_text())["informative_share"])

    # ------------------------------------------------------------------ rounds
    def _sample(self, rows: list[dict]) -> list[SampledGroup]:
        """Generate and score `rows` (on every process at once: TRL's hooks gather), and return every process's groups
        in process order."""
        trainer = self.trainer
        size, rank = trainer.num_generations, trainer.accelerator.process_index
        prompts = [row["prompt"] for row in rows]
        if any("image" in row or "images" in row for row in rows):
            raise ValueError("dynamic_sampling=True serves text prompts only: this training set has images")
        pending_logs = dict(trainer._pending_extra_logs)
        trainer._pending_extra_logs.clear()
        (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, _,
         _) = trainer._generate(prompts)
        rewards = trainer._calculate_rewards(rows, prompts, completions, completion_ids).cpu()
        extra_logs = {k: v for k, v in trainer._pending_extra_logs.items() if len(v) == len(rows)}
        trainer._pending_extra_logs.clear()
        trainer._pending_extra_logs.update(pending_logs)
        spread = self._spread(rewards, size)
        local = rewards[rank * len(rows):(rank + 1) * len(rows)]
        groups = []
        for start in range(0, len(rows), size):
            part = slice(start, start + size)
            groups.append(SampledGroup(
                rows=rows[part], prompt_ids=prompt_ids[part], completion_ids=completion_ids[part],
                completions=completions[part], logprobs=logprobs[part] if logprobs is not None else None,
                tool_mask=tool_mask[part] if tool_mask is not None else None,
                extra_fields=[{k: v[i] if isinstance(v, list) else v for k, v in extra_fields.items()}
                              for i in range(start, start + size)],
                extra_logs={k: v[part] for k, v in extra_logs.items()}, rewards=local[part],
                informative=bool(spread[rank * len(rows) // size + start // size])))
        return gather_object(groups)

    def _spread(self, rewards: torch.Tensor, size: int) -> torch.Tensor:
        """Per group (of every process): whether its rewards (one function's, or TRL's weighted sum) spread."""
        if self.reward_column is not None:
            decisive = rewards[:, self.reward_column]
        else:
            weights = self.trainer.reward_weights.to(rewards.device)
            decisive = (rewards * weights.unsqueeze(0)).nansum(dim=1)
            decisive[torch.isnan(rewards).all(dim=1)] = torch.nan  # unscorable rows, as TRL leaves them out
        std = nanstd(decisive.view(-1, size), dim=1)
        return (std > self.min_std) & ~torch.isclose(std, torch.zeros_like(std))

    def _factor(self) -> float:
        """How many times a batch's groups to ask for at once: 1 / the last batch's informative share, bounded."""
        return min(self.max_oversampling, 1.0 / self.informative_share if self.informative_share > 0 else math.inf)

    def _oversampled_groups(self, local_groups: int) -> int:
        """The groups a process asks for beyond its batch's `local_groups` in a batch's first round."""
        return max(0, math.ceil(local_groups * (self._factor() - 1.0) - 1e-9))

    def _round_groups(self, missing: int, share: float, local_groups: int) -> int:
        """The groups a process asks for in an extra round: enough for the `missing` informative groups (of every
        process) at the informative `share` of the groups this batch has generated so far, at most
        `dynamic_sampling_max_oversampling` times its batch's `local_groups`."""
        wanted = missing / share / self.trainer.accelerator.num_processes if share > 0 else math.inf
        return max(1, math.ceil(min(wanted, self.max_oversampling * local_groups) - 1e-9))

    def _take_ahead(self, prompts: list) -> Optional[list[dict]]:
        """The oversampled rows `ahead` drew for the batch of `prompts`, if it did (older ones are dropped: a batch read
        ahead and never trained, e.g. at the end of `train()`)."""
        wanted = _digest(prompts)
        while self._ahead:
            digest, rows = self._ahead.popleft()
            if digest == wanted:
                return rows
        return None

    def _refills(self, batch_prompts: list, salt: object = None) -> Iterator[dict]:
        """The training set's rows that may refill this generation batch, in a random order seeded by (seed, step,
        process), or `salt` for the step, so that a resumed step draws the same ones: each prompt once before any
        twice, the `batch_prompts` (the data loader's and those drawn ahead, already sampled) after the others in each
        pass. A round never draws again a prompt whose group was just filtered while others are left."""
        trainer = self.trainer
        dataset = trainer.train_dataset
        salt = trainer.state.global_step if salt is None else salt
        rng = random.Random(f"{trainer.args.seed}/{salt}/{trainer.accelerator.process_index}/dynamic-sampling")
        while True:
            drawn, later = set(), []
            while len(drawn) < len(dataset):  # a lazy shuffle: a step draws a few rows of a set of any size
                index = rng.randrange(len(dataset))
                if index in drawn:
                    continue
                drawn.add(index)
                row = dict(dataset[index])
                if row["prompt"] in batch_prompts:
                    later.append(row)
                else:
                    yield row
            yield from later

    def _draw_in_flight(self, groups: int) -> list[dict]:
        """With `in_flight_updates`: the rows of the next `groups` refills, drawn before the batch they refill is known
        (each prompt once before any twice over the run, seeded by (`seed`, process); they may repeat a batch's)."""
        if self._in_flight_refills is None:
            self._in_flight_refills = self._refills([], salt="in-flight")
        return self._refill(self._in_flight_refills, groups)

    def _refill(self, refills: Iterator[dict], groups: int) -> list[dict]:
        """The next `groups` prompts of `refills`, each `num_generations` times (TRL's layout)."""
        return [row for row in itertools.islice(refills, groups) for _ in range(self.trainer.num_generations)]

    # ------------------------------------------------------------------ hand-over
    def _hand_to_trl(self, chosen: list[SampledGroup], mine: list[SampledGroup]) -> None:
        """Leave this process's groups for `_generate`, every process's rewards for `_calculate_rewards`, the reward
        functions' logged columns of the kept rows, and send the kept groups' reference request."""
        trainer = self.trainer
        rows = [row for g in mine for row in g.rows]

        def joined(field: str) -> Optional[list]:
            parts = [getattr(g, field) for g in mine]
            return None if any(p is None for p in parts) else [item for p in parts for item in p]

        keys = {k for g in mine for e in g.extra_fields for k in e}
        extra_fields = {k: [e.get(k) for g in mine for e in g.extra_fields] for k in keys}
        output = (joined("prompt_ids"), joined("completion_ids"), joined("tool_mask"), joined("completions"),
                  joined("logprobs"), extra_fields, None, [])
        self._sampled = ([row["prompt"] for row in rows], output)
        self._rewards = torch.cat([g.rewards for g in chosen]).to(trainer.accelerator.device)
        for column in {k for g in mine for k in g.extra_logs}:
            trainer._pending_extra_logs[column].extend(value for g in mine
                                                       for value in g.extra_logs.get(column, [None] * len(g.rows)))
        trainer.prefetch_reference(output[0], output[1], kept=True)

    def _warn_short(self, kept: int, needed: int, rounds: int) -> None:
        if self._warned:
            return
        self._warned = True
        logger.warning(
            "dynamic_sampling: step %d found %d informative groups of the %d a batch needs after %d extra rounds "
            "(dynamic_sampling_max_rounds): it trains them with filtered groups (zero advantage) in the rest. "
            "Said once; dynamic_sampling/informative_share logs it at every step.",
            self.trainer.state.global_step + 1, kept, needed, rounds)


def _digest(prompts: list) -> str:
    return hashlib.blake2b(repr(prompts).encode(), digest_size=8).hexdigest()


def dynamic_sampling(trainer) -> Optional[DynamicSampling]:
    """The trainer's `DynamicSampling` when `dynamic_sampling` is on, else None."""
    return DynamicSampling(trainer) if trainer.args.dynamic_sampling else None

