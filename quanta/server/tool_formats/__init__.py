"""Tool-call and reasoning formats beyond Hermes (see :mod:`quanta.server.tool_formats.registry`)."""
