"""Load a recipe's prompts as a `datasets.Dataset` with a conversational `prompt` column.

Local `.json`/`.jsonl`/`.csv`/`.parquet` files and hub datasets alike; the other columns (e.g. `solution`) stay,
so reward functions receive them.
"""

from __future__ import annotations

from pathlib import Path

from open_r1_ext.config.data_files import LOCAL_FORMATS
from open_r1_ext.config.recipe import DataSection, is_local_path


def load_prompts(section: DataSection):
    from datasets import load_dataset

    if is_local_path(section.dataset):
        path = Path(section.dataset).expanduser()
        builder = LOCAL_FORMATS.get(path.suffix)
        if builder is None:
            raise ValueError(f"data.dataset {path}: unsupported file type (use {', '.join(LOCAL_FORMATS)})")
        dataset = load_dataset(builder, data_files=str(path), split=section.split)
    else:
        dataset = load_dataset(section.dataset, section.config, split=section.split)
    if section.prompt_column not in dataset.column_names:
        raise ValueError(
            f"data.prompt_column {section.prompt_column!r} is not a column of {section.dataset} "
            f"(columns: {', '.join(dataset.column_names)})"
        )

    def to_conversation(row):
        prompt = row[section.prompt_column]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if section.system_prompt:
            prompt = [{"role": "system", "content": section.system_prompt}] + prompt
        return {"prompt": prompt}

    drop = [section.prompt_column] if section.prompt_column != "prompt" else []
    return dataset.map(to_conversation, remove_columns=drop)
