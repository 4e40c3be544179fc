"""`python -m serve`: the command line (serve.app.main); `python -m serve keygen NAME`
makes a key for --api-keys (serve.app.keygen)."""
import sys

if sys.argv[1:2] == ["keygen"]:
    from serve.app.keygen import main
else:
    from serve.app.main import main

sys.exit(main())
