"""The trainer side: `RemoteGRPOTrainer` (TRL's `GRPOTrainer` with remote reference and generation), its config,
remote generation, weight sync, and the prompts and rewards a recipe names. Imports TRL; the server side never
imports this package.
"""
