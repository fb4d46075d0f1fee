"""The trainer: pulls fragments from Kafka, updates the model, then commits what it trained."""
