"""Tasks: prompts in, rewards out. See `ksjax.tasks.base` for the interface."""
