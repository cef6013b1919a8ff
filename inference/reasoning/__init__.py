"""Reasoning parsers (``base``: the interface and the registry; ``think``: ``<think>`` formats)."""

from inference.reasoning.base import (REASONING_PARSERS, ReasoningDelta, ReasoningParser, get_reasoning_parser,
                                      register_reasoning_parser)
from inference.reasoning.think import default_reasoning_parser

__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "default_reasoning_parser",
           "get_reasoning_parser", "register_reasoning_parser"]
