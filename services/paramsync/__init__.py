"""paramsync: verifies policy candidates, moves the version marker, announces, measures sync latency."""
