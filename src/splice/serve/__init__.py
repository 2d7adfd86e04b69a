"""splice serve: continuous batching over the engine and its OpenAI-compatible HTTP app.

``splice.serve.app(engine, tokenizer)`` returns the ASGI app (``splice.serve.app`` is that function; the module is
``splice.serve.app`` in ``sys.modules``); ``splice.serve.scheduler`` holds the scheduler that batches requests.
"""
from .app import app

__all__ = ["app"]
