"""The scripts' shared helpers now live in vattn.bench._common (kept importable here for the scripts)."""
from vattn.bench._common import *  # noqa: F401,F403
from vattn.bench._common import RESULTS, OUT_ENV, environment, latency_stats, print_table, save  # noqa: F401
