"""Property-based API testing with schemathesis: every operation of the server's own OpenAPI schema
(``GET /schema/openapi.json``) gets generated requests, valid and invalid, against the in-process server over
the scripted engine (support/server_fakes.FakeEngine), and every response is checked with all of schemathesis'
checks but one: no 5xx, status codes, content types, headers and bodies the schema declares, invalid requests
refused. A small example budget per operation keeps it to seconds.

Left out: ``positive_data_acceptance`` (schema-valid requests must succeed). The server refuses some of them,
with a 400 naming the field, by rules the schema does not state: an empty prompt or input, /tokenize with
neither prompt nor messages, and the bounds of optional numbers (``temperature >= 0``, token ids >= 0), which
msgspec enforces but Litestar's schema generator drops from ``Annotated[...] | None`` fields.

Hypothesis drives schemathesis' per-operation strategies directly: schemathesis' pytest plugin does not
load under the pinned pytest."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from schemathesis.checks import positive_data_acceptance
from hypothesis import HealthCheck, given, settings

from support.servers import scripted

EXAMPLES = 15


SERVER = scripted(max_body_bytes=64 * 1024)


def _operations(url: str) -> dict:
    schema = schemathesis.openapi.from_url(f"{url}/schema/openapi.json")
    return {op.label: op for op in (result.ok() for result in schema.get_all_operations())}


def test_schema_lists_the_api(server):
    labels = set(_operations(server.url))
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings", "GET /v1/models",
            "POST /tokenize", "POST /detokenize", "GET /health", "GET /version"} <= labels, labels


@pytest.mark.parametrize("label", ["POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings",
                                   "GET /v1/models", "POST /tokenize", "POST /detokenize", "GET /health",
                                   "GET /version"])
def test_operation_conforms_to_its_schema(server, label):
    op = _operations(server.url)[label]

    @given(case=op.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        case.call_and_validate(base_url=server.url, excluded_checks=[positive_data_acceptance])

    check()
    assert httpx.get(f"{server.url}/health").status_code == 200     # the server outlived the examples
