import sys

from .cli import main

if __name__ == "__main__":  # a spawned child (vLLM's engine core, workers) imports this module again
    sys.exit(main())
