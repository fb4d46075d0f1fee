"""``python -m shared.infra up|down|status``: the local Kafka + S3 stack, without Docker."""

from __future__ import annotations

import argparse
import logging
import sys

from shared.infra.config import DEFAULT_TIMEOUT_S, InfraConfig, InfraError
from shared.infra.stack import down, ensure_up, status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shared.infra",
        description="Run Apache Kafka (KRaft, from Maven Central jars) and an S3 server (moto) as local "
        "processes. Ports default to the FLYWHEEL_INFRA_{KAFKA,CONTROLLER,S3}_PORT environment "
        "variables, else 9092/9093/9000.",
    )
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--home", help="state directory (default: <repo>/.flywheel or $FLYWHEEL_INFRA_HOME)")
    parser.add_argument("--kafka-port", type=int, help="Kafka client (PLAINTEXT) port")
    parser.add_argument("--controller-port", type=int, help="KRaft controller port")
    parser.add_argument("--s3-port", type=int, help="S3 endpoint port")
    parser.add_argument("--bucket", help="bucket to create (default: flywheel)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds to wait for the services to work (default: %(default)s)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Our own progress lines carry the last connection error; aiokafka's retries would only repeat it.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        if args.command == "up":
            ep = ensure_up(
                args.home,
                kafka_port=args.kafka_port,
                controller_port=args.controller_port,
                s3_port=args.s3_port,
                bucket=args.bucket,
                timeout_s=args.timeout,
            )
            print(f"kafka bootstrap: {ep.kafka_bootstrap}")
            print(f"s3 endpoint:     {ep.s3_endpoint} (bucket {ep.bucket}, key/secret testing/testing)")
            return 0
        if args.command == "down":
            down(args.home)
            return 0
        cfg = InfraConfig.resolve(args.home)
        print(f"flywheel local infra in {cfg.home}")
        states = status(args.home)
        for st in states:
            detail = f"running  pid {st.pid}  {st.endpoint}" if st.running else "stopped"
            print(f"  {st.name:6} {detail}")
        return 0 if all(st.running for st in states) else 3
    except InfraError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
