"""On ``PYTHONPATH`` of a job a test starts (``test_serve_replan.py``): the runtime's INFO log
(``megainfer.runtime``: re-plans among it) to stderr, although the job configures no logging."""
import logging
import sys

_handler = logging.StreamHandler(sys.stderr)
_handler.setFormatter(logging.Formatter("%(message)s"))
_log = logging.getLogger("megainfer.runtime")
_log.addHandler(_handler)
_log.setLevel(logging.INFO)
