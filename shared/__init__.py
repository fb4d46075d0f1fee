"""Flywheel's common library: settings, logging, Kafka, the fragment codec and the object store."""
