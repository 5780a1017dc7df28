"""Text handling: tokenizers (HF directories and GGUF vocabularies), chat
templates and incremental detokenization."""

from .chat_template import render_chat_template
from .detokenizer import IncrementalDetokenizer
from .tokenizer import Tokenizer

__all__ = ["Tokenizer", "IncrementalDetokenizer", "render_chat_template"]
