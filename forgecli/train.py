"""placeholder until written."""

def train() -> None:
    """(not yet written)"""
