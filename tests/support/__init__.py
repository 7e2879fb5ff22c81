"""Helpers shared by the tests: `from tests.support import REPO, FIXTURES` and the modules
`tests.support.eval_run` (a tiny trained run and its evaluation), `tests.support.resume` (the
kill -9 and resume check), `tests.support.dataset_files`
(small files in the published dataset formats) and `tests.support.objectives_naive` (literal
loop definitions of the k-sample objectives)."""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]  # the repository root
FIXTURES = REPO / "tests" / "fixtures"
