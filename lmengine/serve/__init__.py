"""OpenAI-compatible HTTP server with LMDeploy's QoS endpoints (`lmengine serve`).

`app.py` has the routes, `protocol.py` the request bodies, `jobs.py` the bridge to the engine
thread, `metrics.py` the Prometheus text, `server.py` the flags and the uvicorn process.
FastAPI and uvicorn are imported only when the server is built (the `serve` extra).
"""
