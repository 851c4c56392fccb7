"""`attnstore serve`: an OpenAI-compatible chat server over ChatPipeline and AttnStore."""

from .app import create_app
from .conversation import MessageTokens, ReplyMemo, SessionIndex
from .engine import ChatEngine, Overloaded

__all__ = ["ChatEngine", "MessageTokens", "Overloaded", "ReplyMemo", "SessionIndex", "create_app"]
