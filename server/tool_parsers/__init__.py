"""Tool-call parsers: model output text -> OpenAI tool calls, streaming or at once (vLLM's names).

Every format runs on one streaming engine (engine.py); a format is a start marker and a block reader.
A plugin file registers its own with::

    from jaxserve.server.tool_parsers import Block, PartialCall, ToolParser, register_tool_parser

    @register_tool_parser("my_format")
    class MyParser(ToolParser):
        start_markers = ("<call>",)
        def read_block(self, text, body, final): ...
"""
from .engine import (Block, ExtractedToolCalls, FunctionCall, PartialCall, StreamDelta, ToolCallDelta,
                     ToolParser)
from .registry import get_tool_parser, import_tool_parser_plugin, register_tool_parser, tool_parser_names
from . import json_formats, pythonic, qwen3_xml  # noqa: F401,E402  (they register themselves)
from .json_formats import NamedToolChoiceParser, RequiredToolChoiceParser

__all__ = ["Block", "ExtractedToolCalls", "FunctionCall", "PartialCall", "StreamDelta", "ToolCallDelta",
           "ToolParser", "get_tool_parser", "import_tool_parser_plugin", "register_tool_parser",
           "tool_parser_names", "NamedToolChoiceParser", "RequiredToolChoiceParser"]
