"""The RL pieces sampler and trainer use: the actor-critic model, its numpy actor, env construction.

``model`` imports torch (trainer, paramsync); ``policy_np`` (the sampler's inference) and ``envs``
import only numpy, safetensors and gymnasium. Entrypoints import them only after the settings
validated.
"""
