"""The process boundary: how a caller reaches an engine loop, and the loop's side of it.

- `messages.py`: what crosses, typed (commands in, messages out).
- `engine_loop.py`: the loop around an `LLMEngine`: commands in, steps, outputs out.
- `request_client.py`: `RequestClient` (what a server asks of an engine) and `EngineClient`
  (one loop's asyncio side: per-request streams, calls by name).
- `async_llm.py`: `AsyncLLM`, the loop in a thread of this process.
- `engine_process.py`: `EngineProcess`, the loop in its own process over ZeroMQ, restarted
  when it dies.
- `output_delta.py`: outputs sent across a process as deltas, rebuilt on arrival.
- `data_parallel.py`: `DataParallel`, a RequestClient over several engine processes.
"""
