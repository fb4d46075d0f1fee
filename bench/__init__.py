"""The benchmark suite: ``python -m bench`` (``make bench``). See docs/benchmarks.md and bench/PERF-NOTES.md.

Where things are: ``figures/`` holds one module per figure (``run(ctx) -> FigureResult``); ``peers/`` runs the
peers (SB3, Sample Factory, EnvPool, Flywheel as a peer) and holds their statistics (``peers.stats``) and the
cores-and-other-work record every peer run gets (``peers.measure``). The helpers the figures share:
``context`` (the bench's home, ports, the context handed to each figure), ``stack`` (a Flywheel stack per run, its
metrics, logs and windows), ``samples`` (a run's samples topic read back into a return curve), ``seeds`` (budgets,
seeds and ``--extend`` pooling from the environment), ``machine`` (the machine's description and CPU accounting),
``stats`` (medians, percentiles, t-intervals) and ``report`` (the markdown and JSON written to docs/).
"""
