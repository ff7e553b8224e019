"""The OpenAI frontend's CPU cost per streamed chunk, without Triton or a model: the real app (its
middleware, routing, replicas, gRPC response parsing, chat/completions streaming and SSE framing)
driven over ASGI, with Triton's gRPC stream replaced by one that answers at once with responses
shaped as the llm model sends them. The per-chunk figure is the CPU time of a long run less a
short one, divided by the chunks between them, so per-request work (templates, validation) drops out.

    python -m tools.bench_frontend [--endpoint chat|completions] [--concurrency 16] [--chunks 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import time

from tritonclient.grpc import service_pb2
from tritonclient.grpc._infer_result import InferResult

from openai_frontend import Settings, build_app
from openai_frontend.replicas import Replica


def bytes_tensor(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def response(text: str, finish_reason: str | None, final: bool) -> service_pb2.ModelInferResponse:
    """One streamed response as the llm model sends it for n=1 (model_repository/llm/1/model.py)."""
    message = service_pb2.ModelInferResponse(model_name="llm", id="bench")
    outputs = [("text_output", "BYTES", bytes_tensor([text.encode()])),
               ("finish_reason", "BYTES", bytes_tensor([str(finish_reason).encode()])),
               ("num_input_tokens", "UINT32", struct.pack("<I", 12)),
               ("num_output_tokens", "UINT32", struct.pack("<I", 1)),
               ("num_cached_tokens", "UINT32", struct.pack("<I", 0))]
    for name, datatype, raw in outputs:
        output = message.outputs.add(name=name, datatype=datatype)
        output.shape.append(1)
        message.raw_output_contents.append(raw)
    message.parameters["triton_final_response"].bool_param = final
    return message


class FakeStream:
    """tritonclient's stream_infer iterator: `chunks` responses, each after one event-loop turn."""

    def __init__(self, responses: list[InferResult]) -> None:
        self.responses, self.position = responses, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)  # a gRPC read completes from the event loop
        if self.position == len(self.responses):
            raise StopAsyncIteration
        self.position += 1
        return self.responses[self.position - 1], None

    def cancel(self) -> bool:
        return True


class FakeGrpcClient:
    def __init__(self, chunks: int) -> None:
        # Built once: the benchmark measures the frontend, not the making of responses.
        self.responses = [InferResult(response(" word", None, False)) for _ in range(chunks - 1)]
        self.responses.append(InferResult(response(" end", "length", True)))

    def stream_infer(self, requests, stream_timeout=None):
        return FakeStream(self.responses)

    async def close(self) -> None:
        pass


async def post(app, path: str, body: dict) -> int:
    """One request through the ASGI app; the number of SSE events received."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 9000)}
    sent, never = False, asyncio.Event()

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    events = 0

    async def send(message):
        nonlocal events
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message
        elif message["type"] == "http.response.body":
            events += message.get("body", b"").count(b"data: ")

    await app(scope, receive, send)
    return events


async def run(app, endpoint: str, concurrency: int, fake: FakeGrpcClient) -> tuple[float, int]:
    """CPU seconds and events for `concurrency` streams of `chunks` responses each."""
    frontend = app.state.frontend
    replica = Replica("bench:1", frontend.triton.replicas["bench:1"].client, ready=True)
    frontend.triton.replicas = {"bench:1": replica}
    model = frontend.settings.served_model_name
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
    else:
        path, body = "/v1/completions", {"model": model, "prompt": "Hi"}
    body |= {"stream": True, "max_tokens": len(fake.responses)}
    replica.client.client = fake
    started = time.process_time()
    events = await asyncio.gather(*(post(app, path, body) for _ in range(concurrency)))
    return time.process_time() - started, sum(events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    app = build_app(Settings(triton_url=["bench:1"], max_model_len=4096))

    async def measure() -> None:
        from openai_frontend.triton import TritonClient
        app.state.frontend.triton.replicas = {"bench:1": Replica("bench:1", TritonClient("bench:1"))}
        long, short = FakeGrpcClient(args.chunks), FakeGrpcClient(max(args.chunks // 8, 2))
        await run(app, args.endpoint, args.concurrency, long)  # warm-up
        costs = []
        for _ in range(args.repeats):
            cpu_long, events_long = await run(app, args.endpoint, args.concurrency, long)
            cpu_short, events_short = await run(app, args.endpoint, args.concurrency, short)
            costs.append((cpu_long - cpu_short) / (events_long - events_short) * 1e6)
        costs.sort()
        print(f"{args.endpoint}: {args.concurrency} streams x {args.chunks} chunks: "
              f"{costs[len(costs) // 2]:.1f} CPU-us per chunk (median of {args.repeats}; "
              f"min {costs[0]:.1f}, max {costs[-1]:.1f})")

    asyncio.run(measure())


if __name__ == "__main__":
    main()
