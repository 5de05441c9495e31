"""A stdio MCP server for tests/agent/test_mcp_tools.py: a ``search`` tool (what the scripted tool caller calls) that
behaves as argv[1] says -- ``ok`` (a passage), ``hang`` (never answers), ``big`` (100,000 characters), ``fail``
(raises), ``nosearch`` (not offered) -- a second tool, ``lookup``, and ``crash``, which ends the server process (a transport that fails). Run as ``python mcp_tool_server.py MODE``."""

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

MODE = sys.argv[1] if len(sys.argv) > 1 else "ok"
server = MCPServer("emapg-test-tools", log_level="ERROR")


async def search(query: str) -> str:
    """Search a tiny corpus."""
    if MODE == "hang":
        await asyncio.sleep(3600)
    if MODE == "big":
        return "x" * 100_000
    if MODE == "fail":
        raise ToolError("the index is on fire")
    return f'Doc 1(Title: "Paris") Paris is the capital of France. (query: {query})'


if MODE != "nosearch":  # nosearch: beside another source's search (tests/fuzz/test_fuzz_tools.py)
    server.add_tool(search, name="search")


@server.tool()
def lookup(key: str) -> str:
    """Look a key up."""
    return key.upper()


@server.tool()
def crash() -> str:
    """End this server's process at once (what a crashed tool server does to its client's transport)."""
    os._exit(3)


if __name__ == "__main__":
    server.run("stdio")
