"""One module per CLI command: its flags (``add_arguments``) and ``run(args, argv)``; no torch at import time."""
