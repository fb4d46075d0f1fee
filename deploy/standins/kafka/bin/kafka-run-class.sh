#!/bin/sh
# The stand-in's kafka-run-class.sh: a class from /opt/kafka/libs, tools logging to stderr at WARN.
exec java ${KAFKA_TOOLS_HEAP_OPTS:--Xmx256m} -cp '/opt/kafka/libs/*' \
  -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties -Dlog4j2.level=WARN "$@"
