"""`python -m vattn`: the command line (`vattn.cli`)."""
from vattn.cli import main

raise SystemExit(main())
