"""Forge engine: the training library behind the `forge` CLI. Importable without the CLI."""
