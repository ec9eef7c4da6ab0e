"""Reward functions, looked up by name from a recipe (as open-r1's `rewards.py`).

Each is a plain function `f(completions, **kwargs) -> list[float]`, with the dataset's columns in `kwargs`.
A recipe names a built-in (`accuracy`, `format`, `length`, `target_token`) or a user's `module:function`.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable

ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
THINK_ANSWER = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def _text(completion) -> str:
    """A completion as text, whether conversational (`[{"role": ..., "content": ...}]`) or plain."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def accuracy(completions, answer=None, solution=None, **kwargs) -> list[float]:
    """1.0 when the text inside `<answer>...</answer>` equals the dataset's `answer` column (else its `solution`
    column), whitespace-trimmed; 0.0 otherwise."""
    truths = answer if answer is not None else solution
    if truths is None:
        raise ValueError("the accuracy reward needs an 'answer' or 'solution' column in the dataset")
    rewards = []
    for completion, truth in zip(completions, truths):
        match = ANSWER.search(_text(completion))
        rewards.append(1.0 if match and match.group(1).strip() == str(truth).strip() else 0.0)
    return rewards


def format(completions, **kwargs) -> list[float]:  # noqa: A001 - the recipe name users know from open-r1
    """1.0 when the completion is `<think>...</think><answer>...</answer>`, else 0.0."""
    return [1.0 if THINK_ANSWER.match(_text(c)) else 0.0 for c in completions]


def length(completion_ids, target_length: int = 8, **kwargs) -> list[float]:
    """1.0 at exactly `target_length` tokens, falling linearly to 0 at twice (or zero times) that length."""
    return [max(0.0, 1.0 - abs(len(ids) - target_length) / target_length) for ids in completion_ids]


def target_token(completion_ids, target_token_id: int = 33, **kwargs) -> list[float]:
    """The fraction of completion tokens equal to `target_token_id`: a task a tiny model learns in a few steps."""
    return [sum(t == target_token_id for t in ids) / max(1, len(ids)) for ids in completion_ids]


BUILTIN: dict[str, Callable] = {"accuracy": accuracy, "format": format, "length": length, "target_token": target_token}


def resolve_reward(name: str) -> Callable:
    """A built-in by name, or `package.module:function`; raises `ValueError` saying what exists."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ValueError(f"unknown reward {name!r}: use one of {', '.join(BUILTIN)} or 'package.module:function'")
    module_name, _, attr = name.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward {name!r} cannot be imported: {err}") from err
    if not callable(function):
        raise ValueError(f"reward {name!r} is not a function")
    return function
