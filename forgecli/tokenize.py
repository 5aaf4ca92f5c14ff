"""placeholder until written."""

def tokenize() -> None:
    """(not yet written)"""
