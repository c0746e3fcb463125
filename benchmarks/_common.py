"""The scripts' shared helpers now live in vattn.bench._common (kept importable here for the scripts)."""
from vattn.bench._common import *  # noqa: F401,F403
from vattn.bench._common import (  # noqa: F401
    RESULTS, OUT_ENV, environment, free_port, latency_stats, print_table, save, wait_healthy)
