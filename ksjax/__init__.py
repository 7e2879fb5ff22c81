"""ksjax."""
