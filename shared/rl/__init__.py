"""The RL pieces sampler and trainer use: the actor-critic model, its numpy actor, env construction.

``model`` (and ``cnn``, the image models) imports torch (trainer, paramsync); ``policy_np`` (the sampler's
MLP inference), ``frames`` (frame stacking) and ``envs`` import only numpy, safetensors and gymnasium;
``policy_torch`` (the sampler's CNN inference) imports torch and is imported only for image runs.
Entrypoints import them only after the settings validated.
"""
