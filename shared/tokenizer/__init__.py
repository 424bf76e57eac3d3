"""Tokenizer, chat template and incremental detokenizer (no torch, no I/O beyond reading model files)."""

from shared.tokenizer.detokenizer import IncrementalDetokenizer
from shared.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "load_tokenizer"]
