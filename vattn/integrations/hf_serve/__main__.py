"""`python -m vattn.integrations.hf_serve`: `vattn serve` (see `main`)."""
from vattn.integrations.hf_serve import main

main()
