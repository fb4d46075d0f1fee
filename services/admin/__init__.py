"""admin: the operator's REST API (status, manual policy sync) and the ``flywheel`` CLI."""
