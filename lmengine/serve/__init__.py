"""OpenAI-compatible HTTP server with LMDeploy's QoS endpoints (`lmengine serve`).

`app.py` builds the app: one `ServerContext` (`client.py`) shared by three routers, OpenAI
(`routes_openai.py`), QoS (`routes_qos.py`) and health/metrics (`routes_health.py`). The
handlers of (chat) completions are in `completions.py` and `chat.py`; what they share is in
`protocol.py` (request bodies), `convert.py` (bodies -> GenerationConfigs), `logprobs.py`,
`streaming.py` (whole or streamed answers), `jobs.py` (the bridge to the engine thread),
`errors.py`, `auth.py`, `settings.py` and `metrics.py` (Prometheus text); `server.py` has the
flags and the uvicorn process. FastAPI and uvicorn are imported only when the server is built
(the `serve` extra).
"""
