"""placeholder until written."""

def doctor() -> None:
    """(not yet written)"""
