"""The `forge` command-line suite: parses, calls `engine`, renders with Rich."""
