"""A run's configuration, the one schema every side reads: `recipe` (the YAML recipe, validated into pydantic
models) and `grpo_config` (`RemoteGRPOConfig`, which a recipe's `trainer:` and `sync:` sections become). The
trainer, the servers' launchers and the launchers import this package; it imports none of them.
"""
