"""The RL pieces both sampler and trainer use: the actor-critic model and env construction.

Importing this package imports torch and gymnasium; entrypoints import it only after the
settings validated.
"""
