"""The sampler: steps envs with the latest policy it has and streams fragments to Kafka."""
