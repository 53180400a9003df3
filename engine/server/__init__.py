"""The engine's OpenAI-compatible HTTP server (`kvmesh serve`) and its Prometheus metrics.

Modules: `protocol` (request bodies), `params` (request -> sampling params),
`responses` (bodies and stream chunks), `errors` (OpenAI error format),
`async_engine` (the engine thread and output dispatch), `generation` (the two
generation endpoints), `streaming` (SSE and disconnect detection), `app`
(routes), `metrics` / `metrics_util` (Prometheus), `runtime` (uvicorn with
SIGTERM draining), `cli` (`kvmesh serve`).
"""
