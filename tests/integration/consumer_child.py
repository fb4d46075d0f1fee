"""A consumer process for the kill test: commits the first ``commit_upto`` records, consumes the
rest without committing, reports every offset on stdout, then hangs until it is killed.

Optional 5th and 6th arguments: a static-membership ``group_instance_id`` and the session timeout in ms."""

import asyncio
import json
import sys

from shared.kafka import make_consumer
from shared.settings import load_settings


async def main(topic: str, group: str, total: int, commit_upto: int, instance_id: str | None = None,
               session_timeout_ms: int | None = None) -> None:
    settings = load_settings(None)
    extra = {} if session_timeout_ms is None else {"session_timeout_ms": session_timeout_ms}
    consumer = make_consumer(settings, topic, group_id=group, group_instance_id=instance_id, **extra)
    await consumer.start()
    seen = 0
    while seen < total:
        polled = await consumer.getmany(timeout_ms=500, max_records=7)
        for tp, records in polled.items():
            for rec in records:
                seen += 1
                print(json.dumps({"partition": tp.partition, "offset": rec.offset}), flush=True)
                if seen == commit_upto:
                    await consumer.commit({tp: rec.offset + 1})
                    print(json.dumps({"committed": rec.offset + 1}), flush=True)
    print(json.dumps({"done": seen}), flush=True)
    await asyncio.sleep(3600)  # consumed but never committed: killed here


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                     sys.argv[5] if len(sys.argv) > 5 else None, int(sys.argv[6]) if len(sys.argv) > 6 else None))
