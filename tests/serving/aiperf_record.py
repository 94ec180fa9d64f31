"""aiperf's own reading of a response's speculation (run where aiperf is installed: its own venv, as the bench
extra says): the response bodies (one, or a stream's chunks) as a JSON list on stdin; prints the per-request
`SpecDecodeAcceptanceRecord` aiperf builds from them as JSON (null: none). `tests/serving/test_server.py` runs it."""

import json
import sys

from aiperf.common.models import ParsedResponse
from aiperf.endpoints.base_endpoint import BaseEndpoint
from aiperf.records.inference_result_parser import InferenceResultParser


def record(bodies: list[dict]):
    stats = BaseEndpoint.extract_spec_decode_stats  # what aiperf's chat and completions endpoints read
    responses = []
    for i, body in enumerate(bodies):
        responses.append(ParsedResponse(perf_ns=i, usage=body.get("usage"), spec_decode_stats=stats(body)))
    return InferenceResultParser._extract_spec_decode_acceptance(responses)


if __name__ == "__main__":
    out = record(json.load(sys.stdin))
    print(json.dumps(None if out is None else out.model_dump(mode="json")))
