"""The native scheduler in the test process, without a link: for the tests that look at every step.

Its calls return the outputs they made (per api process); nothing is published, and no Redis is needed.
"""

from __future__ import annotations

from inference.engine.base_scheduler import Outputs
from inference.engine.core import replica_stats
from inference.engine.runner import ModelRunner
from inference.engine.scheduler import Scheduler


def native_scheduler(runner: ModelRunner, *, max_num_seqs: int = 32, **kwargs) -> Scheduler:
    """``Scheduler`` over ``runner`` (``kwargs``: its ``max_num_batched_tokens``, ``enable_chunked_prefill``)."""
    return Scheduler(runner, "e", replica_stats("e", "m", runner.device.type, max_num_seqs),
                     max_num_seqs=max_num_seqs, **kwargs)


def merged(parts) -> Outputs:
    """The parts a ``step()`` yields, as one batch of outputs (each api process's in order)."""
    out: Outputs = {}
    for part in parts:
        for client_id, outs in part.items():
            out.setdefault(client_id, []).extend(outs)
    return out


def tokens_of(outputs: Outputs) -> dict[str, int]:
    """New tokens per request id in one batch of outputs."""
    got: dict[str, int] = {}
    for outs in outputs.values():
        for o in outs:
            if o.new_token_ids:
                got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
    return got
