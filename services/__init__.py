"""Flywheel's four services: sampler, trainer, paramsync, admin."""
