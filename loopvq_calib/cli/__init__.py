"""The console scripts, one module per command: ``calibrate`` (loopvq-calibrate, ``python -m loopvq_calib``),
``eval``, ``inspect`` and ``push``; ``exits`` holds the exit statuses, Ctrl-C and SIGTERM and the process's
short exit, ``console`` the one-line error. The library raises and returns reports; these print them and pick the
exit status: 0 success, 1 a gate or check failed, 2 bad input (config, paths, bundle), 3 a run failed, 130
interrupted (Ctrl-C, SIGINT), 143 terminated (SIGTERM); each failure is one line on stderr, never a traceback (a
run's goes to its run.log). Each command imports what it runs on demand, so ``--help`` loads neither torch nor
transformers.
"""

from __future__ import annotations

from .calibrate import main as calibrate_main, parser as calibrate_parser
from .eval import main as eval_main, parser as eval_parser
from .inspect import main as inspect_main, parser as inspect_parser
from .push import main as push_main, parser as push_parser

__all__ = [
    "PARSERS",
    "calibrate_main",
    "calibrate_parser",
    "eval_main",
    "eval_parser",
    "inspect_main",
    "inspect_parser",
    "push_main",
    "push_parser",
]

# console script name -> its argument parser (tests check docs and CI against them)
PARSERS = {
    "loopvq-calibrate": calibrate_parser,
    "loopvq-eval": eval_parser,
    "loopvq-inspect": inspect_parser,
    "loopvq-push": push_parser,
}
