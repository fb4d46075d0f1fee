"""The stand-in apache/kafka image's entry point: server.properties from KAFKA_* (the upstream image's rules),
format the log dir with CLUSTER_ID on first start, then run the broker in the foreground."""
import os
import subprocess
import sys

# Upstream's exclusions: variables the launcher reads itself, never broker properties.
NOT_PROPERTIES = {"KAFKA_VERSION", "KAFKA_HEAP_OPTS", "KAFKA_LOG4J_OPTS", "KAFKA_OPTS", "KAFKA_JMX_OPTS",
                  "KAFKA_JVM_PERFORMANCE_OPTS", "KAFKA_GC_LOG_OPTS", "KAFKA_LOG4J_ROOT_LOGLEVEL",
                  "KAFKA_LOG4J_LOGGERS", "KAFKA_TOOLS_LOG4J_LOGLEVEL", "KAFKA_JMX_HOSTNAME", "KAFKA_JMX_PORT"}
CONFIG = "/opt/kafka/config/server.properties"
JAVA = ["java", "-cp", "/opt/kafka/libs/*", "-Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties"]


def prop_name(var: str) -> str:
    return var[len("KAFKA_"):].lower().replace("___", "-").replace("__", "\0").replace("_", ".").replace("\0", "_")


def main() -> int:
    props = {prop_name(k): v for k, v in os.environ.items() if k.startswith("KAFKA_") and k not in NOT_PROPERTIES}
    with open(CONFIG, "w") as fh:
        fh.writelines(f"{k}={v}\n" for k, v in sorted(props.items()))
    log_dirs = props.get("log.dirs", "/var/lib/kafka/data").split(",")
    if not os.path.exists(os.path.join(log_dirs[0], "meta.properties")):
        cluster_id = os.environ.get("CLUSTER_ID")
        if not cluster_id:
            print("kafka stand-in: CLUSTER_ID is required to format the log dir", file=sys.stderr)
            return 2
        subprocess.run([*JAVA, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", CONFIG,
                        "--ignore-formatted"], check=True)
    heap = os.environ.get("KAFKA_HEAP_OPTS", "-Xmx1G -Xms1G").split()
    os.execvp("java", ["java", *heap, "-XX:+UseG1GC", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
                       *os.environ.get("KAFKA_OPTS", "").split(), *JAVA[1:], "kafka.Kafka", CONFIG])


if __name__ == "__main__":
    sys.exit(main())
