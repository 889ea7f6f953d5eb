"""``python -m jaxserve serve`` with one test fault: the engine fails, mid-stream, every request whose prompt
holds ``FAULT`` (and keeps serving the others). The end-to-end tests start the server through this script;
the product has no fault hook."""
from __future__ import annotations

import sys

from jaxserve.engine.async_engine import AsyncLLMEngine

FAULT = "INJECT-FAULT-7f3a"

_publish = AsyncLLMEngine._publish


def _publish_with_fault(self: AsyncLLMEngine, outputs) -> None:
    healthy = []
    for out in outputs:
        stream = self._streams.get(out.request_id)
        if stream is not None and out.prompt and FAULT in out.prompt:
            self.engine.abort_request(out.request_id)
            stream.put(RuntimeError("injected engine fault"))
        else:
            healthy.append(out)
    _publish(self, healthy)


if __name__ == "__main__":
    AsyncLLMEngine._publish = _publish_with_fault
    from jaxserve.cli import main
    sys.exit(main())
