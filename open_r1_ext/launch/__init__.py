"""The launch side: the recipe schema, the SLURM plan (recipe -> jobs), the job runtime both launch paths run,
the submitit launcher, and the built-in server as a local child process.
"""
