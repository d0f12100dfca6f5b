"""The engine: loop, requests, model agent, KV cache engine, sampling."""
