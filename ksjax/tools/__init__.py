"""Command-line tools: `python -m ksjax.tools.<name>`."""
