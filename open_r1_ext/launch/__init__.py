"""The launch side: the SLURM plan (recipe -> jobs), the job runtime both launch paths run, the submitit launcher,
the run's API key, `status` and `plot`, and the built-in server as a local child process.
"""
