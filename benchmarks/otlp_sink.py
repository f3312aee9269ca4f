"""An OTLP/HTTP receiver that counts the spans it gets and drops them: the far end of
`--otlp-traces-endpoint` for measuring what tracing costs the server.

    python benchmarks/otlp_sink.py --port 4318      # spans to http://127.0.0.1:4318/v1/traces
"""

from __future__ import annotations

import argparse
import gzip
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Sink(BaseHTTPRequestHandler):
    spans = 0

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        Sink.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        """GET /count: the spans received so far."""
        body = str(Sink.spans).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), Sink).serve_forever()


if __name__ == "__main__":
    main()
