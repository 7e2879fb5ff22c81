"""The paper's CodeContests run with Llama 3.1 8B Instruct (appendix A); see
configs/code_contests_llama70b.py for the commands."""

from ksjax.run import config as run_config


def get_config():
  return run_config.code_contests_config("llama3.1-8b", tensor=1)
