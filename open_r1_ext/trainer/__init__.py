"""The trainer side: `RemoteGRPOTrainer` (TRL's `GRPOTrainer` with remote reference and generation), remote
generation, weight sync, and the prompts a recipe names. Imports TRL; the server side never imports this package.
"""
