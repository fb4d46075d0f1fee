"""The asynchronous peers side by side on CartPole-v1 (figure ``peers``): Sample Factory APPO in its own
virtualenv, Stable-Baselines3 PPO and Flywheel, each with rl-zoo's and with Flywheel's settings.

``stats`` (medians with order-statistic intervals) and ``sf_log`` (Sample Factory's console reports) are
pure; ``sample_factory``, ``sb3_peer`` and ``flywheel_peer`` run one seed each and return a ``PeerRun``.
"""
