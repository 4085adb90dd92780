"""``lumen worker`` with its self-fencing turned off (by path, never imported): it ignores a
lost lease, a fenced heartbeat and a refused token report, and goes on serving. It also keeps
the tokens of a report the gateway never answered and sends them again, from the last
acknowledged position, with its next report (a retrying zombie): its first report after a heal
then overlaps what the gateway knows instead of leaving a gap the gateway refuses whatever its
epoch checks, so the stale write reaches the epoch checks (or their absence). With the
gateway's ``--unfenced`` it is how the partition tests show that their stale-write invariant
can fail. Arguments: those of ``lumen worker``."""

from __future__ import annotations

import sys

from lumen_core.cli import main
from lumen_core.gateway.client import GatewayClient, RequestTokens
from lumen_core.gateway.errors import GatewayError
from lumen_core.worker.process import Worker

_unsent: dict[int, RequestTokens] = {}  # request -> the tokens since its last acknowledged report


def _ignore_fencing(self: Worker, reason: str) -> None:
    self.fence_reason = f"ignored: {reason}"


def _report_retrying(self: Worker, reports: list[RequestTokens]) -> None:
    batch = []
    for report in reports:
        kept = _unsent.get(report.request_id)
        if kept is not None and kept.start_position + len(kept.token_ids) == report.start_position:
            report = RequestTokens(
                report.request_id,
                report.epoch,
                kept.start_position,
                kept.token_ids + report.token_ids,
                report.finished,
                report.error,
            )
        _unsent[report.request_id] = report
        batch.append(report)
    if not batch:
        return
    try:
        acks = self.client.report_tokens_batch(batch)
    except GatewayError:
        return  # kept for the next report
    for ack in acks:
        _unsent.pop(ack.request_id, None)
        if ack.code != 0:
            self._drop(ack.request_id)


Worker._on_fenced = _ignore_fencing  # type: ignore[method-assign]
Worker._report = _report_retrying  # type: ignore[method-assign]
GatewayClient.lease_valid = lambda self: True  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[1:]]))
