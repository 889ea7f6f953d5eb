"""The OpenAI-compatible Litestar server (installed as jaxserve.server)."""
