"""`python -m serve`: the command line (serve.app.main)."""
import sys

from serve.app.main import main

sys.exit(main())
