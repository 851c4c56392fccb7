"""The application: the chat pipeline (pipeline.py, batching.py), and `attnstore serve`, an OpenAI-compatible
server over it (app.py; the routes chat_api.py, completions_api.py and responses_api.py over one base, base.py;
the schema in protocol/; engine.py, conversation.py, metrics.py).

The HTTP parts load on first use, so that `import hf_attnstore` (which imports the pipeline) does not import
FastAPI.

Example:
    >>> from hf_attnstore.serving import ChatPipeline, create_app  # doctest: +SKIP
"""

from importlib import import_module

_LAZY = {"create_app": ".app", "ChatEngine": ".engine", "Overloaded": ".engine", "MessageTokens": ".conversation",
         "ReplyMemo": ".conversation", "SessionIndex": ".conversation", "ChatPipeline": ".pipeline"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
