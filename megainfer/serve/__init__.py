"""``megainfer-serve``: an OpenAI-compatible HTTP server over the online engine (FastAPI +
uvicorn + prometheus-client), and ``megainfer-bench-serve``, its load generator (docs/serve.md).

``protocol``: request bodies; ``app``: the routes; ``chat``: chat prompts; ``streaming``: SSE
chunks; ``responses``: response objects; ``metrics``: Prometheus; ``errors``: OpenAI-shaped
errors; ``served_engine``: admission and the engine's streams; ``server``: uvicorn, signals and
draining; ``bench``: the serving benchmark. The Hydra entry point is ``megainfer.launch.serve``.
"""
